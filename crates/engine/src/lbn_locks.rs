//! `LbnLocks`: the locks that order requests on logical blocks — the gate, which
//! every request step holds shared and a checkpoint snapshot or a volume operation
//! holds exclusively, and the lock stripes that serialize writes to one block.

use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

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
        let h = (lbn ^ (volume_id.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
            .wrapping_mul(0xff51_afd7_ed55_8ccd)
            >> 40;
        pick(&self.stripes, h as usize)
    }
}

/// One of a fixed set picked by a hash or zone number (`n` modulo the set's length).
/// The stripes are made non-empty ([`LBN_STRIPES`]).
fn pick<T>(items: &[T], n: usize) -> &T {
    n.checked_rem(items.len())
        .and_then(|i| items.get(i))
        .expect("zones and stripes are made non-empty at open")
}
