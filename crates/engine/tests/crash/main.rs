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
//! For some crash points a super block copy is also a bad sector: a seeded bit of a
//! seeded copy reads back flipped (`FaultPlan::flip_read`), as a drive returning bad
//! bytes would, and the same guarantees must hold (the pool opens from the other
//! copy). Only where the crash left both copies valid: a copy torn by the crash and
//! the other rotten are two faults. At some crash points with neither fault, one copy
//! of a directory page reads back with a bit flipped instead (`bad_copy.rs`): the
//! open reads the other copy (format version 3). At some crash points with no fault
//! and map pages shared by clones, snapshots or rollbacks, a scrub finds nothing.
//!
//! Replay one failure with the variables it prints: `FEWERBYTES_SEED=<seed>
//! FEWERBYTES_CRASH_AT=<point> FEWERBYTES_CRASH_LOG=<shape>` (the workload is run
//! again until its log has the failing run's order). Run more workloads:
//! `FEWERBYTES_CRASH_SEEDS=<count>` (from `FEWERBYTES_CRASH_FIRST_SEED`, default 0);
//! `FEWERBYTES_CRASH_SOAK=1` runs 2,000 from a random first seed. docs/testing.md,
//! "Crash simulation", says more. One seed in eight runs a receive beside writers
//! first (`receive.rs`), another a damaged block healed by a write beside writers
//! (`heal.rs`).

mod bad_copy;
mod bad_sector;
#[path = "../common/mod.rs"]
mod common;
mod heal;
mod model;
mod receive;
mod workload;

use common::BLOCK;
use fewerbytes_engine::storage::{
    CrashMode, FaultPlan, FlipRead, IoEvent, IoLog, LogReplay, Storage as _,
};
use fewerbytes_engine::Pool;
use rand::{rngs::StdRng, RngCore, SeedableRng};
use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use workload::{record, smallest_pool_bytes, Coverage, Devices, Recorded, VOL_BLOCKS};

/// Workloads in a default run: enough for well over 10,000 crash points.
const SEEDS_DEFAULT: u64 = 32;
/// Workloads in a soak (`FEWERBYTES_CRASH_SOAK=1`).
const SEEDS_SOAK: u64 = 2000;
/// Runs of a workload a replay tries for the log order of the failing run.
const REPLAY_RUNS_MAX: usize = 200;
/// One crash point in this many also crashes its recovery.
const SECOND_CRASH_EVERY: u64 = 6;
/// One crash point in this many also has a super block copy that reads back with a
/// bit flipped.
const BAD_SECTOR_EVERY: u64 = 4;
/// One crash point in this many, where the pool holds shared map pages and no fault
/// was injected, is also scrubbed: about 150 of a default run's 32,000 points (a
/// scrub of these pools of a few MiB takes milliseconds).
const SCRUB_EVERY: u64 = 2;

/// Mix two numbers into a well-spread one (splitmix64's finaliser): the survival modes,
/// second crashes and samples follow from a workload's seed and a crash point.
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

/// The event a crash at `at` came just before, for a failure's message.
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
        if let Some(healed) = &self.healed {
            healed.check(pool, at)?;
        }
        let audit = pool.audit();
        if !audit.problems.is_empty() {
            return Err(format!("the audit found {:?}", audit.problems));
        }
        keeps_working(pool)
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
    /// Crash points opened with a rotted journal sector.
    rotted: AtomicU64,
    /// Crash points opened with a super block copy reading back flipped.
    bad_sectors: AtomicU64,
    /// Crash points opened with one copy of a directory page reading back flipped.
    bad_copies: AtomicU64,
    /// Crash points opened with a saved dedup index beside the pool, and those whose
    /// open loaded it (the rest found it stale and rebuilt).
    saved_index_offered: AtomicU64,
    saved_index_loaded: AtomicU64,
    /// Crash points inside a volume rollback (between its call and its return).
    in_rollback: AtomicU64,
    /// Crash points inside the taking or the deleting of a snapshot.
    in_snapshot: AtomicU64,
    /// Crash points whose pool held shared map pages and was scrubbed clean.
    scrubbed: AtomicU64,
    /// Reads after a crash of a block the heal workload damaged: damaged (the heal
    /// not yet durable), and good.
    heal_damaged: AtomicU64,
    heal_good: AtomicU64,
    /// Crash points whose open read blocks stored new back from the journal's
    /// `NewStored` records to compute their fingerprints.
    read_back: AtomicU64,
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

/// The dedup index a clean close of the recorded run saved, as a file of its own for
/// one crash point (removed with it).
struct SavedFile<'a> {
    bytes: &'a [u8],
    path: std::path::PathBuf,
}

impl<'a> SavedFile<'a> {
    /// The latest index saved at or before log position `at`.
    fn latest(rec: &'a Recorded, at: usize) -> Option<SavedFile<'a>> {
        let (_, bytes) = rec.saved_indexes.iter().rev().find(|(end, _)| *end <= at)?;
        Some(SavedFile {
            bytes,
            path: workload::index_file(rec.seed, "point"),
        })
    }

    /// Write the file (again: an open that loads it removes it).
    fn put(&self) -> Result<std::path::PathBuf, String> {
        std::fs::write(&self.path, self.bytes)
            .map_err(|e| format!("writing {}: {e}", self.path.display()))?;
        Ok(self.path.clone())
    }
}

impl Drop for SavedFile<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Open after a crash at `at`, verify, and for some points crash the recovery too.
fn crash_point(rec: &Recorded, replay: &LogReplay, tally: &Tally) -> Result<(), String> {
    let at = replay.position();
    let mode = mode_for(rec.seed, at, 0);
    let mut images = replay.crash_images(mode);
    // Some points also find one journal sector rotted (the metadata device is the last).
    let pick = mix(rec.seed, at as u64 + 7);
    let rotted = if pick.is_multiple_of(bad_sector::BAD_SECTOR_EVERY) {
        images
            .last_mut()
            .and_then(|meta| bad_sector::rot_one(meta, pick / 3))
    } else {
        None
    };
    let with_rot = |e: String| match &rotted {
        Some(what) => format!("{e} (with {what})"),
        None => e,
    };
    let second = mix(rec.seed, at as u64).is_multiple_of(SECOND_CRASH_EVERY);
    let open_log = IoLog::new();
    let mut devices = Devices::from_images(&images, second.then_some(&open_log));
    // The index the latest clean close before the crash saved lies beside the pool:
    // the open must load it only if it is this state's, and rebuild otherwise.
    let saved = SavedFile::latest(rec, at);
    if let Some(file) = &saved {
        devices = devices.saving_index_to(file.put()?);
        tally.saved_index_offered.fetch_add(1, Ordering::Relaxed);
    }
    // One fault at a time: a flipped super block copy only where no journal sector
    // rotted (two bad sectors are beyond the model).
    let flip = if rotted.is_none() {
        bad_super_block_sector(&devices, mix(mix(rec.seed, at as u64), 0xbad))
    } else {
        None
    };
    let mut bad = flip.as_ref().map(|(f, _)| {
        format!(
            "super block copy {} reading back with bits {:#04x} of byte {} flipped",
            f.offset_bytes / BLOCK as u64,
            f.mask,
            f.offset_bytes % BLOCK as u64
        )
    });
    if bad.is_some() {
        tally.bad_sectors.fetch_add(1, Ordering::Relaxed);
    } else if rotted.is_none() {
        bad = bad_copy::flip_one_copy(&devices, mix(mix(rec.seed, at as u64), 0xc0b1));
        if bad.is_some() {
            tally.bad_copies.fetch_add(1, Ordering::Relaxed);
        }
    }
    let pool = devices.open().map_err(|e| match &bad {
        Some(what) => format!("open failed with {what}: {e}"),
        None => with_rot(format!("open failed: {e}")),
    })?;
    let open_events = open_log.take();
    if pool.info().replay_blocks_read_back > 0 {
        tally.read_back.fetch_add(1, Ordering::Relaxed);
    }
    if pool.index_status().loaded {
        tally.saved_index_loaded.fetch_add(1, Ordering::Relaxed);
    }
    let healthy = bad.is_none()
        && rotted.is_none()
        && !rec.healed.as_ref().is_some_and(|h| h.may_be_damaged(at));
    let first = rec
        .verify(&pool, at)
        .and_then(|()| scrub_shared(&pool, healthy, mix(rec.seed, at as u64 + 11), tally))
        .map_err(|e| match &bad {
            Some(what) => format!("{what}: {e}"),
            None => e,
        });
    devices.stop();
    drop(pool);
    first.map_err(with_rot)?;
    tally.points.fetch_add(1, Ordering::Relaxed);
    if rotted.is_some() {
        tally.rotted.fetch_add(1, Ordering::Relaxed);
    }
    if !second || open_events.is_empty() {
        return Ok(());
    }
    // The recovery crashes at one of its own events.
    let m = (mix(rec.seed, at as u64 + 1) % open_events.len() as u64) as usize;
    let mode2 = mode_for(rec.seed, at, 1 + m as u64);
    let mut replay2 = LogReplay::new(images, &open_events);
    replay2.seek(m);
    let mut devices2 = Devices::from_images(&replay2.crash_images(mode2), None);
    if let Some(file) = &saved {
        devices2 = devices2.saving_index_to(file.put()?);
    }
    // The bad sector stays bad unless a write of the recovery landed on it before
    // its crash (the copy's bytes on the device changed).
    if let Some((f, pristine)) = &flip {
        let dev = devices2.meta.as_ref().unwrap_or(&devices2.data);
        let mut now = vec![0u8; BLOCK];
        let at = f.offset_bytes / BLOCK as u64 * BLOCK as u64;
        if dev.read_at(&mut now, at).is_ok() && now == *pristine {
            dev.set_plan(FaultPlan {
                flip_read: Some(*f),
                ..FaultPlan::default()
            });
        }
    }
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

/// For one crash point in [`SCRUB_EVERY`] (chosen by `h`) of a `healthy` pool (no
/// fault injected) that holds map pages shared by clones, snapshots or rollbacks: a
/// scrub reads every page and object back and finds nothing, as the open found
/// nothing (the pages name their lineage, as the load checks them).
fn scrub_shared(pool: &Arc<Pool>, healthy: bool, h: u64, tally: &Tally) -> Result<(), String> {
    if !healthy || !h.is_multiple_of(SCRUB_EVERY) || pool.shared_map_pages() == 0 {
        return Ok(());
    }
    pool.scrub_start(0)
        .map_err(|e| format!("a scrub did not start: {e}"))?;
    // Bounded: a scrub always ends (its reads are of a pool of a few MiB).
    let s = loop {
        let s = pool.scrub_status();
        if s.state == fewerbytes_engine::ScrubState::Done {
            break s;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    if s.errors_found > 0 || s.stopped.is_some() {
        return Err(format!(
            "the scrub of a pool with {} shared map pages found {} errors ({:?}): {:?}",
            pool.shared_map_pages(),
            s.errors_found,
            s.stopped,
            s.findings
        ));
    }
    tally.scrubbed.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// For one crash point in [`BAD_SECTOR_EVERY`] (chosen by `h`) where both super
/// block copies are valid, make one of them (chosen by `h`) a bad sector: one of its
/// bits reads back flipped until it is written. Returns the flip and the copy's
/// block as the device holds it.
fn bad_super_block_sector(devices: &Devices, h: u64) -> Option<(FlipRead, Vec<u8>)> {
    if !h.is_multiple_of(BAD_SECTOR_EVERY) {
        return None;
    }
    let meta = devices.meta.as_ref().unwrap_or(&devices.data);
    let blocks: Vec<Vec<u8>> = (0..2u64)
        .map(|copy| {
            let mut block = vec![0u8; BLOCK];
            let read = meta.read_at(&mut block, copy * BLOCK as u64);
            let valid =
                read.is_ok() && fewerbytes_format::superblock::SuperBlock::decode(&block).is_ok();
            if valid {
                block
            } else {
                Vec::new()
            }
        })
        .collect();
    if blocks.iter().any(Vec::is_empty) {
        return None;
    }
    let copy = (h >> 8) % 2;
    let byte = (h >> 16) % BLOCK as u64;
    let flip = FlipRead {
        offset_bytes: copy * BLOCK as u64 + byte,
        mask: 1 << ((h >> 32) % 8),
    };
    meta.set_plan(FaultPlan {
        flip_read: Some(flip),
        ..FaultPlan::default()
    });
    let pristine = blocks.into_iter().nth(copy as usize)?;
    Some((flip, pristine))
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
        if rec
            .model
            .ops
            .iter()
            .any(|o| o.start < at && at < o.end && o.what.starts_with("roll "))
        {
            tally.in_rollback.fetch_add(1, Ordering::Relaxed);
        }
        if rec.model.ops.iter().any(|o| {
            o.start < at
                && at < o.end
                && (o.what.starts_with("snapshot ")
                    || o.what.starts_with("delete ") && o.what.contains('@'))
        }) {
            tally.in_snapshot.fetch_add(1, Ordering::Relaxed);
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            crash_point(&rec, &replay, tally)
        }))
        .unwrap_or_else(|panic| Err(format!("panicked: {}", panic_text(&*panic))));
        if let Err(why) = outcome {
            tally_heal(&rec, tally);
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
    tally_heal(&rec, tally);
}

/// Add what the crash points of `rec` read of its healed block.
fn tally_heal(rec: &Recorded, tally: &Tally) {
    if let Some(h) = &rec.healed {
        let damaged = h.read_damaged.load(Ordering::Relaxed);
        tally.heal_damaged.fetch_add(damaged, Ordering::Relaxed);
        let good = h.read_good.load(Ordering::Relaxed);
        tally.heal_good.fetch_add(good, Ordering::Relaxed);
    }
}

/// What a caught panic said.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// A number from the environment, if set.
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
    // Two workers: each takes the next workload and all of its crash points.
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(&seed) = seeds.get(i) else { break };
                crash_workload(seed, pool_bytes, only_at, &tally);
            });
        }
    });
    let points = tally.points.load(Ordering::Relaxed);
    let second = tally.second.load(Ordering::Relaxed);
    let rotted = tally.rotted.load(Ordering::Relaxed);
    // Written past the test harness's capture, for scripts/test.sh's summary.
    let _ = writeln!(
        std::io::stdout(),
        "crash points: {points} across {} workloads, {second} second crashes during recovery, {rotted} with a rotted journal sector, {} with a super block copy reading back flipped, {} with a directory page copy reading back flipped, {} with a saved dedup index beside the pool ({} loaded it), {} inside a volume rollback, {} inside taking or deleting a snapshot, {} scrubbed with shared map pages, {} reading blocks stored new back at replay, {} reading a block damaged before its heal's flush ({} reading it good), in {:.1} s",
        seeds.len(),
        tally.bad_sectors.load(Ordering::Relaxed),
        tally.bad_copies.load(Ordering::Relaxed),
        tally.saved_index_offered.load(Ordering::Relaxed),
        tally.saved_index_loaded.load(Ordering::Relaxed),
        tally.in_rollback.load(Ordering::Relaxed),
        tally.in_snapshot.load(Ordering::Relaxed),
        tally.scrubbed.load(Ordering::Relaxed),
        tally.read_back.load(Ordering::Relaxed),
        tally.heal_damaged.load(Ordering::Relaxed),
        tally.heal_good.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64()
    );
    let c = *tally.coverage.lock();
    let _ = writeln!(
        std::io::stdout(),
        "crash workloads: {} device writes and flushes logged; {} checkpoints, {} journal commits ({} KiB), {} packed blocks compacted, {} crashes inside workloads, {} discards of freed blocks, {} page-store slots discarded, {} data blocks holding metadata pages at the ends of pool lives",
        tally.events.load(Ordering::Relaxed),
        c.checkpoints,
        c.journal_commits,
        c.journal_bytes >> 10,
        c.compacted_blocks,
        c.workload_crashes,
        c.discards,
        c.slot_discards,
        c.page_blocks
    );
    // The proof that discards are safe is that crash points land after them.
    assert!(
        c.discards > 0 || seeds.len() < 8,
        "no workload discarded a freed block: the crash points prove nothing about discards"
    );
    assert!(
        c.slot_discards > 0 || seeds.len() < 8,
        "no workload discarded a retired page-store slot: the crash points prove nothing about them"
    );
    // Likewise for metadata pages in data blocks (the tiny page stores).
    assert!(
        c.page_blocks > 0 || seeds.len() < 8,
        "no workload put a metadata page in a data block: the crash points prove nothing about them"
    );
    assert!(
        tally.in_rollback.load(Ordering::Relaxed) > 0 || seeds.len() < 8,
        "no crash point fell inside a volume rollback: they prove nothing about it"
    );
    assert!(
        tally.in_snapshot.load(Ordering::Relaxed) > 0 || seeds.len() < 8,
        "no crash point fell inside taking or deleting a snapshot: they prove nothing about it"
    );
    assert!(
        tally.scrubbed.load(Ordering::Relaxed) > 0 || seeds.len() < 8,
        "no crash point scrubbed a pool with shared map pages: they prove nothing about it"
    );
    assert!(
        tally.read_back.load(Ordering::Relaxed) > 0 || seeds.len() < 8,
        "no crash point replayed a block stored new: they prove nothing about slim records"
    );
    assert!(
        tally.bad_sectors.load(Ordering::Relaxed) > 0 || seeds.len() < 8,
        "no crash point read a flipped super block copy: they prove nothing about bad sectors"
    );
    assert!(
        tally.bad_copies.load(Ordering::Relaxed) > 0 || seeds.len() < 8,
        "no crash point read a flipped directory page copy: they prove nothing about the copies"
    );
    assert!(
        tally.saved_index_loaded.load(Ordering::Relaxed) > 0 || seeds.len() < 8,
        "no crash point loaded a saved dedup index: they prove nothing about loading one"
    );
    assert!(
        tally.heal_damaged.load(Ordering::Relaxed) > 0 || seeds.len() < 8,
        "no crash point found a damaged block before its heal: they prove nothing about heals"
    );
    let failures = tally.failures.into_inner();
    assert!(
        failures.is_empty(),
        "{} workloads failed a crash point:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
