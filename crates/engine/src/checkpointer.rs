//! The checkpointer's state: the super block of the last checkpoint, the page store,
//! the directory trees of the object tables, the page-store slots to free once the
//! next checkpoint is durable and those held for the older super block copy, the lock that lets one checkpoint (or volume
//! operation) run at a time, and what the checkpoints wrote. The procedure that
//! takes a checkpoint is `checkpoint.rs`; loading one is `load.rs`.

use crate::counters::RegionBytes;
use crate::dir_tree::DirTree;
use crate::page_store::PageStore;
use fewerbytes_format::superblock::SuperBlock;
use parking_lot::{Mutex, MutexGuard};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// What the checkpoints keep between them.
pub(crate) struct Checkpointer {
    /// The super block of the last checkpoint (its changing fields: generation,
    /// catalog, replay point, holder; the geometry is read from `PoolGeometry`).
    super_block: Mutex<SuperBlock>,
    page_store: Mutex<PageStore>,
    /// Directory tree of the count table (version 2; of the object table while a
    /// version-1 pool is loaded).
    count_dirs: Mutex<DirTree>,
    /// Directory tree of the fingerprint table (version 2).
    fp_dirs: Mutex<DirTree>,
    /// Page addresses (slots and data blocks) whose pages are gone from the image (a
    /// deleted volume, a shrunk map): freed by the next checkpoint, once its super
    /// block is durable.
    slots_to_free: Mutex<Vec<u64>>,
    /// Page addresses the last durable checkpoint retired: the older super block
    /// copy's image still reaches them, so they are freed (and discarded) only once
    /// the next checkpoint is durable (deferred frees, docs/format.md "Checkpoints").
    retired_by_last: Mutex<Vec<u64>>,
    /// Damaged super block copies the open found, and directory pages read from
    /// their second copy.
    copies_repaired: AtomicU64,
    /// One checkpoint or volume operation at a time.
    serial: Mutex<()>,
    /// Checkpoints taken since open.
    taken: AtomicU64,
    /// Page-store slots discarded on the metadata device since open.
    slots_discarded: AtomicU64,
    /// Metadata bytes written, by region.
    written: RegionBytes,
    /// Pages turned dirty since the last checkpoint snapshot: each needs a fresh
    /// page-store slot at the next checkpoint, so their number is bounded (see
    /// `Inner::page_store_pressed`). Map pages and slabs add to it.
    dirty_pages: Arc<AtomicU64>,
    /// The last checkpoint was durable in full (set when it is, cleared as the next
    /// begins): with no page turned dirty since, a checkpoint may skip the volumes
    /// whose trees are as it wrote them (`checkpoint.rs: snapshot`).
    settled: AtomicBool,
}

impl Checkpointer {
    /// The state of a pool opened from super block `sb`, with a page store of `page_slots`.
    pub(crate) fn new(sb: SuperBlock, page_slots: u64) -> Self {
        Checkpointer {
            super_block: Mutex::new(sb),
            page_store: Mutex::new(PageStore::new(page_slots)),
            count_dirs: Mutex::new(DirTree::default()),
            fp_dirs: Mutex::new(DirTree::default()),
            slots_to_free: Mutex::new(Vec::new()),
            retired_by_last: Mutex::new(Vec::new()),
            copies_repaired: AtomicU64::new(0),
            serial: Mutex::new(()),
            taken: AtomicU64::new(0),
            slots_discarded: AtomicU64::new(0),
            written: RegionBytes::default(),
            dirty_pages: Arc::new(AtomicU64::new(0)),
            settled: AtomicBool::new(false),
        }
    }

    /// The count of pages turned dirty, which map pages and slabs add to.
    pub(crate) fn dirty_pages(&self) -> &Arc<AtomicU64> {
        &self.dirty_pages
    }

    /// Pages turned dirty since the last snapshot.
    pub(crate) fn dirty_page_count(&self) -> u64 {
        self.dirty_pages.load(Ordering::Relaxed)
    }

    /// A snapshot took every dirty page.
    pub(crate) fn dirty_pages_taken(&self) {
        self.dirty_pages.store(0, Ordering::Relaxed);
    }

    /// At a snapshot's start (the gate held): whether the last checkpoint was
    /// durable in full and no map or slab page turned dirty since, so that no page
    /// is dirty now. Clears the mark until this checkpoint is durable.
    pub(crate) fn quiet_since_settled(&self) -> bool {
        self.settled.swap(false, Ordering::AcqRel) && self.dirty_page_count() == 0
    }

    /// The checkpoint just taken is durable in full.
    pub(crate) fn settled(&self) {
        self.settled.store(true, Ordering::Release);
    }

    /// Run alone: no other checkpoint or volume operation until the guard drops.
    pub(crate) fn serialize(&self) -> MutexGuard<'_, ()> {
        self.serial.lock()
    }

    /// The super block of the last checkpoint.
    pub(crate) fn super_block(&self) -> MutexGuard<'_, SuperBlock> {
        self.super_block.lock()
    }

    /// The page store.
    pub(crate) fn page_store(&self) -> MutexGuard<'_, PageStore> {
        self.page_store.lock()
    }

    /// The directory tree of the count table.
    pub(crate) fn count_dirs(&self) -> MutexGuard<'_, DirTree> {
        self.count_dirs.lock()
    }

    /// The directory tree of the fingerprint table.
    pub(crate) fn fp_dirs(&self) -> MutexGuard<'_, DirTree> {
        self.fp_dirs.lock()
    }

    /// Free these page addresses once the next checkpoint is durable.
    pub(crate) fn free_after_next(&self, slots: impl IntoIterator<Item = u64>) {
        self.slots_to_free.lock().extend(slots);
    }

    /// The slots waiting to be freed (a snapshot retires them with its own).
    pub(crate) fn take_slots_to_free(&self) -> Vec<u64> {
        std::mem::take(&mut *self.slots_to_free.lock())
    }

    /// A checkpoint that retired `retired` is durable: returns what the checkpoint
    /// before it retired, which no super block copy reaches any more (the copy that
    /// named those pages was just overwritten), to be freed now.
    pub(crate) fn retire(&self, retired: Vec<u64>) -> Vec<u64> {
        std::mem::replace(&mut *self.retired_by_last.lock(), retired)
    }

    /// Page addresses held for the older super block copy (retired by the last
    /// checkpoint, not yet freed).
    pub(crate) fn held_for_older_copy(&self) -> u64 {
        self.retired_by_last.lock().len() as u64
    }

    /// The open found a damaged super block copy, or a directory page was read from
    /// its second copy (`dir_copies.rs`).
    pub(crate) fn count_copy_repaired(&self) {
        self.copies_repaired.fetch_add(1, Ordering::Relaxed);
    }

    /// Damaged metadata copies found since open.
    pub(crate) fn copies_repaired(&self) -> u64 {
        self.copies_repaired.load(Ordering::Relaxed)
    }

    /// One more checkpoint taken.
    pub(crate) fn count_taken(&self) {
        self.taken.fetch_add(1, Ordering::Relaxed);
    }

    /// Checkpoints taken since open.
    pub(crate) fn taken(&self) -> u64 {
        self.taken.load(Ordering::Relaxed)
    }

    /// `n` more page-store slots discarded.
    pub(crate) fn count_slots_discarded(&self, n: u64) {
        self.slots_discarded.fetch_add(n, Ordering::Relaxed);
    }

    /// Page-store slots discarded since open.
    pub(crate) fn slots_discarded(&self) -> u64 {
        self.slots_discarded.load(Ordering::Relaxed)
    }

    /// Metadata bytes written, by region.
    pub(crate) fn written(&self) -> &RegionBytes {
        &self.written
    }
}
