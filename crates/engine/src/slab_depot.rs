//! The slab depot: every slab of the pool, each behind its own lock (the physical
//! zone's unit), the object reference counts kept in them, the free-space check, and
//! the dedup advice with its verification (`advice.rs`).
//!
//! Advice from the index is never trusted: a candidate becomes a duplicate only if its
//! record, under its slab's lock, still holds the same full fingerprint and can take
//! one more reference. A count reaching zero frees the object, which leaves the index;
//! a count below zero is a broken invariant and latches the pool read-only.
//!
//! Blocks freed between checkpoints become allocatable only after the checkpoint
//! that frees them is durable; just before, they are given back to the data device
//! (`release_pending`): a hole punched in a pool file, a discard on an SSD or thin
//! volume. Nothing durable names them then, and nothing can allocate them yet.

use crate::devices::Devices;
use crate::geometry::{metadata_headroom_of, PoolGeometry, SLAB_BLOCKS};
use crate::index::DedupIndex;
use crate::slab::{ObjRec, ObjTable, Slab};
use crate::{EngineError, Result};
use fewerbytes_format::location::{Location, ObjectId};
use fewerbytes_format::BLOCK_BYTES;
use fewerbytes_storage::DiscardOutcome;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Every slab of the pool, each behind its own lock (the physical zone's unit), and
/// the arithmetic between object ids, slabs and data blocks.
pub(crate) struct SlabDepot {
    /// Room for every slab the pool may grow to (`pool grow`); of the first `count`,
    /// those touched so far are set (`slab` makes one on first use: a slab that
    /// never held anything costs this cell alone, so an empty 256 TiB pool does not
    /// hold 8 million slab headers). A slab, once set, never moves, so a reference
    /// to it stays good while slabs are added.
    slabs: Vec<OnceLock<Box<Mutex<Slab>>>>,
    count: AtomicU32,
    objects_per_slab: u32,
    data_blocks: AtomicU64,
    /// Pages the slabs turn dirty (for slabs added by a grow).
    dirty_pages: Arc<AtomicU64>,
    /// Advice on where a fingerprint was stored (hash zones).
    index: DedupIndex,
    /// Fragments freed since the compactor last looked.
    fragment_frees: AtomicU64,
    /// Whether data leaves each slab a headroom for metadata pages (flags bit 3).
    data_region_pages: bool,
    /// Blocks data leaves free for metadata pages, over all slabs.
    metadata_headroom: AtomicU64,
    /// Data blocks, and headroom blocks, of the slabs touched so far: the rest
    /// are free whole. Added to before a new slab is published, so a walk that
    /// meets it midway counts its blocks at worst as not free.
    touched_blocks: AtomicU64,
    touched_headroom: AtomicU64,
    /// Objects reads found damaged, which a write of their data heals (`heal.rs`).
    damaged: crate::heal::DamagedObjects,
}

impl SlabDepot {
    /// Empty slabs laid out as `geometry` says; pages they turn dirty count in
    /// `dirty_pages`. The index holds the window the pool records, or takes
    /// `index_memory` bytes when given (a budget for this open). `max_slabs`: the
    /// most slabs the pool may grow to while open (at least the geometry's); the
    /// index's object groups are sized for them.
    pub(crate) fn new(
        geometry: &PoolGeometry,
        dirty_pages: &Arc<AtomicU64>,
        index_memory: Option<u64>,
        max_slabs: u32,
    ) -> Self {
        let count = geometry.slab_count();
        let slabs: Vec<OnceLock<Box<Mutex<Slab>>>> =
            (0..count.max(max_slabs)).map(|_| OnceLock::new()).collect();
        let objects = slabs.len() as u64 * u64::from(geometry.objects_per_slab());
        let mode = geometry.index_mode();
        let index = match index_memory {
            Some(bytes) => DedupIndex::with_memory(bytes, objects, mode),
            None => DedupIndex::with_mode(geometry.index_entries(), objects, mode),
        };
        let depot = SlabDepot {
            slabs,
            count: AtomicU32::new(0),
            objects_per_slab: geometry.objects_per_slab(),
            data_blocks: AtomicU64::new(0),
            dirty_pages: dirty_pages.clone(),
            index,
            fragment_frees: AtomicU64::new(0),
            data_region_pages: geometry.data_region_pages(),
            metadata_headroom: AtomicU64::new(0),
            touched_blocks: AtomicU64::new(0),
            touched_headroom: AtomicU64::new(0),
            damaged: crate::heal::DamagedObjects::default(),
        };
        depot.grow(geometry.data_blocks());
        depot
    }

    /// Slabs a data region of `data_blocks` is cut into.
    pub(crate) fn slabs_for(data_blocks: u64) -> u64 {
        data_blocks.div_ceil(u64::from(SLAB_BLOCKS))
    }

    /// Extend the data region to `data_blocks`: the last slab takes the blocks up to
    /// its full size, new empty slabs the rest. Returns false, changing nothing, past
    /// the slabs the depot has room for. Callers hold the gate for writing (no
    /// allocation runs), and the geometry follows only after (`grow.rs`).
    pub(crate) fn grow(&self, data_blocks: u64) -> bool {
        let old_blocks = self.data_blocks.load(Ordering::Acquire);
        let old_count = self.count();
        let new_count = Self::slabs_for(data_blocks);
        if data_blocks < old_blocks || new_count > self.slabs.len() as u64 {
            return false;
        }
        if let Some(last) = old_count.checked_sub(1) {
            // The old last slab takes the blocks up to its full size: made now if it
            // was never touched, so that it is not made later at its old length.
            let mut slab = self.slab(last).lock();
            let (blocks_before, before) =
                (slab.block_count(), self.headroom_of(slab.block_count()));
            slab.grow_blocks(Self::blocks_of(data_blocks, u64::from(last)));
            let after = self.headroom_of(slab.block_count());
            slab.set_metadata_headroom(after);
            let added_headroom = u64::from(after - before.min(after));
            self.metadata_headroom
                .fetch_add(added_headroom, Ordering::AcqRel);
            self.touched_headroom
                .fetch_add(added_headroom, Ordering::AcqRel);
            self.touched_blocks.fetch_add(
                u64::from(slab.block_count() - blocks_before),
                Ordering::AcqRel,
            );
        }
        // New slabs are made when first touched (`slab`); only their headroom is
        // counted now.
        let added: u64 = (u64::from(old_count)..new_count)
            .map(|s| u64::from(self.headroom_of(Self::blocks_of(data_blocks, s))))
            .sum();
        self.metadata_headroom.fetch_add(added, Ordering::AcqRel);
        self.data_blocks.store(data_blocks, Ordering::Release);
        self.count.store(new_count as u32, Ordering::Release);
        true
    }

    /// Blocks of slab `s` in a data region of `data_blocks` (the last may be short).
    fn blocks_of(data_blocks: u64, s: u64) -> u32 {
        let slab_blocks = u64::from(SLAB_BLOCKS);
        (data_blocks - s * slab_blocks).min(slab_blocks) as u32
    }

    /// Blocks a slab of `blocks` leaves free for metadata pages.
    fn headroom_of(&self, blocks: u32) -> u32 {
        if self.data_region_pages {
            metadata_headroom_of(blocks)
        } else {
            0
        }
    }

    /// After a durable checkpoint: make the blocks and objects it freed (`pending`,
    /// per slab, from its snapshot) allocatable, first discarding the freed blocks on
    /// the data device in runs of adjacent blocks (one call per run). Under the
    /// slab's lock, so no block is allocated between its discard and its release. A
    /// failed discard is logged and changes nothing else: the blocks stay allocated
    /// on the device, as they were before discards.
    pub(crate) fn release_pending(
        &self,
        devices: &Devices,
        geometry: &PoolGeometry,
        pending: &[(u32, Vec<u32>, Vec<u32>)],
    ) {
        for (s, objects, blocks) in pending {
            let mut slab = self.slab(*s).lock();
            let mut freed: Vec<u32> = blocks
                .iter()
                .copied()
                .filter(|&b| slab.holders(b) == 0 && slab.block_used(b))
                .collect();
            freed.sort_unstable();
            freed.dedup();
            for (first, count) in block_runs(&freed) {
                let offset_bytes =
                    geometry.data_offset_bytes() + self.pbn(*s, first) * BLOCK_BYTES as u64;
                let len_bytes = u64::from(count) * BLOCK_BYTES as u64;
                match devices.data().discard(offset_bytes, len_bytes) {
                    Ok(DiscardOutcome::Discarded) => {}
                    // Off, or a device that cannot: asking again costs nothing.
                    Ok(DiscardOutcome::Disabled | DiscardOutcome::Unsupported) => break,
                    Err(e) => {
                        tracing::warn!("a discard of freed blocks failed (they stay allocated on the device): {e}");
                        break;
                    }
                }
            }
            slab.release(objects, blocks);
        }
    }

    /// Take up to `n` free data blocks for metadata pages (a checkpoint whose pages
    /// outnumber the page store's free slots), from the last slab backwards: the
    /// zones fill slabs from the front. A checkpoint's snapshot may hold one slab's
    /// lock while it asks (`held`): that slab is passed over (the snapshot takes its
    /// blocks itself). Every other slab is waited for: a write beside the checkpoint
    /// holds a slab only while it allocates, and passing it over failed checkpoints
    /// of pools whose only slab with free blocks was locked that moment. No holder of
    /// a slab's lock waits for another slab or for the checkpoint. Each
    /// block is allocated with no holder, so no packer, compaction or dedup can hand
    /// it out; unused ones come back through [`Self::return_unused_blocks`]. Returns
    /// the PBNs taken (fewer when fewer are free).
    pub(crate) fn take_metadata_blocks(&self, n: u64, held: Option<u32>) -> Vec<u64> {
        let mut taken = Vec::new();
        for s in (0..self.count()).rev() {
            if taken.len() as u64 >= n {
                break;
            }
            if held == Some(s) {
                continue;
            }
            let mut slab = self.slab(s).lock();
            while (taken.len() as u64) < n {
                let Some(b) = slab.alloc_block_for_metadata() else {
                    break;
                };
                taken.push(self.pbn(s, b));
            }
        }
        taken
    }

    /// Free data blocks taken by [`Self::take_metadata_blocks`] that no page was
    /// written to: nothing durable or in flight names them.
    pub(crate) fn return_unused_blocks(&self, pbns: &[u64]) {
        for (s, blocks) in self.by_slab_blocks(pbns) {
            self.slab(s).lock().release(&[], &blocks);
        }
    }

    /// After a durable checkpoint: data blocks whose pages it moved (their addresses
    /// left the image) are discarded and become free, as blocks of freed data do.
    pub(crate) fn release_metadata_blocks(
        &self,
        devices: &Devices,
        geometry: &PoolGeometry,
        pbns: &[u64],
    ) {
        let pending: Vec<(u32, Vec<u32>, Vec<u32>)> = self
            .by_slab_blocks(pbns)
            .into_iter()
            .map(|(s, blocks)| (s, Vec::new(), blocks))
            .collect();
        self.release_pending(devices, geometry, &pending);
    }

    /// At open, and after a repair's rebuild (which derive allocation from the object
    /// records alone): mark the data blocks that hold metadata pages allocated. A
    /// block outside the data region, or one an object's data also lies in, is
    /// corruption: two owners would overwrite each other.
    pub(crate) fn hold_metadata_blocks(&self, geometry: &PoolGeometry, pbns: &[u64]) -> Result<()> {
        let data_start_block = geometry.data_offset_bytes() / BLOCK_BYTES as u64;
        for &pbn in pbns {
            let corrupt = |reason: String| EngineError::Corrupt {
                region: "metadata page in the data region",
                block: data_start_block + pbn,
                device: "data",
                reason,
            };
            let data_blocks = self.data_blocks.load(Ordering::Acquire);
            if pbn >= data_blocks {
                return Err(corrupt(format!(
                    "data block {pbn} is past the data region's {data_blocks} blocks"
                )));
            }
            let s = (pbn / u64::from(SLAB_BLOCKS)) as u32;
            let b = (pbn % u64::from(SLAB_BLOCKS)) as u32;
            let mut slab = self.slab(s).lock();
            if slab.holders(b) > 0 {
                return Err(corrupt(format!(
                    "data block {pbn} holds a metadata page and stored data"
                )));
            }
            slab.claim_block_at(b);
        }
        Ok(())
    }

    /// Blocks data leaves free for metadata pages in the whole pool.
    pub(crate) fn metadata_headroom_blocks(&self) -> u64 {
        self.metadata_headroom.load(Ordering::Acquire)
    }

    /// Free data blocks in the whole pool (each slab touched locked in turn; one
    /// never touched is free whole).
    pub(crate) fn free_blocks(&self) -> u64 {
        let touched: u64 = self
            .touched()
            .map(|(_, slab)| u64::from(slab.lock().free_blocks()))
            .sum();
        touched + self.untouched_blocks().0
    }

    /// The slabs never touched: (their blocks, the part of them data may take:
    /// all but their metadata headroom). Every one of their blocks is free.
    pub(crate) fn untouched_blocks(&self) -> (u64, u64) {
        let blocks = self
            .data_blocks
            .load(Ordering::Acquire)
            .saturating_sub(self.touched_blocks.load(Ordering::Acquire));
        let headroom = self
            .metadata_headroom
            .load(Ordering::Acquire)
            .saturating_sub(self.touched_headroom.load(Ordering::Acquire));
        (blocks, blocks.saturating_sub(headroom))
    }

    /// Data blocks grouped by slab: (slab, its local block numbers).
    fn by_slab_blocks(&self, pbns: &[u64]) -> Vec<(u32, Vec<u32>)> {
        let mut groups: std::collections::BTreeMap<u32, Vec<u32>> = Default::default();
        let data_blocks = self.data_blocks.load(Ordering::Acquire);
        for &pbn in pbns.iter().filter(|&&p| p < data_blocks) {
            groups
                .entry((pbn / u64::from(SLAB_BLOCKS)) as u32)
                .or_default()
                .push((pbn % u64::from(SLAB_BLOCKS)) as u32);
        }
        groups.into_iter().collect()
    }

    /// Slab `s`, made (empty) on its first use.
    pub(crate) fn slab(&self, s: u32) -> &Mutex<Slab> {
        // Slab numbers come from `order` and from objects checked by `valid_object`
        // (every map entry at open, every journal record at replay): one past the end
        // is a bug, and must not wrap round to another slab's records.
        let count = self.count();
        let cell = self
            .slabs
            .get(s as usize)
            .filter(|_| s < count)
            .unwrap_or_else(|| panic!("slab {s} does not exist: the pool has {count}"));
        cell.get_or_init(|| {
            // `grow` stores the region's blocks before the count (Release), so a
            // slab below the count sees the blocks that include it.
            let data_blocks = self.data_blocks.load(Ordering::Acquire);
            let blocks = Self::blocks_of(data_blocks, u64::from(s));
            let mut slab = Slab::new(
                s,
                u64::from(s) * u64::from(SLAB_BLOCKS),
                blocks,
                self.objects_per_slab,
                self.dirty_pages.clone(),
            );
            let headroom = self.headroom_of(blocks);
            slab.set_metadata_headroom(headroom);
            self.touched_blocks
                .fetch_add(u64::from(blocks), Ordering::AcqRel);
            self.touched_headroom
                .fetch_add(u64::from(headroom), Ordering::AcqRel);
            Box::new(Mutex::new(slab))
        })
    }

    /// Slabs in the pool.
    pub(crate) fn count(&self) -> u32 {
        self.count.load(Ordering::Acquire)
    }

    /// The most slabs the depot has room for (`pool grow`).
    pub(crate) fn capacity(&self) -> u32 {
        self.slabs.len() as u32
    }

    /// Every slab touched so far, in order, with its number. The others hold
    /// nothing: a walk that needs their (empty) state derives it from their length.
    pub(crate) fn touched(&self) -> impl Iterator<Item = (u32, &Mutex<Slab>)> + '_ {
        self.slabs
            .iter()
            .take(self.count() as usize)
            .enumerate()
            .filter_map(|(s, cell)| cell.get().map(|b| (s as u32, &**b)))
    }

    /// Pages of `table` per slab (every slab has the same object slots).
    pub(crate) fn table_pages_per_slab(&self, table: ObjTable) -> u64 {
        (self.objects_per_slab as usize).div_ceil(table.records_per_page()) as u64
    }

    /// Slabs in the order zone `zone` of `zones` tries them: its own first, then the rest.
    pub(crate) fn order(&self, zone: usize, zones: usize) -> impl Iterator<Item = u32> + '_ {
        let n = self.count() as usize;
        let own = (zone % zones..n).step_by(zones);
        let rest = (0..n).filter(move |s| s % zones != zone % zones);
        own.chain(rest).map(|s| s as u32)
    }

    /// The slab of an object and its record's index there.
    pub(crate) fn split_object(&self, o: ObjectId) -> (u32, u32) {
        (
            (o.0 / u64::from(self.objects_per_slab)) as u32,
            (o.0 % u64::from(self.objects_per_slab)) as u32,
        )
    }

    /// Set the fingerprint of object `o`, stored new by a write step whose record now
    /// stores it (it was `slab.rs: FINGERPRINT_IN_FLIGHT`).
    pub(crate) fn set_fingerprint(&self, o: ObjectId, fp: &[u8; 32]) -> Result<()> {
        let (s, i) = self.split_object(o);
        let mut slab = self.slab(s).lock();
        let rec = slab.rec_mut_stored(i).ok_or_else(|| {
            EngineError::Invariant(format!("object {} stored new has no record", o.0))
        })?;
        rec.fingerprint = *fp;
        Ok(())
    }

    /// The object of record `index` of slab `slab`.
    pub(crate) fn object_id(&self, slab: u32, index: u32) -> ObjectId {
        ObjectId(u64::from(slab) * u64::from(self.objects_per_slab) + u64::from(index))
    }

    /// Whether an object id names a record of some slab.
    pub(crate) fn valid_object(&self, o: ObjectId) -> bool {
        o.0 < u64::from(self.count()) * u64::from(self.objects_per_slab)
    }

    /// Whether a location lies in the data region and in the slab its object belongs to.
    pub(crate) fn valid_location(&self, slab: u32, loc: Location) -> bool {
        let (first, count) = loc.blocks();
        let slab_first = u64::from(slab) * u64::from(SLAB_BLOCKS);
        let slab_end =
            (slab_first + u64::from(SLAB_BLOCKS)).min(self.data_blocks.load(Ordering::Acquire));
        first >= slab_first && first + count <= slab_end
    }

    /// Data block number (data-region relative) of block `block` of slab `slab`.
    pub(crate) fn pbn(&self, slab: u32, block: u32) -> u64 {
        u64::from(slab) * u64::from(SLAB_BLOCKS) + u64::from(block)
    }

    /// Whether a write that found no free block may succeed after another checkpoint:
    /// some slab has a free block (and object), or blocks waiting to become free.
    pub(crate) fn space_to_retry(&self) -> bool {
        self.untouched_blocks().1 > 0
            || self.touched().any(|(_, slab)| {
                let slab = slab.lock();
                (slab.free_blocks_for_data() > 0 && slab.free_objects() > 0)
                    || slab.pending_blocks() > 0
            })
    }

    /// Object slots per slab.
    pub(crate) fn objects_per_slab(&self) -> u32 {
        self.objects_per_slab
    }

    /// The dedup index (advice only; see the file's header).
    pub(crate) fn index(&self) -> &DedupIndex {
        &self.index
    }

    /// The objects known damaged (`heal.rs`).
    pub(crate) fn damaged(&self) -> &crate::heal::DamagedObjects {
        &self.damaged
    }

    /// Fragments freed since the last call (the compactor's cue).
    pub(crate) fn take_fragment_frees(&self) -> u64 {
        self.fragment_frees.swap(0, Ordering::AcqRel)
    }

    /// Add one reference to each of `objects` (a clone), taking each slab's lock once.
    /// All or none: past an object's [`REFCOUNT_MAX`] (refused) or at a free one (a
    /// broken invariant, which latches), the references added are taken back.
    pub(crate) fn add_references(&self, devices: &Devices, objects: &[ObjectId]) -> Result<()> {
        let mut added: Vec<(u32, Vec<u32>)> = Vec::new();
        for (s, indexes) in self.by_slab(objects) {
            let failed = {
                let mut slab = self.slab(s).lock();
                indexes
                    .iter()
                    .enumerate()
                    .find_map(|(n, &i)| slab.add_ref(i).err().map(|e| (n, e)))
            };
            let Some((n, e)) = failed else {
                added.push((s, indexes));
                continue;
            };
            added.push((s, indexes.into_iter().take(n).collect()));
            // Each of these had a reference before ours: none is freed here.
            for (s, indexes) in added {
                let mut slab = self.slab(s).lock();
                for i in indexes {
                    devices.check_invariant(slab.drop_ref(i))?;
                }
            }
            devices.latch(&e);
            return Err(e);
        }
        Ok(())
    }

    /// Drop one reference of each of `objects` (a delete, a trim), taking each slab's
    /// lock once; freed objects leave the index. A count below zero latches the pool
    /// and is returned once the rest are released.
    pub(crate) fn release_objects(&self, devices: &Devices, objects: &[ObjectId]) -> Result<()> {
        let mut broken = Ok(());
        for (s, indexes) in self.by_slab(objects) {
            let mut freed: Vec<(u32, ObjRec)> = Vec::new();
            {
                let mut slab = self.slab(s).lock();
                for i in indexes {
                    match slab.drop_ref(i) {
                        Ok(Some(rec)) => freed.push((i, rec)),
                        Ok(None) => {}
                        Err(e) => broken = broken.and(devices.check_invariant(Err(e))),
                    }
                }
            }
            for (i, rec) in freed {
                self.forget_freed(self.object_id(s, i), &rec);
            }
        }
        broken
    }

    /// Drop a reference; a freed object leaves the index. A count below zero
    /// latches the pool.
    pub(crate) fn release_object(&self, devices: &Devices, o: ObjectId) -> Result<()> {
        let (s, i) = self.split_object(o);
        let freed = self.slab(s).lock().drop_ref(i);
        if let Some(rec) = devices.check_invariant(freed)? {
            self.forget_freed(o, &rec);
        }
        Ok(())
    }

    /// Object indexes grouped by slab: (slab, its indexes), only slabs with some.
    /// Reference changes commute, so the order within a slab does not matter. Many
    /// objects (a delete) go into one bucket per slab; few (a small trim) are sorted,
    /// so their cost never grows with the pool's slab count.
    fn by_slab(&self, objects: &[ObjectId]) -> Vec<(u32, Vec<u32>)> {
        if objects.len() < self.count() as usize {
            let mut pairs: Vec<(u32, u32)> =
                objects.iter().map(|&o| self.split_object(o)).collect();
            pairs.sort_unstable();
            return pairs
                .chunk_by(|a, b| a.0 == b.0)
                .map(|run| {
                    let slab = run.first().map_or(0, |p| p.0);
                    (slab, run.iter().map(|p| p.1).collect())
                })
                .collect();
        }
        let mut groups = vec![Vec::new(); self.count() as usize];
        for &o in objects {
            let (s, i) = self.split_object(o);
            if let Some(g) = groups.get_mut(s as usize) {
                g.push(i);
            }
        }
        (0..self.count())
            .zip(groups)
            .filter(|(_, g)| !g.is_empty())
            .collect()
    }

    /// What follows an object's last reference going: it leaves the index, and a
    /// dead fragment may leave its packed block mostly empty (the compactor's cue).
    fn forget_freed(&self, o: ObjectId, rec: &ObjRec) {
        self.index.remove(&rec.fingerprint, o);
        // Its id may hold other data next.
        self.damaged.take(o);
        if rec.location & (1 << 63) != 0 {
            self.fragment_frees.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Sorted, distinct block numbers as runs of adjacent blocks: (first, count).
fn block_runs(sorted: &[u32]) -> Vec<(u32, u32)> {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &b in sorted {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == b => *count += 1,
            _ => runs.push((b, 1)),
        }
    }
    runs
}

#[cfg(test)]
mod discard_tests {
    use super::block_runs;

    #[test]
    fn freed_blocks_are_discarded_in_runs_of_adjacent_blocks() {
        assert_eq!(block_runs(&[]), vec![]);
        assert_eq!(block_runs(&[3]), vec![(3, 1)]);
        assert_eq!(
            block_runs(&[0, 1, 2, 5, 6, 9]),
            vec![(0, 3), (5, 2), (9, 1)]
        );
    }
}
