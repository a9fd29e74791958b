//! The engine's error type: a small stable kind plus the context a person needs.

use fewerbytes_format::FormatError;
use fewerbytes_storage::StorageError;

/// Everything that can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A device failed. The pool is latched read-only when this happens on a write or flush.
    #[error(transparent)]
    Io(#[from] StorageError),
    /// Metadata failed its checksum or self-identification.
    #[error("corrupt metadata in {region} at block {block} on the {device} device: {reason}")]
    Corrupt {
        /// Which region (super block, journal, page store, ...).
        region: &'static str,
        /// Block number on its device.
        block: u64,
        /// `data` or `metadata`.
        device: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A decode failed (wrapped with its place by the caller where known).
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The pool was latched read-only by an earlier I/O failure, or opened read-only.
    #[error("the pool is read-only: {0}")]
    ReadOnly(String),
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
    /// The pool has no free data blocks or object slots left.
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
}

impl EngineError {
    /// The errno an NBD server should answer with.
    pub fn errno(&self) -> u32 {
        match self {
            EngineError::ReadOnly(_) => 1,        // EPERM
            EngineError::OutOfRange { .. } => 22, // EINVAL
            EngineError::NoSpace(_) => 28,        // ENOSPC
            EngineError::VolumeGone(_) => 108,    // ESHUTDOWN
            _ => 5,                               // EIO
        }
    }
}

/// Shorthand.
pub type Result<T> = std::result::Result<T, EngineError>;
