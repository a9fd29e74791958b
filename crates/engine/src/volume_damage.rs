//! A damaged range as a volume holds it (`block_map.rs: VolumeState`): the map pages
//! one failed page covered, and that page's reference, which every checkpoint keeps
//! until the range is cleared (the rules: `map_damage.rs`). State only: it names
//! the error a request touching it gets, and nothing that opens or walks a pool.

use crate::damaged_range::DamagedRange;
use crate::EngineError;
use fewerbytes_format::page::{PageRef, MAP_ENTRIES_PER_PAGE};
use fewerbytes_format::BLOCK_BYTES;

const BLOCK: u64 = BLOCK_BYTES as u64;

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
        let per = MAP_ENTRIES_PER_PAGE as u64;
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
