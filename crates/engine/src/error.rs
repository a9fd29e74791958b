//! The engine's error type: a small stable kind plus the context a person needs.

use fewerbytes_format::FormatError;
use fewerbytes_storage::StorageError;

/// Everything that can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A device failed. The pool is latched read-only when this happens on a write or flush.
    #[error(transparent)]
    Io(#[from] StorageError),
    /// Metadata failed its checksum or self-identification, or stored data failed
    /// its fingerprint (region `data`).
    #[error("{}", corrupt_sentence(region, *block, device, reason))]
    Corrupt {
        /// Which region (super block, journal, page store, ...).
        region: &'static str,
        /// Block number on its device (from the device's start, 4,096 bytes each).
        block: u64,
        /// `data` or `metadata`.
        device: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A device is shorter than the pool's geometry says it is: truncated or shrunk
    /// since the pool was made. Opening refuses it rather than fail at the first
    /// read past the end.
    #[error("{device} (the pool's {role} device) holds {len_bytes} bytes, but the pool's geometry needs {needed_bytes}: it was truncated or shrunk since the pool was made, and the blocks past its end are gone; the pool is not opened")]
    Truncated {
        /// The device's name (its path).
        device: String,
        /// `data` or `metadata`.
        role: &'static str,
        /// Its length now.
        len_bytes: u64,
        /// The length the super block's geometry needs.
        needed_bytes: u64,
    },
    /// A decode failed (wrapped with its place by the caller where known).
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The pool was latched read-only by an earlier I/O failure, or opened read-only.
    #[error("the pool is read-only: {0}")]
    ReadOnly(String),
    /// The pool was latched read-only by an I/O failure while open, so closing it
    /// could not take its final checkpoint: it did not close cleanly.
    #[error("the pool did not close cleanly: it was {0}. Writes acknowledged after its last successful flush may be lost; reopening it replays its journal, then run `fewerbytes check`")]
    ClosedLatched(String),
    /// A request outside a volume.
    #[error("{op} of {len_bytes} bytes at offset {offset_bytes} is outside volume '{volume}' ({size_bytes} bytes)")]
    OutOfRange {
        /// The volume.
        volume: String,
        /// What was asked.
        op: &'static str,
        /// Where.
        offset_bytes: u64,
        /// How much.
        len_bytes: u64,
        /// The volume's size.
        size_bytes: u64,
    },
    /// The pool has no free data blocks or object slots left, or the device below
    /// has no space for what the pool must write (see [`EngineError::is_no_space`]).
    #[error("the pool is full: {0}")]
    NoSpace(String),
    /// No such volume.
    #[error("no volume named '{0}' in this pool")]
    VolumeNotFound(String),
    /// The name is taken.
    #[error("a volume named '{0}' already exists")]
    VolumeExists(String),
    /// The volume has open handles (e.g. NBD clients).
    #[error("volume '{name}' is in use by {users} client(s); use --force to delete it anyway")]
    VolumeInUse {
        /// The volume.
        name: String,
        /// How many handles are open.
        users: u32,
    },
    /// The volume was deleted while this handle was open.
    #[error("volume '{0}' was deleted")]
    VolumeGone(String),
    /// A refusal with the numbers behind it (too small, too big, over capacity, ...).
    #[error("{0}")]
    Refused(String),
    /// A request touched a volume range whose block-map page (or map directory
    /// page) failed its checks at open (`map_damage.rs`): its entries are unknown,
    /// so it is neither read nor written until `check --repair` clears it.
    #[error("{op} refused: {}; `fewerbytes check --repair` (on the pool, not served) clears the range, which then reads as zeros", .range.describe())]
    Damaged {
        /// What was asked (read, write, trim, write_zeroes).
        op: &'static str,
        /// The damaged range it touched.
        range: Box<crate::damaged_range::DamagedRange>,
    },
    /// A state the engine's own bookkeeping rules out: a reference or holder count
    /// taken below zero, a buffer range outside its buffer. The metadata (or the
    /// engine) is wrong; a count underflow latches the pool read-only, for a person
    /// to run `fewerbytes check`, rather than be clamped and hidden.
    #[error("broken invariant: {0}")]
    Invariant(String),
}

impl EngineError {
    /// Whether the request failed for want of space: the pool has no free block
    /// ([`EngineError::NoSpace`]) or the device below, or the file system it is a
    /// file on, is full (an [`EngineError::Io`] that [`StorageError::is_no_space`]).
    /// Neither latches the pool: the same request succeeds once space is freed.
    pub fn is_no_space(&self) -> bool {
        match self {
            EngineError::NoSpace(_) => true,
            EngineError::Io(e) => e.is_no_space(),
            _ => false,
        }
    }
}

/// Shorthand.
pub type Result<T> = std::result::Result<T, EngineError>;

/// `bytes[range]`, or [`EngineError::Invariant`] naming `what` when the range lies
/// outside `bytes`: for ranges the caller computed to be inside, so that a slip
/// fails the request instead of becoming a short (clamped) slice.
pub(crate) fn within<'a>(
    bytes: &'a [u8],
    range: std::ops::Range<usize>,
    what: &str,
) -> Result<&'a [u8]> {
    let len = bytes.len();
    bytes
        .get(range.clone())
        .ok_or_else(|| out_of_buffer(what, &range, len))
}

/// [`within`] for a mutable slice.
pub(crate) fn within_mut<'a>(
    bytes: &'a mut [u8],
    range: std::ops::Range<usize>,
    what: &str,
) -> Result<&'a mut [u8]> {
    let len = bytes.len();
    bytes
        .get_mut(range.clone())
        .ok_or_else(|| out_of_buffer(what, &range, len))
}

fn out_of_buffer(what: &str, range: &std::ops::Range<usize>, len: usize) -> EngineError {
    EngineError::Invariant(format!(
        "{what}: bytes {}..{} of a {len}-byte buffer",
        range.start, range.end
    ))
}

/// `Corrupt`'s message. Stored data names its place in `reason` (`pool block N: …`,
/// or the volume range read, `crate::damage`), one way for every report of damage.
fn corrupt_sentence(region: &str, block: u64, device: &str, reason: &str) -> String {
    if region == "data" {
        format!("damaged data: {reason}")
    } else {
        format!("corrupt {region} at block {block} of the {device} device: {reason}")
    }
}
