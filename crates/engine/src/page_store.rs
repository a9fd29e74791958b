//! The page store: which slots of the metadata device's page region hold live
//! pages. A checkpoint writes every page to a fresh slot (`checkpoint.rs`) and frees
//! the slots the previous image used once the new super block is durable; loading
//! marks the slots the durable image names (`load.rs`).

use fewerbytes_format::page::PageRef;

/// Which page-store slots hold live pages.
pub struct PageStore {
    words: Vec<u64>,
    slots: u64,
    cursor: u64,
    used: u64,
}

impl PageStore {
    /// An empty store of `slots` (slot 0 is never used: 0 means "no page").
    pub fn new(slots: u64) -> Self {
        let mut s = PageStore {
            words: vec![0; slots.div_ceil(64) as usize],
            slots,
            cursor: 1,
            used: 0,
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
    /// Every slot in use (slot 0 excepted).
    pub fn used_slots(&self) -> Vec<u32> {
        (1..self.slots)
            .filter(|s| self.is_used(*s))
            .filter_map(|s| u32::try_from(s).ok())
            .collect()
    }
}

/// The page-store slot a reference names, if it names one.
pub(crate) fn page_slot(r: &PageRef) -> Option<u32> {
    r.page_store_slot()
        .filter(|s| *s != 0)
        .and_then(|s| u32::try_from(s).ok())
}
