//! Slabs: the physical zone's unit. A slab owns a run of data blocks and a table of
//! object records (location, reference count, fingerprint) for what is stored in
//! them, plus the allocation state derived from that table.
//!
//! Freed objects and blocks are not reusable at once: they wait on a pending list
//! until the next checkpoint makes the state that freed them durable. Until then a
//! crash could bring back a mapping to them, so their bytes must stay intact.
//!
//! A slab that never held anything costs a few hundred bytes: its tables (object
//! pages, page references, bitmaps, holders) are allocated on first use, so a pool's
//! memory and open time follow what it stores, not the size of its device.

use fewerbytes_format::location::{Codec, Location};
use fewerbytes_format::page::{PageRef, COUNTS_PER_PAGE, FINGERPRINTS_PER_PAGE, OBJECTS_PER_PAGE};

use crate::error::{EngineError, Result};

/// Largest reference count; a duplicate of an object at this count gets a new copy.
pub const REFCOUNT_MAX: u32 = u32::MAX - 1;

/// The fingerprint an object stored new has while the write step that stored it has
/// not yet journalled it (`write_path.rs: map_placed` sets the real one under the map
/// page's lock, after the record): no block hashes to it, so no advice takes the
/// object and nothing names it in the journal before the record that stores it.
/// Compaction does not move it, the scrub and the index build pass it by. A
/// checkpoint never sees it (the step holds the gate).
pub const FINGERPRINT_IN_FLIGHT: [u8; 32] = [0xfe; 32];

/// One object record in memory (the on-disk form is `format::page::ObjectRecord`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ObjRec {
    /// Encoded location; 0 when free.
    pub location: u64,
    /// References from block maps.
    pub refcount: u32,
    /// Keyed BLAKE3-256 of the block.
    pub fingerprint: [u8; 32],
}

/// The two tables a checkpoint writes a slab's object records to (version 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjTable {
    /// Locations and reference counts, [`COUNTS_PER_PAGE`] objects a page.
    Counts,
    /// Fingerprints, [`FINGERPRINTS_PER_PAGE`] objects a page.
    Fingerprints,
}

impl ObjTable {
    /// Object records one page of the table holds.
    pub fn records_per_page(self) -> usize {
        match self {
            ObjTable::Counts => COUNTS_PER_PAGE,
            ObjTable::Fingerprints => FINGERPRINTS_PER_PAGE,
        }
    }
}

/// A page of object records in memory, the unit of change tracking. On disk
/// (version 2) its locations and counts go to count pages and its fingerprints to
/// fingerprint pages (`checkpoint.rs`).
pub struct ObjPage {
    /// The records.
    recs: Box<[ObjRec; OBJECTS_PER_PAGE]>,
    /// A location or count changed since the last checkpoint snapshot.
    dirty: bool,
    /// A fingerprint changed (an object was stored) since the last snapshot.
    fp_dirty: bool,
}

impl ObjPage {
    fn empty() -> Self {
        ObjPage {
            recs: Box::new([ObjRec::default(); OBJECTS_PER_PAGE]),
            dirty: false,
            fp_dirty: false,
        }
    }
}

/// A fixed-size bitmap with a rotating search cursor. Its words are allocated when
/// a bit is first set: a bitmap that never had one set takes no memory.
pub struct Bitmap {
    words: Vec<u64>,
    bits: u32,
    cursor: u32,
}

impl Bitmap {
    fn new(bits: u32) -> Self {
        Bitmap {
            words: Vec::new(),
            bits,
            cursor: 0,
        }
    }
    /// Room for `bits` bits; the new ones clear.
    fn grow(&mut self, bits: u32) {
        self.bits = bits;
        if !self.words.is_empty() {
            self.words.resize(bits.div_ceil(64) as usize, 0);
        }
    }
    /// Whether bit `i` is set.
    pub fn get(&self, i: u32) -> bool {
        self.words
            .get((i / 64) as usize)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }
    fn set(&mut self, i: u32, on: bool) {
        assert!(i < self.bits, "bit {i} of a bitmap of {} bits", self.bits);
        if on && self.words.is_empty() {
            self.words = vec![0; self.bits.div_ceil(64) as usize];
        }
        if let Some(w) = self.words.get_mut((i / 64) as usize) {
            if on {
                *w |= 1 << (i % 64);
            } else {
                *w &= !(1 << (i % 64));
            }
        }
    }
    /// Find and set a clear bit, searching from the cursor.
    fn take_free(&mut self) -> Option<u32> {
        if self.words.is_empty() {
            // Nothing set yet: the first bit is free (if there is one).
            if self.bits == 0 {
                return None;
            }
            self.set(0, true);
            self.cursor = 0;
            return Some(0);
        }
        let words = self.words.len() as u32;
        let start_word = self.cursor / 64;
        for step in 0..=words {
            let wi = (start_word + step) % words.max(1);
            let word = *self.words.get(wi as usize)?;
            if word == u64::MAX {
                continue;
            }
            let bit = (!word).trailing_zeros();
            let i = wi * 64 + bit;
            if i >= self.bits {
                continue;
            }
            self.set(i, true);
            self.cursor = i;
            return Some(i);
        }
        None
    }
}

/// What one slab holds, for statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlabUsage {
    /// Blocks in use. Blocks freed since the last checkpoint stay allocated until it
    /// (their bytes may still be named by a durable mapping) but are not counted here.
    pub used_blocks: u64,
    /// Blocks freed since the last checkpoint.
    pub pending_blocks: u64,
    /// Live objects.
    pub objects: u64,
    /// References beyond each object's first: blocks dedup saved.
    pub dedup_saved_blocks: u64,
    /// Live objects stored as compressed fragments.
    pub fragments: u64,
    /// Their compressed bytes.
    pub fragment_bytes: u64,
    /// Of the fragments, those compressed with zstd (the others with LZ4).
    pub zstd_fragments: u64,
    /// Live objects stored as whole blocks.
    pub whole_blocks: u64,
}

impl SlabUsage {
    /// Add another slab's usage.
    pub fn add(&mut self, other: &SlabUsage) {
        self.used_blocks += other.used_blocks;
        self.pending_blocks += other.pending_blocks;
        self.objects += other.objects;
        self.dedup_saved_blocks += other.dedup_saved_blocks;
        self.fragments += other.fragments;
        self.fragment_bytes += other.fragment_bytes;
        self.zstd_fragments += other.zstd_fragments;
        self.whole_blocks += other.whole_blocks;
    }
}

/// One slab.
pub struct Slab {
    /// Slab number.
    index: u32,
    /// First data block (data-region relative).
    first_pbn: u64,
    /// Data blocks in this slab (the last slab may be short).
    blocks: u32,
    /// Object slots (a multiple of [`OBJECTS_PER_PAGE`]).
    objects: u32,
    /// Object pages, allocated when first used; the vector itself is empty until
    /// then (it is sized to `objects` pages on the first).
    pages: Vec<Option<ObjPage>>,
    /// The durable count pages (version 2), [`COUNTS_PER_PAGE`] objects each; empty
    /// until one is written or loaded (a missing entry is [`PageRef::NONE`]).
    count_refs: Vec<PageRef>,
    /// The durable fingerprint pages (version 2), [`FINGERPRINTS_PER_PAGE`] each;
    /// empty likewise.
    fp_refs: Vec<PageRef>,
    objects_used: Bitmap,
    objects_used_count: u32,
    blocks_used: Bitmap,
    blocks_used_count: u32,
    /// Live holders per block: 1 for a whole-block object; one per fragment touching
    /// it for a packed block, plus one while a packer has it open. Empty until the
    /// first hold (every block then has none).
    holders: Vec<u16>,
    pending_objects: Vec<u32>,
    pending_blocks: Vec<u32>,
    /// Blocks open in a packer, and which zone's packer (for reads of unwritten bytes).
    open_blocks: Vec<(u32, usize)>,
    /// Pages of the pool turned dirty since the last checkpoint (shared pool-wide).
    dirty_pages: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Free blocks data may not take: kept for a checkpoint's metadata pages
    /// (`geometry.rs: METADATA_HEADROOM_BLOCKS`); 0 in pools that keep every page
    /// in the page store.
    metadata_headroom: u32,
    /// A fragment was freed since the compactor last looked at this slab.
    fragments_freed: bool,
}

impl Slab {
    /// An empty slab.
    pub fn new(
        index: u32,
        first_pbn: u64,
        blocks: u32,
        objects: u32,
        dirty_pages: std::sync::Arc<std::sync::atomic::AtomicU64>,
    ) -> Self {
        assert!(
            (objects as usize).is_multiple_of(OBJECTS_PER_PAGE),
            "slab {index}: {objects} object slots, not a multiple of {OBJECTS_PER_PAGE}"
        );
        Slab {
            index,
            first_pbn,
            blocks,
            objects,
            pages: Vec::new(),
            count_refs: Vec::new(),
            fp_refs: Vec::new(),
            objects_used: Bitmap::new(objects),
            objects_used_count: 0,
            blocks_used: Bitmap::new(blocks),
            blocks_used_count: 0,
            holders: Vec::new(),
            pending_objects: Vec::new(),
            pending_blocks: Vec::new(),
            open_blocks: Vec::new(),
            dirty_pages,
            metadata_headroom: 0,
            fragments_freed: false,
        }
    }

    /// The last slab of a grown data region: `blocks` now, free past the old end.
    pub fn grow_blocks(&mut self, blocks: u32) {
        if blocks <= self.blocks {
            return;
        }
        self.blocks = blocks;
        self.blocks_used.grow(blocks);
        if !self.holders.is_empty() {
            self.holders.resize(blocks as usize, 0);
        }
    }

    /// Object page `p`, allocated (and the page vector sized) on first use; `None`
    /// past the slab's objects.
    fn page_mut(&mut self, p: usize) -> Option<&mut ObjPage> {
        page_in(&mut self.pages, self.objects, p)
    }

    /// Keep `blocks` free blocks for metadata pages: data allocation stops there.
    pub fn set_metadata_headroom(&mut self, blocks: u32) {
        self.metadata_headroom = blocks;
    }

    /// Free blocks data may take (past the metadata headroom).
    pub fn free_blocks_for_data(&self) -> u32 {
        self.free_blocks().saturating_sub(self.metadata_headroom)
    }

    /// What the slab holds now.
    pub fn usage(&self) -> SlabUsage {
        let mut u = SlabUsage {
            used_blocks: u64::from(self.used_blocks() - self.pending_blocks()),
            pending_blocks: u64::from(self.pending_blocks()),
            ..SlabUsage::default()
        };
        for page in self.pages.iter().flatten() {
            for rec in page.recs.iter().filter(|r| r.refcount > 0) {
                u.objects += 1;
                u.dedup_saved_blocks += u64::from(rec.refcount - 1);
                match Location::decode(rec.location) {
                    Ok(Location::Fragment {
                        len_bytes, codec, ..
                    }) => {
                        u.fragments += 1;
                        u.fragment_bytes += u64::from(len_bytes);
                        u.zstd_fragments += u64::from(codec == Codec::Zstd);
                    }
                    Ok(Location::Block { .. }) => u.whole_blocks += 1,
                    Err(_) => {}
                }
            }
        }
        u
    }

    /// First data block (data-region relative).
    pub fn first_pbn(&self) -> u64 {
        self.first_pbn
    }

    /// Slab number.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Data blocks in this slab.
    pub fn block_count(&self) -> u32 {
        self.blocks
    }

    /// Note that zone `zone`'s packer holds block `b` open.
    pub fn add_open_block(&mut self, b: u32, zone: usize) {
        self.open_blocks.push((b, zone));
    }

    /// Zone `zone`'s packer no longer holds block `b` open (every note of it).
    pub fn remove_open_block(&mut self, b: u32, zone: usize) {
        self.open_blocks.retain(|&(ob, z)| !(ob == b && z == zone));
    }

    /// Zone `zone`'s packer no longer holds block `b` of its run open (one note).
    pub fn remove_open_run_block(&mut self, b: u32, zone: usize) {
        if let Some(i) = self
            .open_blocks
            .iter()
            .position(|&(ob, z)| ob == b && z == zone)
        {
            self.open_blocks.swap_remove(i);
        }
    }

    /// Whether some packer holds block `b` open.
    pub fn is_open(&self, b: u32) -> bool {
        self.open_blocks.iter().any(|(ob, _)| *ob == b)
    }

    /// The blocks a packer holds open.
    pub fn open_block_numbers(&self) -> Vec<u32> {
        self.open_blocks.iter().map(|(b, _)| *b).collect()
    }

    /// The zone whose packer has block `block` open, if any.
    pub fn open_zone(&self, block: u32) -> Option<usize> {
        self.open_blocks
            .iter()
            .find(|(b, _)| *b == block)
            .map(|(_, z)| *z)
    }

    /// Object slots in this slab.
    pub fn objects(&self) -> u32 {
        self.objects
    }
    /// Free (allocatable) objects.
    pub fn free_objects(&self) -> u32 {
        self.objects() - self.objects_used_count
    }
    /// Free (allocatable) blocks.
    pub fn free_blocks(&self) -> u32 {
        self.blocks - self.blocks_used_count
    }
    /// Blocks in use (including pending frees and open packer blocks).
    pub fn used_blocks(&self) -> u32 {
        self.blocks_used_count
    }

    /// Blocks freed but not reusable until the next checkpoint.
    pub fn pending_blocks(&self) -> u32 {
        self.pending_blocks.len() as u32
    }

    /// Which blocks are freed but not reusable until the next checkpoint.
    pub fn pending_block_list(&self) -> &[u32] {
        &self.pending_blocks
    }

    /// Whether block `b` is allocated (holding data, open, or pending-free).
    pub fn block_used(&self, b: u32) -> bool {
        self.blocks_used.get(b)
    }

    /// The record of object `i` (a free record if its page was never used).
    pub fn rec(&self, i: u32) -> ObjRec {
        let (p, r) = (i as usize / OBJECTS_PER_PAGE, i as usize % OBJECTS_PER_PAGE);
        match self.pages.get(p) {
            Some(Some(page)) => page.recs.get(r).copied().unwrap_or_default(),
            _ => ObjRec::default(),
        }
    }

    /// Mutable record of object `i`; allocates its page and marks it dirty (its
    /// count page is rewritten at the next checkpoint, not its fingerprint page).
    pub fn rec_mut(&mut self, i: u32) -> Option<&mut ObjRec> {
        let (p, r) = (i as usize / OBJECTS_PER_PAGE, i as usize % OBJECTS_PER_PAGE);
        let page = page_in(&mut self.pages, self.objects, p)?;
        if !page.dirty {
            page.dirty = true;
            self.dirty_pages
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        page.recs.get_mut(r)
    }

    /// Mutable record of object `i` whose fingerprint is being set (an object
    /// stored): its fingerprint page is rewritten too. A page of 84 records touches
    /// at most two fingerprint pages, counted as dirty pages for the page store's
    /// budget.
    pub fn rec_mut_stored(&mut self, i: u32) -> Option<&mut ObjRec> {
        let p = i as usize / OBJECTS_PER_PAGE;
        let page = page_in(&mut self.pages, self.objects, p)?;
        if !page.fp_dirty {
            page.fp_dirty = true;
            self.dirty_pages
                .fetch_add(2, std::sync::atomic::Ordering::Relaxed);
        }
        self.rec_mut(i)
    }

    /// Set the record of object `i` as loaded from a checkpoint (not dirty).
    pub fn load_rec(&mut self, i: u32, set: impl FnOnce(&mut ObjRec)) {
        let (p, r) = (i as usize / OBJECTS_PER_PAGE, i as usize % OBJECTS_PER_PAGE);
        if let Some(rec) = self.page_mut(p).and_then(|page| page.recs.get_mut(r)) {
            set(rec);
        }
    }

    /// Pages of `table` over this slab.
    pub fn table_pages(&self, table: ObjTable) -> usize {
        (self.objects as usize).div_ceil(table.records_per_page())
    }

    /// The object pages in memory under page `k` of `table`.
    fn obj_pages_under(&self, table: ObjTable, k: usize) -> &[Option<ObjPage>] {
        let per_page = table.records_per_page();
        let first = k * per_page;
        let end = (first + per_page).min(self.objects() as usize);
        self.pages
            .get(first / OBJECTS_PER_PAGE..end.div_ceil(OBJECTS_PER_PAGE))
            .unwrap_or(&[])
    }

    /// Whether page `k` of `table` must be rewritten: one of its records changed
    /// since the last checkpoint snapshot.
    pub fn table_page_changed(&self, table: ObjTable, k: usize) -> bool {
        self.obj_pages_under(table, k)
            .iter()
            .flatten()
            .any(|p| match table {
                ObjTable::Counts => p.dirty,
                ObjTable::Fingerprints => p.fp_dirty,
            })
    }

    /// The pages of `table` with an object page in memory under them, in order: the
    /// only ones that can be changed or held. None, at no cost, in a slab that never
    /// held anything.
    pub fn table_pages_in_memory(&self, table: ObjTable) -> impl Iterator<Item = usize> + '_ {
        let n = if self.pages.is_empty() {
            0
        } else {
            self.table_pages(table)
        };
        (0..n).filter(move |&k| self.table_page_held(table, k))
    }

    /// The object slots under object pages in memory, in order: the only ones whose
    /// record can be anything but free. None in a slab that never held anything.
    pub fn objects_in_memory(&self) -> impl Iterator<Item = u32> + '_ {
        self.pages
            .iter()
            .enumerate()
            .filter(|(_, page)| page.is_some())
            .flat_map(|(p, _)| {
                let first = (p * OBJECTS_PER_PAGE) as u32;
                first..first + OBJECTS_PER_PAGE as u32
            })
    }

    /// Whether no block is allocated, held or open and no object page is in memory:
    /// a slab with nothing in it to check.
    pub fn holds_nothing(&self) -> bool {
        self.pages.is_empty()
            && self.holders.is_empty()
            && self.blocks_used_count == 0
            && self.open_blocks.is_empty()
    }

    /// The pages of `table` with a durable copy, in order (none, at no cost, in a
    /// slab that never had one).
    pub fn durable_table_pages(&self, table: ObjTable) -> impl Iterator<Item = usize> + '_ {
        let refs = match table {
            ObjTable::Counts => &self.count_refs,
            ObjTable::Fingerprints => &self.fp_refs,
        };
        refs.iter()
            .enumerate()
            .filter(|(_, r)| !r.is_none())
            .map(|(k, _)| k)
    }

    /// Whether the slab holds no durable page reference (none written or loaded).
    pub fn has_no_durable_pages(&self) -> bool {
        self.count_refs.is_empty() && self.fp_refs.is_empty()
    }

    /// Whether any object under page `k` of `table` is held in memory (the page
    /// would be written by a full rewrite).
    pub fn table_page_held(&self, table: ObjTable, k: usize) -> bool {
        self.obj_pages_under(table, k).iter().any(Option::is_some)
    }

    /// Where page `k` of `table` lies durable (none when never written).
    pub fn durable_ref(&self, table: ObjTable, k: usize) -> PageRef {
        let refs = match table {
            ObjTable::Counts => &self.count_refs,
            ObjTable::Fingerprints => &self.fp_refs,
        };
        refs.get(k).copied().unwrap_or_default()
    }

    /// Page `k` of `table` is durable at `r`: a checkpoint wrote it, or loading read it.
    pub fn set_durable(&mut self, table: ObjTable, k: usize, r: PageRef) {
        let pages = self.table_pages(table);
        assert!(k < pages, "page {k} of a table of {pages} pages");
        let refs = match table {
            ObjTable::Counts => &mut self.count_refs,
            ObjTable::Fingerprints => &mut self.fp_refs,
        };
        if refs.is_empty() {
            if r.is_none() {
                return;
            }
            refs.resize(pages, PageRef::NONE);
        }
        if let Some(slot) = refs.get_mut(k) {
            *slot = r;
        }
    }

    /// A checkpoint snapshot took every change: clear the marks.
    pub fn snapshot_taken(&mut self) {
        for page in self.pages.iter_mut().flatten() {
            page.dirty = false;
            page.fp_dirty = false;
        }
    }

    /// The durable page `k` of `table` failed its checks (a scrub found it
    /// damaged): mark the records under it changed, so the next checkpoint writes
    /// them, the good copy, to a fresh slot. False when no record under it is in
    /// memory (nothing to write it from).
    pub fn mark_table_page_dirty(&mut self, table: ObjTable, k: usize) -> bool {
        let per_page = table.records_per_page();
        let first = k * per_page;
        let end = (first + per_page).min(self.objects() as usize);
        let range = first / OBJECTS_PER_PAGE..end.div_ceil(OBJECTS_PER_PAGE);
        let Some(page) = self
            .pages
            .get_mut(range)
            .into_iter()
            .flatten()
            .flatten()
            .next()
        else {
            return false;
        };
        let flag = match table {
            ObjTable::Counts => &mut page.dirty,
            ObjTable::Fingerprints => &mut page.fp_dirty,
        };
        if !*flag {
            *flag = true;
            self.dirty_pages
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        true
    }

    /// Mark every allocated page dirty, counts and fingerprints: the next
    /// checkpoint rewrites them all (the upgrade from version 1).
    pub fn mark_all_dirty(&mut self) {
        for page in self.pages.iter_mut().flatten() {
            page.dirty = true;
            page.fp_dirty = true;
        }
    }

    /// Allocate an object slot.
    pub fn alloc_object(&mut self) -> Option<u32> {
        let i = self.objects_used.take_free()?;
        self.objects_used_count += 1;
        Some(i)
    }

    /// Allocate any free block.
    pub fn alloc_block(&mut self) -> Option<u32> {
        if self.free_blocks_for_data() == 0 {
            return None;
        }
        self.alloc_block_for_metadata()
    }

    /// Allocate a block for a metadata page: the headroom is for these.
    pub fn alloc_block_for_metadata(&mut self) -> Option<u32> {
        let b = self.blocks_used.take_free()?;
        self.blocks_used_count += 1;
        Some(b)
    }

    /// Allocate block `b` for data if it is free (past the metadata headroom).
    pub fn alloc_block_at(&mut self, b: u32) -> bool {
        self.free_blocks_for_data() > 0 && self.claim_block_at(b)
    }

    /// Allocate block `b` if it is free, headroom or not (a metadata page's block
    /// found at open).
    pub fn claim_block_at(&mut self, b: u32) -> bool {
        if b >= self.blocks || self.blocks_used.get(b) {
            return false;
        }
        self.blocks_used.set(b, true);
        self.blocks_used_count += 1;
        true
    }

    /// Return an unused object slot that was allocated but never recorded.
    pub fn unalloc_object(&mut self, i: u32) {
        if self.objects_used.get(i) {
            self.objects_used.set(i, false);
            self.objects_used_count -= 1;
        }
    }

    /// Add a holder to block `b`. A block the slab does not have, or a count at its
    /// maximum, is an [`EngineError::Invariant`], as in [`Self::drop_block`]: a hold
    /// not recorded would let the block be freed under a live fragment.
    pub fn hold_block(&mut self, b: u32) -> Result<()> {
        let index = self.index;
        if b < self.blocks && self.holders.is_empty() {
            // The first hold in this slab: every block had none until now.
            self.holders = vec![0; self.blocks as usize];
        }
        let h = self.holders.get_mut(b as usize).ok_or_else(|| {
            EngineError::Invariant(format!(
                "a holder added to block {b} of slab {index}, which has no such block"
            ))
        })?;
        *h = h.checked_add(1).ok_or_else(|| {
            EngineError::Invariant(format!(
                "block {b} of slab {index} has more holders than a count can hold"
            ))
        })?;
        Ok(())
    }

    /// Drop a holder of block `b`; at zero it becomes pending-free. A block with no
    /// holder (or none such) is an [`EngineError::Invariant`]: every drop pairs with a
    /// hold, so the holders recorded are wrong, and a block freed under a live
    /// fragment would be overwritten.
    pub fn drop_block(&mut self, b: u32) -> Result<()> {
        let index = self.index;
        if b < self.blocks && self.holders.is_empty() {
            return Err(EngineError::Invariant(format!(
                "block {b} of slab {index} dropped below zero holders"
            )));
        }
        let h = self.holders.get_mut(b as usize).ok_or_else(|| {
            EngineError::Invariant(format!(
                "a holder dropped from block {b} of slab {index}, which has no such block"
            ))
        })?;
        *h = h.checked_sub(1).ok_or_else(|| {
            EngineError::Invariant(format!(
                "block {b} of slab {index} dropped below zero holders"
            ))
        })?;
        if *h == 0 {
            self.pending_blocks.push(b);
        }
        Ok(())
    }

    /// Holders of block `b`.
    pub fn holders(&self, b: u32) -> u16 {
        self.holders.get(b as usize).copied().unwrap_or(0)
    }

    /// Add one reference to live object `i` (a clone). At [`REFCOUNT_MAX`] it is
    /// [`EngineError::Refused`] and the count is left as it was: a count held at its
    /// maximum would under-count, and the last map's blocks be freed under it.
    /// A free object is an [`EngineError::Invariant`].
    pub fn add_ref(&mut self, i: u32) -> Result<()> {
        let index = self.index;
        let rec = self.rec_mut(i).ok_or_else(|| {
            EngineError::Invariant(format!(
                "a reference added to object {i} of slab {index}, which has no such object"
            ))
        })?;
        if rec.refcount == 0 {
            return Err(EngineError::Invariant(format!(
                "a reference added to object {i} of slab {index}, which is free"
            )));
        }
        if rec.refcount >= REFCOUNT_MAX {
            return Err(EngineError::Refused(format!(
                "object {i} of slab {index} already has {REFCOUNT_MAX} references, the most a count holds"
            )));
        }
        rec.refcount += 1;
        Ok(())
    }

    /// Drop one reference to object `i`. Returns the record if that freed it; then
    /// its blocks lose their holder and the slot becomes pending-free. A reference
    /// dropped from a free object is an [`EngineError::Invariant`], and the record is
    /// left as it was: a map named the object without its count saying so.
    pub fn drop_ref(&mut self, i: u32) -> Result<Option<ObjRec>> {
        let (first_pbn, index) = (self.first_pbn, self.index);
        let rec = self.rec_mut(i).ok_or_else(|| {
            EngineError::Invariant(format!(
                "a reference dropped from object {i} of slab {index}, which has no such object"
            ))
        })?;
        rec.refcount = rec.refcount.checked_sub(1).ok_or_else(|| {
            EngineError::Invariant(format!(
                "object {i} of slab {index} dropped below zero references"
            ))
        })?;
        if rec.refcount > 0 {
            return Ok(None);
        }
        let freed = *rec;
        // Every live record's location decoded into this slab at open (`rebuild`) or
        // was encoded here: one that does not is a broken invariant, not blocks to
        // leave held forever. The record is left as it was.
        let Some(blocks) = self.local_blocks(freed.location) else {
            if let Some(rec) = self.rec_mut(i) {
                rec.refcount = 1;
            }
            return Err(EngineError::Invariant(format!(
                "object {i} of slab {index} (first block {first_pbn}) was freed with location \
                 {:#x}, which does not decode or lies outside the slab",
                freed.location
            )));
        };
        if let Some(rec) = self.rec_mut(i) {
            *rec = ObjRec::default();
        }
        self.pending_objects.push(i);
        self.fragments_freed |= matches!(
            Location::decode(freed.location),
            Ok(Location::Fragment { .. })
        );
        for b in blocks {
            self.drop_block(b)?;
        }
        Ok(Some(freed))
    }

    /// Whether a fragment was freed since the last call: a packed block of this
    /// slab may now be worth compacting (the compactor's cue, per slab).
    pub fn take_fragments_freed(&mut self) -> bool {
        std::mem::take(&mut self.fragments_freed)
    }

    /// Take the pending frees; they become allocatable after the next checkpoint.
    pub fn take_pending(&mut self) -> (Vec<u32>, Vec<u32>) {
        (
            std::mem::take(&mut self.pending_objects),
            std::mem::take(&mut self.pending_blocks),
        )
    }

    /// Make pending frees allocatable (their freeing is durable now). A block that
    /// gained a holder since (a packer reopened it) stays in use.
    pub fn release(&mut self, objects: &[u32], blocks: &[u32]) {
        for &i in objects {
            if self.rec(i).refcount == 0 {
                self.unalloc_object(i);
            }
        }
        for &b in blocks {
            if self.holders(b) == 0 && self.blocks_used.get(b) {
                self.blocks_used.set(b, false);
                self.blocks_used_count -= 1;
            }
        }
    }

    /// The slab-relative blocks an encoded location covers, if it decodes and lies
    /// wholly in this slab.
    fn local_blocks(&self, location: u64) -> Option<std::ops::Range<u32>> {
        let (first, count) = Location::decode(location).ok()?.blocks();
        let start = first.checked_sub(self.first_pbn)?;
        let end = start.checked_add(count)?;
        if end > u64::from(self.blocks) {
            return None;
        }
        Some(u32::try_from(start).ok()?..u32::try_from(end).ok()?)
    }

    /// Rebuild allocation state from the records (after load and replay). Returns the
    /// live records found, for the index, as (object index, record). A live record
    /// whose location does not decode or lies outside the slab is
    /// [`EngineError::Corrupt`], naming it.
    pub fn rebuild(&mut self) -> Result<Vec<(u32, ObjRec)>> {
        let objects = self.objects();
        self.objects_used = Bitmap::new(objects);
        self.objects_used_count = 0;
        self.blocks_used = Bitmap::new(self.blocks);
        self.blocks_used_count = 0;
        self.holders.iter_mut().for_each(|h| *h = 0);
        // Only the object pages in memory can hold a live record.
        let held: Vec<u32> = self.objects_in_memory().collect();
        self.pending_blocks.clear();
        self.pending_objects.clear();
        self.open_blocks.clear();
        let mut live = Vec::new();
        for i in held {
            let rec = self.rec(i);
            if rec.refcount == 0 {
                if rec.location != 0 {
                    // Stored but never mapped before a crash, or freed: clear it.
                    if let Some(r) = self.rec_mut(i) {
                        *r = ObjRec::default();
                    }
                }
                continue;
            }
            self.objects_used.set(i, true);
            self.objects_used_count += 1;
            let index = self.index;
            let corrupt = |reason: String| EngineError::Corrupt {
                region: "slab object page",
                block: 0,
                device: "metadata",
                reason: format!("object {i} of slab {index}: {reason}"),
            };
            let blocks = self.local_blocks(rec.location).ok_or_else(|| {
                corrupt(format!(
                    "location {:#x} does not decode or lies outside its slab",
                    rec.location
                ))
            })?;
            for local in blocks {
                if !self.blocks_used.get(local) {
                    self.blocks_used.set(local, true);
                    self.blocks_used_count += 1;
                }
                // More holders than fragments fit in a block: records that overlap.
                self.hold_block(local).map_err(|e| corrupt(e.to_string()))?;
            }
            live.push((i, rec));
        }
        Ok(live)
    }
}

/// Object page `p` of `pages` (a slab of `objects` object slots), allocated, and the
/// vector sized, on first use; `None` past the slab's objects.
fn page_in(pages: &mut Vec<Option<ObjPage>>, objects: u32, p: usize) -> Option<&mut ObjPage> {
    let count = objects as usize / OBJECTS_PER_PAGE;
    if p >= count {
        return None;
    }
    if pages.is_empty() {
        *pages = (0..count).map(|_| None).collect();
    }
    Some(pages.get_mut(p)?.get_or_insert_with(ObjPage::empty))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    /// Slab `index` with one whole-block object of one reference: (slab, block, object).
    fn slab_with_one_object(index: u32) -> (Slab, u32, u32) {
        let mut slab = Slab::new(index, 0, 64, OBJECTS_PER_PAGE as u32, Default::default());
        let b = slab.alloc_block().unwrap();
        let o = slab.alloc_object().unwrap();
        *slab.rec_mut(o).unwrap() = ObjRec {
            location: Location::Block { pbn: u64::from(b) }.encode(),
            refcount: 1,
            fingerprint: [1; 32],
        };
        slab.hold_block(b).unwrap();
        (slab, b, o)
    }

    // hold_block ignored a block the slab does not have, while drop_block refused
    // one: a hold lost there lets the block be freed under a live fragment.
    #[test]
    fn a_hold_on_a_block_the_slab_does_not_have_is_an_error() {
        let (mut slab, b, _) = slab_with_one_object(3);
        assert!(matches!(
            slab.hold_block(64),
            Err(EngineError::Invariant(reason)) if reason.contains("block 64 of slab 3")
        ));
        slab.hold_block(b).unwrap();
        assert_eq!(slab.holders(b), 2);
    }

    // A live record whose location lay outside its slab was skipped (or its block
    // number wrapped) when the slab was rebuilt at open.
    #[test]
    fn a_live_record_outside_its_slab_is_corrupt_at_rebuild() {
        let (mut slab, _, o) = slab_with_one_object(2);
        slab.rec_mut(o).unwrap().location = Location::Block { pbn: 64 }.encode();
        match slab.rebuild() {
            Err(EngineError::Corrupt { reason, .. }) => {
                assert!(
                    reason.contains(&format!("object {o} of slab 2")),
                    "{reason}"
                )
            }
            other => panic!("rebuilt as {other:?}"),
        }
        slab.rec_mut(o).unwrap().location = 1 << 63 | 7 << 60 | 5 << 48;
        assert!(matches!(slab.rebuild(), Err(EngineError::Corrupt { .. })));
        slab.rec_mut(o).unwrap().location = Location::Block { pbn: 5 }.encode();
        assert_eq!(slab.rebuild().unwrap().len(), 1);
        assert_eq!(slab.holders(5), 1);
    }

    #[test]
    fn freed_block_is_not_reused_before_release() {
        let (mut slab, b, o) = slab_with_one_object(0);
        assert!(slab.drop_ref(o).unwrap().is_some());
        assert!(
            !slab.alloc_block_at(b),
            "a pending-free block must stay allocated"
        );
        let (objs, blocks) = slab.take_pending();
        slab.release(&objs, &blocks);
        assert!(slab.alloc_block_at(b));
    }

    // Counts below zero used to be clamped (`saturating_sub`, with only a
    // `debug_assert!`): in a release build a map naming a freed object, or a block
    // dropped twice, went unnoticed until the block was reused under live data.
    #[test]
    fn counts_below_zero_are_reported_not_clamped() {
        let (mut slab, b, o) = slab_with_one_object(3);
        assert!(
            slab.drop_ref(o).unwrap().is_some(),
            "the last reference frees it"
        );
        let err = slab.drop_ref(o).expect_err("a reference below zero");
        assert!(
            matches!(&err, EngineError::Invariant(why) if why.contains(&format!("object {o} of slab 3 dropped below zero references"))),
            "{err}"
        );
        assert_eq!(
            slab.rec(o),
            ObjRec::default(),
            "the record is left as it was"
        );
        let err = slab.drop_block(b).expect_err("a holder below zero");
        assert!(
            matches!(&err, EngineError::Invariant(why) if why.contains(&format!("block {b} of slab 3 dropped below zero holders"))),
            "{err}"
        );
        assert_eq!(slab.holders(b), 0);
        assert!(slab.drop_block(64).is_err(), "a block past the slab's end");
    }

    // A clone's reference used to be clamped at REFCOUNT_MAX (`saturating_add` and
    // `min`): the count then said fewer maps than held the object.
    #[test]
    fn a_reference_past_the_maximum_is_refused_not_clamped() {
        let (mut slab, _, o) = slab_with_one_object(0);
        slab.add_ref(o).unwrap();
        assert_eq!(slab.rec(o).refcount, 2);
        slab.rec_mut(o).unwrap().refcount = REFCOUNT_MAX;
        let err = slab.add_ref(o).expect_err("past the maximum");
        assert!(matches!(err, EngineError::Refused(_)), "{err}");
        assert_eq!(
            slab.rec(o).refcount,
            REFCOUNT_MAX,
            "the count is left as it was"
        );
        let free = o + 1;
        assert!(matches!(slab.add_ref(free), Err(EngineError::Invariant(_))));
    }
}
