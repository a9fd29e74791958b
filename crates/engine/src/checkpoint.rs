//! Checkpoints: the durable image of every table, written copy-on-write.
//!
//! A checkpoint snapshots every dirty page (block-map pages, slab object pages)
//! under the pool's gate, so the image is exactly the state after a known journal
//! position. Pages go to fresh page-store slots, never over the slots the previous
//! checkpoint uses; then directory pages, then the catalog, then the super block
//! copy `generation % 2`. Until that last write lands, the previous checkpoint and
//! its journal are intact; after it, the old slots and the blocks freed before the
//! snapshot become reusable.

use crate::block_map::ENTRIES_PER_PAGE;
use crate::pool::Inner;
use crate::slab::ObjRec;
use crate::{EngineError, Result};
use fewerbytes_format::catalog::{Catalog, VolumeRecord};
use fewerbytes_format::page::{
    decode_page, encode_page, ObjectRecord, PageHeader, PageKind, OBJECTS_PER_PAGE,
    PAGE_PAYLOAD_BYTES, SLOTS_PER_DIR_PAGE,
};
use fewerbytes_format::superblock::{SuperBlock, MAX_CATALOG_PAGES};
use fewerbytes_format::{Reader, Writer, BLOCK_BYTES};
use parking_lot::RwLockWriteGuard;
use std::sync::atomic::Ordering;

/// Owner id of the slab object table's directory pages.
pub const OBJECT_TABLE_OWNER: u64 = u64::MAX;

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
}

/// One page ready to write.
struct Encoded {
    slot: u32,
    kind: PageKind,
    bytes: Box<[u8; BLOCK_BYTES]>,
}

/// What a snapshot produced.
struct Snapshot {
    pages: Vec<Encoded>,
    old_slots: Vec<u32>,
    pending: Vec<(u32, Vec<u32>, Vec<u32>)>,
    superblock: SuperBlock,
}

/// The pages a snapshot writes: each goes to a fresh slot, and the slot it replaces
/// is retired once the snapshot is durable.
struct Writeback<'a> {
    store: parking_lot::MutexGuard<'a, PageStore>,
    pages: Vec<Encoded>,
    old_slots: Vec<u32>,
    nonce: u64,
    generation: u64,
}

impl Writeback<'_> {
    /// Encode one page into a fresh slot, retiring `current` (0: none). Returns the slot.
    fn place(
        &mut self,
        kind: PageKind,
        owner: u64,
        index: u64,
        count: u32,
        payload: &[u8],
        current: u32,
    ) -> Result<u32> {
        // Sizing and the dirty-page trigger keep the store from running out; if it
        // does, the checkpoint cannot complete, and the pool must stop taking writes
        // rather than retry forever.
        let slot = self.store.alloc().ok_or_else(|| {
            EngineError::NoSpace("the metadata page store has no free slot for a checkpoint".into())
        })?;
        let header = PageHeader {
            kind,
            count,
            nonce: self.nonce,
            slot: u64::from(slot),
            generation: self.generation,
            owner,
            index,
        };
        let mut bytes = Box::new([0u8; BLOCK_BYTES]);
        encode_page(&header, payload, &mut bytes);
        self.pages.push(Encoded { slot, kind, bytes });
        if current != 0 {
            self.old_slots.push(current);
        }
        Ok(slot)
    }

    /// Rewrite the directory pages of a table whose range of `slots` changed
    /// (`dirty[k]`: a page under directory page `k` moved), or that were never written.
    fn write_dirs(
        &mut self,
        dirs: &mut Vec<u32>,
        slots: &[u32],
        dirty: &[bool],
        owner: u64,
    ) -> Result<()> {
        let want = slots.len().div_ceil(SLOTS_PER_DIR_PAGE);
        while dirs.len() > want {
            if let Some(s) = dirs.pop() {
                self.old_slots.push(s);
            }
        }
        dirs.resize(want, 0);
        let mut payload = vec![0u8; PAGE_PAYLOAD_BYTES];
        for (k, chunk) in slots.chunks(SLOTS_PER_DIR_PAGE).enumerate() {
            let Some(current) = dirs.get_mut(k) else {
                continue;
            };
            let unwritten = *current == 0 && chunk.iter().any(|s| *s != 0);
            if !dirty.get(k).copied().unwrap_or(false) && !unwritten {
                continue;
            }
            payload.fill(0);
            let mut w = Writer::new(&mut payload);
            chunk.iter().for_each(|s| w.u32(*s));
            *current = self.place(
                PageKind::Directory,
                owner,
                k as u64,
                chunk.len() as u32,
                &payload,
                *current,
            )?;
        }
        Ok(())
    }
}

impl Inner {
    /// Take a checkpoint (the commit thread, or a caller holding no pool locks).
    pub(crate) fn checkpoint(&self) -> Result<()> {
        let _ck = self.checkpoint_lock.lock();
        let gate = self.gate.write();
        self.checkpoint_locked(gate, false)
    }

    /// Take a checkpoint with the gate held; with `hold`, keep it until the super
    /// block is durable (volume operations, which are not journalled).
    pub(crate) fn checkpoint_locked(
        &self,
        gate: RwLockWriteGuard<'_, ()>,
        hold: bool,
    ) -> Result<()> {
        if let Some(why) = self.journal.failure() {
            return Err(EngineError::ReadOnly(why));
        }
        // No commit may be in flight while the replay point is chosen: its records are
        // in the image, and replaying them again on top of it would count them twice.
        let commit_guard = self.commit_lock.lock();
        let batch = self.journal.take_batch();
        let snapshot = match self.snapshot() {
            Ok(s) => s,
            Err(e) => {
                // A checkpoint that cannot be taken cannot be retried into success:
                // stop taking writes (journal space would never come back).
                self.latch_with(format!("latched read-only: a checkpoint failed: {e}"));
                return Err(e);
            }
        };
        drop(commit_guard);
        let guard = if hold {
            Some(gate)
        } else {
            drop(gate);
            None
        };
        let result = self.write_snapshot(&snapshot);
        drop(guard);
        if let Err(e) = result {
            self.latch(&e);
            return Err(e);
        }
        {
            let mut store = self.page_store.lock();
            for s in &snapshot.old_slots {
                store.free(u64::from(*s));
            }
        }
        for (s, objects, blocks) in &snapshot.pending {
            self.slab(*s).lock().release(objects, blocks);
        }
        *self.sb.lock() = snapshot.superblock.clone();
        self.journal.batch_durable(&batch, 0);
        self.journal
            .checkpointed(snapshot.superblock.journal_replay_seq);
        self.checkpoints.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Encode every dirty page into fresh slots. Runs with the gate held.
    fn snapshot(&self) -> Result<Snapshot> {
        let generation = self.sb.lock().generation + 1;
        // Every page dirty now is written by this snapshot.
        self.dirty_pages.store(0, Ordering::Relaxed);
        let mut wb = Writeback {
            store: self.page_store.lock(),
            pages: Vec::new(),
            old_slots: std::mem::take(&mut *self.slots_to_free.lock()),
            nonce: self.nonce,
            generation,
        };
        let mut payload = vec![0u8; PAGE_PAYLOAD_BYTES];

        // Slab object pages.
        let pages_per_slab = self.objects_per_slab as usize / OBJECTS_PER_PAGE;
        let mut object_slots: Vec<u32> =
            Vec::with_capacity(self.slab_count as usize * pages_per_slab);
        let mut object_dirty_dirs =
            vec![false; (self.slab_count as usize * pages_per_slab).div_ceil(SLOTS_PER_DIR_PAGE)];
        let mut pending = Vec::new();
        for s in 0..self.slab_count {
            let mut slab = self.slab(s).lock();
            let (objects, blocks) = slab.take_pending();
            if !objects.is_empty() || !blocks.is_empty() {
                pending.push((s, objects, blocks));
            }
            for (p, page) in slab.pages.iter_mut().enumerate() {
                let Some(page) = page else {
                    object_slots.push(0);
                    continue;
                };
                if page.dirty {
                    let mut w = Writer::new(&mut payload);
                    for r in page.recs.iter() {
                        ObjectRecord {
                            location: r.location,
                            refcount: r.refcount,
                            fingerprint: r.fingerprint,
                        }
                        .encode(&mut w);
                    }
                    page.slot = wb.place(
                        PageKind::Objects,
                        u64::from(s),
                        p as u64,
                        OBJECTS_PER_PAGE as u32,
                        &payload,
                        page.slot,
                    )?;
                    page.dirty = false;
                    if let Some(d) = object_dirty_dirs
                        .get_mut((s as usize * pages_per_slab + p) / SLOTS_PER_DIR_PAGE)
                    {
                        *d = true;
                    }
                }
                object_slots.push(page.slot);
            }
        }
        let mut object_dirs = self.object_dir_slots.lock();
        wb.write_dirs(
            &mut object_dirs,
            &object_slots,
            &object_dirty_dirs,
            OBJECT_TABLE_OWNER,
        )?;

        // Volumes.
        let volumes = self.volumes.read();
        let mut records = Vec::new();
        for vol in volumes.iter().flatten() {
            let map = vol.pages.read();
            let mut map_slots = Vec::with_capacity(map.len());
            let mut dirty_dirs = vec![false; map.len().div_ceil(SLOTS_PER_DIR_PAGE)];
            for (p, page) in map.iter().enumerate() {
                let mut page = page.lock();
                if page.dirty {
                    let mut w = Writer::new(&mut payload);
                    match &page.entries {
                        Some(entries) => entries.iter().for_each(|e| w.u64(*e)),
                        None => (0..ENTRIES_PER_PAGE).for_each(|_| w.u64(0)),
                    }
                    page.slot = wb.place(
                        PageKind::Map,
                        vol.id,
                        p as u64,
                        ENTRIES_PER_PAGE as u32,
                        &payload,
                        page.slot,
                    )?;
                    page.dirty = false;
                    if let Some(d) = dirty_dirs.get_mut(p / SLOTS_PER_DIR_PAGE) {
                        *d = true;
                    }
                }
                map_slots.push(page.slot);
            }
            let mut dirs = vol.dir_slots.lock();
            wb.write_dirs(&mut dirs, &map_slots, &dirty_dirs, vol.id)?;
            records.push(VolumeRecord {
                slot: vol.slot,
                id: vol.id,
                name: vol.name.clone(),
                size_bytes: vol.size_blocks() * BLOCK_BYTES as u64,
                map_dir_slots: dirs.clone(),
            });
        }

        // Catalog, rewritten whole.
        let catalog = Catalog {
            next_volume_id: self.next_volume_id.load(Ordering::Relaxed),
            object_dir_slots: object_dirs.clone(),
            volumes: records,
        };
        let stream = catalog.encode();
        let mut sb = self.sb.lock().clone();
        let chunks = stream.len().div_ceil(PAGE_PAYLOAD_BYTES);
        if chunks > MAX_CATALOG_PAGES {
            return Err(EngineError::Refused(format!(
                "the catalog needs {chunks} pages (max {MAX_CATALOG_PAGES})"
            )));
        }
        let mut catalog_slots = Vec::with_capacity(chunks);
        for (i, chunk) in stream.chunks(PAGE_PAYLOAD_BYTES).enumerate() {
            let old = sb.catalog_slots.get(i).copied().unwrap_or(0);
            catalog_slots.push(wb.place(
                PageKind::Catalog,
                0,
                i as u64,
                chunk.len() as u32,
                chunk,
                old,
            )?);
        }
        // Old catalog pages beyond the new catalog's length retire too.
        wb.old_slots.extend(
            sb.catalog_slots
                .iter()
                .skip(chunks)
                .copied()
                .filter(|s| *s != 0),
        );
        sb.generation = generation;
        sb.catalog_slots = catalog_slots;
        sb.catalog_bytes = stream.len() as u32;
        sb.journal_replay_seq = self.journal.next_seq();
        Ok(Snapshot {
            pages: wb.pages,
            old_slots: wb.old_slots,
            pending,
            superblock: sb,
        })
    }

    fn write_snapshot(&self, snap: &Snapshot) -> Result<()> {
        // The image refers to data written before the snapshot: make it durable first.
        self.flush_packers()?;
        let r = self.data.flush();
        self.check_io(r)?;
        let mut sorted: Vec<&Encoded> = snap.pages.iter().collect();
        sorted.sort_by_key(|p| p.slot);
        for page in sorted {
            let at = (self.pages_start_block + u64::from(page.slot)) * BLOCK_BYTES as u64;
            let r = self.meta.write_at(&page.bytes[..], at);
            self.check_io(r)?;
            self.meta_written.count_page(page.kind);
        }
        let r = self.meta.flush();
        self.check_io(r)?;
        let mut block = [0u8; BLOCK_BYTES];
        snap.superblock.encode(&mut block);
        let copy = snap.superblock.generation % 2;
        let r = self.meta.write_at(&block, copy * BLOCK_BYTES as u64);
        self.check_io(r)?;
        self.meta_written
            .super_bytes
            .fetch_add(BLOCK_BYTES as u64, Ordering::Relaxed);
        let r = self.meta.flush();
        self.check_io(r)?;
        Ok(())
    }

    fn read_page<'a>(
        &self,
        buf: &'a mut [u8; BLOCK_BYTES],
        kind: PageKind,
        slot: u32,
        owner: u64,
        index: u64,
    ) -> Result<(PageHeader, &'a [u8])> {
        let block = self.pages_start_block + u64::from(slot);
        let corrupt = |reason: String| EngineError::Corrupt {
            region: kind.name(),
            block,
            device: "metadata",
            reason,
        };
        if slot == 0 || u64::from(slot) >= self.page_slots {
            return Err(corrupt(format!(
                "page slot {slot} is outside the page store"
            )));
        }
        self.meta
            .read_at(&mut buf[..], block * BLOCK_BYTES as u64)?;
        let (header, payload) = decode_page(&buf[..], kind, self.nonce, u64::from(slot))
            .map_err(|e| corrupt(e.to_string()))?;
        if header.owner != owner || header.index != index {
            return Err(corrupt(format!(
                "page names owner {} index {}, expected owner {owner} index {index}",
                header.owner, header.index
            )));
        }
        if header.generation > self.sb.lock().generation {
            return Err(corrupt(format!(
                "page generation {} is newer than the super block's",
                header.generation
            )));
        }
        self.page_store.lock().mark(u64::from(slot));
        Ok((header, payload))
    }

    fn read_dirs(&self, dirs: &[u32], owner: u64, entries: usize) -> Result<Vec<u32>> {
        let mut slots = Vec::with_capacity(entries);
        let mut buf = Box::new([0u8; BLOCK_BYTES]);
        for (k, &d) in dirs.iter().enumerate() {
            let want = (entries - slots.len()).min(SLOTS_PER_DIR_PAGE);
            if d == 0 {
                slots.extend(std::iter::repeat_n(0, want));
                continue;
            }
            let (_, payload) = self.read_page(&mut buf, PageKind::Directory, d, owner, k as u64)?;
            let mut r = Reader::new("directory page", payload);
            for _ in 0..want {
                slots.push(r.u32()?);
            }
        }
        slots.resize(entries, 0);
        Ok(slots)
    }

    /// Load the catalog named by the super block.
    pub(crate) fn load_catalog(&self) -> Result<Catalog> {
        let sb = self.sb.lock().clone();
        let mut stream = Vec::with_capacity(sb.catalog_bytes as usize);
        let mut buf = Box::new([0u8; BLOCK_BYTES]);
        for (i, &slot) in sb.catalog_slots.iter().enumerate() {
            let (header, payload) =
                self.read_page(&mut buf, PageKind::Catalog, slot, 0, i as u64)?;
            stream.extend_from_slice(payload.get(..header.count as usize).unwrap_or(payload));
        }
        stream.truncate(sb.catalog_bytes as usize);
        Catalog::decode(&stream).map_err(|e| EngineError::Corrupt {
            region: "catalog",
            block: sb.pages_start_block + u64::from(sb.catalog_slots.first().copied().unwrap_or(0)),
            device: "metadata",
            reason: e.to_string(),
        })
    }

    /// Load every slab's object pages.
    pub(crate) fn load_objects(&self, object_dirs: &[u32]) -> Result<()> {
        let pages_per_slab = self.objects_per_slab as usize / OBJECTS_PER_PAGE;
        let total = self.slab_count as usize * pages_per_slab;
        let slots = self.read_dirs(object_dirs, OBJECT_TABLE_OWNER, total)?;
        let mut buf = Box::new([0u8; BLOCK_BYTES]);
        for (g, &slot) in slots.iter().enumerate() {
            if slot == 0 {
                continue;
            }
            let (s, p) = ((g / pages_per_slab) as u32, g % pages_per_slab);
            let (_, payload) =
                self.read_page(&mut buf, PageKind::Objects, slot, u64::from(s), p as u64)?;
            let mut r = Reader::new("slab object page", payload);
            let mut slab = self.slab(s).lock();
            for i in 0..OBJECTS_PER_PAGE {
                let rec = ObjectRecord::decode(&mut r)?;
                if rec.refcount == 0 && rec.location == 0 {
                    continue;
                }
                if let Some(m) = slab.rec_mut((p * OBJECTS_PER_PAGE + i) as u32) {
                    *m = ObjRec {
                        location: rec.location,
                        refcount: rec.refcount,
                        fingerprint: rec.fingerprint,
                    };
                }
            }
            if let Some(Some(page)) = slab.pages.get_mut(p) {
                page.slot = slot;
                page.dirty = false;
            } else if let Some(page) = slab.pages.get_mut(p) {
                // An all-free page: keep its slot so the next checkpoint can retire it.
                let mut fresh = crate::slab::ObjPage {
                    recs: Box::new([ObjRec::default(); OBJECTS_PER_PAGE]),
                    dirty: false,
                    slot,
                };
                fresh.dirty = false;
                *page = Some(fresh);
            }
        }
        Ok(())
    }

    /// Load one volume's block map.
    pub(crate) fn load_map(
        &self,
        record: &VolumeRecord,
        vol: &crate::block_map::VolumeState,
    ) -> Result<()> {
        let pages_len = vol.pages.read().len();
        let slots = self.read_dirs(&record.map_dir_slots, record.id, pages_len)?;
        let mut buf = Box::new([0u8; BLOCK_BYTES]);
        let pages = vol.pages.read();
        for (p, &slot) in slots.iter().enumerate() {
            if slot == 0 {
                continue;
            }
            let (_, payload) =
                self.read_page(&mut buf, PageKind::Map, slot, record.id, p as u64)?;
            let mut r = Reader::new("block map page", payload);
            if let Some(page) = pages.get(p) {
                let mut page = page.lock();
                let mut entries = Box::new([0u64; ENTRIES_PER_PAGE as usize]);
                for e in entries.iter_mut() {
                    *e = r.u64()?;
                }
                page.entries = Some(entries);
                page.slot = slot;
                page.dirty = false;
            }
        }
        *vol.dir_slots.lock() = record.map_dir_slots.clone();
        Ok(())
    }
}
