//! A table's directory tree in memory: the references of its directory pages at
//! every level, as the last checkpoint wrote them (`docs/format.md`, "Directory
//! trees"). The checkpoint rewrites the pages above a changed page, level by level
//! (`checkpoint.rs`); loading reads the tree down from the catalog's top list,
//! verifying each page against its parent's reference (`load.rs`).

use crate::page_store::page_address;
use fewerbytes_format::catalog::TableRoot;
use fewerbytes_format::page::PageRef;

/// The directory pages of one table, by level.
#[derive(Debug, Clone, Default)]
pub struct DirTree {
    /// `levels[k]`: the references of the level-(k + 1) directory pages, in order.
    /// The last level is the top list the catalog holds. Version 1 has one level.
    levels: Vec<Vec<PageRef>>,
    /// Table pages under the tree as last written or loaded: when the table's length
    /// changes, the level-1 page over its end must be rewritten (a shrink leaves
    /// references past the new end in it, which a later grow would bring back).
    pages: usize,
}

impl DirTree {
    /// A tree as loading read it: `levels` bottom up (the last the top list), over a
    /// table of `pages` pages.
    pub fn loaded(levels: Vec<Vec<PageRef>>, pages: usize) -> DirTree {
        DirTree { levels, pages }
    }

    /// Shape the tree for a table now `pages` long that needs `depth` levels, before
    /// a checkpoint rewrites it: the slots of levels it no longer needs go to
    /// `retired`. Returns the table page whose level-1 directory page must be
    /// rewritten because the length changed (the last page both lengths hold), if any.
    pub fn reshape(&mut self, depth: usize, pages: usize, retired: &mut Vec<u64>) -> Option<usize> {
        while self.levels.len() > depth {
            if let Some(level) = self.levels.pop() {
                retired.extend(level.iter().filter_map(page_address));
            }
        }
        self.levels.resize_with(depth, Vec::new);
        let boundary = self.pages.min(pages);
        let changed = self.pages != pages;
        self.pages = pages;
        if changed {
            boundary.checked_sub(1)
        } else {
            None
        }
    }

    /// Level `k + 1` to rewrite, with the references it is written over: the table's
    /// pages `refs` for level 1, else the level below. `None` past the top.
    pub fn level_to_write<'a>(
        &'a mut self,
        k: usize,
        refs: &'a [PageRef],
    ) -> Option<(&'a [PageRef], &'a mut Vec<PageRef>)> {
        let at = k.min(self.levels.len());
        let (below, rest) = self.levels.split_at_mut(at);
        let children: &[PageRef] = below.last().map_or(refs, Vec::as_slice);
        rest.first_mut().map(|dirs| (children, dirs))
    }

    /// The catalog's view: the depth and the top list.
    pub fn root(&self) -> TableRoot {
        TableRoot {
            depth: self.levels.len().max(1) as u32,
            top: self.levels.last().cloned().unwrap_or_default(),
        }
    }

    /// The page addresses of every directory page.
    pub fn slots(&self) -> impl Iterator<Item = u64> + '_ {
        self.levels.iter().flatten().filter_map(page_address)
    }
}
