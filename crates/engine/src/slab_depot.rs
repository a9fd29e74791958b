//! The slab depot: every slab of the pool, each behind its own lock (the physical
//! zone's unit), the object reference counts kept in them, the free-space check, and
//! the dedup advice with its verification.
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
use crate::geometry::{PoolGeometry, SLAB_BLOCKS};
use crate::index::DedupIndex;
use crate::slab::{ObjRec, Slab, REFCOUNT_MAX};
use crate::Result;
use fewerbytes_format::location::{Location, ObjectId};
use fewerbytes_format::BLOCK_BYTES;
use fewerbytes_storage::DiscardOutcome;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Objects after a thread's last dedup hit that a miss tries, once the index is lossy.
const NEIGHBOURS: u64 = 8;

thread_local! {
    /// This thread's last dedup hit: (the depot, by address; the object).
    static LAST_HIT: std::cell::Cell<Option<(usize, ObjectId)>> = const { std::cell::Cell::new(None) };
}

/// Every slab of the pool, each behind its own lock (the physical zone's unit), and
/// the arithmetic between object ids, slabs and data blocks.
pub(crate) struct SlabDepot {
    slabs: Vec<Mutex<Slab>>,
    objects_per_slab: u32,
    data_blocks: u64,
    /// Advice on where a fingerprint was stored (hash zones).
    index: DedupIndex,
    /// Fragments freed since the compactor last looked.
    fragment_frees: AtomicU64,
}

impl SlabDepot {
    /// Empty slabs laid out as `geometry` says; pages they turn dirty count in
    /// `dirty_pages`. The index holds the window the pool records, or takes
    /// `index_memory` bytes when given (a budget for this open).
    pub(crate) fn new(
        geometry: &PoolGeometry,
        dirty_pages: &Arc<AtomicU64>,
        index_memory: Option<u64>,
    ) -> Self {
        let slab_blocks = geometry.slab_blocks();
        let slabs = (0..geometry.slab_count())
            .map(|s| {
                let first = u64::from(s) * u64::from(slab_blocks);
                let blocks = (geometry.data_blocks() - first).min(u64::from(slab_blocks)) as u32;
                Mutex::new(Slab::new(
                    s,
                    first,
                    blocks,
                    geometry.objects_per_slab(),
                    dirty_pages.clone(),
                ))
            })
            .collect();
        let objects = u64::from(geometry.slab_count()) * u64::from(geometry.objects_per_slab());
        let index = match index_memory {
            Some(bytes) => DedupIndex::with_memory(bytes, objects),
            None => DedupIndex::new(geometry.index_entries(), objects),
        };
        SlabDepot {
            slabs,
            objects_per_slab: geometry.objects_per_slab(),
            data_blocks: geometry.data_blocks(),
            index,
            fragment_frees: AtomicU64::new(0),
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

    /// Slab `s`.
    pub(crate) fn slab(&self, s: u32) -> &Mutex<Slab> {
        // Slab numbers come from `order` and from objects checked by `valid_object`
        // (every map entry at open, every journal record at replay): one past the end
        // is a bug, and must not wrap round to another slab's records.
        self.slabs
            .get(s as usize)
            .unwrap_or_else(|| panic!("slab {s} does not exist: the pool has {}", self.slabs.len()))
    }

    /// Slabs in the pool.
    pub(crate) fn count(&self) -> u32 {
        self.slabs.len() as u32
    }

    /// Every slab, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Mutex<Slab>> + '_ {
        self.slabs.iter()
    }

    /// Slabs in the order zone `zone` of `zones` tries them: its own first, then the rest.
    pub(crate) fn order(&self, zone: usize, zones: usize) -> impl Iterator<Item = u32> + '_ {
        let n = self.slabs.len();
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
        let slab_end = (slab_first + u64::from(SLAB_BLOCKS)).min(self.data_blocks);
        first >= slab_first && first + count <= slab_end
    }

    /// Data block number (data-region relative) of block `block` of slab `slab`.
    pub(crate) fn pbn(&self, slab: u32, block: u32) -> u64 {
        u64::from(slab) * u64::from(SLAB_BLOCKS) + u64::from(block)
    }

    /// Whether a write that found no free block may succeed after another checkpoint:
    /// some slab has a free block (and object), or blocks waiting to become free.
    pub(crate) fn space_to_retry(&self) -> bool {
        self.slabs.iter().any(|slab| {
            let slab = slab.lock();
            (slab.free_blocks() > 0 && slab.free_objects() > 0) || slab.pending_blocks() > 0
        })
    }

    /// The dedup index (advice only; see the file's header).
    pub(crate) fn index(&self) -> &DedupIndex {
        &self.index
    }

    /// Fragments freed since the last call (the compactor's cue).
    pub(crate) fn take_fragment_frees(&self) -> u64 {
        self.fragment_frees.swap(0, Ordering::AcqRel)
    }

    /// A stored object holding `fp`, with one reference taken, if the index's advice
    /// names one that checks out; and how many candidates were stale. A candidate
    /// is a group of consecutive objects (one object but in pools of more than 2^24).
    ///
    /// Once the index has dropped entries (past its window it holds a sample), a
    /// miss tries the objects just after the last one this thread found: a second
    /// copy of data written in order finds its blocks in the order the first copy
    /// stored them, so one sampled hit leads to its neighbours (as dm-vdo's sparse
    /// index loads the chapter of a sampled hit).
    pub(crate) fn take_duplicate(&self, fp: &[u8; 32]) -> (Option<ObjectId>, u64) {
        let (candidates, n) = self.index.lookup(fp);
        let mut stale = 0;
        for &g in candidates.iter().take(n) {
            if let Some(o) = self.take_advice(self.index.objects_of(g), fp) {
                self.remember_hit(o);
                return (Some(o), stale);
            }
            stale += 1;
        }
        if self.index.lossy() {
            let me = self as *const SlabDepot as usize;
            if let Some((_, last)) = LAST_HIT.get().filter(|(depot, _)| *depot == me) {
                let next = last.0 + 1;
                if let Some(o) = self.take_advice(next..next + NEIGHBOURS, fp) {
                    self.index.count_neighbour_hit();
                    self.remember_hit(o);
                    return (Some(o), stale);
                }
            }
        }
        (None, stale)
    }

    /// Note `o` as this thread's last dedup hit (for the neighbours of a sample).
    fn remember_hit(&self, o: ObjectId) {
        LAST_HIT.set(Some((self as *const SlabDepot as usize, o)));
    }

    /// Take a reference to an object of `objects` that still holds `fp` and can
    /// take one more.
    fn take_advice(&self, objects: std::ops::Range<u64>, fp: &[u8; 32]) -> Option<ObjectId> {
        let mut o = objects.start;
        while o < objects.end {
            if !self.valid_object(ObjectId(o)) {
                return None;
            }
            let (s, first) = self.split_object(ObjectId(o));
            let end = (u64::from(first) + objects.end - o).min(u64::from(self.objects_per_slab));
            let mut slab = self.slab(s).lock();
            for i in first..end as u32 {
                let rec = slab.rec(i);
                if rec.refcount == 0 || rec.refcount >= REFCOUNT_MAX || rec.fingerprint != *fp {
                    continue;
                }
                if let Some(r) = slab.rec_mut(i) {
                    r.refcount += 1;
                }
                return Some(self.object_id(s, i));
            }
            o += end - u64::from(first);
        }
        None
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
        if objects.len() < self.slabs.len() {
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
        let mut groups = vec![Vec::new(); self.slabs.len()];
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
