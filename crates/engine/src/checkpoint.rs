//! Checkpoints: the durable image of every table, written copy-on-write in format
//! version 3.
//!
//! A checkpoint snapshots every dirty page (block-map pages, object count pages,
//! fingerprint pages) under the pool's gate, so the image is exactly the state after
//! a known journal position. Pages go to fresh page-store slots, never over the
//! slots the previous checkpoint uses; then directory pages, then the catalog, then
//! the super block copy `generation % 2`. Each parent holds a [`PageRef`] (slot, crc,
//! generation) of every page it points to, so a page the drive lost or misplaced is
//! caught when it is read (`load.rs`). Until the super block lands, the previous
//! checkpoint and its journal are intact; after it, the blocks freed before the
//! snapshot are discarded on their device and become reusable, and so do the slots
//! the *previous* checkpoint retired. The slots this one retired are still reached
//! by the older super block copy: they wait for the next checkpoint (deferred
//! frees), so either copy opens the pool with every flushed write.
//!
//! Each directory page is written twice, byte for byte, to two fresh addresses, and
//! its parent holds a twinned reference naming both (`docs/format.md`, "Version 3"):
//! a directory page that did not change between the two newest checkpoints is shared
//! by both, and its second copy is what survives a bad sector there.

use crate::block_map::{VolumeState, ENTRIES_PER_PAGE};
use crate::dir_tree::{DirLevel, DirTree, SparseRefs};
use crate::inner::Inner;
use crate::journal::Work;
use crate::map_pages::MapPages;
use crate::page_store::{address_block, discard_slots, page_addresses, PageStore};
use crate::slab::{ObjTable, Slab};
use crate::slab_depot::SlabDepot;
use crate::{EngineError, Result};
use fewerbytes_format::catalog::{Catalog, VolumeRecord};
use fewerbytes_format::counters::encode_counters;
use fewerbytes_format::dir_tree::{level_sizes, MAX_DEPTH};
use fewerbytes_format::page::ADDRESS_DATA_REGION;
use fewerbytes_format::page::{
    encode_page, ref_generation, refs_per_dir_page, CountRecord, PageHeader, PageKind, PageRef,
    COUNTS_PER_PAGE, FINGERPRINTS_PER_PAGE, PAGE_PAYLOAD_BYTES, PAGE_REF_BYTES, REFS_PER_DIR_PAGE,
    TWIN_REF_BYTES,
};
use fewerbytes_format::superblock::{
    SuperBlock, FLAG_DATA_REGION_PAGES, FLAG_SHARED_MAPS, FLAG_UPGRADED_FROM_V1,
    MAX_CATALOG_PAGES_V2,
};
use fewerbytes_format::{Writer, BLOCK_BYTES, FORMAT_VERSION, FORMAT_VERSION_1};
use parking_lot::RwLockWriteGuard;
use std::collections::BTreeSet;

/// Owner id of the directory pages of the slab object table (version 1) and of the
/// count table (version 2).
pub const OBJECT_TABLE_OWNER: u64 = u64::MAX;
/// Owner id of the fingerprint table's directory pages (version 2).
pub const FINGERPRINT_TABLE_OWNER: u64 = u64::MAX - 1;

/// Data blocks a snapshot takes from the depot at a time for pages past the free
/// slots; those left over are freed when it is durable.
const SPILL_BATCH_BLOCKS: u64 = 64;

/// What a page is, as its header names it.
struct PageName {
    kind: PageKind,
    /// Directory level (directory pages only; 0 for every other kind).
    level: u8,
    owner: u64,
    index: u64,
}

impl PageName {
    /// A page that is not a directory page.
    fn table(kind: PageKind, owner: u64, index: u64) -> Self {
        PageName {
            kind,
            level: 0,
            owner,
            index,
        }
    }
}

/// One page ready to write.
struct Encoded {
    /// A page-store slot, or a data block with bit 63 set.
    address: u64,
    kind: PageKind,
    bytes: Box<[u8; BLOCK_BYTES]>,
}

/// What a snapshot produced.
struct Snapshot {
    pages: Vec<Encoded>,
    old_slots: Vec<u64>,
    pending: Pending,
    superblock: SuperBlock,
    /// The counters the snapshot's counters page holds, if it writes one.
    counters: Option<Vec<u64>>,
    /// Data blocks taken for pages and not used.
    unused_blocks: Vec<u64>,
}

/// The pages a snapshot writes: each goes to a fresh slot (or, with none free, to a
/// data block taken for it before the snapshot), and the address it replaces is
/// retired once the snapshot is durable.
struct Writeback<'a> {
    store: parking_lot::MutexGuard<'a, PageStore>,
    pages: Vec<Encoded>,
    old_slots: Vec<u64>,
    /// Where data blocks come from for pages that find no free slot.
    depot: &'a SlabDepot,
    /// Free data blocks taken from it and not used yet.
    spare: Vec<u64>,
    /// The slab whose lock the snapshot holds now (its tables are being written).
    held_slab: Option<u32>,
    /// A page went to the data region.
    spilled: bool,
    nonce: u64,
    generation: u64,
}

impl Writeback<'_> {
    /// A fresh page address: a slot first, then a free data block
    /// (`Inner::metadata_room` checked there is room for both). Past those the
    /// checkpoint cannot complete, and the pool must stop taking writes rather than
    /// retry forever.
    fn alloc(&mut self) -> Result<u64> {
        let address = match self.store.alloc() {
            Some(slot) => u64::from(slot),
            None => {
                if self.spare.is_empty() {
                    self.spare = self
                        .depot
                        .take_metadata_blocks(SPILL_BATCH_BLOCKS, self.held_slab);
                }
                let pbn = self.spare.pop().ok_or_else(|| {
                    EngineError::NoSpace(
                        "no free page-store slot or data block for a checkpoint's page".into(),
                    )
                })?;
                self.spilled = true;
                pbn | ADDRESS_DATA_REGION
            }
        };
        self.store.mark_address(address);
        Ok(address)
    }

    /// Encode one page into a fresh slot, retiring `current`. Returns the reference
    /// its parent holds.
    fn place(
        &mut self,
        name: PageName,
        count: u32,
        payload: &[u8],
        current: PageRef,
    ) -> Result<PageRef> {
        self.place_copies(name, count, payload, current, false)
    }

    /// Encode one page and write it to one fresh address, or (`twinned`) the same
    /// bytes to two: the header names the first, which the reference's `address`
    /// holds, the second its `twin`. The addresses of `current` (both copies of a
    /// twinned page) retire.
    fn place_copies(
        &mut self,
        name: PageName,
        count: u32,
        payload: &[u8],
        current: PageRef,
        twinned: bool,
    ) -> Result<PageRef> {
        let address = self.alloc()?;
        let twin = if twinned { self.alloc()? } else { 0 };
        let header = PageHeader {
            version: FORMAT_VERSION,
            kind: name.kind,
            level: name.level,
            count,
            nonce: self.nonce,
            slot: address,
            generation: self.generation,
            owner: name.owner,
            index: name.index,
        };
        let mut bytes = Box::new([0u8; BLOCK_BYTES]);
        let crc = encode_page(&header, payload, &mut bytes);
        if twinned {
            self.pages.push(Encoded {
                address: twin,
                kind: name.kind,
                bytes: bytes.clone(),
            });
        }
        self.pages.push(Encoded {
            address,
            kind: name.kind,
            bytes,
        });
        self.old_slots.extend(page_addresses(&current));
        Ok(PageRef {
            address,
            crc,
            generation: ref_generation(self.generation),
            twin,
        })
    }

    /// While a slab is locked (the depot passes it over): with no free slot and no
    /// spare block, take the next page's block from that slab, which may be the
    /// pool's only one with free blocks.
    fn top_up(&mut self, slab: &mut Slab) {
        if self.spare.is_empty() && self.store.free_slots() == 0 {
            if let Some(b) = slab.alloc_block_for_metadata() {
                self.spare.push(slab.first_pbn() + u64::from(b));
            }
        }
    }

    /// Rewrite the directory tree of a table of `pages` pages whose written pages
    /// are `refs`: at level 1 the pages `dirty` marks (a page under directory page
    /// `k` moved) and those never written over a page that is, and the one over the
    /// table's end when its length changed; then at each level above the pages over
    /// a rewritten one, up to the top list the catalog holds. Levels the table no
    /// longer needs retire.
    fn write_tree(
        &mut self,
        tree: &mut DirTree,
        pages: u64,
        refs: &[(u64, PageRef)],
        mut dirty: BTreeSet<u64>,
        owner: u64,
    ) -> Result<()> {
        let depth = level_sizes(pages)
            .ok_or_else(|| {
                EngineError::Refused(format!(
                    "a table of {pages} pages needs more than {MAX_DEPTH} directory levels"
                ))
            })?
            .len();
        if let Some(last) = tree.reshape(depth, pages, &mut self.old_slots) {
            dirty.insert(last / PER_DIR);
        }
        // The level below: its length and its written pages.
        let (mut len, mut children) = (pages, refs);
        let mut written: SparseRefs;
        for k in 0..depth {
            let Some(dirs) = tree.level_mut(k) else {
                break;
            };
            let level = k as u8 + 1;
            dirty = self.write_level(dirs, len, children, &dirty, owner, level)?;
            len = dirs.len();
            written = dirs.refs().collect();
            children = &written;
        }
        Ok(())
    }

    /// Rewrite the directory pages of one level over `len` children of which `refs`
    /// were written (`dirty` as in [`Self::write_tree`], and those marked for
    /// rewriting). Returns the dirty marks of the level above: the pages over a
    /// rewritten page, and over the last page when this level's length changed. A
    /// page's payload holds the references of its children in order, NONE (zeros)
    /// for those never written: 252 of 16 bytes at level 1, 168 twinned ones of 24
    /// above. Each page is written twice (`place_copies`).
    fn write_level(
        &mut self,
        dirs: &mut DirLevel,
        len: u64,
        refs: &[(u64, PageRef)],
        dirty: &BTreeSet<u64>,
        owner: u64,
        level: u8,
    ) -> Result<BTreeSet<u64>> {
        let per = refs_per_dir_page(FORMAT_VERSION, level) as u64;
        let per_above = refs_per_dir_page(FORMAT_VERSION, level + 1) as u64;
        let (ref_bytes, twinned) = if level >= 2 {
            (TWIN_REF_BYTES, true)
        } else {
            (PAGE_REF_BYTES, false)
        };
        let want = len.div_ceil(per);
        let mut above = BTreeSet::new();
        if dirs.len() != want {
            if let Some(last) = want.checked_sub(1) {
                above.insert(last / per_above);
            }
        }
        dirs.set_len(want, &mut self.old_slots);
        // Those marked, and those never written over a child that was.
        let mut rewrite: BTreeSet<u64> = dirty.range(..want).copied().collect();
        rewrite.extend(dirs.take_rewrite().range(..want));
        rewrite.extend(
            refs.iter()
                .map(|(i, _)| i / per)
                .filter(|&k| dirs.get(k).is_none()),
        );
        let mut payload = vec![0u8; PAGE_PAYLOAD_BYTES];
        for k in rewrite {
            let first = k * per;
            payload.fill(0);
            let mut w = Writer::new(&mut payload);
            let from = refs.partition_point(|(i, _)| *i < first);
            let under = refs.get(from..).unwrap_or_default();
            for (i, r) in under.iter().take_while(|(i, _)| *i < first + per) {
                w.seek((i - first) as usize * ref_bytes);
                r.encode_as(twinned, &mut w);
            }
            let name = PageName {
                kind: PageKind::Directory,
                level,
                owner,
                index: k,
            };
            let count = (len - first).min(per) as u32;
            let at = self.place_copies(name, count, &payload, dirs.get(k), true)?;
            dirs.set(k, at);
            above.insert(k / per_above);
        }
        Ok(above)
    }

    /// Write the count and fingerprint pages of one slab that changed since the last
    /// snapshot, and clear its dirty marks. A count page (336 records) is rewritten
    /// when one of its records changed; a fingerprint page (126) only when an object
    /// in it was stored. Appends the slab's references to `counts` and `fps`, and
    /// marks the directory pages above a rewritten page in `count_dirty`/`fp_dirty`.
    fn write_slab(
        &mut self,
        s: u32,
        slab: &mut Slab,
        tables: &mut ObjectTables,
        payload: &mut [u8],
    ) -> Result<()> {
        if slab.has_no_durable_pages()
            && slab
                .table_pages_in_memory(ObjTable::Counts)
                .next()
                .is_none()
        {
            // Nothing in memory and nothing durable: no page to write or reference.
            tables.count_pages += slab.table_pages(ObjTable::Counts) as u64;
            tables.fp_pages += slab.table_pages(ObjTable::Fingerprints) as u64;
            return Ok(());
        }
        let objects = slab.objects() as usize;
        for c in 0..slab.table_pages(ObjTable::Counts) {
            let first = c * COUNTS_PER_PAGE;
            let end = (first + COUNTS_PER_PAGE).min(objects);
            if slab.table_page_changed(ObjTable::Counts, c) {
                payload.fill(0);
                let mut w = Writer::new(payload);
                for i in first..end {
                    let rec = slab.rec(i as u32);
                    CountRecord {
                        location: rec.location,
                        refcount: rec.refcount,
                    }
                    .encode(&mut w);
                }
                let current = slab.durable_ref(ObjTable::Counts, c);
                self.top_up(slab);
                let name = PageName::table(PageKind::Counts, u64::from(s), c as u64);
                let r = self.place(name, (end - first) as u32, payload, current)?;
                slab.set_durable(ObjTable::Counts, c, r);
                tables.count_dirty.insert(tables.count_pages / PER_DIR);
            }
            let r = slab.durable_ref(ObjTable::Counts, c);
            if !r.is_none() {
                tables.counts.push((tables.count_pages, r));
            }
            tables.count_pages += 1;
        }
        for f in 0..slab.table_pages(ObjTable::Fingerprints) {
            let first = f * FINGERPRINTS_PER_PAGE;
            let end = (first + FINGERPRINTS_PER_PAGE).min(objects);
            if slab.table_page_changed(ObjTable::Fingerprints, f) {
                payload.fill(0);
                let mut w = Writer::new(payload);
                for i in first..end {
                    w.put(&slab.rec(i as u32).fingerprint);
                }
                let current = slab.durable_ref(ObjTable::Fingerprints, f);
                self.top_up(slab);
                let name = PageName::table(PageKind::Fingerprints, u64::from(s), f as u64);
                let r = self.place(name, (end - first) as u32, payload, current)?;
                slab.set_durable(ObjTable::Fingerprints, f, r);
                tables.fp_dirty.insert(tables.fp_pages / PER_DIR);
            }
            let r = slab.durable_ref(ObjTable::Fingerprints, f);
            if !r.is_none() {
                tables.fps.push((tables.fp_pages, r));
            }
            tables.fp_pages += 1;
        }
        slab.snapshot_taken();
        Ok(())
    }
}

/// References per level-1 directory page (of table pages), as a u64 for page
/// arithmetic.
const PER_DIR: u64 = REFS_PER_DIR_PAGE as u64;

/// The count and fingerprint tables over all slabs, as a snapshot builds them: each
/// table's length, its written pages, and the level-1 directory pages over a page
/// rewritten.
#[derive(Default)]
struct ObjectTables {
    count_pages: u64,
    counts: SparseRefs,
    count_dirty: BTreeSet<u64>,
    fp_pages: u64,
    fps: SparseRefs,
    fp_dirty: BTreeSet<u64>,
}

/// Take a checkpoint (the commit thread, or a caller holding no pool locks).
pub(crate) fn checkpoint(inner: &Inner) -> Result<()> {
    let _ck = inner.checkpointer.serialize();
    let gate = inner.locks.exclusive();
    checkpoint_locked(inner, gate, false)
}

/// Take a checkpoint with the gate held; with `hold`, keep it until the super
/// block is durable (volume operations, which are not journalled). Such a change is
/// in no journal record, so opening from the older super block copy could not
/// replay it: with `hold`, a second checkpoint follows before the gate opens, and
/// both copies hold the change before any sector is written after it.
pub(crate) fn checkpoint_locked(
    inner: &Inner,
    gate: RwLockWriteGuard<'_, ()>,
    hold: bool,
) -> Result<()> {
    if !hold {
        return checkpoint_once(inner, Some(gate), false, Vec::new()).map(drop);
    }
    // The first checkpoint's freed data blocks and objects (a deleted volume's) are
    // still named by the older copy, and no journal record frees them for a replay
    // from it: they are released with the second checkpoint's.
    let first = checkpoint_once(inner, None, true, Vec::new())?;
    checkpoint_once(inner, None, false, first)?;
    drop(gate);
    Ok(())
}

/// A checkpoint with the gate held by the caller, who keeps it after: a clone, a
/// snapshot or a rollback takes one first when its source has pages changed since
/// the last, so that every page it takes is durable and shared, not copied
/// (`page_share.rs`).
pub(crate) fn checkpoint_held(inner: &Inner) -> Result<()> {
    checkpoint_once(inner, None, false, Vec::new()).map(drop)
}

/// Data blocks and objects a snapshot took as freed, per slab.
type Pending = Vec<(u32, Vec<u32>, Vec<u32>)>;

/// One checkpoint, the gate held by the caller; `release`, when given, is that
/// gate, opened once the snapshot is taken. Once durable it releases the frees it
/// took and those `carried` from an earlier one, or with `keep_pending` returns its
/// own unreleased (with `carried` empty).
fn checkpoint_once(
    inner: &Inner,
    release: Option<RwLockWriteGuard<'_, ()>>,
    keep_pending: bool,
    carried: Pending,
) -> Result<Pending> {
    if let Some(why) = inner.journal.failure() {
        return Err(EngineError::ReadOnly(why));
    }
    if inner.devices.opened_read_only() {
        return Err(EngineError::ReadOnly("opened read-only".into()));
    }
    // A device with no room for the data written so far: refuse before the
    // snapshot, which could not be taken back (`inner.rs: checkpoint_space`).
    inner.checkpoint_space()?;
    // Room for its pages in slots and data blocks: a snapshot that cannot finish
    // cannot be taken back.
    inner.metadata_room()?;
    // No commit may be in flight while the replay point is chosen: its records are
    // in the image, and replaying them again on top of it would count them twice.
    let commit_guard = inner.journal.pause_commits();
    // The tail goes to the ring first, so the journal since the older copy's
    // replay point holds every record this image holds (opening from that copy
    // replays them).
    let data_durable = || {
        inner.zones.flush(&inner.space())?;
        let r = inner.devices.data().flush();
        inner.devices.check_io(r)
    };
    let committed = inner.journal.commit_held(
        inner.devices.meta(),
        inner.devices.separate_metadata(),
        data_durable,
    );
    if let Err(e) = committed {
        if !e.is_no_space() {
            inner.devices.latch(&e);
        }
        return Err(e);
    }
    let snapshot = match snapshot(inner) {
        Ok(s) => s,
        Err(e) => {
            // A checkpoint that cannot be taken cannot be retried into success:
            // stop taking writes (journal space would never come back).
            inner
                .devices
                .latch_with(format!("latched read-only: a checkpoint failed: {e}"));
            return Err(e);
        }
    };
    drop(commit_guard);
    drop(release);
    if let Err(e) = write_snapshot(inner, &snapshot) {
        inner.devices.latch(&e);
        return Err(e);
    }
    inner.checkpointer.settled();
    // Durable. The pages it retired are still reached by the older super block copy
    // (the previous checkpoint): they stay until the next checkpoint is durable.
    // Those the previous checkpoint retired are reached by no copy now (this one
    // overwrote the copy that named them): they go back to the metadata device
    // while still marked used (no checkpoint can place a page there meanwhile),
    // then become free.
    let to_free = inner.checkpointer.retire(snapshot.old_slots.clone());
    let retired: Vec<u64> = {
        let store = inner.checkpointer.page_store();
        let mut slots: Vec<u64> = to_free
            .iter()
            .copied()
            .filter(|&a| address_block(a).is_none() && store.is_used(a))
            .collect();
        slots.sort_unstable();
        slots.dedup();
        slots
    };
    let discarded = discard_slots(
        inner.devices.meta(),
        inner.geometry.pages_start_block(),
        &retired,
    );
    inner.checkpointer.count_slots_discarded(discarded);
    let moved_blocks: Vec<u64> = {
        let mut store = inner.checkpointer.page_store();
        to_free
            .iter()
            .filter_map(|a| store.free_address(*a))
            .collect()
    };
    // What it freed in the data region is discarded on the data device and
    // reusable, data blocks whose pages moved as well.
    inner.depot.return_unused_blocks(&snapshot.unused_blocks);
    let mut pending = carried;
    pending.extend(snapshot.pending.iter().cloned());
    let kept = if keep_pending {
        pending
    } else {
        inner
            .depot
            .release_pending(&inner.devices, &inner.geometry, &pending);
        Vec::new()
    };
    inner
        .depot
        .release_metadata_blocks(&inner.devices, &inner.geometry, &moved_blocks);
    *inner.checkpointer.super_block() = snapshot.superblock.clone();
    if let Some(values) = snapshot.counters {
        inner.counters.written(values);
    }
    inner
        .journal
        .checkpointed(snapshot.superblock.journal_replay_seq);
    inner.checkpointer.count_taken();
    Ok(kept)
}

/// One volume's block map into `wb`: every dirty page to a fresh place, and the
/// directory pages over those and over any page whose reference changed (a tree
/// new since the last checkpoint, the ranges a repair cleared, a resize). The
/// volume's tree is as written after.
fn write_map(
    wb: &mut Writeback<'_>,
    vol: &VolumeState,
    map: &MapPages,
    dirs: &mut DirTree,
    payload: &mut [u8],
) -> Result<()> {
    let mut map_refs = Vec::new();
    // A damaged page is never dirty (its reference is kept as it is); the
    // directory pages over a range a repair cleared are rewritten.
    let mut dirty_dirs = vol.take_cleared_dirs();
    for (p, page) in map.iter() {
        let mut page = page.lock();
        if page.is_dirty() && page.is_shared() {
            return Err(EngineError::Invariant(format!(
                "map page {p} of volume '{}' is dirty and shared",
                vol.name()
            )));
        }
        if page.is_dirty() {
            let mut w = Writer::new(payload);
            match page.encoded_entries() {
                Some(entries) => entries.iter().for_each(|e| w.u64(*e)),
                None => (0..ENTRIES_PER_PAGE).for_each(|_| w.u64(0)),
            }
            // A map page names its volume's lineage: the trees that share it all
            // accept it (`page_share.rs`).
            let name = PageName::table(PageKind::Map, vol.lineage(), p);
            let at = wb.place(name, ENTRIES_PER_PAGE as u32, payload, page.durable())?;
            page.written(at);
            dirty_dirs.insert(p / PER_DIR);
        }
        if !page.durable().is_none() {
            map_refs.push((p, page.durable()));
        }
    }
    wb.write_tree(dirs, map.len(), &map_refs, dirty_dirs, vol.id())?;
    vol.tree_written();
    Ok(())
}

/// Encode every dirty page into fresh slots, or data blocks past them. Runs with
/// the gate held.
fn snapshot(inner: &Inner) -> Result<Snapshot> {
    let generation = inner.checkpointer.super_block().generation + 1;
    // No page dirty anywhere: a volume whose tree is as the last checkpoint wrote
    // it has nothing to write, and is not walked (a snapshot's checkpoints after the
    // first cost what changed, not the pages of every volume).
    let quiet = inner.checkpointer.quiet_since_settled()
        && inner.checkpointer.super_block().version == FORMAT_VERSION;
    // Every page dirty now is written by this snapshot.
    inner.checkpointer.dirty_pages_taken();
    let mut wb = Writeback {
        store: inner.checkpointer.page_store(),
        pages: Vec::new(),
        old_slots: inner.checkpointer.take_slots_to_free(),
        depot: &inner.depot,
        spare: Vec::new(),
        held_slab: None,
        spilled: false,
        nonce: inner.geometry.nonce(),
        generation,
    };
    let mut payload = vec![0u8; PAGE_PAYLOAD_BYTES];
    // Object count and fingerprint pages.
    let mut tables = ObjectTables::default();
    let mut pending = Vec::new();
    // Slabs never touched have no page, in memory or durable: the tables'
    // page numbers skip over them.
    let count_pages_per_slab = inner.depot.table_pages_per_slab(ObjTable::Counts);
    let fp_pages_per_slab = inner.depot.table_pages_per_slab(ObjTable::Fingerprints);
    for (s, slab) in inner.depot.touched() {
        let mut slab = slab.lock();
        tables.count_pages = u64::from(s) * count_pages_per_slab;
        tables.fp_pages = u64::from(s) * fp_pages_per_slab;
        let (objects, blocks) = slab.take_pending();
        if !objects.is_empty() || !blocks.is_empty() {
            pending.push((s, objects, blocks));
        }
        wb.held_slab = Some(s);
        wb.write_slab(s, &mut slab, &mut tables, &mut payload)?;
        wb.held_slab = None;
    }
    let slabs = u64::from(inner.geometry.slab_count());
    tables.count_pages = slabs * count_pages_per_slab;
    tables.fp_pages = slabs * fp_pages_per_slab;
    let mut count_dirs = inner.checkpointer.count_dirs();
    wb.write_tree(
        &mut count_dirs,
        tables.count_pages,
        &tables.counts,
        tables.count_dirty,
        OBJECT_TABLE_OWNER,
    )?;
    let mut fp_dirs = inner.checkpointer.fp_dirs();
    wb.write_tree(
        &mut fp_dirs,
        tables.fp_pages,
        &tables.fps,
        tables.fp_dirty,
        FINGERPRINT_TABLE_OWNER,
    )?;

    // Volumes.
    let volumes = inner.volumes.all();
    let mut records = Vec::new();
    for vol in volumes.iter() {
        // Only the pages in memory: a page never written has no durable copy.
        let map = vol.map_pages();
        let mut dirs = vol.dirs();
        let settled = quiet
            && !vol.tree_stale()
            && dirs.pages() == map.len()
            && dirs.marked() == 0
            && !vol.has_cleared_dirs();
        if !settled {
            write_map(&mut wb, vol, &map, &mut dirs, &mut payload)?;
        }
        let size_bytes = vol.size_blocks() * BLOCK_BYTES as u64;
        let (reservation_bytes, thin) = inner.volumes.reservations().record(vol.id(), size_bytes);
        records.push(VolumeRecord {
            slot: vol.slot(),
            id: vol.id(),
            name: vol.name(),
            size_bytes,
            reservation_bytes,
            thin,
            limited: vol.limited(),
            incomplete: vol.incomplete(),
            lineage: vol.lineage(),
            origin: vol.origin().unwrap_or(0),
            snapshot: vol.is_snapshot(),
            created: vol.created(),
            guid: vol.guid(),
            map: dirs.root(),
        });
    }

    // Catalog, rewritten whole.
    let catalog = Catalog {
        version: FORMAT_VERSION,
        next_volume_id: inner.volumes.next_id(),
        objects: count_dirs.root(),
        fingerprints: fp_dirs.root(),
        volumes: records,
    };
    let stream = catalog.encode();
    let mut sb = inner.checkpointer.super_block().clone();
    // Shared map pages and lineages: flag bit 7 while the catalog carries them.
    if catalog.has_lineage() {
        sb.flags |= FLAG_SHARED_MAPS;
    } else {
        sb.flags &= !FLAG_SHARED_MAPS;
    }
    let chunks = stream.len().div_ceil(PAGE_PAYLOAD_BYTES);
    if chunks > MAX_CATALOG_PAGES_V2 {
        return Err(EngineError::Refused(format!(
            "the catalog needs {chunks} pages (max {MAX_CATALOG_PAGES_V2})"
        )));
    }
    let mut catalog_refs = Vec::with_capacity(chunks);
    for (i, chunk) in stream.chunks(PAGE_PAYLOAD_BYTES).enumerate() {
        let old = sb.catalog.get(i).copied().unwrap_or_default();
        let name = PageName::table(PageKind::Catalog, 0, i as u64);
        catalog_refs.push(wb.place(name, chunk.len() as u32, chunk, old)?);
    }
    // Old catalog pages beyond the new catalog's length retire too.
    wb.old_slots
        .extend(sb.catalog.iter().skip(chunks).flat_map(page_addresses));
    // The pool's counters, when they changed since the page the pool has.
    let counters = inner.counters.to_write();
    if let Some(values) = &counters {
        payload.fill(0);
        let count = encode_counters(values, &mut payload);
        let name = PageName::table(PageKind::Counters, 0, 0);
        sb.counters = wb.place(name, count, &payload, sb.counters)?;
    }
    if wb.spilled {
        // Page references may now name data blocks (docs/format.md, flags).
        sb.flags |= FLAG_DATA_REGION_PAGES;
        let in_data_region = wb
            .pages
            .iter()
            .filter(|p| address_block(p.address).is_some())
            .count();
        inner
            .volumes
            .reservations()
            .taken_for_metadata(in_data_region as u64);
    }
    if sb.version == FORMAT_VERSION_1 {
        // This snapshot is the upgrade: every page above went to a free slot, or
        // past them to a free data block (bit 3 above).
        sb.flags |= FLAG_UPGRADED_FROM_V1;
        sb.upgraded_generation = generation;
    }
    sb.version = FORMAT_VERSION;
    sb.generation = generation;
    sb.catalog = catalog_refs;
    sb.catalog_bytes = stream.len() as u32;
    sb.journal_replay_seq = inner.journal.next_seq();
    Ok(Snapshot {
        pages: wb.pages,
        old_slots: wb.old_slots,
        pending,
        superblock: sb,
        counters,
        unused_blocks: wb.spare,
    })
}

fn write_snapshot(inner: &Inner, snap: &Snapshot) -> Result<()> {
    // The image refers to data written before the snapshot: make it durable first.
    inner.zones.flush(&inner.space())?;
    let r = inner.devices.data().flush();
    inner.devices.check_io(r)?;
    let mut sorted: Vec<&Encoded> = snap.pages.iter().collect();
    sorted.sort_by_key(|p| p.address);
    // Each page has its own block: the writes of one device go out as one batch,
    // which a device may keep in flight at once (an RBD image does). The page
    // store's first, then the data region's (bit 63): the order of the addresses.
    let mut to_data: Vec<(u64, &[u8])> = Vec::new();
    let mut to_meta: Vec<(u64, &[u8])> = Vec::with_capacity(sorted.len());
    for page in &sorted {
        match address_block(page.address) {
            Some(pbn) => {
                let at = inner.geometry.data_offset_bytes() + pbn * BLOCK_BYTES as u64;
                to_data.push((at, &page.bytes[..]));
            }
            None => {
                let block = inner.geometry.pages_start_block() + page.address;
                to_meta.push((block * BLOCK_BYTES as u64, &page.bytes[..]));
            }
        }
    }
    let in_data_region = !to_data.is_empty();
    for (device, writes) in [
        (inner.devices.meta(), &to_meta),
        (inner.devices.data(), &to_data),
    ] {
        if writes.is_empty() {
            continue;
        }
        let r = device.write_batch(writes);
        inner.devices.check_io(r)?;
    }
    for page in &sorted {
        inner.checkpointer.written().count_page(page.kind);
    }
    // One device: the flush below covers both regions.
    if in_data_region && inner.devices.separate_metadata() {
        let r = inner.devices.data().flush();
        inner.devices.check_io(r)?;
    }
    let r = inner.devices.meta().flush();
    inner.devices.check_io(r)?;
    let mut block = [0u8; BLOCK_BYTES];
    snap.superblock.encode(&mut block);
    let copy = snap.superblock.generation % 2;
    let r = inner
        .devices
        .meta()
        .write_at(&block, copy * BLOCK_BYTES as u64);
    inner.devices.check_io(r)?;
    inner.checkpointer.written().count_super_block();
    let r = inner.devices.meta().flush();
    inner.devices.check_io(r)?;
    Ok(())
}

/// The commit thread: each group commit the journal asks for, and a checkpoint
/// when one is due.
pub(crate) fn commit_loop(inner: &Inner) {
    loop {
        match inner.journal.next_work() {
            Work::Shutdown => return,
            Work::Commit => {
                if inner.commit().is_ok()
                    && (inner.journal.wants_checkpoint() || inner.page_store_pressed())
                {
                    inner.journal.request_checkpoint();
                }
            }
            Work::Checkpoint => {
                if let Err(e) = checkpoint(inner) {
                    tracing::error!("checkpoint failed: {e}");
                }
            }
            Work::Idle => {}
        }
        // The damaged blocks known, if they changed, about once a second.
        crate::damage_hint::save(inner, false);
    }
}
