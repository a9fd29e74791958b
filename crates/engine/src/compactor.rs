//! The compactor's state: the wake-up of its thread and what it emptied. The rounds
//! themselves (which blocks, how fragments move) are `compact.rs`.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What the compactor keeps between rounds.
pub(crate) struct Compactor {
    /// Wakes the compactor early when the pool closes (it otherwise sleeps between rounds).
    wake: (Mutex<()>, Condvar),
    /// Packed blocks emptied by compaction since open.
    compacted_blocks: AtomicU64,
}

impl Compactor {
    pub(crate) fn new() -> Self {
        Compactor {
            wake: (Mutex::new(()), Condvar::new()),
            compacted_blocks: AtomicU64::new(0),
        }
    }

    /// Sleep up to `interval`, unless `closed` already holds; `wake` ends it early.
    /// `closed` is checked under the wake's lock, so a close between the check and
    /// the wait is not missed.
    pub(crate) fn sleep(&self, interval: Duration, closed: impl Fn() -> bool) {
        let (lock, wake) = &self.wake;
        let mut guard = lock.lock();
        if !closed() {
            wake.wait_for(&mut guard, interval);
        }
    }

    /// End the compactor's sleep (the pool closes).
    pub(crate) fn wake(&self) {
        let _guard = self.wake.0.lock();
        self.wake.1.notify_all();
    }

    /// A round emptied `blocks` packed blocks.
    pub(crate) fn emptied(&self, blocks: u64) {
        self.compacted_blocks.fetch_add(blocks, Ordering::Relaxed);
    }

    /// Packed blocks emptied since open.
    pub(crate) fn compacted_blocks(&self) -> u64 {
        self.compacted_blocks.load(Ordering::Relaxed)
    }
}
