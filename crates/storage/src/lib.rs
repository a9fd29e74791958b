//! The `Storage` trait: the only way the engine reaches a device.
//!
//! A pool sits on one or two devices (data, and optionally metadata). Each is a
//! `Storage`: positioned reads and writes, a durability barrier (`flush`), and a
//! length. Every implementation counts the bytes that cross it, so the engine's
//! statistics report what reached each device, not what the engine meant to write.
//!
//! A device can also be told that a range is no longer needed ([`Storage::discard`]:
//! a hole punched in a file, `BLKDISCARD` on a block device), says when it is full
//! ([`StorageError::is_no_space`]) apart from any other failure, and reports a new
//! length once it has grown ([`Storage::refresh_len`]).
//!
//! Implementations: [`FileStorage`] (a regular file or a block device) and
//! [`FaultStorage`] (an in-memory device for tests that separates what is durable
//! from what was written since the last flush, can crash, and can fail the Nth I/O),
//! and [`RbdStorage`] (an image of a Ceph RBD pool, through librbd loaded at run
//! time: [`open_rbd`]).
//!
//! A device named by a path or URI ([`DeviceUri`]: `/path`, `file:///path`,
//! `rbd:POOL/IMAGE[@CLUSTER]`) is opened by [`open_device`], the one place a pool's
//! devices are opened from their names.
//!
//! **Architecture invariant:** `storage` knows nothing of pools, blocks or dedup.

#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::indexing_slicing)]

mod device;
mod fault;
mod file;
mod image;
mod loop_device;
mod rbd;
mod rbd_aio;
mod rbd_lib;
mod rbd_lock;
mod rbd_watch;

pub use device::{open_device, DeviceOptions, DeviceUri, TakeOver};
pub use fault::{CrashMode, FaultPlan, FaultStorage, FlipRead, IoEvent, IoLog, LogReplay};
pub use file::{FileStorage, LockHolder};
pub use image::Image;
pub use rbd::{open_rbd, RbdStorage};

use std::sync::atomic::{AtomicU64, Ordering};

/// Which I/O failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoOp {
    /// A positioned read.
    Read,
    /// A positioned write.
    Write,
    /// A durability barrier.
    Flush,
    /// Opening or sizing the device.
    Open,
    /// Giving a range back to the device (a punched hole, a block-device discard).
    Discard,
    /// Checking that this handle still owns the device (an RBD image's lock).
    Own,
}

impl std::fmt::Display for IoOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoOp::Read => "read",
            IoOp::Write => "write",
            IoOp::Flush => "flush",
            IoOp::Open => "open",
            IoOp::Discard => "discard",
            IoOp::Own => "ownership check",
        })
    }
}

/// An error from a device.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The operating system reported an error.
    #[error("{}", io_message(device, *op, *offset_bytes, *len_bytes, source))]
    Io {
        /// The device's name (its path).
        device: String,
        /// What was attempted.
        op: IoOp,
        /// Where.
        offset_bytes: u64,
        /// How much.
        len_bytes: u64,
        /// The OS error.
        source: std::io::Error,
    },
    /// The device, or the file system it is a file on, has no space for a write or
    /// a discard (`ENOSPC`, or `EDQUOT` past a quota). Unlike [`StorageError::Io`]
    /// the device is not failing: the bytes of the range are unspecified (the write
    /// may have landed in part), everything else is as it was, and the same write
    /// succeeds once space is freed. A flush that fails for want of space is `Io`,
    /// not this: writes it was to make durable may be lost, as with any failed flush.
    #[error("{op} of {len_bytes} bytes at offset {offset_bytes} on {device} found no space (the device, or the file system it is on, is full): {source}")]
    NoSpace {
        /// The device's name (its path).
        device: String,
        /// What was attempted.
        op: IoOp,
        /// Where.
        offset_bytes: u64,
        /// How much.
        len_bytes: u64,
        /// The OS error (`ENOSPC` or `EDQUOT`).
        source: std::io::Error,
    },
    /// A request outside the device.
    #[error("{op} of {len_bytes} bytes at offset {offset_bytes} is past the end of {device} ({device_bytes} bytes)")]
    OutOfBounds {
        /// The device's name.
        device: String,
        /// What was attempted.
        op: IoOp,
        /// Where.
        offset_bytes: u64,
        /// How much.
        len_bytes: u64,
        /// The device's length.
        device_bytes: u64,
    },
    /// Another process (or this one) holds the device.
    #[error("{device} is in use by {holder}")]
    Locked {
        /// The device's name.
        device: String,
        /// Who holds it, as well as can be told.
        holder: LockHolder,
    },
    /// An RBD image whose exclusive lock another client holds: a server elsewhere (or
    /// one that died or was cut off without releasing it) owns the image.
    #[error("{device} is owned by another client, {owner}: it holds the image's exclusive lock")]
    Owned {
        /// The device's name.
        device: String,
        /// The holder, as librbd names it (its client address, `IP:PORT/NONCE`).
        owner: String,
    },
    /// An RBD image that cannot be locked for one writer (no `exclusive-lock`
    /// feature), or whose lock could not be taken or broken.
    #[error("{device} cannot be locked for one writer: {reason}")]
    NotLockable {
        /// The device's name.
        device: String,
        /// Why, and what to do.
        reason: String,
    },
    /// This client no longer owns the device: another client took its exclusive lock
    /// over and blocklisted this one, so the cluster refuses its writes. What was not
    /// flushed before is lost; nothing written from now on reaches the device.
    #[error("{op} on {device} was refused: this client lost the device to another one, which took it over and fenced this one off (blocklisted it): {source}")]
    Fenced {
        /// The device's name.
        device: String,
        /// What was refused.
        op: IoOp,
        /// librbd's error (`ESHUTDOWN`, Ceph's `EBLOCKLISTED`; or `EROFS`, the lock lost).
        source: std::io::Error,
    },
    /// A loop device whose backing file cannot be opened and locked: another process
    /// could hold the same bytes through it, so the device is refused.
    #[error("{device} is a loop device over {backing}, which cannot be locked ({why}); refusing it, since another program could be using the same bytes through that file")]
    BackingUnreachable {
        /// The loop device's name.
        device: String,
        /// The backing file, as the kernel names it.
        backing: String,
        /// Why it cannot be locked.
        why: String,
    },
    /// The file shrank under the open pool (truncated by another program): the
    /// bytes past its new end are gone, and writes made since may be too. Found at a
    /// flush, so that nothing is reported durable on a file that lost its tail.
    #[error("{device} was truncated while open: it holds {len_bytes} bytes, but was {expected_bytes} when opened (or last grown); the blocks past its end are gone, and writes not yet on the device may be lost")]
    Shrunk {
        /// The file's name (its path).
        device: String,
        /// Its length now.
        len_bytes: u64,
        /// Its length when opened or last grown.
        expected_bytes: u64,
    },
    /// A device's name that is not a path, `file:` or `rbd:` URI ([`DeviceUri`]).
    #[error("{uri:?} is not a device name fewerbytes can open: {reason}")]
    InvalidUri {
        /// The name as given.
        uri: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An injected fault (tests only).
    #[error("injected {op} fault on {device}")]
    Injected {
        /// The device's name.
        device: String,
        /// What failed.
        op: IoOp,
    },
}

impl StorageError {
    /// Whether the device (or the file system under it) was full: the request can
    /// succeed once space is freed, and the device is otherwise sound.
    pub fn is_no_space(&self) -> bool {
        matches!(self, StorageError::NoSpace { .. })
    }

    /// Whether another client took the device over and fenced this one off
    /// ([`StorageError::Fenced`]): nothing this handle writes reaches it any more.
    pub fn is_fenced(&self) -> bool {
        matches!(self, StorageError::Fenced { .. })
    }

    /// The error for an OS failure of `op`: [`StorageError::NoSpace`] when a write or
    /// a discard found no space (`ENOSPC`, `EDQUOT`), [`StorageError::Io`] otherwise.
    pub fn from_os(
        device: &str,
        op: IoOp,
        offset_bytes: u64,
        len_bytes: u64,
        source: std::io::Error,
    ) -> StorageError {
        let no_space = matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT));
        let device = device.to_string();
        match op {
            IoOp::Write | IoOp::Discard if no_space => StorageError::NoSpace {
                device,
                op,
                offset_bytes,
                len_bytes,
                source,
            },
            _ => StorageError::Io {
                device,
                op,
                offset_bytes,
                len_bytes,
                source,
            },
        }
    }
}

fn io_message(
    device: &str,
    op: IoOp,
    offset_bytes: u64,
    len_bytes: u64,
    source: &std::io::Error,
) -> String {
    match op {
        IoOp::Open if len_bytes == 0 => format!("could not open {device}: {source}"),
        IoOp::Open => format!("could not size {device} to {len_bytes} bytes: {source}"),
        _ => format!(
            "{op} of {len_bytes} bytes at offset {offset_bytes} on {device} failed: {source}"
        ),
    }
}

/// Bytes and operations that crossed a device, counted at the storage layer.
#[derive(Debug, Default)]
pub struct IoCounters {
    /// Bytes read from the device.
    pub read_bytes: AtomicU64,
    /// Bytes written to the device.
    pub write_bytes: AtomicU64,
    /// Read calls.
    pub reads: AtomicU64,
    /// Write calls.
    pub writes: AtomicU64,
    /// Flush (fsync) calls.
    pub flushes: AtomicU64,
    /// Bytes given back to the device by discards it took.
    pub discard_bytes: AtomicU64,
    /// Discard calls the device took (not those refused as unsupported or off).
    pub discards: AtomicU64,
}

/// A point-in-time copy of [`IoCounters`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IoSnapshot {
    /// Bytes read from the device.
    pub read_bytes: u64,
    /// Bytes written to the device.
    pub write_bytes: u64,
    /// Read calls.
    pub reads: u64,
    /// Write calls.
    pub writes: u64,
    /// Flush calls.
    pub flushes: u64,
    /// Bytes given back to the device by discards it took.
    pub discard_bytes: u64,
    /// Discard calls the device took.
    pub discards: u64,
}

impl IoCounters {
    /// Count a read of `len` bytes.
    pub fn count_read(&self, len: usize) {
        self.read_bytes.fetch_add(len as u64, Ordering::Relaxed);
        self.reads.fetch_add(1, Ordering::Relaxed);
    }
    /// Count a write of `len` bytes.
    pub fn count_write(&self, len: usize) {
        self.write_bytes.fetch_add(len as u64, Ordering::Relaxed);
        self.writes.fetch_add(1, Ordering::Relaxed);
    }
    /// Count a flush.
    pub fn count_flush(&self) {
        self.flushes.fetch_add(1, Ordering::Relaxed);
    }
    /// Count a discard of `len_bytes` the device took.
    pub fn count_discard(&self, len_bytes: u64) {
        self.discard_bytes.fetch_add(len_bytes, Ordering::Relaxed);
        self.discards.fetch_add(1, Ordering::Relaxed);
    }
    /// Read all counters.
    pub fn snapshot(&self) -> IoSnapshot {
        IoSnapshot {
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            write_bytes: self.write_bytes.load(Ordering::Relaxed),
            reads: self.reads.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            flushes: self.flushes.load(Ordering::Relaxed),
            discard_bytes: self.discard_bytes.load(Ordering::Relaxed),
            discards: self.discards.load(Ordering::Relaxed),
        }
    }
}

/// The page [`Storage::write_pages`] aligns to: the largest logical block size a
/// direct write must be aligned to on the devices a pool sits on.
pub const PAGE_BYTES: usize = 4096;

/// One page of memory on a [`PAGE_BYTES`] boundary.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; PAGE_BYTES]);

const _: () = assert!(std::mem::align_of::<Page>() == PAGE_BYTES);
const _: () = assert!(std::mem::size_of::<Page>() == PAGE_BYTES);

/// A buffer of whole pages that starts on a page boundary: what
/// [`Storage::write_pages`] can write past the device's cache.
#[derive(Default)]
pub struct PageBuf {
    pages: Vec<Page>,
}

impl PageBuf {
    /// `pages` pages of zeros.
    pub fn zeroed(pages: usize) -> PageBuf {
        PageBuf {
            pages: vec![Page([0; PAGE_BYTES]); pages],
        }
    }

    /// Make it `pages` pages long; pages added are zeros, the others keep their bytes.
    pub fn resize_pages(&mut self, pages: usize) {
        self.pages.resize(pages, Page([0; PAGE_BYTES]));
    }

    /// Its bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `Page` is `repr(C)` around a byte array, with no padding (its size
        // is its array's, asserted above), so the vector's pages are
        // `len * PAGE_BYTES` initialised bytes in one allocation, borrowed as `self`.
        unsafe {
            std::slice::from_raw_parts(
                self.pages.as_ptr().cast::<u8>(),
                self.pages.len() * PAGE_BYTES,
            )
        }
    }

    /// Its bytes, to fill.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`, borrowed mutably as `self`; any byte is a valid `u8`.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.pages.as_mut_ptr().cast::<u8>(),
                self.pages.len() * PAGE_BYTES,
            )
        }
    }
}

/// The unit of a discard: only the whole 4 KiB pages inside a range asked for are
/// discarded (the range is rounded inward), so a discard never touches a byte
/// outside the range, and every device (512-byte or 4 KiB sectors) takes it.
pub const DISCARD_UNIT_BYTES: u64 = 4096;

/// What a discard did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiscardOutcome {
    /// The device was told (or the range held no whole 4 KiB page, and nothing
    /// needed telling). The range's bytes are unspecified until written again.
    Discarded,
    /// Discards are turned off for this device ([`Storage::set_discard_enabled`]):
    /// nothing was done.
    Disabled,
    /// The device, or the file system the file is on, cannot discard: nothing was
    /// done, and the device stays as sound as it was. Remembered, so asking again
    /// costs nothing.
    Unsupported,
}

/// A device a pool lives on.
///
/// Contract: a write that returned is visible to later reads; it is durable only
/// after a later `flush` returns. A write may be torn at 512-byte boundaries by a
/// crash. After an I/O error, callers must assume nothing about unflushed writes.
/// A write that finds no space ([`StorageError::is_no_space`]) leaves its range
/// unspecified and nothing else changed.
///
/// A discard gives the whole 4 KiB pages of a range back: until they are written
/// again they read as zeros or as their old bytes (a drive's choice), and until the
/// next flush returns a crash may leave either, page by page, as with a write of
/// zeros that was not flushed. A caller discards only what no durable state names.
pub trait Storage: Send + Sync {
    /// Read exactly `buf.len()` bytes at `offset_bytes`.
    fn read_at(&self, buf: &mut [u8], offset_bytes: u64) -> Result<(), StorageError>;
    /// Read like [`Storage::read_at`], but only if that needs no wait for the device
    /// (the bytes are cached): `Ok(true)` when read, `Ok(false)` when it would wait
    /// (nothing counted, `buf` unspecified). A device that cannot tell says `false`.
    fn read_at_cached(&self, buf: &mut [u8], offset_bytes: u64) -> Result<bool, StorageError> {
        let _ = (buf, offset_bytes);
        Ok(false)
    }
    /// Write all of `buf` at `offset_bytes`.
    fn write_at(&self, buf: &[u8], offset_bytes: u64) -> Result<(), StorageError>;
    /// Write whole pages of data as [`Storage::write_at`] would, with the same contract,
    /// but past the device's cache where it can (a file's `O_DIRECT`): for bytes the
    /// caller keeps and serves itself until written, and reads seldom soon after. It
    /// goes past the cache only when `buf` starts on a [`PAGE_BYTES`] boundary in
    /// memory ([`PageBuf`]) and `offset_bytes` and `buf.len()` are multiples of it;
    /// any other write is an ordinary one. A later read of the range, through either
    /// kind of write, returns the new bytes; `flush` makes it durable as any write.
    /// Default: `write_at`.
    fn write_pages(&self, buf: &[u8], offset_bytes: u64) -> Result<(), StorageError> {
        self.write_at(buf, offset_bytes)
    }
    /// Write each `(offset_bytes, bytes)` of `writes` as [`Storage::write_at`] would,
    /// possibly several at once and in any order, and return once all have. The
    /// ranges must not overlap. Every range is checked against the device's end
    /// before anything is written; after another error, which of the writes landed
    /// is unspecified, as for a failed `write_at`. Counted as one write per entry.
    /// Default: one `write_at` after another; an RBD image keeps up to
    /// `AIO_IN_FLIGHT_MAX` of them in flight at once (`rbd_aio_write2`).
    fn write_batch(&self, writes: &[(u64, &[u8])]) -> Result<(), StorageError> {
        check_batch_bounds(self.name(), writes, self.len_bytes())?;
        for &(offset_bytes, bytes) in writes {
            self.write_at(bytes, offset_bytes)?;
        }
        Ok(())
    }
    /// Make every write that returned before this call durable.
    fn flush(&self) -> Result<(), StorageError>;
    /// Give the whole 4 KiB pages of `[offset_bytes, offset_bytes+len_bytes)` back
    /// to the device (see the trait's contract). A device that cannot discard says
    /// [`DiscardOutcome::Unsupported`], never an error; errors are a range past the
    /// end, no space (a hole punched in a file can need a new extent block), and
    /// the device failing.
    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> Result<DiscardOutcome, StorageError> {
        check_bounds(
            self.name(),
            IoOp::Discard,
            offset_bytes,
            len_bytes,
            self.len_bytes(),
        )?;
        Ok(DiscardOutcome::Unsupported)
    }
    /// Turn discards on (the default) or off for this device; while off,
    /// [`Storage::discard`] does nothing and says [`DiscardOutcome::Disabled`].
    fn set_discard_enabled(&self, enabled: bool) {
        let _ = enabled;
    }
    /// The device's length in bytes, as last measured (at open, or by
    /// [`Storage::refresh_len`]).
    fn len_bytes(&self) -> u64;
    /// Measure the device's length again (a file extended with `truncate`, a loop
    /// device after `losetup -c`, a grown logical volume), make it the length
    /// [`Storage::len_bytes`] reports and requests are checked against, and return
    /// it. A device that cannot change length returns the one it has.
    fn refresh_len(&self) -> Result<u64, StorageError> {
        Ok(self.len_bytes())
    }
    /// The device's name for messages (a path).
    fn name(&self) -> &str;
    /// Bytes and calls that crossed this device.
    fn counters(&self) -> &IoCounters;
    /// Be told, once, when another client takes the device over and fences this
    /// handle off, even while nothing is written through it: `fenced` gets the error
    /// ([`StorageError::Fenced`]). An RBD image learns it from its header's watch (the
    /// cluster drops a blocklisted client's watch). Default: never, for a device whose
    /// lock cannot be taken from a live holder (a file's). A later call replaces the
    /// listener.
    fn on_fenced(&self, fenced: FencedListener) {
        drop(fenced);
    }
}

/// Told when a device was taken over by another client ([`Storage::on_fenced`]).
pub type FencedListener = Box<dyn Fn(StorageError) + Send + Sync>;

/// The whole [`DISCARD_UNIT_BYTES`] pages inside `[offset_bytes, offset_bytes+len_bytes)`,
/// as (offset, length); `None` when there is none (or the range overflows).
pub fn discard_pages(offset_bytes: u64, len_bytes: u64) -> Option<(u64, u64)> {
    let end = offset_bytes.checked_add(len_bytes)?;
    let start = offset_bytes.checked_next_multiple_of(DISCARD_UNIT_BYTES)?;
    let end = end - end % DISCARD_UNIT_BYTES;
    (start < end).then(|| (start, end - start))
}

/// Check every range of a [`Storage::write_batch`] with [`check_bounds`].
pub fn check_batch_bounds(
    device: &str,
    writes: &[(u64, &[u8])],
    device_bytes: u64,
) -> Result<(), StorageError> {
    for &(offset_bytes, bytes) in writes {
        check_bounds(
            device,
            IoOp::Write,
            offset_bytes,
            bytes.len() as u64,
            device_bytes,
        )?;
    }
    Ok(())
}

/// Check that `[offset, offset+len)` lies inside a device of `device_bytes`.
pub fn check_bounds(
    device: &str,
    op: IoOp,
    offset_bytes: u64,
    len_bytes: u64,
    device_bytes: u64,
) -> Result<(), StorageError> {
    match offset_bytes.checked_add(len_bytes) {
        Some(end) if end <= device_bytes => Ok(()),
        _ => Err(StorageError::OutOfBounds {
            device: device.to_string(),
            op,
            offset_bytes,
            len_bytes,
            device_bytes,
        }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn a_discard_covers_only_the_whole_pages_inside_its_range() {
        assert_eq!(discard_pages(0, 8192), Some((0, 8192)));
        assert_eq!(discard_pages(1, 8192), Some((4096, 4096)));
        assert_eq!(discard_pages(1, 4096), None);
        assert_eq!(discard_pages(4096, 4095), None);
        assert_eq!(discard_pages(u64::MAX - 10, 5), None);
        assert_eq!(discard_pages(4096, u64::MAX), None, "overflow");
    }

    #[test]
    fn no_space_is_told_apart_from_other_failures() {
        let full = |errno| {
            StorageError::from_os(
                "d",
                IoOp::Write,
                0,
                1,
                std::io::Error::from_raw_os_error(errno),
            )
        };
        assert!(full(libc::ENOSPC).is_no_space());
        assert!(full(libc::EDQUOT).is_no_space());
        assert!(!full(libc::EIO).is_no_space());
        let flush = StorageError::from_os(
            "d",
            IoOp::Flush,
            0,
            0,
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert!(!flush.is_no_space(), "a failed flush may have lost writes");
    }
}
