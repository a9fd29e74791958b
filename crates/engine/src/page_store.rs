//! The page store: which slots of the metadata device's page region hold live
//! pages, and which data-region blocks do. A checkpoint writes every page to a fresh
//! slot (`checkpoint.rs`), or, when no slot is free, to a data block the slab depot
//! gives it (a page address with bit 63 set, `docs/format.md`); it frees the
//! addresses the previous image used once the new super block is durable, a data
//! block going back to the depot. Loading marks the addresses the durable image
//! names (`load.rs`): nothing else records which data blocks hold pages.
//!
//! Slots a durable checkpoint retired are given back to the metadata device before
//! they are freed ([`discard_slots`]), as freed data blocks are to the data device
//! (`slab_depot.rs: release_pending`): still marked used, no checkpoint can place a
//! page there between the discard and the free.

use fewerbytes_format::page::{PageRef, ADDRESS_DATA_REGION};
use fewerbytes_format::BLOCK_BYTES;
use fewerbytes_storage::{DiscardOutcome, Storage};
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
    /// Allocate a slot: the first free one at or after the cursor, wrapping round
    /// (so slots are used in turn). A word of 64 slots at a time, and nothing to
    /// scan when every slot is used: a pool whose store is full (its pages go to
    /// data blocks) asks for a slot for every page a checkpoint writes.
    pub fn alloc(&mut self) -> Option<u32> {
        if self.used >= self.slots {
            return None;
        }
        let words = self.words.len() as u64;
        let first = self.cursor / 64;
        // The first word once from the cursor on, then every word, then the first
        // word's slots below the cursor.
        for i in 0..=words {
            let w = (first + i) % words;
            let mut free = !self.words.get(w as usize).copied().unwrap_or(u64::MAX);
            if i == 0 {
                free &= u64::MAX << (self.cursor % 64);
            }
            if w == words - 1 && !self.slots.is_multiple_of(64) {
                free &= (1u64 << (self.slots % 64)) - 1;
            }
            if free != 0 {
                let s = w * 64 + u64::from(free.trailing_zeros());
                self.mark(s);
                self.cursor = if s + 1 >= self.slots { 1 } else { s + 1 };
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

/// Runs of adjacent slots in `sorted` (ascending, no repeats), as (first, count):
/// each run is one discard.
pub(crate) fn slot_runs(sorted: &[u64]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &slot in sorted {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == slot => *count += 1,
            _ => runs.push((slot, 1)),
        }
    }
    runs
}

/// Discard page-store `slots` (ascending, no repeats) on the metadata `device`,
/// whose slot 0 is block `pages_start_block`: one call per run of adjacent slots (a
/// hole punched in a pool file, BLKDISCARD on a device). The caller guarantees that
/// nothing durable or in flight names them: a durable checkpoint retired them, and
/// they are still marked used, so no checkpoint writes there meanwhile. Returns the
/// slots discarded. Discards turned off or unsupported stop here; a failed one is
/// logged and changes nothing else (the slots stay allocated on the device).
pub(crate) fn discard_slots(device: &dyn Storage, pages_start_block: u64, slots: &[u64]) -> u64 {
    let mut discarded = 0;
    for (first, count) in slot_runs(slots) {
        let offset_bytes = (pages_start_block + first) * BLOCK_BYTES as u64;
        match device.discard(offset_bytes, count * BLOCK_BYTES as u64) {
            Ok(DiscardOutcome::Discarded) => discarded += count,
            Ok(DiscardOutcome::Disabled | DiscardOutcome::Unsupported) => break,
            Err(e) => {
                tracing::warn!(
                    "a discard of freed page-store slots failed (they stay allocated on the device): {e}"
                );
                break;
            }
        }
    }
    discarded
}

/// The data block a page address names, if it names one (bit 63).
pub(crate) fn address_block(address: u64) -> Option<u64> {
    (address & ADDRESS_DATA_REGION != 0).then_some(address & !ADDRESS_DATA_REGION)
}

/// The page addresses a reference names (each a slot, or a data block with bit 63):
/// none, one, or two for a twinned directory page (format version 3).
pub(crate) fn page_addresses(r: &PageRef) -> impl Iterator<Item = u64> {
    r.addresses()
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::{slot_runs, PageStore};

    #[test]
    fn freed_slots_are_discarded_in_runs_of_adjacent_slots() {
        assert_eq!(slot_runs(&[]), vec![]);
        assert_eq!(slot_runs(&[7]), vec![(7, 1)]);
        assert_eq!(
            slot_runs(&[1, 2, 3, 10, 11, 64, 65, 66, 67]),
            vec![(1, 3), (10, 2), (64, 4)]
        );
    }

    /// The slot a next-fit scan one slot at a time would give (the allocator as it
    /// was before it scanned by words).
    fn next_fit(used: &[bool], cursor: u64) -> Option<u64> {
        let slots = used.len() as u64;
        (0..slots)
            .map(|i| {
                let s = cursor + i;
                if s >= slots {
                    s - slots + 1
                } else {
                    s
                }
            })
            .find(|s| !used[*s as usize])
    }

    #[test]
    fn alloc_gives_the_next_free_slot_in_turn_and_none_when_full() {
        for slots in [2u64, 63, 64, 65, 130, 1000] {
            let mut store = PageStore::new(slots);
            let mut used = vec![false; slots as usize];
            used[0] = true;
            let mut cursor = 1;
            let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ slots;
            for _ in 0..4000 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                if seed.is_multiple_of(3) {
                    let s = 1 + seed % (slots - 1).max(1);
                    if s < slots && used[s as usize] {
                        store.free(s);
                        used[s as usize] = false;
                    }
                    continue;
                }
                let want = next_fit(&used, cursor);
                let got = store.alloc().map(u64::from);
                assert_eq!(got, want, "{slots} slots");
                if let Some(s) = got {
                    used[s as usize] = true;
                    cursor = if s + 1 >= slots { 1 } else { s + 1 };
                }
                assert_eq!(
                    store.free_slots(),
                    used.iter().filter(|u| !**u).count() as u64
                );
            }
        }
    }
}
