//! How many metadata pages the pool may still have to place, and where they fit.
//!
//! Before a checkpoint's snapshot (the gate held, so nothing turns dirty meanwhile):
//! how many pages it will write. When the page store's free slots cannot hold them,
//! the rest go to data blocks, and a checkpoint that could not place them all must be
//! refused before its snapshot, which cannot be taken back (`inner.rs:
//! metadata_room`). Counted as the snapshot writes (`checkpoint.rs`): each changed
//! count, fingerprint and map page; above them, per table and level, at most one
//! directory page per distinct parent of a rewritten page (never more than the level
//! holds), plus one per level for a length change; and the whole catalog.
//!
//! For the space ledger (`reservation.rs`): the pages that will become live and need
//! room of their own, beyond the free slots — the new pages (no durable copy yet)
//! the next checkpoint writes, and, at worst, the pages the data volumes have
//! reserved and not written yet will need: block-map pages for their unwritten
//! blocks ([`map_pages_for`]), count and fingerprint pages for one new object per
//! block ([`object_pages_for`]), and the directory pages above both. The
//! copy-on-write room a checkpoint needs for the new copies of pages that already
//! have one is the slabs' headroom (`geometry.rs: METADATA_HEADROOM_BLOCKS`),
//! which no data takes.

use crate::block_map::VolumeState;
use crate::slab::ObjTable;
use crate::slab_depot::SlabDepot;
use fewerbytes_format::dir_tree::{level_sizes, MAX_DEPTH};
use fewerbytes_format::page::{
    COUNTS_PER_PAGE, FINGERPRINTS_PER_PAGE, MAP_ENTRIES_PER_PAGE, REFS_PER_DIR_PAGE,
};
use std::collections::BTreeSet;
use std::sync::Arc;

/// An upper bound on the pages the next checkpoint writes, catalog pages
/// (`catalog_pages`, of the current catalog, plus two for growth) and the counters
/// page included.
pub(crate) fn pages_to_write(
    depot: &SlabDepot,
    volumes: &[Arc<VolumeState>],
    catalog_pages: u64,
) -> u64 {
    let mut pages = catalog_pages + 2 + 1;
    for table in [ObjTable::Counts, ObjTable::Fingerprints] {
        let mut changed = Vec::new();
        let per_slab = depot.table_pages_per_slab(table);
        // Slabs never touched have no page in memory, so none changed.
        for (s, slab) in depot.touched() {
            let slab = slab.lock();
            changed.extend(
                slab.table_pages_in_memory(table)
                    .filter(|&k| slab.table_page_changed(table, k))
                    .map(|k| u64::from(s) * per_slab + k as u64),
            );
        }
        let total = u64::from(depot.count()) * per_slab;
        pages += changed.len() as u64 + directory_pages(&changed, total);
    }
    for vol in volumes {
        // The pages in memory: only those can be dirty.
        let map = vol.map_pages();
        let changed: Vec<u64> = map
            .iter()
            .filter(|(_, p)| p.lock().is_dirty())
            .map(|(k, _)| k)
            .collect();
        pages += changed.len() as u64 + directory_pages(&changed, map.len());
    }
    pages
}

/// What the page store offers the ledger (`reservation.rs`), read from the
/// checkpointer with no lock kept.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PageRoom {
    /// Free page-store slots.
    pub free_slots: u64,
    /// Pages turned dirty since the last checkpoint (`Checkpointer::dirty_page_count`).
    pub dirty_pages: u64,
}

impl PageRoom {
    /// An upper bound on the pages the next checkpoint writes that have no durable
    /// copy yet, with the directory pages above them. Cheap (every dirty page taken
    /// for new, with a new directory page at each level above it) when that and
    /// `future` pages fit in the free slots anyway; else counted page by page.
    pub(crate) fn new_pages(
        &self,
        depot: &SlabDepot,
        volumes: &[Arc<VolumeState>],
        future: u64,
    ) -> u64 {
        let quick = self.dirty_pages * (1 + u64::from(MAX_DEPTH));
        if quick + future <= self.free_slots {
            return quick;
        }
        new_pages_to_write(depot, volumes)
    }
}

/// The pages the next checkpoint writes that no durable copy holds yet (table pages
/// changed and never written), and the directory pages that may be rewritten above
/// them (`directory_pages`).
pub(crate) fn new_pages_to_write(depot: &SlabDepot, volumes: &[Arc<VolumeState>]) -> u64 {
    let mut pages = 0;
    for table in [ObjTable::Counts, ObjTable::Fingerprints] {
        let mut new = Vec::new();
        let per_slab = depot.table_pages_per_slab(table);
        for (s, slab) in depot.touched() {
            let slab = slab.lock();
            new.extend(
                slab.table_pages_in_memory(table)
                    .filter(|&k| {
                        slab.table_page_changed(table, k) && slab.durable_ref(table, k).is_none()
                    })
                    .map(|k| u64::from(s) * per_slab + k as u64),
            );
        }
        if !new.is_empty() {
            let total = u64::from(depot.count()) * per_slab;
            pages += new.len() as u64 + directory_pages(&new, total);
        }
    }
    for vol in volumes {
        // The pages in memory: only those can be dirty.
        let map = vol.map_pages();
        let new: Vec<u64> = map
            .iter()
            .filter(|(_, p)| {
                let p = p.lock();
                p.is_dirty() && p.durable().is_none()
            })
            .map(|(k, _)| k)
            .collect();
        if !new.is_empty() {
            pages += new.len() as u64 + directory_pages(&new, map.len());
        }
    }
    pages
}

/// Block-map pages, with the directory pages above them, that a volume of
/// `size_blocks` may still add while it writes `blocks` new blocks: one a block at
/// worst (each in a page never written), never more than its pages that hold no
/// entry yet. At least one page in 504 holds an entry for each of the
/// `written_blocks` it maps (to data or zeros), so no more than the rest can be
/// unwritten.
pub(crate) fn map_pages_for(blocks: u64, size_blocks: u64, written_blocks: u64) -> u64 {
    let per_page = MAP_ENTRIES_PER_PAGE as u64;
    let total = size_blocks.div_ceil(per_page);
    let unwritten = total.saturating_sub(written_blocks.div_ceil(per_page));
    let pages = blocks.min(unwritten);
    if pages == 0 {
        return 0;
    }
    pages + tree_pages(total).min(pages * u64::from(MAX_DEPTH))
}

/// Count and fingerprint pages, with the directory pages above them, that `objects`
/// new objects may add to a pool of `slabs` slabs of `objects_per_slab` objects: a
/// slab gives out objects in order (`slab.rs: alloc_object`), so a new page every 336
/// (counts) or 126 (fingerprints) objects, and one begun in each slab they land in;
/// never more than the tables hold.
pub(crate) fn object_pages_for(objects: u64, slabs: u64, objects_per_slab: u64) -> u64 {
    if objects == 0 {
        return 0;
    }
    [COUNTS_PER_PAGE, FINGERPRINTS_PER_PAGE]
        .iter()
        .map(|&records| {
            let records = records as u64;
            let table = slabs * objects_per_slab.div_ceil(records);
            let pages = objects.div_ceil(records) + objects.min(slabs);
            pages.min(table) + tree_pages(table)
        })
        .sum()
}

/// Directory pages of a table of `pages` pages, every level (the most a table's
/// tree can add).
fn tree_pages(pages: u64) -> u64 {
    level_sizes(pages).map_or(pages, |sizes| sizes.iter().sum())
}

/// Directory pages a checkpoint may rewrite above the `changed` pages (in order) of a
/// table of `total` pages.
pub(crate) fn directory_pages(changed: &[u64], total: u64) -> u64 {
    let sizes = level_sizes(total).unwrap_or_else(|| vec![total; MAX_DEPTH as usize]);
    let mut below: BTreeSet<u64> = changed.iter().copied().collect();
    let mut pages = 0u64;
    for size in sizes {
        below = below.iter().map(|k| k / REFS_PER_DIR_PAGE as u64).collect();
        // One more where the table's length changed (the last page's parent).
        pages += (below.len() as u64 + 1).min(size);
    }
    pages
}

#[cfg(test)]
mod tests {
    use super::{directory_pages, map_pages_for, object_pages_for};

    #[test]
    fn directory_pages_count_distinct_parents_at_each_level() {
        // No change: only a length change's page per level.
        assert_eq!(directory_pages(&[], 10), 1);
        // Two pages under one level-1 directory of a one-level tree.
        assert_eq!(directory_pages(&[0, 5], 10), 1);
        // 2,000 pages: eight level-1 directories, two levels.
        assert_eq!(directory_pages(&[0, 300, 1999], 2000), 4 + 1);
    }

    #[test]
    fn a_reserved_block_may_need_a_map_page_while_some_page_holds_no_entry() {
        // A new volume of 5,040 blocks: ten map pages, under one directory page.
        assert_eq!(map_pages_for(0, 5040, 0), 0);
        assert_eq!(map_pages_for(3, 5040, 0), 3 + 1);
        assert_eq!(map_pages_for(5040, 5040, 0), 10 + 1);
        // Half of it written: at least five pages hold entries, five at most are new.
        assert_eq!(map_pages_for(2520, 5040, 2520), 5 + 1);
        // Written whole: no page is new.
        assert_eq!(map_pages_for(100, 5040, 5040), 0);
    }

    #[test]
    fn new_objects_need_a_count_page_per_336_and_a_fingerprint_page_per_126() {
        // Four slabs of 24,612 objects: 74 count and 196 fingerprint pages each, under
        // two and four directory pages.
        assert_eq!(object_pages_for(0, 4, 24612), 0);
        // One object: a page of each table begun, and their directories.
        assert_eq!(object_pages_for(1, 4, 24612), (1 + 1 + 2) + (1 + 1 + 4));
        // 3,360 objects: ten count and 27 fingerprint pages, one more of each for
        // each slab they may begin a page in.
        assert_eq!(
            object_pages_for(3360, 4, 24612),
            (10 + 4 + 2) + (27 + 4 + 4)
        );
        // Never more than the tables hold.
        assert_eq!(object_pages_for(1 << 40, 4, 24612), (296 + 2) + (784 + 4));
    }
}
