//! Block-map pages several volumes' trees reach (format flag bit 7, shared map
//! pages): a clone, a snapshot or a rollback takes its source's map by reaching the
//! same durable pages, so it costs the same whatever the map's size.
//!
//! Which durable pages are shared is not stored: the open finds every address
//! that more than one tree names (`load.rs`), and from then on this table follows
//! the trees. A page reached from one tree is not in it. An object's reference
//! count counts the map *pages* that name it (once per entry), not the volumes: a
//! shared page counts once however many trees reach it. A volume makes a shared
//! page its own before changing it (`MapPage::make_own`): it leaves the durable
//! copy to the other trees and becomes a new page, each of whose objects gains a
//! reference. A volume that is deleted leaves each of its shared pages the same way
//! (`MapPage::leave`), and frees only the pages no other tree reaches: its cost is
//! what it alone holds.

use fewerbytes_format::page::PageRef;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};

/// The durable map pages more than one tree reaches, with how many trees do (≥ 2).
#[derive(Default)]
pub(crate) struct Shares {
    referrers: Mutex<HashMap<u64, u32>>,
}

impl Shares {
    /// One more tree reaches each of the durable pages `all`, which one tree reached
    /// at least (a page listed twice gains two), the table locked once.
    pub(crate) fn join_all(&self, all: &[PageRef]) {
        let mut referrers = self.referrers.lock();
        referrers.reserve(all.len());
        for at in all {
            *referrers.entry(at.address).or_insert(1) += 1;
        }
    }

    /// A tree stops reaching the durable page `at`: whether others still do (else
    /// the tree leaving was its only one, and the page is its to free or rewrite).
    pub(crate) fn leave(&self, at: PageRef) -> bool {
        let mut referrers = self.referrers.lock();
        match referrers.get_mut(&at.address) {
            Some(n) if *n > 2 => {
                *n -= 1;
                true
            }
            Some(_) => {
                referrers.remove(&at.address);
                true
            }
            None => false,
        }
    }

    /// Trees reaching the durable page `at` (1 for a page not shared).
    pub(crate) fn referrers(&self, at: PageRef) -> u32 {
        self.referrers.lock().get(&at.address).copied().unwrap_or(1)
    }

    /// Pages more than one tree reaches.
    pub(crate) fn shared_pages(&self) -> u64 {
        self.referrers.lock().len() as u64
    }

    /// Start again from no shared page (an open derives the table from its trees).
    pub(crate) fn clear(&self) {
        self.referrers.lock().clear();
    }
}

/// A walk over every volume's map that counts references as the counts do: each
/// durable page once, however many trees reach it.
#[derive(Default)]
pub(crate) struct CountedPages {
    seen: HashSet<u64>,
}

impl CountedPages {
    /// Whether a page's entries count in this walk: every page a volume holds
    /// alone (not `shared`), and a shared page the first time the walk meets its
    /// durable copy `durable`.
    pub(crate) fn counts(&mut self, shared: bool, durable: PageRef) -> bool {
        !shared || self.seen.insert(durable.address)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests fail loudly by design")]
mod tests {
    use super::*;

    #[test]
    fn a_page_is_shared_until_all_but_one_tree_left_it() {
        let at = PageRef {
            address: 77,
            ..PageRef::NONE
        };
        let shares = Shares::default();
        assert!(
            !shares.leave(at),
            "a page no other tree reaches is the leaver's"
        );
        shares.join_all(&[at, at]);
        assert_eq!(shares.referrers(at), 3);
        assert!(shares.leave(at));
        assert_eq!(shares.referrers(at), 2);
        assert!(shares.leave(at), "one tree still reaches it");
        assert_eq!(shares.shared_pages(), 0);
        assert!(!shares.leave(at), "the last tree's own page");
    }
}
