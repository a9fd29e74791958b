//! Building the dedup index in the background: a read-write open serves at once,
//! and a thread of its own inserts every live object record into the index, slab
//! by slab, while writes go on. A read-only open never builds it (nothing it does
//! asks for advice).
//!
//! The race with the writes is closed by locks, not by luck:
//! - a slab's records are inserted while the slab's lock is held, and an object is
//!   freed (its count reaching zero) under that lock too, with its entry removed
//!   just after: so the rebuild either sees it free and skips it, or inserts it
//!   before the free, whose removal then takes the entry out. No entry names an
//!   object freed before it was inserted;
//! - an object stored meanwhile is inserted by its write, and by the rebuild if its
//!   slab is scanned after: both use [`DedupIndex::insert_once`] until the build is
//!   done, so it holds one entry, which its free removes.
//!
//! Advice is verified anyway (`SlabDepot::take_duplicate`: the record must hold the
//! fingerprint and be live), so a stale entry could cost a compare, never a wrong
//! dedup; the locks keep the index exact rather than merely safe.
//!
//! [`DedupIndex::insert_once`]: crate::index::DedupIndex::insert_once

use crate::index::DedupIndex;
use crate::slab_depot::SlabDepot;
use fewerbytes_format::location::ObjectId;
use parking_lot::{Condvar, Mutex};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};

/// Where the index's build stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BuildState {
    /// Not built: the pool was opened read-only.
    NotBuilt,
    /// Being rebuilt from the object records; advice is partial.
    Rebuilding,
    /// Holds every live object (up to its window).
    Ready,
}

const NOT_BUILT: u8 = 0;
const REBUILDING: u8 = 1;
const READY: u8 = 2;

/// The build's state and progress, shared by the open, the build thread, the
/// writes and the statistics.
pub(crate) struct IndexBuild {
    state: AtomicU8,
    /// Slabs scanned, and the slabs there were when the build began.
    slabs_done: AtomicU32,
    slabs_total: AtomicU32,
    /// New objects stored while the index was rebuilding: blocks whose duplicate
    /// may have been missed (their advice was partial).
    stored_while_rebuilding: AtomicU64,
    /// Set by close: the thread stops between slabs.
    stop: AtomicBool,
    /// Tests hold the build before its first slab (`OpenOptions`), to write while
    /// it has not run; released by `release` or close.
    held: Mutex<bool>,
    released: Condvar,
    /// Set when the thread ends (ready or stopped), for [`Self::wait`].
    ended: Mutex<bool>,
    ended_signal: Condvar,
    /// Where the index is saved at a clean close and loaded at open (`index_save.rs`);
    /// none in a read-only or repair open.
    saved_path: Option<PathBuf>,
    /// Loaded from the saved index, not built.
    loaded: AtomicBool,
}

impl IndexBuild {
    /// A build for a pool opened read-write (`rebuild`: the thread will run) or
    /// read-only (never built). `hold`: wait for [`Self::release`] before the first
    /// slab. `saved_path`: the saved index's file.
    pub(crate) fn new(rebuild: bool, hold: bool, saved_path: Option<PathBuf>) -> Self {
        IndexBuild {
            state: AtomicU8::new(if rebuild { REBUILDING } else { NOT_BUILT }),
            slabs_done: AtomicU32::new(0),
            slabs_total: AtomicU32::new(0),
            stored_while_rebuilding: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            held: Mutex::new(hold),
            released: Condvar::new(),
            ended: Mutex::new(!rebuild),
            ended_signal: Condvar::new(),
            saved_path,
            loaded: AtomicBool::new(false),
        }
    }

    /// The saved index's file, in a read-write open.
    pub(crate) fn saved_path(&self) -> Option<&Path> {
        self.saved_path.as_deref()
    }

    /// The saved index was loaded at open (`index_save.rs`): ready, no build.
    pub(crate) fn loaded(&self) {
        self.loaded.store(true, Ordering::Release);
        self.state.store(READY, Ordering::Release);
        self.end();
    }

    /// Whether the index was loaded from the saved one at open.
    pub(crate) fn was_loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire)
    }

    /// Whether the open must start the build thread.
    pub(crate) fn needs_build(&self) -> bool {
        self.state() == BuildState::Rebuilding
    }

    pub(crate) fn state(&self) -> BuildState {
        match self.state.load(Ordering::Acquire) {
            NOT_BUILT => BuildState::NotBuilt,
            REBUILDING => BuildState::Rebuilding,
            _ => BuildState::Ready,
        }
    }

    /// Percent of the slabs scanned (100 once ready, 0 when never built).
    pub(crate) fn percent(&self) -> u8 {
        match self.state() {
            BuildState::Ready => 100,
            BuildState::NotBuilt => 0,
            BuildState::Rebuilding => {
                let total = u64::from(self.slabs_total.load(Ordering::Acquire));
                let done = u64::from(self.slabs_done.load(Ordering::Acquire));
                // Below 100 until the state says ready.
                (done * 100)
                    .checked_div(total)
                    .map_or(0, |p| p.min(99) as u8)
            }
        }
    }

    /// Blocks stored new while the index was rebuilding.
    pub(crate) fn stored_while_rebuilding(&self) -> u64 {
        self.stored_while_rebuilding.load(Ordering::Relaxed)
    }

    /// Record `fp` stored as the new object `object` (the write path), counted as
    /// stored without full advice while the build runs. Inserted once, also after the
    /// build is done: the build may have found the object's record (set before this
    /// insert) and inserted it just before it finished, and a second entry would
    /// outlive the object's free, which removes one.
    pub(crate) fn insert_stored(&self, index: &DedupIndex, fp: &[u8; 32], object: ObjectId) {
        if self.state.load(Ordering::Acquire) != READY {
            self.stored_while_rebuilding.fetch_add(1, Ordering::Relaxed);
        }
        index.insert_once(fp, object);
    }

    /// Let a held build run.
    pub(crate) fn release(&self) {
        *self.held.lock() = false;
        self.released.notify_all();
    }

    /// Wait until the build has ended (ready, or stopped by close); at once when
    /// there is none (read-only).
    pub(crate) fn wait(&self) {
        let mut ended = self.ended.lock();
        while !*ended {
            self.ended_signal.wait(&mut ended);
        }
    }

    fn end(&self) {
        *self.ended.lock() = true;
        self.ended_signal.notify_all();
    }

    /// Stop the build (close): it ends between slabs, the index left partial.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.release();
    }
}

/// The build thread of the pool on `device` (its name, for the log): every live
/// record of every slab of `depot` into its index, then ready.
pub(crate) fn run(build: &IndexBuild, depot: &SlabDepot, objects_per_slab: u32, device: &str) {
    fill(build, depot, objects_per_slab, device);
    build.end();
}

fn fill(build: &IndexBuild, depot: &SlabDepot, objects_per_slab: u32, device: &str) {
    {
        let mut held = build.held.lock();
        while *held {
            build.released.wait(&mut held);
        }
    }
    let started = std::time::Instant::now();
    let objects_per_slab = u64::from(objects_per_slab);
    // Only slabs touched hold objects (the open loaded them); one touched later,
    // or added by a grow, holds only what writes store meanwhile, and they insert.
    let slabs: Vec<u32> = depot.touched().map(|(s, _)| s).collect();
    build
        .slabs_total
        .store(slabs.len() as u32, Ordering::Release);
    let mut inserted = 0u64;
    for (done, &s) in (1u32..).zip(&slabs) {
        if build.stop.load(Ordering::Acquire) {
            tracing::info!("dedup index build stopped at slab {s} (the pool is closing)");
            return;
        }
        {
            let slab = depot.slab(s).lock();
            for i in slab.objects_in_memory() {
                let rec = slab.rec(i);
                // One in flight is indexed by its write once journalled.
                if rec.refcount == 0 || rec.fingerprint == crate::slab::FINGERPRINT_IN_FLIGHT {
                    continue;
                }
                let o = ObjectId(u64::from(s) * objects_per_slab + u64::from(i));
                depot.index().insert_once(&rec.fingerprint, o);
                inserted += 1;
            }
        }
        build.slabs_done.store(done, Ordering::Release);
    }
    build.state.store(READY, Ordering::Release);
    tracing::info!(
        "{device}: dedup index rebuilt from {inserted} stored objects in {:.2} s",
        started.elapsed().as_secs_f64()
    );
}
