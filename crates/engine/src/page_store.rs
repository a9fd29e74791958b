//! The page store: which slots of the metadata device's page region hold live
//! pages, and which data-region blocks do. A checkpoint writes every page to a fresh
//! slot (`checkpoint.rs`), or, when no slot is free, to a data block the slab depot
//! gives it (a page address with bit 63 set, `docs/format.md`); it frees the
//! addresses the previous image used once the new super block is durable, a data
//! block going back to the depot. Loading marks the addresses the durable image
//! names (`load.rs`): nothing else records which data blocks hold pages.

use fewerbytes_format::page::{PageRef, ADDRESS_DATA_REGION};
use std::collections::BTreeSet;

/// Which page-store slots and data-region blocks hold live pages.
pub struct PageStore {
    words: Vec<u64>,
    slots: u64,
    cursor: u64,
    used: u64,
    /// Data blocks (PBNs) holding live pages, or pages of the image being written.
    blocks: BTreeSet<u64>,
}

impl PageStore {
    /// An empty store of `slots` (slot 0 is never used: 0 means "no page").
    pub fn new(slots: u64) -> Self {
        let mut s = PageStore {
            words: vec![0; slots.div_ceil(64) as usize],
            slots,
            cursor: 1,
            used: 0,
            blocks: BTreeSet::new(),
        };
        s.mark(0);
        s
    }
    /// Mark a slot used.
    pub fn mark(&mut self, slot: u64) {
        if let Some(w) = self.words.get_mut((slot / 64) as usize) {
            if *w & (1 << (slot % 64)) == 0 {
                *w |= 1 << (slot % 64);
                self.used += 1;
            }
        }
    }
    /// Whether a slot is used.
    pub fn is_used(&self, slot: u64) -> bool {
        self.words
            .get((slot / 64) as usize)
            .is_some_and(|w| w & (1 << (slot % 64)) != 0)
    }
    /// Free a slot.
    pub fn free(&mut self, slot: u64) {
        if slot == 0 {
            return;
        }
        if let Some(w) = self.words.get_mut((slot / 64) as usize) {
            if *w & (1 << (slot % 64)) != 0 {
                *w &= !(1 << (slot % 64));
                self.used -= 1;
            }
        }
    }
    /// Allocate a slot.
    pub fn alloc(&mut self) -> Option<u32> {
        for _ in 0..self.slots {
            let s = self.cursor;
            self.cursor = if self.cursor + 1 >= self.slots {
                1
            } else {
                self.cursor + 1
            };
            if !self.is_used(s) {
                self.mark(s);
                return u32::try_from(s).ok();
            }
        }
        None
    }
    /// Slots in use.
    pub fn used(&self) -> u64 {
        self.used
    }
    /// Slots free.
    pub fn free_slots(&self) -> u64 {
        self.slots.saturating_sub(self.used)
    }
    /// Every slot in use (slot 0 excepted), as page addresses.
    pub fn used_slots(&self) -> Vec<u64> {
        (1..self.slots).filter(|s| self.is_used(*s)).collect()
    }

    /// Mark a page address used: a slot, or a data block (bit 63).
    pub fn mark_address(&mut self, address: u64) {
        match address_block(address) {
            Some(pbn) => {
                self.blocks.insert(pbn);
            }
            None => self.mark(address),
        }
    }
    /// Free a page address. Returns the data block it named, which the caller gives
    /// back to the slab depot.
    pub fn free_address(&mut self, address: u64) -> Option<u64> {
        match address_block(address) {
            Some(pbn) => self.blocks.remove(&pbn).then_some(pbn),
            None => {
                self.free(address);
                None
            }
        }
    }
    /// Data blocks holding pages.
    pub fn data_blocks(&self) -> u64 {
        self.blocks.len() as u64
    }
    /// Which data blocks hold pages, in order.
    pub fn data_block_list(&self) -> Vec<u64> {
        self.blocks.iter().copied().collect()
    }
    /// Whether data block `pbn` holds a page.
    pub fn holds_block(&self, pbn: u64) -> bool {
        self.blocks.contains(&pbn)
    }
    /// Whether `dirty_pages` waiting for the next checkpoint should force it: the
    /// pages a checkpoint writes for them (up to about four each, with object pages'
    /// two tables and the directories above) would pass the free slots and the
    /// `headroom` data blocks kept free for metadata pages.
    /// Without headroom (a pool that keeps every page in the store), half the free
    /// slots.
    pub fn pressed(&self, dirty_pages: u64, headroom: u64) -> bool {
        if headroom == 0 {
            return dirty_pages * 2 > self.free_slots();
        }
        dirty_pages * 4 > self.free_slots() + headroom
    }
}

/// The data block a page address names, if it names one (bit 63).
pub(crate) fn address_block(address: u64) -> Option<u64> {
    (address & ADDRESS_DATA_REGION != 0).then_some(address & !ADDRESS_DATA_REGION)
}

/// The page address a reference names (a slot, or a data block with bit 63), if it
/// names a page.
pub(crate) fn page_address(r: &PageRef) -> Option<u64> {
    (!r.is_none()).then_some(r.address)
}
