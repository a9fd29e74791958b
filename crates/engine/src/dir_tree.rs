//! A table's directory tree in memory: the references of its directory pages at
//! every level, as the last checkpoint wrote them (`docs/format.md`, "Directory
//! trees"). The checkpoint rewrites the pages above a changed page, level by level
//! (`checkpoint.rs`); loading reads the tree down from the catalog's top list,
//! verifying each page against its parent's reference (`load.rs`).
//!
//! Each level is sparse: its length (a function of the table's length) and the
//! references of the directory pages written. A directory page over only pages that
//! were never written is never written itself (its reference is NONE), so the tree
//! of a 4 PiB block map with a few pages written holds a few references, not the
//! 8.6 million its level 1 has room for.
//!
//! In format version 3 each directory page has two copies (its reference's
//! `address` and `twin`): every address here retires with both. A page loaded from
//! its second copy, or found damaged by the scrub, is marked for rewriting
//! ([`DirLevel::mark_rewrite`]): the next checkpoint writes it (both copies, to new
//! addresses) and the path above it.

use crate::page_store::page_addresses;
use fewerbytes_format::catalog::TableRoot;
use fewerbytes_format::page::PageRef;
use std::collections::{BTreeMap, BTreeSet};

/// References of one table's pages or of one level's directory pages: `(index,
/// reference)` in index order, none of them NONE.
pub type SparseRefs = Vec<(u64, PageRef)>;

/// One level of directory pages.
#[derive(Debug, Clone, Default)]
pub struct DirLevel {
    /// Directory pages the level has, written or not.
    len: u64,
    /// The references of those written, by index (below `len`).
    refs: BTreeMap<u64, PageRef>,
    /// Pages the next checkpoint rewrites whatever changed below them: one copy
    /// was found damaged, or the pool's upgrade rewrites every page.
    rewrite: BTreeSet<u64>,
}

impl DirLevel {
    /// A level of `len` pages holding `refs` (NONE ones are left out).
    pub fn new(len: u64, refs: impl IntoIterator<Item = (u64, PageRef)>) -> Self {
        DirLevel {
            len,
            refs: refs.into_iter().filter(|(_, r)| !r.is_none()).collect(),
            rewrite: BTreeSet::new(),
        }
    }

    /// A level as a list holds it (the catalog's top list; version 1's one level).
    pub fn from_list(list: &[PageRef]) -> Self {
        DirLevel::new(list.len() as u64, (0u64..).zip(list.iter().copied()))
    }

    /// Directory pages the level has, written or not.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// The reference of page `k` (NONE: never written).
    pub fn get(&self, k: u64) -> PageRef {
        self.refs.get(&k).copied().unwrap_or_default()
    }

    /// Page `k` was written at `r`.
    pub fn set(&mut self, k: u64, r: PageRef) {
        if r.is_none() {
            self.refs.remove(&k);
        } else {
            self.refs.insert(k, r);
        }
    }

    /// The references of the pages written, in order.
    pub fn refs(&self) -> impl Iterator<Item = (u64, PageRef)> + '_ {
        self.refs.iter().map(|(k, r)| (*k, *r))
    }

    /// Have the next checkpoint rewrite page `k` (and so the path above it).
    pub fn mark_rewrite(&mut self, k: u64) {
        self.rewrite.insert(k);
    }

    /// The pages marked for rewriting, the marks cleared.
    pub fn take_rewrite(&mut self) -> BTreeSet<u64> {
        std::mem::take(&mut self.rewrite)
    }

    /// Make the level `len` pages long: the addresses of pages past it go to `retired`.
    pub fn set_len(&mut self, len: u64, retired: &mut Vec<u64>) {
        let past = self.refs.split_off(&len);
        retired.extend(past.values().flat_map(page_addresses));
        self.len = len;
    }
}

/// The directory pages of one table, by level.
#[derive(Debug, Clone, Default)]
pub struct DirTree {
    /// `levels[k]`: the level-(k + 1) directory pages. The last level is the top
    /// list the catalog holds. Version 1 has one level.
    levels: Vec<DirLevel>,
    /// Table pages under the tree as last written or loaded: when the table's length
    /// changes, the level-1 page over its end must be rewritten (a shrink leaves
    /// references past the new end in it, which a later grow would bring back).
    pages: u64,
}

impl DirTree {
    /// A tree as loading read it: `levels` bottom up (the last the top list), over a
    /// table of `pages` pages.
    pub fn loaded(levels: Vec<DirLevel>, pages: u64) -> DirTree {
        DirTree { levels, pages }
    }

    /// Shape the tree for a table now `pages` long that needs `depth` levels, before
    /// a checkpoint rewrites it: the slots of levels it no longer needs go to
    /// `retired`. Returns the table page whose level-1 directory page must be
    /// rewritten because the length changed (the last page both lengths hold), if any.
    pub fn reshape(&mut self, depth: usize, pages: u64, retired: &mut Vec<u64>) -> Option<u64> {
        while self.levels.len() > depth {
            if let Some(level) = self.levels.pop() {
                retired.extend(level.refs.values().flat_map(page_addresses));
            }
        }
        self.levels.resize_with(depth, DirLevel::default);
        let boundary = self.pages.min(pages);
        let changed = self.pages != pages;
        self.pages = pages;
        if changed {
            boundary.checked_sub(1)
        } else {
            None
        }
    }

    /// Make the next checkpoint write this tree anew in format version 3 (the
    /// upgrade from version 2): every level-1 page rewritten (its layout is
    /// version 2's, but its parent's reference must name two copies), and the levels
    /// above dropped, their addresses to `retired` (version 2 grouped them 252 a page,
    /// version 3 groups them 168): the checkpoint builds them again over level 1.
    pub fn rewrite_all(&mut self, retired: &mut Vec<u64>) {
        let mut levels = self.levels.iter_mut();
        if let Some(level_1) = levels.next() {
            level_1.rewrite = level_1.refs.keys().copied().collect();
        }
        for level in levels {
            retired.extend(level.refs.values().flat_map(page_addresses));
            *level = DirLevel::default();
        }
    }

    /// Table pages under the tree as last written or loaded.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Directory pages marked for rewriting, every level.
    pub fn marked(&self) -> u64 {
        self.levels.iter().map(|l| l.rewrite.len() as u64).sum()
    }

    /// Level `k + 1`, to rewrite. `None` past the top.
    pub fn level_mut(&mut self, k: usize) -> Option<&mut DirLevel> {
        self.levels.get_mut(k)
    }

    /// The catalog's view: the depth and the top list (NONE where a page was never
    /// written).
    pub fn root(&self) -> TableRoot {
        TableRoot {
            depth: self.levels.len().max(1) as u32,
            top: self
                .levels
                .last()
                .map(|top| (0..top.len).map(|k| top.get(k)).collect())
                .unwrap_or_default(),
        }
    }

    /// The page addresses of every directory page.
    pub fn slots(&self) -> impl Iterator<Item = u64> + '_ {
        self.levels
            .iter()
            .flat_map(|level| level.refs.values())
            .flat_map(page_addresses)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests fail loudly by design")]
mod tests {
    use super::*;

    fn at(address: u64) -> PageRef {
        PageRef {
            address,
            crc: 7,
            generation: 1,
            twin: 0,
        }
    }

    #[test]
    fn a_level_holds_only_the_pages_written_and_retires_those_past_a_shorter_length() {
        let mut level = DirLevel::new(1_000_000, [(3, at(10)), (5, PageRef::NONE)]);
        level.set(999_999, at(11));
        assert_eq!(level.refs().count(), 2);
        assert!(level.get(5).is_none());
        let mut retired = Vec::new();
        level.set_len(4, &mut retired);
        assert_eq!(retired, [11]);
        assert_eq!(level.len(), 4);
        let top = DirLevel::from_list(&[PageRef::NONE, at(12)]);
        let tree = DirTree::loaded(vec![level, top], 1000);
        assert_eq!(tree.root().top, [PageRef::NONE, at(12)]);
        assert_eq!(tree.slots().collect::<Vec<_>>(), [10, 12]);
    }

    #[test]
    fn both_copies_of_a_twinned_page_retire_and_an_upgrade_rewrites_level_1() {
        let twinned = |a: u64| PageRef {
            twin: a + 100,
            ..at(a)
        };
        let level_1 = DirLevel::new(300, [(0, at(1)), (299, at(2))]);
        let level_2 = DirLevel::from_list(&[twinned(3), twinned(4)]);
        let mut tree = DirTree::loaded(vec![level_1, level_2], 300 * 252);
        assert_eq!(tree.slots().collect::<Vec<_>>(), [1, 2, 3, 103, 4, 104]);
        let mut retired = Vec::new();
        tree.rewrite_all(&mut retired);
        assert_eq!(retired, [3, 103, 4, 104]);
        let l1 = tree.level_mut(0).unwrap();
        assert_eq!(l1.take_rewrite().into_iter().collect::<Vec<_>>(), [0, 299]);
        assert!(l1.take_rewrite().is_empty());
        assert_eq!(tree.level_mut(1).unwrap().refs().count(), 0);
    }
}
