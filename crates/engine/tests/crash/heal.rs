//! The crash simulation's heal workload: a block of a hidden internal volume is
//! stored and made durable, one of its bits is flipped on the data device (a drive
//! returning bad bytes, itself a logged write and flush), a read finds it damaged,
//! and its good data is written to `v0` while other writes go to `v1`, then
//! flushed (ARCHITECTURE.md, "Healing a damaged block"). At every crash point from
//! the block's flush on, it reads as its good data or fails as damage (never other
//! bytes), and as its good data once the heal's flush returned. The internal volume
//! is no volume of the model (no user listing shows it); `v0` and `v1` are checked
//! by the model as any volume is.

use crate::common::BLOCK;
use crate::workload::{data_of, random_bytes, Devices, Workload, VOL_BLOCKS};
use fewerbytes_engine::storage::{CrashMode, Storage as _};
use fewerbytes_engine::{read_damage, InternalName, Pool, Provisioning};
use rand::{rngs::StdRng, Rng};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Workloads whose seed is this modulo 8 heal a damaged block first (neither a
/// full pool's class, a tiny page store's, nor the receive's).
pub(crate) const HEAL_SEED_CLASS: u64 = 6;
/// The most ordinary writes beside the heal's.
const BESIDE_MAX: usize = 4;

/// The block a heal workload damaged and healed, placed in the log.
pub(crate) struct Healed {
    /// The internal volume holding it at block 0.
    pub(crate) volume: String,
    pub(crate) good: Vec<u8>,
    /// Log position at which the flush after the block's write returned.
    pub(crate) stored: usize,
    /// Log position at which the heal's flush returned.
    pub(crate) healed: usize,
    /// Crash points (and second crashes) that found the block damaged, and those
    /// past the block's flush that found it good.
    pub(crate) read_damaged: AtomicU64,
    pub(crate) read_good: AtomicU64,
}

impl Healed {
    /// Whether a crash at `at` may find the block damaged (no scrub is clean then).
    pub(crate) fn may_be_damaged(&self, at: usize) -> bool {
        self.stored <= at && at < self.healed
    }

    /// The block after a crash at `at`: good, or damage before the heal's flush
    /// returned.
    pub(crate) fn check(&self, pool: &Arc<Pool>, at: usize) -> Result<(), String> {
        if at < self.stored {
            return Ok(());
        }
        let v = pool
            .internal()
            .open(&self.volume)
            .map_err(|e| format!("opening {}: {e}", self.volume))?;
        let mut got = vec![0u8; BLOCK];
        match v.read(0, &mut got) {
            Ok(()) if got == self.good => {
                self.read_good.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Ok(()) => Err(format!(
                "the damaged block of {} reads other bytes than its good data",
                self.volume
            )),
            Err(e) if read_damage(&e).is_some() && at < self.healed => {
                self.read_damaged.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => Err(format!(
                "the block of {} after the heal's flush returned: {e}",
                self.volume
            )),
        }
    }
}

impl Workload<'_> {
    /// The heal workload (the module's header): on a pool holding `v0` and `v1`.
    /// The pool is reopened on the way (its memory may hold the block it wrote): the
    /// open pool is returned.
    pub(crate) fn heal(
        &mut self,
        rng: &mut StdRng,
        pool: Arc<Pool>,
        devices: &Devices,
    ) -> Arc<Pool> {
        let name = InternalName::new("heal", "v0").expect("internal name");
        let internal = pool.internal();
        self.run(&format!("create {}", name.as_str()), true, |_| {
            internal
                .create(&name, VOL_BLOCKS * BLOCK as u64, Provisioning::THIN)
                .expect("create an internal volume")
        });
        let good = random_bytes(rng, 1);
        let v = internal.open(name.as_str()).expect("internal volume");
        self.run("write the block to damage", false, |_| {
            v.write(0, &good, false).expect("write")
        });
        self.run("flush", true, |_| pool.flush().expect("flush"));
        let stored = self.log.len();
        // Random data is stored whole, in a block of its own.
        let image = devices.data.crash_image(CrashMode::KeepAll);
        let at = image
            .chunks_exact(BLOCK)
            .position(|b| b == good.as_slice())
            .expect("the stored block on the data device");
        let mut bad = good.clone();
        bad[rng.gen_range(0..BLOCK)] ^= 1 << rng.gen_range(0..8);
        self.run("flip a bit of the stored block", false, |_| {
            devices
                .data
                .write_at(&bad, (at * BLOCK) as u64)
                .expect("flip");
            devices.data.flush().expect("flush the flip");
        });
        drop(v);
        self.coverage.note(&pool);
        self.run("close", true, |_| pool.close().expect("close"));
        self.keep_saved_index(devices);
        let pool = self.run("open", true, |_| devices.open().expect("reopen"));
        let v = pool
            .internal()
            .open(name.as_str())
            .expect("internal volume");
        let mut got = vec![0u8; BLOCK];
        match v.read(0, &mut got) {
            Err(e) => assert!(read_damage(&e).is_some(), "not damage: {e}"),
            Ok(()) => panic!("a damaged block read without an error"),
        }
        assert_eq!(pool.stats().damaged_objects_known, 1, "the damage found");
        self.heal_beside_writes(rng, &pool, &good);
        let healed = self.log.len();
        assert_eq!(pool.stats().damaged_objects_healed, 1, "the write healed");
        v.read(0, &mut got).expect("the healed block");
        assert!(got == good, "the healed block reads other bytes");
        self.healed = Some(Healed {
            volume: name.as_str().to_string(),
            good,
            stored,
            healed,
            read_damaged: AtomicU64::new(0),
            read_good: AtomicU64::new(0),
        });
        drop(v);
        pool
    }

    /// The good data written to a block of `v0` while writes go to `v1`, then the
    /// heal's flush.
    fn heal_beside_writes(&mut self, rng: &mut StdRng, pool: &Arc<Pool>, good: &[u8]) {
        let lbn = rng.gen_range(0..VOL_BLOCKS);
        let beside: Vec<(u64, Vec<u8>)> = (0..rng.gen_range(1..=BESIDE_MAX))
            .map(|_| {
                let lbn = rng.gen_range(0..VOL_BLOCKS - 2);
                (lbn * BLOCK as u64, data_of(rng, 2 * BLOCK))
            })
            .collect();
        let log = self.log;
        let start = log.len();
        let (heal_end, beside_ends) = std::thread::scope(|s| {
            let healer = s.spawn(|| {
                let v = pool.open_volume("v0").expect("volume");
                v.write(lbn * BLOCK as u64, good, false).expect("the heal");
                log.len()
            });
            let writer = s.spawn(|| {
                let v = pool.open_volume("v1").expect("volume");
                beside
                    .iter()
                    .map(|(offset, data)| {
                        v.write(*offset, data, false).expect("write beside");
                        log.len()
                    })
                    .collect::<Vec<_>>()
            });
            (
                healer.join().expect("healer"),
                writer.join().expect("writer"),
            )
        });
        let (v0, _) = self.model.volumes["v0"];
        let op = self.note(
            &format!("write v0 block {lbn} (the heal)"),
            start,
            heal_end,
            false,
        );
        self.model.change(op, v0, lbn * BLOCK as u64, good, false);
        let (v1, _) = self.model.volumes["v1"];
        for ((offset, data), end) in beside.iter().zip(beside_ends) {
            let what = format!("write v1 {offset}+{} (beside the heal)", data.len());
            let op = self.note(&what, start, end, false);
            self.model.change(op, v1, *offset, data, false);
        }
        self.run("the heal's flush", true, |_| pool.flush().expect("flush"));
    }
}
