//! Directory trees (versions 2 and 3): how the pages of one table (a volume's block
//! map, the count table, the fingerprint table) are reached from the catalog.
//!
//! Level-1 directory pages hold the references of the table's pages, 252 each; a
//! level-*k* directory page holds those of up to 168 level-(*k* − 1) directory pages
//! (version 3: twinned references of 24 bytes, [`crate::page::TWIN_REFS_PER_DIR_PAGE`];
//! version 2: 252 references of 16 bytes, [`level_sizes_v2`]).
//! Levels are built up until a level has at most [`MAX_TOP_REFS`] pages: that level
//! is the table's *depth*, and the catalog holds its references (the *top list*).
//! The shape is a function of the table's page count alone, so a reader computes it
//! and refuses a catalog that disagrees. The depth is bounded by [`MAX_DEPTH`],
//! which holds the largest table the format allows (checked below at compile time).

use crate::journal::MAX_LBN;
use crate::page::{MAP_ENTRIES_PER_PAGE, REFS_PER_DIR_PAGE, TWIN_REFS_PER_DIR_PAGE};
use crate::{BLOCK_BYTES, FORMAT_VERSION};

/// Most references in a table's top list: a volume of up to 4 × 252 map pages
/// (1,008 × 504 blocks, 1.94 GiB) has one level of directories, as before trees.
pub const MAX_TOP_REFS: usize = 4;
/// Most directory levels of a table (a directory page's header holds its level, so the
/// bound lives with the page layout). Four levels reach 4 × 168³ × 252 (about
/// 4.8 × 10⁹) table pages in version 3, more than the largest table below needs.
pub use crate::page::MAX_DEPTH;

/// Logical blocks of the largest volume: a journal record holds an LBN in 40 bits.
pub const MAX_VOLUME_BLOCKS: u64 = MAX_LBN + 1;
/// Logical bytes of the largest volume: 2⁵² (4 PiB).
pub const MAX_VOLUME_BYTES: u64 = MAX_VOLUME_BLOCKS * BLOCK_BYTES as u64;
/// Blocks of the largest data region: a fragment's location holds its byte address
/// in 48 bits, so the region is at most 2⁴⁸ bytes (256 TiB).
pub const MAX_DATA_REGION_BLOCKS: u64 = (1 << 48) / BLOCK_BYTES as u64;
/// Most pages of the largest volume's block map.
pub const MAX_MAP_PAGES: u64 = MAX_VOLUME_BLOCKS.div_ceil(MAP_ENTRIES_PER_PAGE as u64);
/// Most table pages a tree of [`MAX_DEPTH`] levels reaches (version 3).
pub const MAX_TREE_PAGES: u64 = MAX_TOP_REFS as u64
    * (TWIN_REFS_PER_DIR_PAGE as u64).pow(MAX_DEPTH - 1)
    * REFS_PER_DIR_PAGE as u64;

const _: () = assert!(
    MAX_MAP_PAGES <= MAX_TREE_PAGES,
    "the largest volume's map fits in MAX_DEPTH levels"
);
const _: () = assert!(
    (MAX_DATA_REGION_BLOCKS / 8192 + 1) * 196 <= MAX_TREE_PAGES,
    "the object tables of the largest data region of the default geometry (8,192-block \
     slabs, 196 fingerprint pages each) fit in MAX_DEPTH levels; the super block's \
     check refuses a geometry whose tables do not (`superblock.rs`)"
);

/// Directory pages at each level of a table of `pages` pages (version 3): entry 0 is
/// level 1, the last entry the top level (at most [`MAX_TOP_REFS`] pages). A table
/// has at least one level, empty when it has no pages. `None` when it needs more
/// than [`MAX_DEPTH`] levels.
pub fn level_sizes(pages: u64) -> Option<Vec<u64>> {
    level_sizes_of(FORMAT_VERSION, pages)
}

/// [`level_sizes`] of a version-2 tree: 252 references a page at every level.
pub fn level_sizes_v2(pages: u64) -> Option<Vec<u64>> {
    level_sizes_of(crate::FORMAT_VERSION_2, pages)
}

/// [`level_sizes`] of a tree of format `version` (2 or 3).
pub fn level_sizes_of(version: u32, pages: u64) -> Option<Vec<u64>> {
    let above = if version >= FORMAT_VERSION {
        TWIN_REFS_PER_DIR_PAGE
    } else {
        REFS_PER_DIR_PAGE
    } as u64;
    let mut sizes = vec![pages.div_ceil(REFS_PER_DIR_PAGE as u64)];
    while let Some(&below) = sizes.last() {
        if below <= MAX_TOP_REFS as u64 {
            break;
        }
        if sizes.len() >= MAX_DEPTH as usize {
            return None;
        }
        sizes.push(below.div_ceil(above));
    }
    Some(sizes)
}

/// The depth of a table of `pages` pages (version 3), or `None` past [`MAX_DEPTH`].
pub fn depth(pages: u64) -> Option<u32> {
    level_sizes(pages).map(|s| s.len() as u32)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests fail loudly by design")]
mod tests {
    use super::*;

    #[test]
    fn levels_are_built_until_the_top_list_has_at_most_four_references() {
        assert_eq!(level_sizes(0), Some(vec![0]));
        assert_eq!(level_sizes(1), Some(vec![1]));
        // 4 × 252 map pages (4 × 252 × 504 blocks, just under 2 GiB): one level.
        assert_eq!(level_sizes(4 * 252), Some(vec![4]));
        assert_eq!(level_sizes(4 * 252 + 1), Some(vec![5, 1]));
        // Above level 1, 168 twinned references a page.
        assert_eq!(level_sizes(4 * 168 * 252), Some(vec![4 * 168, 4]));
        assert_eq!(
            level_sizes(4 * 168 * 252 + 1),
            Some(vec![4 * 168 + 1, 5, 1])
        );
        assert_eq!(depth(MAX_TREE_PAGES), Some(4));
        assert_eq!(depth(MAX_TREE_PAGES + 1), None);
        // Version 2: 252 at every level.
        assert_eq!(level_sizes_v2(4 * 252 * 252), Some(vec![4 * 252, 4]));
        assert_eq!(
            level_sizes_v2(4 * 252 * 252 + 1),
            Some(vec![4 * 252 + 1, 5, 1])
        );
        assert_eq!(level_sizes_v2(4 * 252 * 252 * 252 * 252 + 1), None);
    }

    #[test]
    fn format_maxima() {
        assert_eq!(MAX_VOLUME_BYTES, 1 << 52, "4 PiB");
        assert_eq!(
            MAX_DATA_REGION_BLOCKS * BLOCK_BYTES as u64,
            1 << 48,
            "256 TiB"
        );
        assert_eq!(MAX_TREE_PAGES, 4_779_565_056);
        // The largest volume: 2,181,570,691 map pages, depth 4 with 2 top references.
        assert_eq!(MAX_MAP_PAGES, 2_181_570_691);
        assert_eq!(
            level_sizes(MAX_MAP_PAGES),
            Some(vec![8_657_027, 51_530, 307, 2])
        );
        assert_eq!(depth(MAX_MAP_PAGES), Some(4));
        // The largest data region with the default geometry (8,192-block slabs of
        // 24,612 objects: 196 fingerprint pages and 74 count pages each): depth 4.
        let slabs = MAX_DATA_REGION_BLOCKS / 8192;
        assert_eq!(
            level_sizes(slabs * 196),
            Some(vec![6_524_473, 38_837, 232, 2])
        );
        assert_eq!(depth(slabs * 74), Some(4));
        // A 1 TiB data region: depth 3. A 1 GiB volume: depth 1; 2 GiB (1,041 map
        // pages): depth 2; 1 TiB (532,611 map pages): depth 3.
        assert_eq!(depth((1 << 40) / 4096 / 8192 * 196), Some(3));
        assert_eq!(depth((1u64 << 30).div_ceil(4096 * 504)), Some(1));
        assert_eq!(
            level_sizes((2u64 << 30).div_ceil(4096 * 504)),
            Some(vec![5, 1])
        );
        assert_eq!(
            level_sizes((1u64 << 40).div_ceil(4096 * 504)),
            Some(vec![2_114, 13, 1])
        );
    }
}
