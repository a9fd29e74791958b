//! Block maps: per volume, logical block → map entry, in pages of 504 entries.
//!
//! A page is allocated when first written (`map_pages.rs`: only written pages are
//! in memory, whatever the volume's size), locked on its own (the logical zone's
//! unit), marked dirty when changed and written back at checkpoints; the journal
//! makes every change between checkpoints recoverable.

use crate::counters::Counters;
use crate::damaged_range::DamagedRange;
use crate::dir_tree::DirTree;
use crate::map_pages::{Entries, MapPage, MapPages};
use crate::page_share::Shares;
use crate::volume_damage::Damage;
use crate::Result;
use fewerbytes_format::location::{MapEntry, ObjectId};
use fewerbytes_format::page::{PageRef, MAP_ENTRIES_PER_PAGE};
use parking_lot::{
    MappedRwLockReadGuard, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};

/// What unmapping the end of a map changed (`VolumeState::unmap_from`).
#[derive(Default)]
pub struct Unmapped {
    /// Objects that gain a reference (a page made its volume's own), once per entry.
    pub gained: Vec<ObjectId>,
    /// Objects whose reference is dropped, once per entry.
    pub released: Vec<ObjectId>,
    /// Durable copies of pages past the end that no other tree reaches.
    pub retired: Vec<PageRef>,
}

/// Entries per page, as a u64 for LBN arithmetic.
pub const ENTRIES_PER_PAGE: u64 = MAP_ENTRIES_PER_PAGE as u64;

/// A volume's state in memory.
pub struct VolumeState {
    /// Slot in the catalog (names the volume in journal records).
    slot: u16,
    /// Unique id.
    id: u64,
    /// The owner its map pages name: its id, or the lineage of the volume whose
    /// pages it took (a clone, a snapshot, a rollback: `page_share.rs`).
    lineage: AtomicU64,
    /// The volume this is a snapshot of (0: not a snapshot). A snapshot is never
    /// written.
    origin: u64,
    /// When a snapshot was made (seconds since 1970; 0 for a volume).
    created: u32,
    /// A snapshot's identity, the same in every pool it was sent to (0: none).
    guid: u64,
    /// Name (changed only by a rename, with the gate held exclusively).
    name: RwLock<String>,
    /// Size in 4 KiB blocks.
    size_blocks: AtomicU64,
    /// Map pages in memory (chunks are made and dropped under the write lock).
    pages: RwLock<MapPages>,
    /// Directory tree of the durable map (checkpoint-owned).
    dirs: Mutex<DirTree>,
    /// Open handles.
    users: AtomicU32,
    /// Set when deleted; handles fail from then on.
    deleted: AtomicBool,
    /// Limited to the TLS identities of the allow list (the catalog's flag, for
    /// the server's access check; the engine does not enforce it).
    limited: AtomicBool,
    /// An import into it began and has not ended (the catalog's flag, for the
    /// server's refusal to export it; the engine does not enforce it).
    incomplete: AtomicBool,
    /// Entries mapped to objects.
    mapped: AtomicI64,
    /// Entries mapped to zero.
    zeros: AtomicI64,
    /// Counters since open.
    counters: Counters,
    /// Ranges whose map page or directory page failed its checks at open
    /// (`map_damage.rs`); `damaged` says whether there are any without the lock.
    damage: RwLock<Vec<Damage>>,
    damaged: AtomicBool,
    /// Level-1 directory pages a repair cleared damage under: the next checkpoint
    /// rewrites them (and so retires the failed directory pages).
    cleared_dirs: Mutex<BTreeSet<u64>>,
    /// Its pages' durable references changed without a page turning dirty (it took
    /// another volume's pages, or left its own): the next checkpoint walks its map
    /// and writes its tree, however quiet the pool.
    tree_stale: AtomicBool,
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

    /// Whether only the allow list's identities may open the volume.
    pub fn limited(&self) -> bool {
        self.limited.load(Ordering::Acquire)
    }

    /// Limit the volume (or not), in memory; a checkpoint makes it durable.
    pub fn set_limited(&self, limited: bool) {
        self.limited.store(limited, Ordering::Release);
    }

    /// Whether an import into the volume began and has not ended.
    pub fn incomplete(&self) -> bool {
        self.incomplete.load(Ordering::Acquire)
    }

    /// Mark the volume incomplete (or not), in memory; a checkpoint makes it durable.
    pub fn set_incomplete(&self, incomplete: bool) {
        self.incomplete.store(incomplete, Ordering::Release);
    }

    /// A volume with an empty map of `size_blocks`.
    pub fn new(slot: u16, id: u64, name: String, size_blocks: u64) -> Self {
        VolumeState {
            slot,
            id,
            lineage: AtomicU64::new(id),
            origin: 0,
            created: 0,
            guid: 0,
            name: RwLock::new(name),
            size_blocks: AtomicU64::new(size_blocks),
            pages: RwLock::new(MapPages::new(size_blocks.div_ceil(ENTRIES_PER_PAGE))),
            dirs: Mutex::new(DirTree::default()),
            users: AtomicU32::new(0),
            deleted: AtomicBool::new(false),
            limited: AtomicBool::new(false),
            incomplete: AtomicBool::new(false),
            mapped: AtomicI64::new(0),
            zeros: AtomicI64::new(0),
            counters: Counters::default(),
            damage: RwLock::new(Vec::new()),
            damaged: AtomicBool::new(false),
            cleared_dirs: Mutex::new(BTreeSet::new()),
            tree_stale: AtomicBool::new(true),
        }
    }

    /// Record a damaged range found at open; a damaged map page itself is kept with
    /// its failed reference (`MapPage::loaded_damaged`).
    pub(crate) fn add_damage(&self, damage: Damage) {
        if damage.level == 0 {
            let mut pages = self.pages.write();
            if pages.make(damage.first_page) {
                if let Some(page) = pages.get(damage.first_page) {
                    page.lock().loaded_damaged(damage.reference);
                }
            }
        }
        self.damage.write().push(damage);
        self.damaged.store(true, Ordering::Release);
    }

    /// Whether any range of the volume is damaged.
    pub fn has_damage(&self) -> bool {
        self.damaged.load(Ordering::Acquire)
    }

    /// The damaged range holding any of blocks `first..end`, if one does.
    pub(crate) fn damage_in(&self, first: u64, end: u64) -> Option<Damage> {
        if !self.has_damage() {
            return None;
        }
        let size = self.size_blocks();
        self.damage
            .read()
            .iter()
            .find(|d| {
                let r = d.lbns(size);
                first < r.end && r.start < end.max(first + 1)
            })
            .cloned()
    }

    /// The error of `op` on blocks `first..end` if they touch a damaged range.
    pub(crate) fn refuse_damaged(&self, op: &'static str, first: u64, end: u64) -> Result<()> {
        match self.damage_in(first, end) {
            Some(d) => Err(d.error(&self.name(), self.size_blocks(), op)),
            None => Ok(()),
        }
    }

    /// The volume's damaged ranges, for a person.
    pub fn damaged_ranges(&self) -> Vec<DamagedRange> {
        let (name, size) = (self.name(), self.size_blocks());
        self.damage
            .read()
            .iter()
            .map(|d| d.range(&name, size))
            .collect()
    }

    /// The damaged ranges as held (a repair clears them).
    pub(crate) fn damage(&self) -> Vec<Damage> {
        self.damage.read().clone()
    }

    /// Clear every damaged range (`repair.rs`, with the gate held exclusively):
    /// damaged map pages become written with every entry unmapped, and the level-1
    /// directory pages under a damaged directory page are marked for the next
    /// checkpoint to rewrite.
    pub(crate) fn clear_damage(&self, shares: &Shares, dirty_pages: &AtomicU64) -> Result<()> {
        let cleared = std::mem::take(&mut *self.damage.write());
        self.damaged.store(false, Ordering::Release);
        let per_dir = fewerbytes_format::page::REFS_PER_DIR_PAGE as u64;
        for d in &cleared {
            if d.level == 0 {
                let pages = self.pages.read();
                if let Some(page) = pages.get(d.first_page) {
                    let mut page = page.lock();
                    // A damaged page's entries are unknown: no reference is gained.
                    page.make_own(shares, dirty_pages);
                    page.clear_damage(dirty_pages)?;
                }
            } else {
                let mut dirs = self.cleared_dirs.lock();
                dirs.extend(d.first_page / per_dir..d.end_page.div_ceil(per_dir));
            }
        }
        Ok(())
    }

    /// Whether the next checkpoint must walk the map and write the tree whatever
    /// else changed (see `tree_stale`).
    pub(crate) fn tree_stale(&self) -> bool {
        self.tree_stale.load(Ordering::Acquire)
    }

    /// The map's tree names every page's durable copy as it is now (a checkpoint
    /// wrote it, or the open read it).
    pub(crate) fn tree_written(&self) {
        self.tree_stale.store(false, Ordering::Release);
    }

    /// Whether a repair cleared damage under directory pages the next checkpoint
    /// must rewrite.
    pub(crate) fn has_cleared_dirs(&self) -> bool {
        !self.cleared_dirs.lock().is_empty()
    }

    /// The level-1 directory pages a repair cleared damage under, taken by the
    /// checkpoint that rewrites them.
    pub(crate) fn take_cleared_dirs(&self) -> BTreeSet<u64> {
        std::mem::take(&mut *self.cleared_dirs.lock())
    }

    /// Slot in the catalog (names the volume in journal records).
    pub fn slot(&self) -> u16 {
        self.slot
    }

    /// Unique id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The owner its map pages name (`page_share.rs`).
    pub fn lineage(&self) -> u64 {
        self.lineage.load(Ordering::Acquire)
    }

    /// Take the lineage of the volume whose map pages this one now reaches (a
    /// clone's, a rollback's; gate held exclusively).
    pub(crate) fn set_lineage(&self, lineage: u64) {
        self.lineage.store(lineage, Ordering::Release);
    }

    /// The volume this is a snapshot of, if it is one.
    pub fn origin(&self) -> Option<u64> {
        Some(self.origin).filter(|&o| o != 0)
    }

    /// Whether this is a snapshot (read-only, a point in time of its origin).
    pub fn is_snapshot(&self) -> bool {
        self.origin != 0
    }

    /// This volume as a snapshot of the volume with id `origin`, with identity
    /// `guid` (set once, before it is listed).
    pub(crate) fn with_origin(mut self, origin: u64, guid: u64) -> Self {
        self.origin = origin;
        self.guid = guid;
        self
    }

    /// This volume as made at `created` (seconds since 1970; set once, before it
    /// is listed).
    pub(crate) fn made_at(mut self, created: u32) -> Self {
        self.created = created;
        self
    }

    /// When it was made (seconds since 1970; 0: not known).
    pub fn created(&self) -> u32 {
        self.created
    }

    /// A snapshot's identity (0: none).
    pub fn guid(&self) -> u64 {
        self.guid
    }

    /// The map pages in memory, held so the map is not resized meanwhile (a page is
    /// changed under its own lock).
    pub fn map_pages(&self) -> RwLockReadGuard<'_, MapPages> {
        self.pages.read()
    }

    /// Page `p`, made in memory if it was not (a write's): `None` past the map's end.
    /// The common case, a page in memory, takes the read lock and one lookup; the
    /// first write into a chunk takes the write lock once to make it.
    pub fn page_for_write(&self, p: u64) -> Option<MappedRwLockReadGuard<'_, Mutex<MapPage>>> {
        match RwLockReadGuard::try_map(self.pages.read(), |pages| pages.get(p)) {
            Ok(page) => return Some(page),
            Err(pages) if p >= pages.len() => return None,
            Err(_) => {}
        }
        let mut pages = self.pages.write();
        if !pages.make(p) {
            return None;
        }
        RwLockReadGuard::try_map(RwLockWriteGuard::downgrade(pages), |pages| pages.get(p)).ok()
    }

    /// Load page `p` from its durable copy at `from` (`load.rs`).
    pub fn load_page(&self, p: u64, entries: Entries, from: PageRef) {
        let mut pages = self.pages.write();
        if pages.make(p) {
            if let Some(page) = pages.get(p) {
                page.lock().loaded(entries, from);
            }
        }
    }

    /// The block map's memory: the pages written, and the bytes its chunks of page
    /// slots and the entries it alone holds take (entries shared in memory with a
    /// snapshot's or a clone's page count in neither: the pool's
    /// `shared_map_pages` counts them).
    pub fn map_memory(&self) -> (u64, u64) {
        let (slots, written, alone) = self.pages.read().memory();
        let bytes = slots / crate::map_pages::CHUNK_PAGES * MapPages::chunk_bytes()
            + alone * (MAP_ENTRIES_PER_PAGE * 8) as u64;
        (written, bytes)
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
        match pages.get(lbn / ENTRIES_PER_PAGE) {
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

    /// Visit every entry that is not unmapped: (lbn, entry). Only pages in memory
    /// are visited.
    pub fn for_each_mapped(&self, mut f: impl FnMut(u64, MapEntry)) {
        let pages = self.pages.read();
        for (p, page) in pages.iter() {
            let page = page.lock();
            if let Some(entries) = page.encoded_entries() {
                for (i, raw) in entries.iter().enumerate() {
                    if *raw != 0 {
                        f(p * ENTRIES_PER_PAGE + i as u64, MapEntry::decode(*raw));
                    }
                }
            }
        }
    }

    /// Visit every entry that is not unmapped, as the reference counts count them:
    /// a page several trees reach only in the first volume a walk over all of them
    /// (sharing `counted`) meets it in.
    pub(crate) fn for_each_counted(
        &self,
        counted: &mut crate::page_share::CountedPages,
        mut f: impl FnMut(u64, MapEntry),
    ) {
        let pages = self.pages.read();
        for (p, page) in pages.iter() {
            let page = page.lock();
            if !counted.counts(page.is_shared(), page.durable()) {
                continue;
            }
            if let Some(entries) = page.encoded_entries() {
                for (i, raw) in entries.iter().enumerate() {
                    if *raw != 0 {
                        f(p * ENTRIES_PER_PAGE + i as u64, MapEntry::decode(*raw));
                    }
                }
            }
        }
    }

    /// Visit every entry that is not unmapped in the pages no other volume's tree
    /// reaches (`page_share.rs`).
    pub(crate) fn for_each_held_alone(&self, shares: &Shares, mut f: impl FnMut(u64, MapEntry)) {
        let pages = self.pages.read();
        for (p, page) in pages.iter() {
            let page = page.lock();
            if page.is_shared() && shares.referrers(page.durable()) > 1 {
                continue;
            }
            if let Some(entries) = page.encoded_entries() {
                for (i, raw) in entries.iter().enumerate() {
                    if *raw != 0 {
                        f(p * ENTRIES_PER_PAGE + i as u64, MapEntry::decode(*raw));
                    }
                }
            }
        }
    }

    /// Unmap every entry from `lbn` on, before a shrink to `lbn` blocks
    /// ([`Self::set_size`]), counting the change. A page wholly past `lbn` is left
    /// (`MapPage::leave`: to the other trees that reach it, else its durable copy
    /// retired and its references dropped); the page `lbn` falls in is made this
    /// volume's own first (`MapPage::make_own`). Visits the pages in memory only.
    pub fn unmap_from(
        &self,
        lbn: u64,
        shares: &Shares,
        dirty_pages: &AtomicU64,
    ) -> Result<Unmapped> {
        let mut out = Unmapped::default();
        let keep = lbn.div_ceil(ENTRIES_PER_PAGE);
        let pages = self.pages.read();
        for (p, page) in pages.iter_from(lbn / ENTRIES_PER_PAGE) {
            let mut page = page.lock();
            let first = lbn.saturating_sub(p * ENTRIES_PER_PAGE) as usize;
            for i in first..MAP_ENTRIES_PER_PAGE {
                self.account(page.get(i), MapEntry::Unmapped);
            }
            if p >= keep {
                let (durable, objects) = page.leave(shares);
                out.retired.extend(durable);
                out.released.extend(objects);
                *page = MapPage::default();
                continue;
            }
            if !page.is_written() {
                continue;
            }
            out.gained.extend(page.make_own(shares, dirty_pages));
            for i in first..MAP_ENTRIES_PER_PAGE {
                if page.get(i) != MapEntry::Unmapped {
                    let old = page.set(i, MapEntry::Unmapped, dirty_pages)?;
                    out.released.extend(old.object());
                }
            }
        }
        Ok(out)
    }

    /// A clone's, snapshot's or rollback's map: `source`'s pages, shared where
    /// they can be (`MapPages::share_from`), its usage counts and its lineage.
    /// Returns the objects that gain a reference (those of the pages copied), once
    /// per entry.
    pub fn share_map_from(
        &self,
        source: &VolumeState,
        shares: &Shares,
        dirty_pages: &AtomicU64,
    ) -> Vec<ObjectId> {
        self.tree_stale.store(true, Ordering::Release);
        let copied = self
            .pages
            .write()
            .share_from(&source.pages.read(), shares, dirty_pages);
        self.copy_usage(source);
        self.set_lineage(source.lineage());
        copied
    }

    /// Leave every page of the map (a delete, a rollback): the durable copies no
    /// other tree reaches, to free, and the objects whose references to drop, once
    /// per entry (a damaged page's are unknown: a leak `check --repair` frees). The
    /// map is empty after, and so is its list of damaged ranges.
    pub(crate) fn leave_map(&self, shares: &Shares) -> (Vec<PageRef>, Vec<ObjectId>) {
        self.damage.write().clear();
        self.damaged.store(false, Ordering::Release);
        self.cleared_dirs.lock().clear();
        self.tree_stale.store(true, Ordering::Release);
        let mut free = Vec::new();
        let mut released = Vec::new();
        let mut pages = self.pages.write();
        for (_, page) in pages.iter() {
            let (durable, objects) = page.lock().leave(shares);
            free.extend(durable);
            released.extend(objects);
        }
        let len = pages.len();
        *pages = MapPages::new(len);
        self.set_usage(0, 0);
        (free, released)
    }

    /// Change the size to `size_blocks`; entries past the end must be unmapped by the
    /// caller first ([`Self::unmap_from`]).
    pub fn set_size(&self, size_blocks: u64) {
        self.tree_stale.store(true, Ordering::Release);
        let mut pages = self.pages.write();
        pages.set_len(size_blocks.div_ceil(ENTRIES_PER_PAGE));
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
