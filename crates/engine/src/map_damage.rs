//! Damaged block-map ranges: a block-map page, or a map directory page, that failed
//! its checks at open (bad checksum, stale, misdirected) when the older super block
//! copy could not stand in for it (the page is one both copies share, or there is
//! no usable older copy). The pool opens anyway: only the volume blocks that page
//! maps are lost, and they are marked DAMAGED.
//!
//! The rules, each kept where it applies:
//! - reads, writes, trims and zeroes that touch a damaged range fail with
//!   [`EngineError::Damaged`] (EIO over NBD): its entries are unknown, so neither
//!   their data nor zeros can be served, and a write there would have to drop a
//!   reference to an object it cannot name (`volume.rs`);
//! - the objects the lost entries named keep the counts the count pages hold: a
//!   leak, never the free of something that may still be referenced;
//! - journal replay: a record into a damaged range changes no entry (the page
//!   stays as its durable copy failed), adds the reference its new entry holds
//!   and drops none (the old entry is unknown): counts may only end too high, never
//!   too low (`recovery.rs`). A damaged page found written after replay is an
//!   invariant error;
//! - the checkpoint keeps the damaged page's (or directory page's) reference as it
//!   is: the page is never dirtied, so no zero reference or empty page is written
//!   over the evidence (`checkpoint.rs` writes only dirty pages);
//! - volume operations that would walk the lost entries (delete, resize, clone) are
//!   refused until the range is cleared;
//! - `check` reports each range; `check --repair` clears it: its entries become
//!   unmapped (read as zeros), the counts are recomputed from the maps, which frees
//!   the leak, and the range is listed as lost (`repair.rs`).

use crate::EngineError;
use fewerbytes_format::page::PageRef;
use fewerbytes_format::BLOCK_BYTES;
use serde::{Deserialize, Serialize};

const BLOCK: u64 = BLOCK_BYTES as u64;

/// One damaged range of a volume: the blocks one failed page maps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DamagedRange {
    /// The volume's name.
    pub volume: String,
    /// First byte of the range in the volume.
    pub offset_bytes: u64,
    /// Bytes of the range.
    pub len_bytes: u64,
    /// The failed page: `block map page` or `directory page`.
    pub region: String,
    /// Its directory level (0: a block-map page itself).
    pub level: u8,
    /// The failed page's block on its device (from the device's start).
    pub block: u64,
    /// `data` or `metadata`.
    pub device: String,
    /// Why it failed its checks.
    pub reason: String,
}

impl DamagedRange {
    /// One line for a person: volume, bytes, page and why.
    pub fn describe(&self) -> String {
        format!(
            "volume '{}' bytes {}..{} ({} bytes) are damaged: the {}{} that maps them, \
             block {} of the {} device, failed its checks ({})",
            self.volume,
            self.offset_bytes,
            self.offset_bytes + self.len_bytes,
            self.len_bytes,
            self.region,
            if self.level > 0 {
                format!(" of level {}", self.level)
            } else {
                String::new()
            },
            self.block,
            self.device,
            self.reason
        )
    }

    /// Whether the range holds any byte of `[offset, offset + len)`.
    pub fn overlaps(&self, offset_bytes: u64, len_bytes: u64) -> bool {
        offset_bytes < self.offset_bytes + self.len_bytes
            && self.offset_bytes < offset_bytes.saturating_add(len_bytes.max(1))
    }
}

/// A damaged range as a volume holds it: in map pages, with the failed page's
/// reference (kept by every checkpoint until the range is cleared).
#[derive(Debug, Clone)]
pub(crate) struct Damage {
    /// Map pages `first_page..end_page` are lost.
    pub(crate) first_page: u64,
    pub(crate) end_page: u64,
    /// 0: a map page; else the directory level of the failed page.
    pub(crate) level: u8,
    /// Its reference, as its parent holds it.
    pub(crate) reference: PageRef,
    pub(crate) block: u64,
    pub(crate) device: &'static str,
    pub(crate) reason: String,
}

impl Damage {
    /// The blocks of a volume of `size_blocks` the damage covers.
    pub(crate) fn lbns(&self, size_blocks: u64) -> std::ops::Range<u64> {
        let per = crate::block_map::ENTRIES_PER_PAGE;
        let first = (self.first_page * per).min(size_blocks);
        first..(self.end_page * per).min(size_blocks)
    }

    /// The public description, for volume `name` of `size_blocks`.
    pub(crate) fn range(&self, name: &str, size_blocks: u64) -> DamagedRange {
        let lbns = self.lbns(size_blocks);
        DamagedRange {
            volume: name.to_string(),
            offset_bytes: lbns.start * BLOCK,
            len_bytes: (lbns.end - lbns.start) * BLOCK,
            region: if self.level == 0 {
                "block map page".into()
            } else {
                "map directory page".into()
            },
            level: self.level,
            block: self.block,
            device: self.device.to_string(),
            reason: self.reason.clone(),
        }
    }

    /// The error a request touching the range gets.
    pub(crate) fn error(&self, name: &str, size_blocks: u64, op: &'static str) -> EngineError {
        EngineError::Damaged {
            op,
            range: Box::new(self.range(name, size_blocks)),
        }
    }
}

/// Every damaged range of every volume, by volume name.
pub(crate) fn pool_ranges(inner: &crate::inner::Inner) -> Vec<DamagedRange> {
    let mut ranges: Vec<DamagedRange> = inner
        .volumes
        .all()
        .iter()
        .flat_map(|v| v.damaged_ranges())
        .collect();
    ranges.sort_by(|a, b| (&a.volume, a.offset_bytes).cmp(&(&b.volume, b.offset_bytes)));
    ranges
}
