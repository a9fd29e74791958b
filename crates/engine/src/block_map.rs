//! Block maps: per volume, logical block → map entry, in pages of 504 entries.
//!
//! A page is allocated when first written, locked on its own (the logical zone's
//! unit), marked dirty when changed and written back at checkpoints; the journal
//! makes every change between checkpoints recoverable.

use crate::counters::Counters;
use crate::dir_tree::DirTree;
use fewerbytes_format::location::MapEntry;
use fewerbytes_format::page::{PageRef, MAP_ENTRIES_PER_PAGE};
use parking_lot::{Mutex, MutexGuard, RwLock, RwLockReadGuard};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};

/// Entries per page, as a u64 for LBN arithmetic.
pub const ENTRIES_PER_PAGE: u64 = MAP_ENTRIES_PER_PAGE as u64;

/// One page of a block map.
#[derive(Default)]
pub struct MapPage {
    /// Encoded entries; `None` while the page has never been written (all unmapped).
    entries: Option<Box<[u64; MAP_ENTRIES_PER_PAGE]>>,
    /// Changed since the last checkpoint snapshot.
    dirty: bool,
    /// Its durable copy (none: never written).
    durable: PageRef,
}

impl MapPage {
    /// Entry `i` of the page.
    pub fn get(&self, i: usize) -> MapEntry {
        MapEntry::decode(
            self.entries
                .as_ref()
                .and_then(|e| e.get(i).copied())
                .unwrap_or(0),
        )
    }

    /// Set entry `i`; returns the old entry. A page that turns dirty counts in `dirty_pages`.
    pub fn set(&mut self, i: usize, entry: MapEntry, dirty_pages: &AtomicU64) -> MapEntry {
        let entries = self
            .entries
            .get_or_insert_with(|| Box::new([0; MAP_ENTRIES_PER_PAGE]));
        let old = entries
            .get(i)
            .copied()
            .map(MapEntry::decode)
            .unwrap_or(MapEntry::Unmapped);
        if let Some(e) = entries.get_mut(i) {
            *e = entry.encode();
        }
        self.turn_dirty(dirty_pages);
        old
    }

    fn turn_dirty(&mut self, dirty_pages: &AtomicU64) {
        if !self.dirty {
            self.dirty = true;
            dirty_pages.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether the page was ever written (else every entry is unmapped).
    pub fn is_written(&self) -> bool {
        self.entries.is_some()
    }

    /// The encoded entries, if the page was ever written.
    pub fn encoded_entries(&self) -> Option<&[u64; MAP_ENTRIES_PER_PAGE]> {
        self.entries.as_deref()
    }

    /// Whether the page changed since the last checkpoint snapshot.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Its durable copy (none: never written).
    pub fn durable(&self) -> PageRef {
        self.durable
    }

    /// A checkpoint wrote the page at `at`: that is its durable copy now.
    pub fn written(&mut self, at: PageRef) {
        self.durable = at;
        self.dirty = false;
    }

    /// The page as loaded from its durable copy at `from`.
    pub fn loaded(&mut self, entries: Box<[u64; MAP_ENTRIES_PER_PAGE]>, from: PageRef) {
        self.entries = Some(entries);
        self.durable = from;
        self.dirty = false;
    }

    /// The page has no durable copy any more (a version-1 pool's upgrade writes every
    /// page afresh): dirty if it holds entries.
    pub fn forget_durable(&mut self) {
        self.durable = PageRef::NONE;
        self.dirty = self.entries.is_some();
    }

    /// A clone's page: the entries of `from`, dirty. Returns the entries copied.
    pub fn copy_from<'a>(
        &mut self,
        from: &'a MapPage,
        dirty_pages: &AtomicU64,
    ) -> Option<&'a [u64; MAP_ENTRIES_PER_PAGE]> {
        let entries = from.entries.as_ref()?;
        self.entries = Some(entries.clone());
        self.turn_dirty(dirty_pages);
        Some(entries)
    }
}

/// A volume's state in memory.
pub struct VolumeState {
    /// Slot in the catalog (names the volume in journal records).
    slot: u16,
    /// Unique id.
    id: u64,
    /// Name (changed only by a rename, with the gate held exclusively).
    name: RwLock<String>,
    /// Size in 4 KiB blocks.
    size_blocks: AtomicU64,
    /// Map pages (the vector is resized under the write lock).
    pages: RwLock<Vec<Mutex<MapPage>>>,
    /// Directory tree of the durable map (checkpoint-owned).
    dirs: Mutex<DirTree>,
    /// Open handles.
    users: AtomicU32,
    /// Set when deleted; handles fail from then on.
    deleted: AtomicBool,
    /// Entries mapped to objects.
    mapped: AtomicI64,
    /// Entries mapped to zero.
    zeros: AtomicI64,
    /// Counters since open.
    counters: Counters,
}

impl VolumeState {
    /// The volume's name now.
    pub fn name(&self) -> String {
        self.name.read().clone()
    }

    /// Whether the volume is called `name`.
    pub fn is_named(&self, name: &str) -> bool {
        *self.name.read() == name
    }

    /// Call the volume `name` (`Pool::rename_volume`, gate held exclusively).
    pub fn rename(&self, name: &str) {
        *self.name.write() = name.to_string();
    }

    /// A volume with an empty map of `size_blocks`.
    pub fn new(slot: u16, id: u64, name: String, size_blocks: u64) -> Self {
        let pages = size_blocks.div_ceil(ENTRIES_PER_PAGE);
        VolumeState {
            slot,
            id,
            name: RwLock::new(name),
            size_blocks: AtomicU64::new(size_blocks),
            pages: RwLock::new((0..pages).map(|_| Mutex::new(MapPage::default())).collect()),
            dirs: Mutex::new(DirTree::default()),
            users: AtomicU32::new(0),
            deleted: AtomicBool::new(false),
            mapped: AtomicI64::new(0),
            zeros: AtomicI64::new(0),
            counters: Counters::default(),
        }
    }

    /// Slot in the catalog (names the volume in journal records).
    pub fn slot(&self) -> u16 {
        self.slot
    }

    /// Unique id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The map pages, held so the map is not resized meanwhile (a page is changed
    /// under its own lock).
    pub fn map_pages(&self) -> RwLockReadGuard<'_, Vec<Mutex<MapPage>>> {
        self.pages.read()
    }

    /// The directory tree of the durable map (the checkpoint's and the load's).
    pub fn dirs(&self) -> MutexGuard<'_, DirTree> {
        self.dirs.lock()
    }

    /// Counters since open.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// A handle opens (`Volume`).
    pub fn attach(&self) {
        self.users.fetch_add(1, Ordering::AcqRel);
    }

    /// A handle closes.
    pub fn detach(&self) {
        self.users.fetch_sub(1, Ordering::AcqRel);
    }

    /// Open handles.
    pub fn users(&self) -> u32 {
        self.users.load(Ordering::Acquire)
    }

    /// The volume is deleted: its handles fail from now on.
    pub fn mark_deleted(&self) {
        self.deleted.store(true, Ordering::Release);
    }

    /// Whether the volume was deleted.
    pub fn is_deleted(&self) -> bool {
        self.deleted.load(Ordering::Acquire)
    }

    /// Blocks mapped to objects (a count below zero, a bug, reads as none).
    pub fn mapped_blocks(&self) -> u64 {
        self.mapped.load(Ordering::Relaxed).max(0) as u64
    }

    /// Blocks mapped to zero (a count below zero, a bug, reads as none).
    pub fn zero_blocks(&self) -> u64 {
        self.zeros.load(Ordering::Relaxed).max(0) as u64
    }

    /// Set the usage counts (rebuilt at open from the map).
    pub fn set_usage(&self, mapped: i64, zeros: i64) {
        self.mapped.store(mapped, Ordering::Relaxed);
        self.zeros.store(zeros, Ordering::Relaxed);
    }

    /// Take the usage counts of `source` (a clone shares its every entry).
    pub fn copy_usage(&self, source: &VolumeState) {
        self.set_usage(
            source.mapped.load(Ordering::Relaxed),
            source.zeros.load(Ordering::Relaxed),
        );
    }

    /// Size in blocks.
    pub fn size_blocks(&self) -> u64 {
        self.size_blocks.load(Ordering::Acquire)
    }

    /// The entry of `lbn`.
    pub fn get(&self, lbn: u64) -> MapEntry {
        let pages = self.pages.read();
        match pages.get((lbn / ENTRIES_PER_PAGE) as usize) {
            Some(p) => p.lock().get((lbn % ENTRIES_PER_PAGE) as usize),
            None => MapEntry::Unmapped,
        }
    }

    /// Track mapped/zero counts for a change from `old` to `new`.
    pub fn account(&self, old: MapEntry, new: MapEntry) {
        let delta = |e: MapEntry| match e {
            MapEntry::Object(_) => (1, 0),
            MapEntry::Zero => (0, 1),
            MapEntry::Unmapped => (0, 0),
        };
        let (om, oz) = delta(old);
        let (nm, nz) = delta(new);
        if nm != om {
            self.mapped.fetch_add(nm - om, Ordering::Relaxed);
        }
        if nz != oz {
            self.zeros.fetch_add(nz - oz, Ordering::Relaxed);
        }
    }

    /// Visit every entry that is not unmapped: (lbn, entry).
    pub fn for_each_mapped(&self, mut f: impl FnMut(u64, MapEntry)) {
        let pages = self.pages.read();
        for (p, page) in pages.iter().enumerate() {
            let page = page.lock();
            if let Some(entries) = &page.entries {
                for (i, raw) in entries.iter().enumerate() {
                    if *raw != 0 {
                        f(
                            p as u64 * ENTRIES_PER_PAGE + i as u64,
                            MapEntry::decode(*raw),
                        );
                    }
                }
            }
        }
    }

    /// Grow or shrink the page vector to `size_blocks`; entries past the end must be
    /// unmapped by the caller first.
    pub fn set_size(&self, size_blocks: u64) {
        let mut pages = self.pages.write();
        let want = size_blocks.div_ceil(ENTRIES_PER_PAGE) as usize;
        pages.resize_with(want, || Mutex::new(MapPage::default()));
        self.size_blocks.store(size_blocks, Ordering::Release);
    }
}

/// Whether two map entries read as the same bytes for a read-modify-write that read
/// one of them: the same entry, or both zeros (ZERO and unmapped).
pub(crate) fn reads_alike(a: MapEntry, b: MapEntry) -> bool {
    match (a, b) {
        (MapEntry::Object(x), MapEntry::Object(y)) => x == y,
        (MapEntry::Object(_), _) | (_, MapEntry::Object(_)) => false,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::reads_alike;
    use fewerbytes_format::location::{MapEntry, ObjectId};

    #[test]
    fn zero_and_unmapped_read_alike_objects_only_themselves() {
        assert!(reads_alike(MapEntry::Zero, MapEntry::Unmapped));
        assert!(reads_alike(MapEntry::Unmapped, MapEntry::Zero));
        assert!(reads_alike(
            MapEntry::Object(ObjectId(7)),
            MapEntry::Object(ObjectId(7))
        ));
        assert!(!reads_alike(
            MapEntry::Object(ObjectId(7)),
            MapEntry::Object(ObjectId(8))
        ));
        assert!(!reads_alike(MapEntry::Object(ObjectId(7)), MapEntry::Zero));
        assert!(!reads_alike(
            MapEntry::Unmapped,
            MapEntry::Object(ObjectId(7))
        ));
    }
}
