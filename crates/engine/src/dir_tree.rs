//! A table's directory tree in memory: the references of its directory pages at
//! every level, as the last checkpoint wrote them (`docs/format.md`, "Directory
//! trees"). The checkpoint rewrites the pages above a changed page, level by level
//! (`checkpoint.rs`); loading reads the tree down from the catalog's top list,
//! verifying each page against its parent's reference (`load.rs`).

use crate::page_store::page_slot;
use fewerbytes_format::catalog::TableRoot;
use fewerbytes_format::page::PageRef;

/// The directory pages of one table, by level.
#[derive(Debug, Clone, Default)]
pub struct DirTree {
    /// `levels[k]`: the references of the level-(k + 1) directory pages, in order.
    /// The last level is the top list the catalog holds. Version 1 has one level.
    pub levels: Vec<Vec<PageRef>>,
    /// Table pages under the tree as last written or loaded: when the table's length
    /// changes, the level-1 page over its end must be rewritten (a shrink leaves
    /// references past the new end in it, which a later grow would bring back).
    pub pages: usize,
}

impl DirTree {
    /// The catalog's view: the depth and the top list.
    pub fn root(&self) -> TableRoot {
        TableRoot {
            depth: self.levels.len().max(1) as u32,
            top: self.levels.last().cloned().unwrap_or_default(),
        }
    }

    /// The page-store slots of every directory page.
    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.levels.iter().flatten().filter_map(page_slot)
    }
}
