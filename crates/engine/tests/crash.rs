//! A crash at every write: each seeded workload runs once on devices that record
//! every write and flush, in order, with the log position at which each operation
//! began and returned. Then, for every position N of that log (a *crash point*: the
//! machine stopped just before event N), the devices are rebuilt as a crash there
//! would leave them (what the last flush before N made durable, plus none, all, or a
//! seeded subset of the writes since, some torn at 512 bytes), the pool is opened,
//! and what a user would notice is checked:
//!
//! - every write acknowledged before the last completed flush (or volume operation,
//!   or clean close), and every completed FUA write, reads back exactly;
//! - every other block reads as its content at that flush or as one of the contents
//!   written since by an operation that had begun before the crash; nothing else;
//! - the volumes are those of the last completed volume operation (or, if one was
//!   under way, those it made, and then everything before it is exact);
//! - the reference-count audit finds nothing; the pool takes a write, a flush and a
//!   read back.
//!
//! For some crash points the recovery itself crashes: the open is recorded too, the
//! devices are rebuilt as a crash at a sampled event of the open would leave them,
//! and the same guarantees must hold after the next open.
//!
//! Replay one failure: `FEWERBYTES_SEED=<seed> FEWERBYTES_CRASH_AT=<point>`. Run more
//! workloads: `FEWERBYTES_CRASH_SEEDS=<count>`; `FEWERBYTES_CRASH_SOAK=1` runs 2,000
//! from a random first seed (docs/testing.md, "Crash simulation").

mod common;
use common::BLOCK;
use fewerbytes_engine::geometry::Geometry;
use fewerbytes_engine::storage::{
    CrashMode, FaultPlan, FaultStorage, Image, IoEvent, IoLog, LogReplay, Storage,
};
use fewerbytes_engine::{CreateOptions, OpenOptions, Pool};
use rand::{rngs::StdRng, Rng, RngCore, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Workloads in a default run: enough for well over 10,000 crash points.
const SEEDS_DEFAULT: u64 = 40;
/// Workloads in a soak (`FEWERBYTES_CRASH_SOAK=1`).
const SEEDS_SOAK: u64 = 2000;
/// Operations per workload after the first volumes are made (bounds the log).
const OPS_MIN: usize = 40;
/// See [`OPS_MIN`].
const OPS_MAX: usize = 120;
/// A volume's size when created, in blocks: small, so a whole volume is read back
/// after every crash.
const VOL_BLOCKS: u64 = 96;
/// Volume names a workload uses.
const NAMES: [&str; 4] = ["v0", "v1", "v2", "v3"];
/// Writes in one churn (at most): enough to fill half the smallest journal ring.
const CHURN_WRITES: usize = 2000;
/// A churn flushes after this many writes.
const CHURN_FLUSH_EVERY: usize = 64;
/// Workloads whose seed is this modulo 16 fill the pool with random data first.
const FULL_POOL_SEED_CLASS: u64 = 7;
/// A full pool's filling and overwriting flush after this many large writes.
const FULL_FLUSH_EVERY: usize = 8;
/// Large overwrites after a pool is filled: 1,536 blocks, more than the ~800 left free.
const FULL_OVERWRITES: usize = 24;
/// The most blocks a large write covers (one engine step).
const BLOCKS_PER_REQUEST_MAX: u64 = 64;
/// A volume up to this many blocks is read whole after every crash; of a larger one,
/// the blocks written since the barrier and one in [`SAMPLE_ONE_IN`] of the others.
const WHOLE_VOLUME_BLOCKS_MAX: u64 = 1024;
/// See [`WHOLE_VOLUME_BLOCKS_MAX`].
const SAMPLE_ONE_IN: u64 = 32;
/// Runs of a workload a replay tries for the log order of the failing run.
const REPLAY_RUNS_MAX: usize = 200;
/// About one operation in this many of a workload is a crash, after which the
/// workload goes on from what the recovered pool holds.
const CRASH_IN_WORKLOAD_EVERY: u32 = 40;
/// One crash point in this many also crashes its recovery.
const SECOND_CRASH_EVERY: u64 = 6;

/// Which device of a log: 0 is the data device (and the metadata, on one device).
const DATA: usize = 0;
const META: usize = 1;

/// The smallest single device a pool can be formatted on, in whole MiB.
fn smallest_pool_bytes() -> u64 {
    (1u64..)
        .map(|mib| mib << 20)
        .find(|bytes| Geometry::compute(bytes / BLOCK as u64, None, false).is_ok())
        .expect("some size fits")
}

/// A volume as the model knows it: which incarnation of a name, and its size.
type VolumeSet = BTreeMap<String, (u32, u64)>;

/// One operation of a workload, placed in the log.
struct OpRecord {
    what: String,
    /// Log length when it was called and when it returned.
    start: usize,
    end: usize,
    /// Everything before it is durable once it returned (flush, volume operation, close).
    barrier: bool,
    /// The volumes after it.
    volumes: VolumeSet,
}

/// A block's content after an operation; `fua` if that operation was a FUA request.
struct Version {
    op: usize,
    fua: bool,
    bytes: Arc<Vec<u8>>,
}

/// The workload's model: the bytes of every volume now, and for each block of each
/// volume incarnation every content it was given, by operation.
#[derive(Default)]
struct Model {
    ops: Vec<OpRecord>,
    volumes: VolumeSet,
    next_incarnation: u32,
    bytes: HashMap<u32, Vec<u8>>,
    history: HashMap<(u32, u64), Vec<Version>>,
}

impl Model {
    fn block(&self, inc: u32, lbn: u64) -> Vec<u8> {
        let at = lbn as usize * BLOCK;
        self.bytes[&inc][at..at + BLOCK].to_vec()
    }

    /// Operation `op` wrote `data` at `offset` of incarnation `inc`.
    fn change(&mut self, op: usize, inc: u32, offset: u64, data: &[u8], fua: bool) {
        if data.is_empty() {
            return;
        }
        let at = offset as usize;
        self.bytes.get_mut(&inc).expect("volume")[at..at + data.len()].copy_from_slice(data);
        let first = offset / BLOCK as u64;
        let last = (offset + data.len() as u64 - 1) / BLOCK as u64;
        for lbn in first..=last {
            let bytes = Arc::new(self.block(inc, lbn));
            self.history
                .entry((inc, lbn))
                .or_default()
                .push(Version { op, fua, bytes });
        }
    }

    /// Operation `op` wrote whole blocks `blocks` from `lbn` on: `change` for
    /// contents shared between versions (a churn writes the same few blocks often).
    fn change_shared(&mut self, op: usize, inc: u32, lbn: u64, blocks: &[&Arc<Vec<u8>>]) {
        let bytes = self.bytes.get_mut(&inc).expect("volume");
        for (i, block) in blocks.iter().enumerate() {
            let at = (lbn as usize + i) * BLOCK;
            bytes[at..at + BLOCK].copy_from_slice(block);
            self.history
                .entry((inc, lbn + i as u64))
                .or_default()
                .push(Version {
                    op,
                    fua: false,
                    bytes: Arc::clone(block),
                });
        }
    }

    fn create(&mut self, op: usize, name: &str, blocks: u64) -> u32 {
        let inc = self.next_incarnation;
        self.next_incarnation += 1;
        self.bytes.insert(inc, vec![0; blocks as usize * BLOCK]);
        self.volumes.insert(name.to_string(), (inc, blocks));
        let _ = op;
        inc
    }

    fn clone_volume(&mut self, op: usize, src: &str, dst: &str) {
        let (src_inc, blocks) = self.volumes[src];
        let inc = self.create(op, dst, blocks);
        let bytes = self.bytes[&src_inc].clone();
        self.change(op, inc, 0, &bytes, false);
    }

    fn resize(&mut self, op: usize, name: &str, blocks: u64) {
        let (inc, old) = self.volumes[name];
        if blocks < old {
            // The blocks past the new end are dropped; grown again, they read zeros.
            let zeros = vec![0u8; (old - blocks) as usize * BLOCK];
            self.change(op, inc, blocks * BLOCK as u64, &zeros, false);
        }
        self.bytes
            .get_mut(&inc)
            .expect("volume")
            .resize(blocks as usize * BLOCK, 0);
        self.volumes.insert(name.to_string(), (inc, blocks));
    }
}

/// What the workloads did that the crash points land in, summed over pool lifetimes.
#[derive(Default, Clone, Copy)]
struct Coverage {
    checkpoints: u64,
    journal_commits: u64,
    journal_bytes: u64,
    compacted_blocks: u64,
    workload_crashes: u64,
}

impl Coverage {
    /// Add what `pool` did since it was opened.
    fn note(&mut self, pool: &Pool) {
        let stats = pool.stats();
        self.checkpoints += stats.checkpoints;
        self.journal_commits += stats.journal_commits;
        self.compacted_blocks += stats.compacted_blocks;
        self.journal_bytes += stats
            .metadata_written_by_region
            .iter()
            .filter(|(region, _)| region == "journal")
            .map(|(_, bytes)| bytes)
            .sum::<u64>();
    }

    fn add(&mut self, other: &Coverage) {
        self.checkpoints += other.checkpoints;
        self.journal_commits += other.journal_commits;
        self.journal_bytes += other.journal_bytes;
        self.compacted_blocks += other.compacted_blocks;
        self.workload_crashes += other.workload_crashes;
    }
}

/// The devices a workload runs on, and what they held before it began.
struct Devices {
    data: Arc<FaultStorage>,
    meta: Option<Arc<FaultStorage>>,
}

impl Devices {
    fn from_images(images: &[Image], log: Option<&Arc<IoLog>>) -> Self {
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
        }
    }

    fn open(&self) -> fewerbytes_engine::Result<Arc<Pool>> {
        Pool::open_devices(
            self.data.clone() as Arc<dyn Storage>,
            self.meta
                .clone()
                .map(|m| (m as Arc<dyn Storage>, "meta".to_string())),
            &OpenOptions { threads: Some(2) },
        )
    }

    /// Stop the devices, so dropping a pool does nothing a crash would not.
    fn stop(&self) {
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
struct Recorded {
    seed: u64,
    bases: Vec<Image>,
    events: Vec<IoEvent>,
    model: Model,
    coverage: Coverage,
}

/// `blocks` of random bytes (incompressible, unique: each takes a data block).
fn random_bytes(rng: &mut StdRng, blocks: u64) -> Vec<u8> {
    let mut out = vec![0u8; blocks as usize * BLOCK];
    rng.fill_bytes(&mut out);
    out
}

/// Random bytes of one of the kinds a guest writes.
fn data_of(rng: &mut StdRng, len: usize) -> Vec<u8> {
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
fn byte_range(rng: &mut StdRng, blocks: u64) -> (u64, u64) {
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
fn record(seed: u64, pool_bytes: u64) -> Recorded {
    let mut rng = StdRng::seed_from_u64(seed);
    // One seed in sixteen fills the pool.
    let full = seed % 16 == FULL_POOL_SEED_CLASS;
    // One seed in three puts the metadata on a device of its own.
    let separate = seed % 3 == 2;
    let (data_bytes, meta_bytes) = if separate {
        let data_blocks = smallest_separate_data_blocks();
        let meta_blocks = Geometry::metadata_blocks_needed(data_blocks, false);
        (data_blocks * BLOCK as u64, Some(meta_blocks * BLOCK as u64))
    } else {
        (pool_bytes, None)
    };
    let data = Arc::new(FaultStorage::new("data", data_bytes));
    let meta = meta_bytes.map(|m| Arc::new(FaultStorage::new("meta", m)));
    Pool::format(
        data.clone() as Arc<dyn Storage>,
        meta.clone().map(|m| m as Arc<dyn Storage>),
        meta.as_ref().map(|_| "meta".to_string()),
        &CreateOptions::default(),
    )
    .expect("format");
    let mut bases = vec![data.crash_pages(CrashMode::KeepAll)];
    bases.extend(meta.as_ref().map(|m| m.crash_pages(CrashMode::KeepAll)));
    let log = IoLog::new();
    let devices = Devices::from_images(&bases, Some(&log));
    drop((data, meta));

    let mut model = Model::default();
    let mut w = Workload {
        log: &log,
        model: &mut model,
        coverage: Coverage::default(),
        capacity_blocks: 0,
        full,
    };
    let mut pool = w.run("open", true, |_| devices.open().expect("open"));
    w.capacity_blocks = pool.info().addressable_bytes / BLOCK as u64;
    if full {
        // A volume taking all but a few small volumes' room, filled with random data:
        // the pool's data region is then nearly full, and overwrites must reclaim.
        let big = w.capacity_blocks - 3 * VOL_BLOCKS;
        w.create(&pool, "v0", big);
        w.create(&pool, "v1", VOL_BLOCKS);
        for (i, lbn) in (0..big)
            .step_by(BLOCKS_PER_REQUEST_MAX as usize)
            .enumerate()
        {
            let len = (big - lbn).min(BLOCKS_PER_REQUEST_MAX);
            w.write(
                &pool,
                "v0",
                lbn * BLOCK as u64,
                random_bytes(&mut rng, len),
                false,
            );
            if i % FULL_FLUSH_EVERY == FULL_FLUSH_EVERY - 1 {
                w.run("flush", true, |_| pool.flush().expect("flush"));
            }
        }
        // Overwrites of more blocks than are free: the writes must reclaim (give back
        // the zones' unfilled runs, checkpoint so freed blocks return) to go on.
        for i in 0..FULL_OVERWRITES {
            let lbn = rng.gen_range(0..=big - BLOCKS_PER_REQUEST_MAX);
            let data = random_bytes(&mut rng, BLOCKS_PER_REQUEST_MAX);
            w.write(&pool, "v0", lbn * BLOCK as u64, data, false);
            if i % FULL_FLUSH_EVERY == FULL_FLUSH_EVERY - 1 {
                w.run("flush", true, |_| pool.flush().expect("flush"));
            }
        }
    } else {
        for name in ["v0", "v1"] {
            w.create(&pool, name, VOL_BLOCKS);
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
    let coverage = w.coverage;
    Recorded {
        seed,
        bases,
        events: log.take(),
        model,
        coverage,
    }
}

/// The smallest data device a pool with separate metadata can have, in blocks.
fn smallest_separate_data_blocks() -> u64 {
    (1u64..)
        .map(|mib| mib << 8)
        .find(|blocks| {
            let meta = Geometry::metadata_blocks_needed(*blocks, false);
            Geometry::compute(*blocks, Some(meta), false).is_ok()
        })
        .expect("some size fits")
}

/// Runs operations and records each in the model with its log positions.
struct Workload<'a> {
    log: &'a Arc<IoLog>,
    model: &'a mut Model,
    coverage: Coverage,
    /// Blocks the volumes may add up to.
    capacity_blocks: u64,
    /// Whether this workload fills the pool (its large writes are then random data).
    full: bool,
}

impl Workload<'_> {
    /// Run `f` as operation `what`; `f` gets the operation's index for the model.
    fn run<T>(&mut self, what: &str, barrier: bool, f: impl FnOnce(usize) -> T) -> T {
        let op = self.model.ops.len();
        let start = self.log.len();
        let out = f(op);
        let end = self.log.len();
        self.model.ops.push(OpRecord {
            what: what.to_string(),
            start,
            end,
            barrier,
            // A volume operation replaces these with the volumes after it (`settle`).
            volumes: self.model.volumes.clone(),
        });
        out
    }

    /// Room for `extra` more volume blocks.
    fn room_for(&self, extra: u64) -> bool {
        let allocated: u64 = self.model.volumes.values().map(|(_, b)| b).sum();
        allocated + extra <= self.capacity_blocks
    }

    /// A write of `data` at `offset` of volume `name`, as one operation.
    fn write(&mut self, pool: &Arc<Pool>, name: &str, offset: u64, data: Vec<u8>, fua: bool) {
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
    fn settle(&mut self) {
        let volumes = self.model.volumes.clone();
        if let Some(last) = self.model.ops.last_mut() {
            last.volumes = volumes;
        }
    }

    /// Many small writes of duplicate and zero blocks, a flush after every
    /// [`CHURN_FLUSH_EVERY`]: little data I/O but much journal, so the journal ring
    /// fills (a checkpoint at half) and wraps.
    fn churn(&mut self, rng: &mut StdRng, pool: &Arc<Pool>) {
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
        let names: Vec<String> = self.model.volumes.keys().cloned().collect();
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

    /// Crash the devices in the middle of the workload, recover, check the recovered
    /// pool as a crash point is checked, and go on from what it holds.
    fn crash(&mut self, rng: &mut StdRng, pool: Arc<Pool>, devices: &Devices) -> Arc<Pool> {
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
        self.model.adopt(&pool, op);
        pool
    }

    fn create(&mut self, pool: &Arc<Pool>, name: &str, blocks: u64) {
        let op = self.run(&format!("create {name}"), true, |op| {
            pool.create_volume(name, blocks * BLOCK as u64)
                .expect("create");
            op
        });
        self.model.create(op, name, blocks);
        self.settle();
    }

    fn random_op(&mut self, rng: &mut StdRng, pool: &mut Arc<Pool>, devices: &Devices) {
        let names: Vec<String> = self.model.volumes.keys().cloned().collect();
        let free: Vec<&str> = NAMES
            .iter()
            .copied()
            .filter(|n| !self.model.volumes.contains_key(*n))
            .collect();
        let vol = (!names.is_empty()).then(|| names[rng.gen_range(0..names.len())].clone());
        match (rng.gen_range(0..32), vol) {
            (30..=31, Some(_)) => self.churn(rng, pool),
            (0..=9, Some(name)) => {
                let blocks = self.model.volumes[&name].1;
                let (offset, len) = byte_range(rng, blocks);
                let data = data_of(rng, len as usize);
                self.write(pool, &name, offset, data, rng.gen_range(0..6) == 0);
            }
            (10..=13, Some(name)) => {
                let (inc, blocks) = self.model.volumes[&name];
                let (offset, len) = byte_range(rng, blocks);
                let fua = rng.gen_range(0..6) == 0;
                let trim = rng.gen_bool(0.5);
                let kind = if trim { "trim" } else { "write-zeroes" };
                let what = format!("{kind} {name} {offset}+{len}{}", fua_tag(fua));
                let op = self.run(&what, false, |op| {
                    let v = pool.open_volume(&name).expect("volume");
                    if trim {
                        v.trim(offset, len, fua).expect("trim");
                    } else {
                        v.write_zeroes(offset, len, fua).expect("write-zeroes");
                    }
                    op
                });
                // Both read as zeros to the byte (the pool is never full here).
                self.model
                    .change(op, inc, offset, &vec![0; len as usize], fua);
            }
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
            (17, Some(src)) if !free.is_empty() && self.room_for(self.model.volumes[&src].1) => {
                let dst = free[rng.gen_range(0..free.len())];
                let op = self.run(&format!("clone {src} to {dst}"), true, |op| {
                    pool.clone_volume(&src, dst).expect("clone");
                    op
                });
                self.model.clone_volume(op, &src, dst);
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
            (20, Some(name)) if self.room_for(VOL_BLOCKS) => {
                let old = self.model.volumes[&name].1;
                let mut blocks = rng.gen_range(old.max(VOL_BLOCKS) / 2..=old + VOL_BLOCKS);
                if blocks == old {
                    blocks -= 1;
                }
                let op = self.run(&format!("resize {name} to {blocks} blocks"), true, |op| {
                    pool.resize_volume(&name, blocks * BLOCK as u64, true)
                        .expect("resize");
                    op
                });
                self.model.resize(op, &name, blocks);
                self.settle();
            }
            (21..=22, _) => {
                self.run("compact", false, |_| pool.compact().expect("compact"));
            }
            (23, _) => {
                self.coverage.note(pool);
                let p = pool.clone();
                self.run("close", true, |_| {
                    // Every handle but `p` is gone; closing takes the final checkpoint.
                    p.close().expect("close")
                });
                *pool = self.run("open", true, |_| devices.open().expect("reopen"));
            }
            (26..=27, Some(name)) => {
                // A large aligned write: many blocks in one request, so commits by size
                // and the journal ring's checkpoints come into the log.
                let blocks = self.model.volumes[&name].1;
                let len = rng.gen_range(8..=blocks.min(BLOCKS_PER_REQUEST_MAX));
                let offset = rng.gen_range(0..=blocks - len) * BLOCK as u64;
                let data = if self.full {
                    random_bytes(rng, len)
                } else {
                    data_of(rng, len as usize * BLOCK)
                };
                self.write(pool, &name, offset, data, false);
            }
            (28..=29, Some(first)) if names.len() >= 2 => {
                // Two writers at once, on two volumes: one operation to the model
                // (begun when both began, returned when both returned).
                let second = names.iter().find(|n| **n != first).expect("two volumes");
                let writes: Vec<(String, u32, u64, Vec<u8>)> = [&first, second]
                    .into_iter()
                    .map(|name| {
                        let (inc, blocks) = self.model.volumes[name];
                        let (offset, len) = byte_range(rng, blocks);
                        (name.clone(), inc, offset, data_of(rng, len as usize))
                    })
                    .collect();
                let what = format!(
                    "two writers: {}",
                    writes
                        .iter()
                        .map(|(n, _, o, d)| format!("{n} {o}+{}", d.len()))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                let op = self.run(&what, false, |op| {
                    std::thread::scope(|s| {
                        for (name, _, offset, data) in &writes {
                            let v = pool.open_volume(name).expect("volume");
                            s.spawn(move || v.write(*offset, data, false).expect("write"));
                        }
                    });
                    op
                });
                for (_, inc, offset, data) in &writes {
                    self.model.change(op, *inc, *offset, data, false);
                }
            }
            (24..=25, Some(name)) => {
                // A read during the workload, against the model.
                let (inc, blocks) = self.model.volumes[&name];
                let (offset, len) = byte_range(rng, blocks);
                let mut got = vec![0u8; len as usize];
                pool.open_volume(&name)
                    .expect("volume")
                    .read(offset, &mut got)
                    .expect("read");
                let at = offset as usize;
                assert!(
                    got == self.model.bytes[&inc][at..at + len as usize],
                    "seed workload: volume {name} bytes {offset}+{len} differ from the model before any crash"
                );
            }
            _ => {}
        }
    }
}

fn fua_tag(fua: bool) -> &'static str {
    if fua {
        " FUA"
    } else {
        ""
    }
}

fn mix(a: u64, b: u64) -> u64 {
    let mut x = a.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.wrapping_add(0x632b_e59b_d9b4_e019);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^ (x >> 29)
}

/// The survival mode of crash point `at` of workload `seed` (and of its second crash).
fn mode_for(seed: u64, at: usize, salt: u64) -> CrashMode {
    let h = mix(mix(seed, at as u64), salt);
    match h % 4 {
        0 => CrashMode::DropAll,
        1 => CrashMode::KeepAll,
        _ => CrashMode::Random(h),
    }
}

fn describe(events: &[IoEvent], at: usize) -> String {
    match events.get(at) {
        None => "after the last event".to_string(),
        Some(IoEvent::Write {
            device,
            offset_bytes,
            data,
        }) => format!(
            "before a write of {} bytes at offset {offset_bytes} of device {device}",
            data.len()
        ),
        Some(IoEvent::Flush { device }) => format!("before a flush of device {device}"),
        Some(IoEvent::Crash { device, .. }) => {
            format!("before the workload's own crash of device {device}")
        }
    }
}

impl Recorded {
    /// Check a pool opened after a crash at `at` against the model, audit it, and
    /// see that it takes new writes.
    fn verify(&self, pool: &Arc<Pool>, at: usize) -> Result<(), String> {
        self.model.check_volumes(pool, at)?;
        let audit = pool.audit();
        if !audit.problems.is_empty() {
            return Err(format!("the audit found {:?}", audit.problems));
        }
        keeps_working(pool)
    }
}

impl Model {
    /// Check the volumes of a pool opened after a crash at `at`, and every block of
    /// them, against what the model allows.
    fn check_volumes(&self, pool: &Arc<Pool>, at: usize) -> Result<(), String> {
        let ops = &self.ops;
        // The last barrier that returned before the crash.
        let mut durable = ops.iter().rposition(|o| o.barrier && o.end <= at);
        let under_way = ops.iter().position(|o| o.start < at && at < o.end);
        let got: BTreeMap<String, u64> = pool
            .volume_sizes()
            .into_iter()
            .map(|(name, bytes)| (name, bytes / BLOCK as u64))
            .collect();
        let sizes = |set: &VolumeSet| -> BTreeMap<String, u64> {
            set.iter().map(|(n, (_, b))| (n.clone(), *b)).collect()
        };
        let empty = VolumeSet::new();
        let before = durable.map_or(&empty, |i| &ops[i].volumes);
        if got != sizes(before) {
            // A volume operation under way may have landed: then it is the barrier.
            match under_way {
                Some(i) if ops[i].barrier && got == sizes(&ops[i].volumes) => durable = Some(i),
                _ => {
                    return Err(format!(
                        "volumes are {got:?}, expected {:?}{}",
                        sizes(before),
                        under_way
                            .map(|i| format!(" or {:?} ({})", sizes(&ops[i].volumes), ops[i].what))
                            .unwrap_or_default()
                    ))
                }
            }
        }
        let volumes = durable.map_or(&empty, |i| &ops[i].volumes);
        let zeros = vec![0u8; BLOCK];
        for (name, (inc, blocks)) in volumes {
            let vol = pool
                .open_volume(name)
                .map_err(|e| format!("opening volume {name}: {e}"))?;
            // A small volume is read whole. Of a large one (a full pool's), every block
            // written since the barrier is read, and a sample of the others.
            let whole = *blocks <= WHOLE_VOLUME_BLOCKS_MAX;
            let mut bytes = vec![
                0u8;
                if whole {
                    *blocks as usize * BLOCK
                } else {
                    BLOCK
                }
            ];
            if whole {
                vol.read(0, &mut bytes)
                    .map_err(|e| format!("reading volume {name}: {e}"))?;
            }
            for lbn in 0..*blocks {
                let versions = self
                    .history
                    .get(&(*inc, lbn))
                    .map(Vec::as_slice)
                    .unwrap_or(&[]);
                // The floor: the content at the barrier, or a later completed FUA write's.
                let floor = versions.iter().rposition(|v| {
                    durable.is_some_and(|d| v.op <= d) || (v.fua && ops[v.op].end <= at)
                });
                let later: Vec<&Version> = versions[floor.map_or(0, |f| f + 1)..]
                    .iter()
                    .filter(|v| ops[v.op].start < at)
                    .collect();
                let block = if whole {
                    &bytes[lbn as usize * BLOCK..(lbn as usize + 1) * BLOCK]
                } else if !later.is_empty() || mix(at as u64, lbn).is_multiple_of(SAMPLE_ONE_IN) {
                    vol.read(lbn * BLOCK as u64, &mut bytes)
                        .map_err(|e| format!("reading volume {name} block {lbn}: {e}"))?;
                    &bytes[..]
                } else {
                    continue;
                };
                let floor_bytes = floor.map_or(zeros.as_slice(), |f| versions[f].bytes.as_slice());
                let mut allowed =
                    std::iter::once(floor_bytes).chain(later.iter().map(|v| v.bytes.as_slice()));
                if !allowed.any(|a| a == block) {
                    let later: Vec<&str> = later.iter().map(|v| ops[v.op].what.as_str()).collect();
                    return Err(format!(
                        "volume {name} block {lbn} reads none of its allowed contents: the one at {} or those of {later:?}{}",
                        floor.map_or("its creation".to_string(), |f| format!("'{}'", ops[versions[f].op].what)),
                        if block == zeros.as_slice() { " (it reads zeros)" } else { "" }
                    ));
                }
            }
        }
        Ok(())
    }

    /// After operation `op` recovered from a crash: every block now holds what the
    /// pool reads (one of the contents the model allowed), durably.
    fn adopt(&mut self, pool: &Arc<Pool>, op: usize) {
        for (name, (inc, blocks)) in self.volumes.clone() {
            let mut bytes = vec![0u8; blocks as usize * BLOCK];
            pool.open_volume(&name)
                .and_then(|v| v.read(0, &mut bytes))
                .expect("read after recovery");
            for lbn in 0..blocks {
                let block = &bytes[lbn as usize * BLOCK..(lbn as usize + 1) * BLOCK];
                if *block != *self.block(inc, lbn) {
                    self.change(op, inc, lbn * BLOCK as u64, block, false);
                }
            }
        }
    }
}

/// The pool takes a write, a flush, and reads it back.
fn keeps_working(pool: &Arc<Pool>) -> Result<(), String> {
    let name = match pool.volume_sizes().first() {
        Some((name, _)) => name.clone(),
        None => {
            pool.create_volume("after", VOL_BLOCKS * BLOCK as u64)
                .map_err(|e| format!("creating a volume after the crash: {e}"))?;
            "after".to_string()
        }
    };
    let v = pool.open_volume(&name).map_err(|e| e.to_string())?;
    let mut block = vec![0u8; BLOCK];
    StdRng::seed_from_u64(7).fill_bytes(&mut block);
    v.write(BLOCK as u64 + 100, &block, false)
        .map_err(|e| format!("a write after the crash: {e}"))?;
    v.flush()
        .map_err(|e| format!("a flush after the crash: {e}"))?;
    let mut got = vec![0u8; BLOCK];
    v.read(BLOCK as u64 + 100, &mut got)
        .map_err(|e| format!("a read after the crash: {e}"))?;
    if got != block {
        return Err("a block written and flushed after the crash reads back wrong".into());
    }
    Ok(())
}

/// What a run of crash points found.
#[derive(Default)]
struct Tally {
    points: AtomicU64,
    second: AtomicU64,
    events: AtomicU64,
    coverage: parking_lot::Mutex<Coverage>,
    failures: parking_lot::Mutex<Vec<String>>,
}

impl Tally {
    /// Note a failure, and print it now (a long soak shows failures as they come).
    fn fail(&self, why: String) {
        let _ = writeln!(std::io::stdout(), "crash simulation failure: {why}");
        self.failures.lock().push(why);
    }
}

/// Open after a crash at `at`, verify, and for some points crash the recovery too.
fn crash_point(rec: &Recorded, replay: &LogReplay, tally: &Tally) -> Result<(), String> {
    let at = replay.position();
    let mode = mode_for(rec.seed, at, 0);
    let images = replay.crash_images(mode);
    let second = mix(rec.seed, at as u64).is_multiple_of(SECOND_CRASH_EVERY);
    let open_log = IoLog::new();
    let devices = Devices::from_images(&images, second.then_some(&open_log));
    let pool = devices.open().map_err(|e| format!("open failed: {e}"))?;
    let open_events = open_log.take();
    let first = rec.verify(&pool, at);
    devices.stop();
    drop(pool);
    first?;
    tally.points.fetch_add(1, Ordering::Relaxed);
    if !second || open_events.is_empty() {
        return Ok(());
    }
    // The recovery crashes at one of its own events.
    let m = (mix(rec.seed, at as u64 + 1) % open_events.len() as u64) as usize;
    let mode2 = mode_for(rec.seed, at, 1 + m as u64);
    let mut replay2 = LogReplay::new(images, &open_events);
    replay2.seek(m);
    let devices2 = Devices::from_images(&replay2.crash_images(mode2), None);
    let during = format!(
        "a second crash during recovery at its event {m} of {} ({}), mode {mode2:?}",
        open_events.len(),
        describe(&open_events, m)
    );
    let pool = devices2
        .open()
        .map_err(|e| format!("{during}: open failed: {e}"))?;
    let result = rec.verify(&pool, at);
    devices2.stop();
    drop(pool);
    result.map_err(|e| format!("{during}: {e}"))?;
    tally.second.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// The log's shape: the order, device, place and length of its events, not their
/// bytes (a pool's nonce and key differ every run). The commit and compaction threads
/// can order a run's events differently from the last run of the same seed.
fn shape(events: &[IoEvent]) -> u64 {
    events.iter().fold(0, |h, e| {
        mix(
            h,
            match e {
                IoEvent::Write {
                    device,
                    offset_bytes,
                    data,
                } => mix(*device as u64, mix(*offset_bytes, data.len() as u64)),
                IoEvent::Flush { device } => mix(1, *device as u64),
                IoEvent::Crash { device, .. } => mix(2, *device as u64),
            },
        )
    })
}

/// Record workload `seed`; with `want`, again until its log has that shape.
fn record_shaped(seed: u64, pool_bytes: u64, want: Option<u64>) -> Recorded {
    let mut rec = record(seed, pool_bytes);
    let mut runs = 1;
    while want.is_some_and(|w| shape(&rec.events) != w) && runs < REPLAY_RUNS_MAX {
        rec = record(seed, pool_bytes);
        runs += 1;
    }
    if let Some(w) = want {
        let got = shape(&rec.events);
        let _ = writeln!(
            std::io::stdout(),
            "replay of seed {seed}: {} log of shape {got:016x} after {runs} runs{}",
            if got == w { "the same" } else { "a different" },
            if got == w {
                String::new()
            } else {
                format!(" (wanted {w:016x}; the crash point is checked on this log)")
            }
        );
    }
    rec
}

/// Every crash point of one workload (or only `only`).
fn crash_workload(seed: u64, pool_bytes: u64, only: Option<(usize, Option<u64>)>, tally: &Tally) {
    let want = only.and_then(|(_, shape)| shape);
    let rec = match std::panic::catch_unwind(|| record_shaped(seed, pool_bytes, want)) {
        Ok(rec) => rec,
        Err(panic) => {
            tally.fail(format!(
                "FEWERBYTES_SEED={seed}: the recorded run failed: {}",
                panic_text(&*panic)
            ));
            return;
        }
    };
    tally.coverage.lock().add(&rec.coverage);
    tally
        .events
        .fetch_add(rec.events.len() as u64, Ordering::Relaxed);
    let mut replay = LogReplay::new(rec.bases.clone(), &rec.events);
    let points: Vec<usize> = match only {
        Some((at, _)) => vec![at.min(rec.events.len())],
        None => (0..=rec.events.len()).collect(),
    };
    for at in points {
        replay.seek(at);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            crash_point(&rec, &replay, tally)
        }))
        .unwrap_or_else(|panic| Err(format!("panicked: {}", panic_text(&*panic))));
        if let Err(why) = outcome {
            let op = rec
                .model
                .ops
                .iter()
                .rfind(|o| o.start <= at)
                .map_or("", |o| o.what.as_str());
            tally.fail(format!(
                "FEWERBYTES_SEED={seed} FEWERBYTES_CRASH_AT={at} FEWERBYTES_CRASH_LOG={:016x} (of {} events; {}, during or after '{op}'; mode {:?}; {} unflushed writes): {why}",
                shape(&rec.events),
                rec.events.len(),
                describe(&rec.events, at),
                mode_for(seed, at, 0),
                replay.unflushed_writes(),
            ));
            // One failure per workload: later points of it would mostly repeat it.
            return;
        }
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name} must be a number, not {v:?}"))
    })
}

#[test]
fn a_crash_at_every_write_keeps_what_was_acknowledged() {
    let started = std::time::Instant::now();
    let pool_bytes = smallest_pool_bytes();
    let only_at = env_u64("FEWERBYTES_CRASH_AT").map(|at| {
        let shape = std::env::var("FEWERBYTES_CRASH_LOG").ok().map(|v| {
            u64::from_str_radix(&v, 16)
                .unwrap_or_else(|_| panic!("FEWERBYTES_CRASH_LOG must be hex, not {v:?}"))
        });
        (at as usize, shape)
    });
    let seeds: Vec<u64> = match env_u64("FEWERBYTES_SEED") {
        Some(seed) => vec![seed],
        None if std::env::var("FEWERBYTES_CRASH_SOAK").is_ok_and(|v| v == "1") => {
            let first = rand::random::<u32>() as u64;
            let _ = writeln!(std::io::stdout(), "crash soak: seeds from {first}");
            (first..first + SEEDS_SOAK).collect()
        }
        None => {
            let first = env_u64("FEWERBYTES_CRASH_FIRST_SEED").unwrap_or(0);
            (first..first + env_u64("FEWERBYTES_CRASH_SEEDS").unwrap_or(SEEDS_DEFAULT)).collect()
        }
    };
    let tally = Tally::default();
    let next = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    // Two workers: each takes the next workload and all of its crash points.
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(&seed) = seeds.get(i) else { break };
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                crash_workload(seed, pool_bytes, only_at, &tally);
            });
        }
    });
    let points = tally.points.load(Ordering::Relaxed);
    let second = tally.second.load(Ordering::Relaxed);
    // Written past the test harness's capture, for scripts/test.sh's summary.
    let _ = writeln!(
        std::io::stdout(),
        "crash points: {points} across {} workloads, {second} second crashes during recovery, in {:.1} s",
        seeds.len(),
        started.elapsed().as_secs_f64()
    );
    let c = *tally.coverage.lock();
    let _ = writeln!(
        std::io::stdout(),
        "crash workloads: {} device writes and flushes logged; {} checkpoints, {} journal commits ({} KiB), {} packed blocks compacted, {} crashes inside workloads",
        tally.events.load(Ordering::Relaxed),
        c.checkpoints,
        c.journal_commits,
        c.journal_bytes >> 10,
        c.compacted_blocks,
        c.workload_crashes
    );
    let failures = tally.failures.into_inner();
    assert!(
        failures.is_empty(),
        "{} workloads failed a crash point:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
