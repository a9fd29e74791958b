//! The crash simulation's workloads: a pool on recording devices, and seeded
//! operations on it, each noted in the model with the log positions it began and
//! returned at.

use crate::common::{self, BLOCK};
use crate::mode_for;
use crate::model::{Model, OpRecord};
use fewerbytes_engine::geometry::Geometry;
use fewerbytes_engine::storage::{
    CrashMode, FaultPlan, FaultStorage, Image, IoEvent, IoLog, Storage,
};
use fewerbytes_engine::{CreateOptions, OpenOptions, Pool, SavedIndex};
use rand::{rngs::StdRng, Rng, RngCore, SeedableRng};
use std::path::PathBuf;
use std::sync::Arc;

/// Operations per workload after the first volumes are made (bounds the log).
pub(crate) const OPS_MIN: usize = 40;
/// See [`OPS_MIN`].
pub(crate) const OPS_MAX: usize = 120;
/// A volume's size when created, in blocks: small, so a whole volume is read back
/// after every crash.
pub(crate) const VOL_BLOCKS: u64 = 96;
/// Volume names a workload uses.
pub(crate) const NAMES: [&str; 4] = ["v0", "v1", "v2", "v3"];
/// Writes in one churn (at most): enough to fill half the smallest journal ring.
pub(crate) const CHURN_WRITES: usize = 2000;
/// A churn flushes after this many writes.
pub(crate) const CHURN_FLUSH_EVERY: usize = 64;
/// Workloads whose seed is this modulo 16 fill the pool with random data first.
pub(crate) const FULL_POOL_SEED_CLASS: u64 = 7;
/// Workloads whose seed is this modulo 4 have a page store of [`TINY_PAGE_SLOTS`]
/// (never one that fills the pool: a full data region holds the image and has only
/// the metadata headroom for a checkpoint's copy of it, ARCHITECTURE.md).
pub(crate) const TINY_PAGE_STORE_SEED_CLASS: u64 = 1;
/// Page-store slots of those workloads: fewer than one checkpoint writes.
pub(crate) const TINY_PAGE_SLOTS: u64 = 6;
/// A full pool's filling and overwriting flush after this many large writes.
pub(crate) const FULL_FLUSH_EVERY: usize = 8;
/// Large overwrites after a pool is filled: 1,536 blocks, more than the ~800 left free.
pub(crate) const FULL_OVERWRITES: usize = 24;
/// The most blocks a large write covers (one engine step).
pub(crate) const BLOCKS_PER_REQUEST_MAX: u64 = 64;
/// About one operation in this many of a workload is a crash, after which the
/// workload goes on from what the recovered pool holds.
pub(crate) const CRASH_IN_WORKLOAD_EVERY: u32 = 40;

/// Which device of a log: the data device (which holds the metadata too, alone).
pub(crate) const DATA: usize = 0;
/// Which device of a log: a separate metadata device.
pub(crate) const META: usize = 1;

/// The smallest single device a pool can be formatted on, in whole MiB.
pub(crate) fn smallest_pool_bytes() -> u64 {
    (1u64..)
        .map(|mib| mib << 20)
        .find(|bytes| Geometry::compute(bytes / BLOCK as u64, None, false).is_ok())
        .expect("some size fits")
}

/// What the workloads did that the crash points land in, summed over pool lifetimes.
#[derive(Default, Clone, Copy)]
pub(crate) struct Coverage {
    pub(crate) checkpoints: u64,
    pub(crate) journal_commits: u64,
    pub(crate) journal_bytes: u64,
    pub(crate) compacted_blocks: u64,
    pub(crate) workload_crashes: u64,
    /// Discards of freed blocks the data device took (logged as unflushed writes of
    /// zeros, so crash points land after them and recovery must not need their bytes).
    pub(crate) discards: u64,
    /// Page-store slots a durable checkpoint retired and discarded (on the metadata
    /// device, or the one device), likewise logged as unflushed writes of zeros.
    pub(crate) slot_discards: u64,
    /// Data blocks holding metadata pages when a pool's life ended (a close or a
    /// crash inside the workload), summed: the tiny page stores' pages go there.
    pub(crate) page_blocks: u64,
}

impl Coverage {
    /// Add what `pool` did since it was opened.
    pub(crate) fn note(&mut self, pool: &Pool) {
        let stats = pool.stats();
        self.checkpoints += stats.checkpoints;
        self.journal_commits += stats.journal_commits;
        self.compacted_blocks += stats.compacted_blocks;
        self.discards += stats.data_device.discards;
        self.slot_discards += stats
            .limits
            .iter()
            .filter(|(name, _)| name == "page store slots discarded since open")
            .map(|(_, n)| n)
            .sum::<u64>();
        self.page_blocks += stats.space.metadata_in_data_bytes / BLOCK as u64;
        self.journal_bytes += stats
            .metadata_written_by_region
            .iter()
            .filter(|(region, _)| region == "journal")
            .map(|(_, bytes)| bytes)
            .sum::<u64>();
    }

    /// Add another workload's.
    pub(crate) fn add(&mut self, other: &Coverage) {
        self.checkpoints += other.checkpoints;
        self.journal_commits += other.journal_commits;
        self.journal_bytes += other.journal_bytes;
        self.compacted_blocks += other.compacted_blocks;
        self.workload_crashes += other.workload_crashes;
        self.discards += other.discards;
        self.slot_discards += other.slot_discards;
        self.page_blocks += other.page_blocks;
    }
}

/// The devices a pool is opened on: the data device, and a metadata device or none.
pub(crate) struct Devices {
    pub(crate) data: Arc<FaultStorage>,
    pub(crate) meta: Option<Arc<FaultStorage>>,
    /// Where a clean close saves the dedup index and an open loads it from.
    pub(crate) saved_index: Option<PathBuf>,
}

impl Devices {
    /// Devices holding `images` (data first), recording into `log` if given.
    pub(crate) fn from_images(images: &[Image], log: Option<&Arc<IoLog>>) -> Self {
        let device = |name: &str, image: &Image, d: usize| {
            let dev = FaultStorage::from_pages(name, image.clone());
            Arc::new(match log {
                Some(log) => dev.record_into(log.clone(), d),
                None => dev,
            })
        };
        Devices {
            data: device("data", &images[DATA], DATA),
            meta: images.get(META).map(|image| device("meta", image, META)),
            saved_index: None,
        }
    }

    /// Save the dedup index at clean closes to `path`, and load it from there.
    pub(crate) fn saving_index_to(mut self, path: PathBuf) -> Self {
        self.saved_index = Some(path);
        self
    }

    /// Open the pool on them (recovering, after a crash), with two worker zones.
    pub(crate) fn open(&self) -> fewerbytes_engine::Result<Arc<Pool>> {
        Pool::open_devices(
            self.data.clone() as Arc<dyn Storage>,
            self.meta
                .clone()
                .map(|m| (m as Arc<dyn Storage>, "meta".to_string())),
            &OpenOptions {
                threads: Some(2),
                index_memory_bytes: None,
                no_discard: false,
                hold_index_build: false,
                take_over: None,
                saved_index: match &self.saved_index {
                    Some(path) => SavedIndex::At(path.clone()),
                    None => SavedIndex::Off,
                },
            },
        )
    }

    /// Stop the devices, so dropping a pool does nothing a crash would not.
    pub(crate) fn stop(&self) {
        for dev in std::iter::once(&self.data).chain(self.meta.as_ref()) {
            dev.set_plan(FaultPlan {
                fail_write: Some(0),
                fail_flush: Some(0),
                ..FaultPlan::default()
            });
        }
    }
}

/// A recorded workload: the devices' images before it, its log, and its model.
pub(crate) struct Recorded {
    pub(crate) seed: u64,
    pub(crate) bases: Vec<Image>,
    pub(crate) events: Vec<IoEvent>,
    pub(crate) model: Model,
    pub(crate) coverage: Coverage,
    /// The dedup index each clean close saved, and the log position it was saved
    /// at: a crash point at or past it opens with the latest such file beside the
    /// pool, as a host that crashed then would.
    pub(crate) saved_indexes: Vec<(usize, Vec<u8>)>,
    /// The block a heal workload damaged and healed.
    pub(crate) healed: Option<crate::heal::Healed>,
}

/// A file of its own for the saved index of workload `seed` (`what`: its use).
pub(crate) fn index_file(seed: u64, what: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!(
        "fewerbytes-crash-{}-{seed}-{what}-{n}.index",
        std::process::id()
    ))
}

/// `blocks` of random bytes (incompressible, unique: each takes a data block).
pub(crate) fn random_bytes(rng: &mut StdRng, blocks: u64) -> Vec<u8> {
    let mut out = vec![0u8; blocks as usize * BLOCK];
    rng.fill_bytes(&mut out);
    out
}

/// Random bytes of one of the kinds a guest writes.
pub(crate) fn data_of(rng: &mut StdRng, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    match rng.gen_range(0..4) {
        0 => {}
        1 => {
            // Duplicates: one of four patterns, so blocks repeat within and across volumes.
            let k: u8 = rng.gen_range(0..4);
            for (i, b) in out.iter_mut().enumerate() {
                *b = ((i % BLOCK) / 512) as u8 ^ k.wrapping_mul(37);
            }
        }
        2 => common::compressible(rng, &mut out),
        _ => rng.fill_bytes(&mut out),
    }
    out
}

/// A byte range of a volume of `blocks`: any offset, a sector's, or a block's; a few
/// bytes, up to two blocks, or up to five.
pub(crate) fn byte_range(rng: &mut StdRng, blocks: u64) -> (u64, u64) {
    let bytes = blocks * BLOCK as u64;
    let offset = match rng.gen_range(0..3) {
        0 => rng.gen_range(0..bytes),
        1 => rng.gen_range(0..bytes / 512) * 512,
        _ => rng.gen_range(0..blocks) * BLOCK as u64,
    };
    let most = match rng.gen_range(0..3) {
        0 => 16,
        1 => 2 * BLOCK as u64,
        _ => 5 * BLOCK as u64,
    };
    (offset, rng.gen_range(1..=most.min(bytes - offset)))
}

/// Run workload `seed` once on recording devices.
pub(crate) fn record(seed: u64, pool_bytes: u64) -> Recorded {
    let mut rng = StdRng::seed_from_u64(seed);
    // One seed in sixteen fills the pool.
    let full = seed % 16 == FULL_POOL_SEED_CLASS;
    // One seed in three puts the metadata on a device of its own.
    let separate = seed % 3 == 2;
    // One seed in four compresses with zstd.
    let compression = if seed % 4 == 1 {
        fewerbytes_engine::Compression::Zstd { level: 3 }
    } else {
        fewerbytes_engine::Compression::Lz4
    };
    let (data_bytes, meta_bytes) = if separate {
        let data_blocks = smallest_separate_data_blocks();
        let meta_blocks = Geometry::metadata_blocks_needed(data_blocks, false);
        (data_blocks * BLOCK as u64, Some(meta_blocks * BLOCK as u64))
    } else {
        (pool_bytes, None)
    };
    let data = Arc::new(FaultStorage::new("data", data_bytes));
    let meta = meta_bytes.map(|m| Arc::new(FaultStorage::new("meta", m)));
    // One seed in four has a page store of a few slots, so most checkpoints put
    // pages in data blocks and free them when the pages move.
    let tiny_page_store = seed % 4 == TINY_PAGE_STORE_SEED_CLASS;
    Pool::format(
        data.clone() as Arc<dyn Storage>,
        meta.clone().map(|m| m as Arc<dyn Storage>),
        meta.as_ref().map(|_| "meta".to_string()),
        &CreateOptions {
            compression,
            page_slots: tiny_page_store.then_some(TINY_PAGE_SLOTS),
            ..CreateOptions::default()
        },
    )
    .expect("format");
    let mut bases = vec![data.crash_pages(CrashMode::KeepAll)];
    bases.extend(meta.as_ref().map(|m| m.crash_pages(CrashMode::KeepAll)));
    let log = IoLog::new();
    let index_path = index_file(seed, "recorded");
    let devices = Devices::from_images(&bases, Some(&log)).saving_index_to(index_path.clone());
    drop((data, meta));

    let mut model = Model::default();
    let mut w = Workload {
        log: &log,
        model: &mut model,
        coverage: Coverage::default(),
        capacity_blocks: 0,
        full,
        saved_indexes: Vec::new(),
        healed: None,
    };
    let mut pool = w.run("open", true, |_| devices.open().expect("open"));
    w.capacity_blocks = pool.info().addressable_bytes / BLOCK as u64;
    if full {
        w.fill_pool(&mut rng, &pool);
    } else {
        for name in ["v0", "v1"] {
            w.create(&pool, name, VOL_BLOCKS);
        }
        if seed % 8 == crate::receive::RECEIVE_SEED_CLASS {
            w.receive(&mut rng, &pool);
        }
        if seed % 8 == crate::heal::HEAL_SEED_CLASS {
            pool = w.heal(&mut rng, pool, &devices);
        }
    }
    let ops = rng.gen_range(OPS_MIN..=OPS_MAX);
    for _ in 0..ops {
        if rng.gen_range(0..CRASH_IN_WORKLOAD_EVERY) == 0 {
            pool = w.crash(&mut rng, pool, &devices);
        } else {
            w.random_op(&mut rng, &mut pool, &devices);
        }
    }
    w.coverage.note(&pool);
    w.run("close", true, |_| pool.close().expect("close"));
    w.keep_saved_index(&devices);
    let _ = std::fs::remove_file(&index_path);
    let coverage = w.coverage;
    let saved_indexes = w.saved_indexes;
    let healed = w.healed;
    Recorded {
        seed,
        bases,
        events: log.take(),
        model,
        coverage,
        saved_indexes,
        healed,
    }
}

/// The smallest data device a pool with separate metadata can have, in blocks.
pub(crate) fn smallest_separate_data_blocks() -> u64 {
    (1u64..)
        .map(|mib| mib << 8)
        .find(|blocks| {
            let meta = Geometry::metadata_blocks_needed(*blocks, false);
            Geometry::compute(*blocks, Some(meta), false).is_ok()
        })
        .expect("some size fits")
}

/// What runs beside a write in [`Workload::concurrent`].
enum Beside {
    Write((String, u32, u64, Vec<u8>)),
    Compact,
    Flush,
    /// Clone the other volume to this name.
    Clone(String),
    /// Delete the other volume.
    Delete,
}

/// Runs operations and records each in the model with its log positions.
pub(crate) struct Workload<'a> {
    pub(crate) log: &'a Arc<IoLog>,
    pub(crate) model: &'a mut Model,
    pub(crate) coverage: Coverage,
    /// Blocks the volumes may add up to.
    pub(crate) capacity_blocks: u64,
    /// Whether this workload fills the pool (its large writes are then random data).
    pub(crate) full: bool,
    /// What each clean close saved of the index, at its log position.
    pub(crate) saved_indexes: Vec<(usize, Vec<u8>)>,
    /// The block the heal workload damaged and healed, if it ran.
    pub(crate) healed: Option<crate::heal::Healed>,
}

impl Workload<'_> {
    /// After a clean close: keep what it saved of the index (nothing, when the
    /// index was not ready), for the crash points past it.
    pub(crate) fn keep_saved_index(&mut self, devices: &Devices) {
        if let Some(bytes) = devices
            .saved_index
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
        {
            self.saved_indexes.push((self.log.len(), bytes));
        }
    }

    /// Run `f` as operation `what`; `f` gets the operation's index for the model.
    pub(crate) fn run<T>(&mut self, what: &str, barrier: bool, f: impl FnOnce(usize) -> T) -> T {
        let op = self.model.ops.len();
        let start = self.log.len();
        let out = f(op);
        let end = self.log.len();
        self.note(what, start, end, barrier);
        out
    }

    /// Note an operation that began at log position `start` and returned at `end`;
    /// its index.
    pub(crate) fn note(&mut self, what: &str, start: usize, end: usize, barrier: bool) -> usize {
        self.model.ops.push(OpRecord {
            what: what.to_string(),
            start,
            end,
            barrier,
            // A volume operation replaces these with the volumes after it (`settle`).
            volumes: self.model.volumes.clone(),
        });
        self.model.ops.len() - 1
    }

    /// Room for `extra` more volume blocks.
    pub(crate) fn room_for(&self, extra: u64) -> bool {
        let allocated: u64 = self.model.volumes.values().map(|(_, b)| b).sum();
        allocated + extra <= self.capacity_blocks
    }

    /// A write of `data` at `offset` of volume `name`, as one operation.
    pub(crate) fn write(
        &mut self,
        pool: &Arc<Pool>,
        name: &str,
        offset: u64,
        data: Vec<u8>,
        fua: bool,
    ) {
        let inc = self.model.volumes[name].0;
        let what = format!("write {name} {offset}+{}{}", data.len(), fua_tag(fua));
        let op = self.run(&what, false, |op| {
            let v = pool.open_volume(name).expect("volume");
            v.write(offset, &data, fua).expect("write");
            op
        });
        self.model.change(op, inc, offset, &data, fua);
    }

    /// Note the volumes after the operation just run.
    pub(crate) fn settle(&mut self) {
        let volumes = self.model.volumes.clone();
        if let Some(last) = self.model.ops.last_mut() {
            last.volumes = volumes;
        }
    }

    /// Many small writes of duplicate and zero blocks, a flush after every
    /// [`CHURN_FLUSH_EVERY`]: little data I/O but much journal, so the journal ring
    /// fills (a checkpoint at half) and wraps.
    pub(crate) fn churn(&mut self, rng: &mut StdRng, pool: &Arc<Pool>) {
        let patterns: Vec<Arc<Vec<u8>>> = (0..4u8)
            .map(|k| {
                Arc::new(if k == 0 {
                    vec![0u8; BLOCK]
                } else {
                    (0..BLOCK)
                        .map(|i| (i / 512) as u8 ^ k.wrapping_mul(37))
                        .collect()
                })
            })
            .collect();
        let names = self.writable();
        let writes = rng.gen_range(CHURN_WRITES / 2..=CHURN_WRITES);
        for i in 0..writes {
            let name = &names[rng.gen_range(0..names.len())];
            let (inc, blocks) = self.model.volumes[name];
            let len = rng.gen_range(1..=blocks.min(16));
            let lbn = rng.gen_range(0..=blocks - len);
            let chosen: Vec<&Arc<Vec<u8>>> = (0..len)
                .map(|_| &patterns[rng.gen_range(0..patterns.len())])
                .collect();
            let data: Vec<u8> = chosen.iter().flat_map(|p| p.iter().copied()).collect();
            let op = self.run(
                &format!("churn write {name} block {lbn}+{len}"),
                false,
                |op| {
                    let v = pool.open_volume(name).expect("volume");
                    v.write(lbn * BLOCK as u64, &data, false).expect("write");
                    op
                },
            );
            self.model.change_shared(op, inc, lbn, &chosen);
            if i % CHURN_FLUSH_EVERY == CHURN_FLUSH_EVERY - 1 {
                self.run("churn flush", true, |_| pool.flush().expect("flush"));
            }
        }
    }

    /// A volume taking all but a few small volumes' room, filled with random data:
    /// the pool's data region is then nearly full. Then overwrites of more blocks than
    /// are free: the writes must reclaim (give back the zones' unfilled runs, and
    /// checkpoint so freed blocks return) to go on.
    fn fill_pool(&mut self, rng: &mut StdRng, pool: &Arc<Pool>) {
        let big = self.capacity_blocks - 3 * VOL_BLOCKS;
        self.create(pool, "v0", big);
        self.create(pool, "v1", VOL_BLOCKS);
        let fills = (0..big).step_by(BLOCKS_PER_REQUEST_MAX as usize);
        let overwrites =
            (0..FULL_OVERWRITES).map(|_| rng.gen_range(0..=big - BLOCKS_PER_REQUEST_MAX));
        let lbns: Vec<u64> = fills.chain(overwrites.collect::<Vec<_>>()).collect();
        for (i, lbn) in lbns.into_iter().enumerate() {
            let len = (big - lbn).min(BLOCKS_PER_REQUEST_MAX);
            self.write(
                pool,
                "v0",
                lbn * BLOCK as u64,
                random_bytes(rng, len),
                false,
            );
            if i % FULL_FLUSH_EVERY == FULL_FLUSH_EVERY - 1 {
                self.run("flush", true, |_| pool.flush().expect("flush"));
            }
        }
    }

    /// Crash the devices in the middle of the workload, recover, check the recovered
    /// pool as a crash point is checked, and go on from what it holds.
    pub(crate) fn crash(
        &mut self,
        rng: &mut StdRng,
        pool: Arc<Pool>,
        devices: &Devices,
    ) -> Arc<Pool> {
        let at = self.log.len();
        let modes: Vec<CrashMode> = (0..2).map(|_| mode_for(rng.gen(), 0, 0)).collect();
        self.coverage.note(&pool);
        self.coverage.workload_crashes += 1;
        self.run(&format!("crash ({modes:?})"), false, |_| {
            devices.stop();
            drop(pool);
            for (dev, mode) in std::iter::once(&devices.data)
                .chain(devices.meta.as_ref())
                .zip(&modes)
            {
                dev.crash_in_place(*mode);
            }
        });
        let (op, pool) = self.run("open after a crash", true, |op| {
            (op, devices.open().expect("open after a crash"))
        });
        if let Err(why) = self.model.check_volumes(&pool, at) {
            panic!("after a crash in the workload at {at}: {why}");
        }
        let audit = pool.audit();
        assert!(
            audit.problems.is_empty(),
            "after a crash in the workload at {at}, the audit found {:?}",
            audit.problems
        );
        if let Some(why) = self.healed.as_ref().and_then(|h| h.check(&pool, at).err()) {
            panic!("after a crash in the workload at {at}: {why}");
        }
        self.model.adopt(&pool, op);
        pool
    }

    /// Create volume `name` of `blocks`.
    pub(crate) fn create(&mut self, pool: &Arc<Pool>, name: &str, blocks: u64) {
        self.run(&format!("create {name}"), true, |_| {
            pool.create_volume(name, blocks * BLOCK as u64)
                .expect("create")
        });
        self.model.create(name, blocks);
        self.settle();
    }

    /// The volumes that are not snapshots (a snapshot, `NAME@s`, is never written).
    fn writable(&self) -> Vec<String> {
        self.model
            .volumes
            .keys()
            .filter(|n| !n.contains('@'))
            .cloned()
            .collect()
    }

    /// Whether volume `name` has a snapshot.
    fn has_snapshot(&self, name: &str) -> bool {
        self.model.volumes.contains_key(&format!("{name}@s"))
    }

    /// Take snapshot `s` of `name`, or roll `name` back to it, or delete it.
    fn snapshot_op(&mut self, rng: &mut StdRng, pool: &Arc<Pool>, name: &str) {
        let snapshot = format!("{name}@s");
        if !self.has_snapshot(name) {
            if !self.room_for(self.model.volumes[name].1) {
                return;
            }
            let op = self.run(&format!("snapshot {snapshot}"), true, |op| {
                pool.snapshot_volume(name, "s").expect("snapshot");
                op
            });
            // A new incarnation holding what `name` holds now.
            self.model.clone_volume(op, name, &snapshot);
        } else if rng.gen_bool(0.6) {
            let grows = self.model.volumes[&snapshot]
                .1
                .saturating_sub(self.model.volumes[name].1);
            if !self.room_for(grows) {
                return;
            }
            let op = self.run(&format!("roll {name} back to {snapshot}"), true, |op| {
                pool.rollback_volume(name, "s")
                    .expect("rollback to a snapshot");
                op
            });
            self.model.clone_volume(op, &snapshot, name);
        } else {
            self.run(&format!("delete {snapshot}"), true, |_| {
                pool.delete_volume(&snapshot, false)
                    .expect("delete a snapshot")
            });
            self.model.volumes.remove(&snapshot);
        }
        self.settle();
    }

    /// One operation drawn at random (weights out of 32).
    pub(crate) fn random_op(&mut self, rng: &mut StdRng, pool: &mut Arc<Pool>, devices: &Devices) {
        let names = self.writable();
        let free: Vec<&str> = NAMES
            .iter()
            .copied()
            .filter(|n| !self.model.volumes.contains_key(*n))
            .collect();
        let vol = (!names.is_empty()).then(|| names[rng.gen_range(0..names.len())].clone());
        match (rng.gen_range(0..32), vol) {
            (0..=9, Some(name)) => {
                let blocks = self.model.volumes[&name].1;
                let (offset, len) = byte_range(rng, blocks);
                let data = data_of(rng, len as usize);
                self.write(pool, &name, offset, data, rng.gen_range(0..6) == 0);
            }
            (10..=13, Some(name)) => self.range_op(rng, pool, &name),
            (14..=16, vol) => {
                let by_volume = vol.filter(|_| rng.gen_bool(0.5));
                let what = match &by_volume {
                    Some(name) => format!("flush (volume {name})"),
                    None => "flush".to_string(),
                };
                self.run(&what, true, |_| match &by_volume {
                    Some(name) => pool.open_volume(name).expect("volume").flush(),
                    None => pool.flush(),
                })
                .expect("flush");
            }
            (17, Some(name)) if rng.gen_bool(0.3) => self.snapshot_op(rng, pool, &name),
            (17, Some(name)) if names.len() >= 2 && rng.gen_bool(0.4) => {
                let others: Vec<&String> = names.iter().filter(|n| **n != name).collect();
                let from = others[rng.gen_range(0..others.len())].clone();
                let grows = self.model.volumes[&from]
                    .1
                    .saturating_sub(self.model.volumes[&name].1);
                if self.room_for(grows) {
                    let op = self.run(&format!("roll {name} back to {from}"), true, |op| {
                        pool.rollback_volume(&name, &from).expect("rollback");
                        op
                    });
                    // A new incarnation of the name, holding what `from` holds.
                    self.model.clone_volume(op, &from, &name);
                    self.settle();
                }
            }
            (17, Some(src)) if !free.is_empty() && self.room_for(self.model.volumes[&src].1) => {
                let dst = free[rng.gen_range(0..free.len())];
                let op = self.run(&format!("clone {src} to {dst}"), true, |op| {
                    pool.clone_volume(&src, dst).expect("clone");
                    op
                });
                self.model.clone_volume(op, &src, dst);
                self.settle();
            }
            (18, Some(name)) if self.has_snapshot(&name) => {
                let snapshot = format!("{name}@s");
                self.run(&format!("delete {snapshot}"), true, |_| {
                    pool.delete_volume(&snapshot, false)
                        .expect("delete a snapshot")
                });
                self.model.volumes.remove(&snapshot);
                self.settle();
            }
            (18, Some(name)) => {
                self.run(&format!("delete {name}"), true, |_| {
                    pool.delete_volume(&name, false).expect("delete")
                });
                self.model.volumes.remove(&name);
                self.settle();
            }
            (19, _) if !free.is_empty() && self.room_for(VOL_BLOCKS) => {
                let name = free[rng.gen_range(0..free.len())];
                self.create(pool, name, VOL_BLOCKS);
            }
            (20, Some(name)) if self.room_for(VOL_BLOCKS) => self.resize(rng, pool, &name),
            (21..=22, _) => {
                self.run("compact", false, |_| pool.compact().expect("compact"));
            }
            (23, _) => {
                self.coverage.note(pool);
                let p = pool.clone();
                // Every handle but `p` is gone; closing takes the final checkpoint.
                self.run("close", true, |_| p.close().expect("close"));
                self.keep_saved_index(devices);
                *pool = self.run("open", true, |_| devices.open().expect("reopen"));
            }
            (24..=25, Some(name)) => self.read_back(rng, pool, &name),
            (26..=27, Some(name)) => self.large_write(rng, pool, &name),
            (28..=29, Some(first)) if names.len() >= 2 => {
                let second = names.iter().find(|n| **n != first).expect("two volumes");
                self.concurrent(rng, pool, [&first, second]);
            }
            (30..=31, Some(_)) => self.churn(rng, pool),
            _ => {}
        }
    }

    /// A trim or a write-zeroes of a random byte range, some FUA.
    fn range_op(&mut self, rng: &mut StdRng, pool: &Arc<Pool>, name: &str) {
        let (inc, blocks) = self.model.volumes[name];
        let (offset, len) = byte_range(rng, blocks);
        let fua = rng.gen_range(0..6) == 0;
        let trim = rng.gen_bool(0.5);
        let kind = if trim { "trim" } else { "write-zeroes" };
        let what = format!("{kind} {name} {offset}+{len}{}", fua_tag(fua));
        let op = self.run(&what, false, |op| {
            let v = pool.open_volume(name).expect("volume");
            if trim {
                v.trim(offset, len, fua).expect("trim");
            } else {
                v.write_zeroes(offset, len, fua).expect("write-zeroes");
            }
            op
        });
        // Both read as zeros to the byte: a trim leaves a partial block as it was only
        // when even reclaiming finds no room, which a thick pool's reserve rules out.
        self.model
            .change(op, inc, offset, &vec![0; len as usize], fua);
    }

    /// Grow or shrink a volume (by up to half).
    fn resize(&mut self, rng: &mut StdRng, pool: &Arc<Pool>, name: &str) {
        let old = self.model.volumes[name].1;
        let mut blocks = rng.gen_range(old.max(VOL_BLOCKS) / 2..=old + VOL_BLOCKS);
        if blocks == old {
            blocks -= 1;
        }
        let op = self.run(&format!("resize {name} to {blocks} blocks"), true, |op| {
            pool.resize_volume(name, blocks * BLOCK as u64, true)
                .expect("resize");
            op
        });
        self.model.resize(op, name, blocks);
        self.settle();
    }

    /// A read during the workload, against the model (no crash yet to blur it).
    fn read_back(&mut self, rng: &mut StdRng, pool: &Arc<Pool>, name: &str) {
        let (inc, blocks) = self.model.volumes[name];
        let (offset, len) = byte_range(rng, blocks);
        let mut got = vec![0u8; len as usize];
        pool.open_volume(name)
            .expect("volume")
            .read(offset, &mut got)
            .expect("read");
        let at = offset as usize;
        assert!(
            got == self.model.bytes[&inc][at..at + len as usize],
            "volume {name} bytes {offset}+{len} differ from the model while the workload runs"
        );
    }

    /// A large aligned write: many blocks in one request, so commits by size and the
    /// journal ring's checkpoints come into the log (random data on a full pool).
    fn large_write(&mut self, rng: &mut StdRng, pool: &Arc<Pool>, name: &str) {
        let blocks = self.model.volumes[name].1;
        let len = rng.gen_range(8..=blocks.min(BLOCKS_PER_REQUEST_MAX));
        let offset = rng.gen_range(0..=blocks - len) * BLOCK as u64;
        let data = if self.full {
            random_bytes(rng, len)
        } else {
            data_of(rng, len as usize * BLOCK)
        };
        self.write(pool, name, offset, data, false);
    }

    /// Two requests at once, each on its own thread: a write, and beside it a write
    /// to another volume, a compaction round, a flush, or a clone or delete of the
    /// other volume. Each is an operation of the model with its own return position;
    /// both began at the same one. A flush or volume operation is a barrier for what
    /// returned before it began, not for the write beside it (so it is noted first:
    /// operations before a barrier in the model are covered by it).
    fn concurrent(&mut self, rng: &mut StdRng, pool: &Arc<Pool>, names: [&String; 2]) {
        let write = |rng: &mut StdRng, name: &String| {
            let (inc, blocks) = self.model.volumes[name];
            let (offset, len) = byte_range(rng, blocks);
            (name.clone(), inc, offset, data_of(rng, len as usize))
        };
        let first = write(rng, names[0]);
        let other = names[1].clone();
        let clone_to = NAMES
            .iter()
            .find(|n| !self.model.volumes.contains_key(**n))
            .filter(|_| self.room_for(self.model.volumes[&other].1));
        let beside = match (rng.gen_range(0..5), clone_to) {
            (0, _) => Beside::Write(write(rng, &other)),
            (1, _) => Beside::Compact,
            (2, Some(dst)) => Beside::Clone(dst.to_string()),
            (3, _) if !self.has_snapshot(&other) => Beside::Delete,
            _ => Beside::Flush,
        };
        let log = self.log;
        let start = log.len();
        let (first_end, beside_end) = std::thread::scope(|s| {
            let (name, _, offset, data) = &first;
            let v = pool.open_volume(name).expect("volume");
            let a = s.spawn(move || {
                v.write(*offset, data, false).expect("write");
                log.len()
            });
            let b = s.spawn(|| {
                match &beside {
                    Beside::Write((name, _, offset, data)) => {
                        let v = pool.open_volume(name).expect("volume");
                        v.write(*offset, data, false).expect("write");
                    }
                    Beside::Compact => {
                        pool.compact().expect("compact");
                    }
                    Beside::Flush => pool.flush().expect("flush"),
                    Beside::Clone(dst) => {
                        pool.clone_volume(&other, dst).expect("clone");
                    }
                    Beside::Delete => pool.delete_volume(&other, false).expect("delete"),
                }
                log.len()
            });
            (a.join().expect("writer"), b.join().expect("beside"))
        });
        let describe = |(name, _, offset, data): &(String, u32, u64, Vec<u8>)| {
            format!("{name} {offset}+{}", data.len())
        };
        let mut writes = vec![&first];
        match &beside {
            Beside::Flush => {
                self.note("flush beside a write", start, beside_end, true);
            }
            Beside::Compact => {
                self.note("compact beside a write", start, beside_end, false);
            }
            Beside::Clone(dst) => {
                let what = format!("clone {other} to {dst} beside a write");
                let op = self.note(&what, start, beside_end, true);
                self.model.clone_volume(op, &other, dst);
                self.settle();
            }
            Beside::Delete => {
                let what = format!("delete {other} beside a write");
                self.note(&what, start, beside_end, true);
                self.model.volumes.remove(&other);
                self.settle();
            }
            Beside::Write(w) => writes.push(w),
        }
        for (i, w) in writes.into_iter().enumerate() {
            let end = if i == 0 { first_end } else { beside_end };
            let op = self.note(
                &format!("write {} (concurrent)", describe(w)),
                start,
                end,
                false,
            );
            let (_, inc, offset, data) = w;
            self.model.change(op, *inc, *offset, data, false);
        }
    }
}

pub(crate) fn fua_tag(fua: bool) -> &'static str {
    if fua {
        " FUA"
    } else {
        ""
    }
}
