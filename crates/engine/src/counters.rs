//! Write-path counters, kept with atomics by the engine itself (per pool and per volume).

use crate::api::WriteCounters;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Atomic twin of [`WriteCounters`].
#[derive(Default, Debug)]
pub struct Counters {
    pub(crate) guest_bytes_written: AtomicU64,
    pub(crate) guest_bytes_read: AtomicU64,
    pub(crate) blocks_written: AtomicU64,
    pub(crate) zero_blocks_written: AtomicU64,
    pub(crate) dedup_hits: AtomicU64,
    pub(crate) advice_valid: AtomicU64,
    pub(crate) advice_stale: AtomicU64,
    pub(crate) compressed_writes: AtomicU64,
    pub(crate) uncompressed_writes: AtomicU64,
    pub(crate) trimmed_bytes: AtomicU64,
    pub(crate) write_zeroes_bytes: AtomicU64,
    pub(crate) flushes: AtomicU64,
}

/// Add `n` to a counter.
pub fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Relaxed);
}

impl Counters {
    /// A plain copy.
    pub fn snapshot(&self) -> WriteCounters {
        WriteCounters {
            guest_bytes_written: self.guest_bytes_written.load(Relaxed),
            guest_bytes_read: self.guest_bytes_read.load(Relaxed),
            blocks_written: self.blocks_written.load(Relaxed),
            zero_blocks_written: self.zero_blocks_written.load(Relaxed),
            dedup_hits: self.dedup_hits.load(Relaxed),
            advice_valid: self.advice_valid.load(Relaxed),
            advice_stale: self.advice_stale.load(Relaxed),
            compressed_writes: self.compressed_writes.load(Relaxed),
            uncompressed_writes: self.uncompressed_writes.load(Relaxed),
            trimmed_bytes: self.trimmed_bytes.load(Relaxed),
            write_zeroes_bytes: self.write_zeroes_bytes.load(Relaxed),
            flushes: self.flushes.load(Relaxed),
        }
    }
}
