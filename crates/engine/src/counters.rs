//! Write-path counters, kept with atomics by the engine itself (per pool and per volume).

use crate::api::WriteCounters;
use fewerbytes_format::page::PageKind;
use fewerbytes_format::BLOCK_BYTES;
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

/// Metadata bytes the checkpoints wrote, by region (the journal counts its own).
#[derive(Default)]
pub(crate) struct RegionBytes {
    super_bytes: AtomicU64,
    map_bytes: AtomicU64,
    object_bytes: AtomicU64,
    fingerprint_bytes: AtomicU64,
    dir_bytes: AtomicU64,
    catalog_bytes: AtomicU64,
}

impl RegionBytes {
    /// One page of `kind` written.
    pub fn count_page(&self, kind: PageKind) {
        let c = match kind {
            PageKind::Map => &self.map_bytes,
            PageKind::Objects | PageKind::Counts => &self.object_bytes,
            PageKind::Fingerprints => &self.fingerprint_bytes,
            PageKind::Directory => &self.dir_bytes,
            PageKind::Catalog | PageKind::Counters => &self.catalog_bytes,
        };
        c.fetch_add(BLOCK_BYTES as u64, Relaxed);
    }

    /// One super block copy written.
    pub fn count_super_block(&self) {
        self.super_bytes.fetch_add(BLOCK_BYTES as u64, Relaxed);
    }

    /// (region, bytes) in the order `stats` shows them, with the journal's bytes.
    pub fn by_region(&self, journal_bytes: u64) -> Vec<(String, u64)> {
        vec![
            ("super block".into(), self.super_bytes.load(Relaxed)),
            ("journal".into(), journal_bytes),
            ("block map pages".into(), self.map_bytes.load(Relaxed)),
            ("slab object pages".into(), self.object_bytes.load(Relaxed)),
            (
                "fingerprint pages".into(),
                self.fingerprint_bytes.load(Relaxed),
            ),
            ("directory pages".into(), self.dir_bytes.load(Relaxed)),
            ("catalog pages".into(), self.catalog_bytes.load(Relaxed)),
        ]
    }
}
