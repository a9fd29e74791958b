//! Write-path counters, kept with atomics by the engine itself (per pool and per volume),
//! and the pool's cumulative counters kept across restarts: loaded from the counters
//! page at open, written to a new one by every checkpoint they changed before
//! (`checkpoint.rs`), as vdostats keeps its statistics.

use crate::api::WriteCounters;
use fewerbytes_format::counters::KNOWN_COUNTERS;
use fewerbytes_format::page::PageKind;
use fewerbytes_format::BLOCK_BYTES;
use parking_lot::Mutex;
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
    /// Writes refused for want of space (ENOSPC) since open: not kept in the
    /// counters page, so not in [`WriteCounters`].
    pub(crate) no_space_refusals: AtomicU64,
    /// The pool's counters before this open, and what the last checkpoint wrote
    /// (per volume: unused, zero).
    kept: Mutex<Kept>,
}

/// The counters page's values: loaded at open, and as last written.
#[derive(Default, Debug)]
struct Kept {
    /// Values at open (the page's, in `COUNTER_NAMES` order, with any this version
    /// does not know kept after them).
    base: Vec<u64>,
    /// Values the last checkpoint wrote, or loaded: a checkpoint that would write the
    /// same values writes no page.
    written: Vec<u64>,
}

/// Add `n` to a counter.
pub fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Relaxed);
}

impl Counters {
    /// Writes refused for want of space since open.
    pub fn no_space_refusals(&self) -> u64 {
        self.no_space_refusals.load(Relaxed)
    }

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

    /// Start from the values of a counters page (the pool's counters before this open).
    pub(crate) fn load_kept(&self, values: Vec<u64>) {
        let mut kept = self.kept.lock();
        kept.written.clone_from(&values);
        kept.base = values;
    }

    /// The pool's counters since it was made: those kept before this open, plus
    /// those since.
    pub fn total(&self) -> WriteCounters {
        let kept = self.kept.lock();
        from_values(&add_values(&kept.base, &to_values(&self.snapshot())))
    }

    /// The values a checkpoint should write to a new counters page, or `None` when
    /// they are those of the page it already has.
    pub(crate) fn to_write(&self) -> Option<Vec<u64>> {
        let kept = self.kept.lock();
        let values = add_values(&kept.base, &to_values(&self.snapshot()));
        (values != kept.written).then_some(values)
    }

    /// The counters page failed its checks (a scrub found it damaged): the next
    /// checkpoint writes a new one whatever changed.
    pub(crate) fn rewrite_page(&self) {
        self.kept.lock().written.clear();
    }

    /// A checkpoint holding `values` is durable.
    pub(crate) fn written(&self, values: Vec<u64>) {
        self.kept.lock().written = values;
    }
}

/// The known counters as a page holds them (`COUNTER_NAMES` order).
fn to_values(c: &WriteCounters) -> [u64; KNOWN_COUNTERS] {
    [
        c.guest_bytes_written,
        c.guest_bytes_read,
        c.blocks_written,
        c.zero_blocks_written,
        c.dedup_hits,
        c.advice_valid,
        c.advice_stale,
        c.compressed_writes,
        c.uncompressed_writes,
        c.trimmed_bytes,
        c.write_zeroes_bytes,
        c.flushes,
    ]
}

/// Counters from a page's values; those missing are 0, those past the known ignored.
fn from_values(v: &[u64]) -> WriteCounters {
    let at = |i: usize| v.get(i).copied().unwrap_or(0);
    WriteCounters {
        guest_bytes_written: at(0),
        guest_bytes_read: at(1),
        blocks_written: at(2),
        zero_blocks_written: at(3),
        dedup_hits: at(4),
        advice_valid: at(5),
        advice_stale: at(6),
        compressed_writes: at(7),
        uncompressed_writes: at(8),
        trimmed_bytes: at(9),
        write_zeroes_bytes: at(10),
        flushes: at(11),
    }
}

/// `base` plus `since_open`, counter by counter: the known ones add up, and those past
/// them (written by a later version) are kept as they were.
fn add_values(base: &[u64], since_open: &[u64; KNOWN_COUNTERS]) -> Vec<u64> {
    let mut out: Vec<u64> = since_open
        .iter()
        .enumerate()
        .map(|(i, n)| base.get(i).copied().unwrap_or(0).wrapping_add(*n))
        .collect();
    out.extend(base.iter().skip(KNOWN_COUNTERS));
    out
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
