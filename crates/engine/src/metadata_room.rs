//! How many pages the next checkpoint will write, counted before its snapshot with
//! the gate held (nothing turns dirty meanwhile): when the page store's free slots
//! cannot hold them, the rest go to data blocks, and a checkpoint that could not
//! place them all must be refused before its snapshot, which cannot be taken back
//! (`inner.rs: metadata_room`).
//!
//! Counted as the snapshot writes (`checkpoint.rs`): each changed count, fingerprint
//! and map page; above them, per table and level, at most one directory page per
//! distinct parent of a rewritten page (never more than the level holds), plus one
//! per level for a length change; and the whole catalog.

use crate::block_map::VolumeState;
use crate::slab::ObjTable;
use crate::slab_depot::SlabDepot;
use fewerbytes_format::dir_tree::{level_sizes, MAX_DEPTH};
use fewerbytes_format::page::REFS_PER_DIR_PAGE;
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
        let mut total = 0u64;
        for slab in depot.iter() {
            let slab = slab.lock();
            let n = slab.table_pages(table);
            changed.extend(
                (0..n)
                    .filter(|&k| slab.table_page_changed(table, k))
                    .map(|k| total + k as u64),
            );
            total += n as u64;
        }
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
    use super::directory_pages;

    #[test]
    fn directory_pages_count_distinct_parents_at_each_level() {
        // No change: only a length change's page per level.
        assert_eq!(directory_pages(&[], 10), 1);
        // Two pages under one level-1 directory of a one-level tree.
        assert_eq!(directory_pages(&[0, 5], 10), 1);
        // 2,000 pages: eight level-1 directories, two levels.
        assert_eq!(directory_pages(&[0, 300, 1999], 2000), 4 + 1);
    }
}
