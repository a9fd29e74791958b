//! Dedup advice beyond the index's own entries: a block found next to an earlier hit.
//!
//! A second copy of data written in order (a clone of a template, a copied image)
//! finds its blocks in the order the first copy stored them, in consecutive objects
//! of one zone's slab (`packer.rs`: a thread keeps its zone, and a zone fills one
//! slab's objects in order). So once one block of a run is found in the index, its
//! neighbours are found next to it, as dm-vdo's sparse index loads the chapter of a
//! sampled hit:
//! - **after** a hit: a miss tries the objects just after each of the thread's
//!   recent runs of hits ([`RUNS`] runs, [`NEIGHBOURS`] objects each). Used once the
//!   index is lossy (past its window it holds a sample) and always when sparse.
//! - **before** the first hook hit of a write step (sparse only): the step hashed all
//!   its blocks before writing any (`write_path.rs: StepFingerprints`); it looks its
//!   first hooks up first, and the records stored just before the hook's object
//!   ([`BeforeHook`]) are matched against the blocks the step writes before it, which
//!   the run after a hit cannot reach (they come first).
//!
//! Every such advice is verified like the index's: the record must hold the full
//! fingerprint and be live.

use crate::slab::REFCOUNT_MAX;
use crate::slab_depot::SlabDepot;
use fewerbytes_format::location::ObjectId;

/// Objects after the end of each of a thread's recent runs of hits that a miss tries.
const NEIGHBOURS: u64 = 8;

/// Runs of hits a thread follows at once.
const RUNS: usize = 4;

/// Objects after a thread's latest hit that its first misses after that hit try
/// ([`GAP_TRIES`] of them), when the [`NEIGHBOURS`] after every run found nothing
/// and that hit continued a run (a stream written in order, not a lone duplicate):
/// a zone's threads each store a step's blocks in one go, so a stream's next block
/// may lie a few steps of other threads' blocks past its last (a template imported
/// by four threads on two zones: a thread's next block up to 203 objects on,
/// docs/benchmarks.md). Four steps.
const GAP_OBJECTS: u64 = 4 * crate::inner::BLOCKS_PER_STEP;

/// Misses after a hit that try the [`GAP_OBJECTS`] after it: past the first two,
/// the data is likely new and the wider look only costs.
const GAP_TRIES: u8 = 2;

/// Hooks of a write step looked up before its blocks are written, at most: the first
/// that hits gives the objects before it.
const HOOKS_TRIED: usize = 4;

thread_local! {
    /// This thread's latest dedup hits, each the end of a run of consecutive objects,
    /// most recent first: (the depot, by address; the object).
    static RECENT_HITS: std::cell::Cell<[Option<(usize, ObjectId)>; RUNS]> =
        const { std::cell::Cell::new([None; RUNS]) };

    /// Misses this thread may still try the [`GAP_OBJECTS`] after its latest hit for.
    static GAP_TRIES_LEFT: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

/// The live records stored just before a write step's first hook hit: where the
/// step's blocks before that hook were stored by an earlier copy, if it was written
/// in the same order. Sorted by the fingerprint's first 8 bytes.
#[derive(Default)]
pub(crate) struct BeforeHook {
    /// The step's piece (block) whose hook hit: pieces before it are matched here.
    pub(crate) piece: usize,
    records: Vec<(u64, ObjectId)>,
}

impl BeforeHook {
    /// The object that held `fp` when the step looked (advice: verified when taken).
    pub(crate) fn find(&self, fp: &[u8; 32]) -> Option<ObjectId> {
        let key = prefix(fp);
        let at = self.records.partition_point(|r| r.0 < key);
        self.records
            .get(at)
            .filter(|r| r.0 == key)
            .map(|&(_, object)| object)
    }
}

fn prefix(fp: &[u8; 32]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(fp.get(..8).unwrap_or(&[0; 8]));
    u64::from_le_bytes(b)
}

/// A stored object holding `fp`, with one reference taken, if the index's advice
/// names one that checks out; and how many candidates were stale. A candidate
/// is a group of consecutive objects (one object but in pools of more than 2^24).
/// `before`: the object a write step found for this block before its first hook
/// hit ([`BeforeHook`]).
///
/// When the index is sparse, or lossy (past its window it holds a sample), a
/// miss tries the objects just after the thread's recent runs of hits.
pub(crate) fn take_duplicate(
    depot: &SlabDepot,
    fp: &[u8; 32],
    before: Option<ObjectId>,
) -> (Option<ObjectId>, u64) {
    let index = depot.index();
    let (candidates, n) = index.lookup(fp);
    let mut stale = 0;
    for &g in candidates.iter().take(n) {
        if let Some(o) = take_advice(depot, index.objects_of(g), fp) {
            remember_hit(depot, o);
            return (Some(o), stale);
        }
        stale += 1;
    }
    if let Some(o) = before.and_then(|b| take_advice(depot, b.0..b.0 + 1, fp)) {
        index.count_neighbour_hit();
        remember_hit(depot, o);
        return (Some(o), stale);
    }
    if index.lossy() || index.sample_shift() > 0 {
        let me = depot as *const SlabDepot as usize;
        let anchors = RECENT_HITS.get();
        for (owner, last) in anchors.iter().flatten() {
            if *owner != me {
                continue;
            }
            let next = last.0 + 1;
            if let Some(o) = take_advice(depot, next..next + NEIGHBOURS, fp) {
                index.count_neighbour_hit();
                remember_hit(depot, o);
                return (Some(o), stale);
            }
        }
        // A gap in the latest run: the stream's next block lies past other
        // threads' blocks of the zone.
        let latest = anchors.first().copied().flatten();
        if let Some((_, last)) = latest.filter(|(owner, _)| *owner == me) {
            if GAP_TRIES_LEFT.get() > 0 {
                let from = last.0 + 1 + NEIGHBOURS;
                if let Some(o) = take_advice(depot, from..last.0 + 1 + GAP_OBJECTS, fp) {
                    index.count_neighbour_hit();
                    remember_hit(depot, o);
                    // Found past a gap: still a stream written in order.
                    GAP_TRIES_LEFT.set(GAP_TRIES);
                    return (Some(o), stale);
                }
            }
        }
    }
    GAP_TRIES_LEFT.set(GAP_TRIES_LEFT.get().saturating_sub(1));
    (None, stale)
}

/// For a write step of a sparse index: its first hook (of `fps`, the step's
/// hashed blocks as (piece, fingerprint) in order; at most [`HOOKS_TRIED`]
/// looked up) found stored, and the live records of the objects just before
/// that object — as many as twice the pieces before the hook, and
/// [`NEIGHBOURS`] more (other writers' blocks may lie between the first copy's,
/// zero blocks and duplicates took none). None when dense, when no hook is
/// found, or when the first found is the step's first block.
pub(crate) fn before_first_hook<'a>(
    depot: &SlabDepot,
    fps: impl Iterator<Item = (usize, &'a [u8; 32])>,
) -> Option<BeforeHook> {
    let index = depot.index();
    if index.sample_shift() == 0 {
        return None;
    }
    let (piece, object) = fps
        .filter(|(_, fp)| index.is_hook(fp))
        .take(HOOKS_TRIED)
        .find_map(|(piece, fp)| {
            let (candidates, n) = index.lookup(fp);
            candidates
                .iter()
                .take(n)
                .find_map(|&g| find_stored(depot, index.objects_of(g), fp))
                .map(|o| (piece, o))
        })?;
    if piece == 0 {
        return None;
    }
    let span = 2 * piece as u64 + NEIGHBOURS;
    let first = object.0.saturating_sub(span);
    let mut records = Vec::with_capacity((object.0 - first) as usize);
    let mut o = first;
    while o < object.0 {
        if !depot.valid_object(ObjectId(o)) {
            break;
        }
        let (s, i) = depot.split_object(ObjectId(o));
        let slab = depot.slab(s).lock();
        let end = (u64::from(i) + object.0 - o).min(u64::from(depot.objects_per_slab()));
        for i in i..end as u32 {
            let rec = slab.rec(i);
            if rec.refcount > 0 {
                records.push((prefix(&rec.fingerprint), depot.object_id(s, i)));
            }
        }
        o += end - u64::from(i);
    }
    records.sort_unstable();
    Some(BeforeHook { piece, records })
}

/// Note `o` as this thread's latest dedup hit (for the neighbours of a sample):
/// it continues the run of a recent hit just before it, or starts a run of its
/// own in place of the least recent.
fn remember_hit(depot: &SlabDepot, o: ObjectId) {
    let me = depot as *const SlabDepot as usize;
    let mut anchors = RECENT_HITS.get();
    let continues = anchors.iter().position(|a| {
        a.is_some_and(|(owner, last)| owner == me && last.0 < o.0 && o.0 <= last.0 + NEIGHBOURS)
    });
    let at = continues.unwrap_or(RUNS - 1);
    if let Some(run) = anchors.get_mut(..=at) {
        run.rotate_right(1);
    }
    if let Some(first) = anchors.first_mut() {
        *first = Some((me, o));
    }
    RECENT_HITS.set(anchors);
    GAP_TRIES_LEFT.set(if continues.is_some() { GAP_TRIES } else { 0 });
}

/// An object of `objects` holding `fp` live, taking no reference (a look ahead;
/// [`take_advice`] verifies again when the block is written).
fn find_stored(
    depot: &SlabDepot,
    objects: std::ops::Range<u64>,
    fp: &[u8; 32],
) -> Option<ObjectId> {
    objects.map(ObjectId).find(|&o| {
        depot.valid_object(o) && {
            let (s, i) = depot.split_object(o);
            let rec = depot.slab(s).lock().rec(i);
            rec.refcount > 0 && rec.fingerprint == *fp
        }
    })
}

/// Take a reference to object `o` if it still holds `fp` and can take one more
/// (advice from elsewhere than the index: `heal.rs`, a known damaged object).
pub(crate) fn take_object(depot: &SlabDepot, o: ObjectId, fp: &[u8; 32]) -> Option<ObjectId> {
    take_advice(depot, o.0..o.0 + 1, fp)
}

/// Take a reference to an object of `objects` that still holds `fp` and can
/// take one more.
fn take_advice(
    depot: &SlabDepot,
    objects: std::ops::Range<u64>,
    fp: &[u8; 32],
) -> Option<ObjectId> {
    let mut o = objects.start;
    while o < objects.end {
        if !depot.valid_object(ObjectId(o)) {
            return None;
        }
        let (s, first) = depot.split_object(ObjectId(o));
        let end = (u64::from(first) + objects.end - o).min(u64::from(depot.objects_per_slab()));
        let mut slab = depot.slab(s).lock();
        for i in first..end as u32 {
            let rec = slab.rec(i);
            if rec.refcount == 0 || rec.refcount >= REFCOUNT_MAX || rec.fingerprint != *fp {
                continue;
            }
            if let Some(r) = slab.rec_mut(i) {
                r.refcount += 1;
            }
            return Some(depot.object_id(s, i));
        }
        o += end - u64::from(first);
    }
    None
}
