//! The `Storage` trait: the only way the engine reaches a device.
//!
//! A pool sits on one or two devices (data, and optionally metadata). Each is a
//! `Storage`: positioned reads and writes, a durability barrier (`flush`), and a
//! length. Every implementation counts the bytes that cross it, so the engine's
//! statistics report what reached each device, not what the engine meant to write.
//!
//! Implementations: [`FileStorage`] (a regular file or a block device) and
//! [`FaultStorage`] (an in-memory device for tests that separates what is durable
//! from what was written since the last flush, can crash, and can fail the Nth I/O).
//! A later `RbdStorage` (Ceph) fits behind the same trait.
//!
//! **Architecture invariant:** `storage` knows nothing of pools, blocks or dedup.

#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::indexing_slicing)]

mod fault;
mod file;
mod loop_device;

pub use fault::{CrashMode, FaultPlan, FaultStorage, Image, IoEvent, IoLog, LogReplay};
pub use file::{FileStorage, LockHolder};

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
}

impl std::fmt::Display for IoOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoOp::Read => "read",
            IoOp::Write => "write",
            IoOp::Flush => "flush",
            IoOp::Open => "open",
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
    /// An injected fault (tests only).
    #[error("injected {op} fault on {device}")]
    Injected {
        /// The device's name.
        device: String,
        /// What failed.
        op: IoOp,
    },
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
    /// Read all counters.
    pub fn snapshot(&self) -> IoSnapshot {
        IoSnapshot {
            read_bytes: self.read_bytes.load(Ordering::Relaxed),
            write_bytes: self.write_bytes.load(Ordering::Relaxed),
            reads: self.reads.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            flushes: self.flushes.load(Ordering::Relaxed),
        }
    }
}

/// A device a pool lives on.
///
/// Contract: a write that returned is visible to later reads; it is durable only
/// after a later `flush` returns. A write may be torn at 512-byte boundaries by a
/// crash. After an I/O error, callers must assume nothing about unflushed writes.
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
    /// Make every write that returned before this call durable.
    fn flush(&self) -> Result<(), StorageError>;
    /// The device's length in bytes.
    fn len_bytes(&self) -> u64;
    /// The device's name for messages (a path).
    fn name(&self) -> &str;
    /// Bytes and calls that crossed this device.
    fn counters(&self) -> &IoCounters;
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
