//! `LbnLocks`: the locks that order requests on logical blocks — the gate, which
//! every request step holds shared and a checkpoint snapshot or a volume operation
//! holds exclusively, and the lock stripes that serialize writes to one block.

use crate::{EngineError, Result};
use parking_lot::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::ops::Range;

/// Lock stripes serializing writes to the same logical block, so a read-modify-write
/// of a partial block never overlaps another write of it (`partial.rs`). 4,096: with
/// 128 requests in flight, two unrelated blocks share a stripe rarely (3% of requests
/// meet another at random), and the table is 4,096 words.
pub const LBN_STRIPES: usize = 4096;

/// The gate and the lock stripes.
pub(crate) struct LbnLocks {
    gate: RwLock<()>,
    stripes: Vec<Mutex<()>>,
}

impl LbnLocks {
    pub fn new() -> Self {
        LbnLocks {
            gate: RwLock::new(()),
            stripes: (0..LBN_STRIPES).map(|_| Mutex::new(())).collect(),
        }
    }

    /// The gate held shared: a request step.
    pub fn shared(&self) -> RwLockReadGuard<'_, ()> {
        self.gate.read()
    }

    /// The gate held shared if no one holds it exclusively now.
    pub fn try_shared(&self) -> Option<RwLockReadGuard<'_, ()>> {
        self.gate.try_read()
    }

    /// The gate held exclusively: an exact image of the pool.
    pub fn exclusive(&self) -> RwLockWriteGuard<'_, ()> {
        self.gate.write()
    }

    /// The stripe of block `lbn` of the volume `volume_id`.
    pub fn stripe(&self, volume_id: u64, lbn: u64) -> &Mutex<()> {
        pick(&self.stripes, stripe_of(volume_id, lbn))
    }

    /// The stripes of blocks `lbns` (at most [`STRIPES_HELD_MAX`]) of the volume
    /// `volume_id` held, each once, taken in the one order every holder of several
    /// uses (their place in the table), so two holders never wait for each other. A
    /// write step holds its blocks' stripes while it places them and sets their
    /// entries (`volume.rs: write_whole`); every other holder holds one. No allocation:
    /// this is on every write's path.
    pub fn stripes(&self, volume_id: u64, lbns: Range<u64>) -> Result<HeldStripes<'_>> {
        if lbns.end.saturating_sub(lbns.start) > STRIPES_HELD_MAX as u64 {
            return Err(EngineError::Invariant(format!(
                "the stripes of {} blocks held at once (at most {STRIPES_HELD_MAX})",
                lbns.end.saturating_sub(lbns.start)
            )));
        }
        let mut at = [0usize; STRIPES_HELD_MAX];
        let mut n = 0usize;
        for (slot, lbn) in at.iter_mut().zip(lbns) {
            *slot = stripe_of(volume_id, lbn) % LBN_STRIPES;
            n += 1;
        }
        let at = at.get_mut(..n).unwrap_or_default();
        at.sort_unstable();
        let mut held = HeldStripes {
            _guards: std::array::from_fn(|_| None),
        };
        let mut last = None;
        for (guard, &i) in held._guards.iter_mut().zip(at.iter()) {
            if last != Some(i) {
                *guard = Some(pick(&self.stripes, i).lock());
                last = Some(i);
            }
        }
        Ok(held)
    }
}

/// Stripes one holder holds at most: a write step's blocks.
pub const STRIPES_HELD_MAX: usize = crate::inner::BLOCKS_PER_STEP as usize;

/// Stripes held together ([`LbnLocks::stripes`]), released when dropped.
pub(crate) struct HeldStripes<'a> {
    _guards: [Option<MutexGuard<'a, ()>>; STRIPES_HELD_MAX],
}

/// Where block `lbn` of the volume `volume_id` hashes among the stripes (before
/// [`pick`] takes it modulo their number).
fn stripe_of(volume_id: u64, lbn: u64) -> usize {
    ((lbn ^ (volume_id.wrapping_mul(0x9e37_79b9_7f4a_7c15))).wrapping_mul(0xff51_afd7_ed55_8ccd)
        >> 40) as usize
}

/// One of a fixed set picked by a hash or zone number (`n` modulo the set's length).
/// The stripes are made non-empty ([`LBN_STRIPES`]).
fn pick<T>(items: &[T], n: usize) -> &T {
    n.checked_rem(items.len())
        .and_then(|i| items.get(i))
        .expect("zones and stripes are made non-empty at open")
}
