//! The engine against a trivial model (volume → bytes), over random writes of
//! duplicate, zero, compressible and random data at any byte offset and length
//! (one byte, a few, across block boundaries, whole blocks), trims and write-zeroes
//! likewise, clones, snapshots (taken, rolled back to, deleted, written to and
//! refused), deletes, flushes, compaction, clean reopens and crashes that
//! keep none, all or a random subset of the unflushed writes (some torn at 512-byte
//! boundaries). Each case ends with a reference-count audit and a scrub. A second
//! model runs a receive's engine steps (frozen internal bases, hidden partial
//! volumes, the checked in-place final step) interleaved with writes to the target
//! and the live base. A third interleaves the first's operations with damaged
//! blocks healed by writes (stored bytes flipped on the device, every block holding
//! them reading as damage until the good data is written through any volume).
//!
//! After a crash, a block written since the last flush may read as its flushed
//! content or as any content written since (the journal may have been committed in
//! the background); anything else is a failure. Flushed blocks must be exact.

mod common;
use common::*;
use fewerbytes_engine::storage::CrashMode;
use proptest::prelude::*;
use std::collections::BTreeMap;

const VOL_BLOCKS: u64 = 256;

#[derive(Debug, Clone)]
enum Data {
    Zero,
    Dup(u8),
    Compressible(u64),
    Random(u64),
}

#[derive(Debug, Clone)]
enum Op {
    Write {
        vol: u8,
        offset: u64,
        len: u64,
        data: Data,
    },
    Trim {
        vol: u8,
        offset: u64,
        len: u64,
    },
    /// Read without waiting (what an NBD server's reader thread does), checked
    /// against the model.
    ReadCached {
        vol: u8,
        offset: u64,
        len: u64,
    },
    WriteZeroes {
        vol: u8,
        offset: u64,
        len: u64,
    },
    Clone {
        src: u8,
        dst: u8,
    },
    Delete {
        vol: u8,
    },
    /// Take snapshot `snap` of `vol` (`v{vol}@s{snap}`).
    Snapshot {
        vol: u8,
        snap: u8,
    },
    /// Roll `vol` back to its snapshot `snap`.
    Rollback {
        vol: u8,
        snap: u8,
    },
    /// Delete snapshot `snap` of `vol`.
    DeleteSnapshot {
        vol: u8,
        snap: u8,
    },
    Create {
        vol: u8,
    },
    Flush,
    Compact,
    Reopen,
    /// A process or power crash: the device keeps none, all, or (seeded) a random
    /// subset of its unflushed writes, some of them torn at 512-byte boundaries.
    Crash(u64),
}

/// A byte range of a volume: any offset (or a sector's, or a block's, so whole
/// blocks are trimmed and written too), and a length of a few bytes, up to two
/// blocks, or up to five.
fn byte_range() -> impl Strategy<Value = (u64, u64)> + Clone {
    let vol_bytes = VOL_BLOCKS * BLOCK as u64;
    let offset = prop_oneof![
        0..vol_bytes,
        (0..VOL_BLOCKS * 8).prop_map(|s| s * 512),
        (0..VOL_BLOCKS).prop_map(|b| b * BLOCK as u64),
    ];
    offset.prop_flat_map(move |at| {
        let rest = vol_bytes - at;
        let len = prop_oneof![
            1..=rest.min(16),
            1..=rest.min(2 * BLOCK as u64),
            1..=rest.min(5 * BLOCK as u64),
        ];
        (Just(at), len)
    })
}

fn op() -> impl Strategy<Value = Op> {
    let vol = 0u8..3;
    let range = byte_range();
    let data = prop_oneof![
        Just(Data::Zero),
        (0u8..4).prop_map(Data::Dup),
        any::<u64>().prop_map(Data::Compressible),
        any::<u64>().prop_map(Data::Random),
    ];
    prop_oneof![
        10 => (vol.clone(), range.clone(), data).prop_map(|(vol, (offset, len), data)| Op::Write { vol, offset, len, data }),
        2 => (vol.clone(), range.clone()).prop_map(|(vol, (offset, len))| Op::Trim { vol, offset, len }),
        2 => (vol.clone(), range.clone()).prop_map(|(vol, (offset, len))| Op::ReadCached { vol, offset, len }),
        2 => (vol.clone(), range).prop_map(|(vol, (offset, len))| Op::WriteZeroes { vol, offset, len }),
        1 => (vol.clone(), vol.clone()).prop_map(|(src, dst)| Op::Clone { src, dst }),
        1 => vol.clone().prop_map(|vol| Op::Delete { vol }),
        2 => (vol.clone(), 0u8..2).prop_map(|(vol, snap)| Op::Snapshot { vol, snap }),
        1 => (vol.clone(), 0u8..2).prop_map(|(vol, snap)| Op::Rollback { vol, snap }),
        1 => (vol.clone(), 0u8..2).prop_map(|(vol, snap)| Op::DeleteSnapshot { vol, snap }),
        1 => vol.prop_map(|vol| Op::Create { vol }),
        3 => Just(Op::Flush),
        1 => Just(Op::Compact),
        1 => Just(Op::Reopen),
        1 => any::<u64>().prop_map(Op::Crash),
    ]
}

fn bytes_of(data: &Data, len: usize) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut out = vec![0u8; len];
    match data {
        Data::Zero => {}
        Data::Dup(k) => out
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i / 512) as u8 ^ k.wrapping_mul(37)),
        Data::Compressible(seed) => {
            compressible(&mut rand::rngs::StdRng::seed_from_u64(*seed), &mut out)
        }
        Data::Random(seed) => rand::rngs::StdRng::seed_from_u64(*seed).fill_bytes(&mut out),
    }
    out
}

/// Per volume: current bytes, and per block the contents it may hold after a crash.
struct Model {
    vols: BTreeMap<u8, Vec<u8>>,
    /// (volume, snapshot) → the volume's bytes when the snapshot was taken.
    snaps: BTreeMap<(u8, u8), Vec<u8>>,
    /// Block → allowed contents since the last flush (the flushed one first).
    maybe: BTreeMap<(u8, u64), Vec<Vec<u8>>>,
}

impl Model {
    fn block(&self, vol: u8, b: u64) -> Vec<u8> {
        self.vols[&vol][(b as usize) * BLOCK..(b as usize + 1) * BLOCK].to_vec()
    }
    fn change(&mut self, vol: u8, offset: u64, new: &[u8]) {
        let first = offset / BLOCK as u64;
        let last = (offset + new.len() as u64 - 1) / BLOCK as u64;
        for b in first..=last {
            let before = self.block(vol, b);
            self.maybe.entry((vol, b)).or_insert_with(|| vec![before]);
        }
        let at = offset as usize;
        self.vols.get_mut(&vol).unwrap()[at..at + new.len()].copy_from_slice(new);
        for b in first..=last {
            let now = self.block(vol, b);
            self.maybe.get_mut(&(vol, b)).unwrap().push(now);
        }
    }
    fn durable(&mut self) {
        self.maybe.clear();
    }
}

fn snap_name(v: u8, s: u8) -> String {
    format!("v{v}@s{s}")
}

fn name(v: u8) -> String {
    format!("v{v}")
}

fn run(ops: Vec<Op>, compression: fewerbytes_engine::Compression) {
    let (mut t, mut model) = start(compression);
    for op in ops {
        apply(&mut t, &mut model, op);
    }
    check_end(&t, &model);
}

/// A pool holding `v0` and `v1`, zeros, and its model.
fn start(compression: fewerbytes_engine::Compression) -> (TestPool, Model) {
    let options = fewerbytes_engine::CreateOptions {
        compression,
        ..Default::default()
    };
    let t = create_with(64 << 20, None, &options);
    let mut model = Model {
        vols: BTreeMap::new(),
        snaps: BTreeMap::new(),
        maybe: BTreeMap::new(),
    };
    for v in 0..2u8 {
        t.pool()
            .create_volume(&name(v), VOL_BLOCKS * BLOCK as u64)
            .unwrap();
        model.vols.insert(v, vec![0; (VOL_BLOCKS as usize) * BLOCK]);
    }
    (t, model)
}

/// One operation on the pool and the model.
fn apply(t: &mut TestPool, model: &mut Model, op: Op) {
    let p = t.pool().clone();
    match op {
        Op::ReadCached { vol, offset, len } if model.vols.contains_key(&vol) => {
            let mut got = vec![0u8; len as usize];
            let done = p
                .open_volume(&name(vol))
                .unwrap()
                .read_cached(offset, &mut got)
                .unwrap();
            // In memory nothing waits, and no checkpoint holds the pool here.
            assert!(done, "a read of memory-backed storage would have waited");
            let at = offset as usize;
            assert!(
                got == model.vols[&vol][at..at + got.len()],
                "volume {vol}: a cached read of bytes {offset}+{len} differs from the model"
            );
        }
        Op::Write {
            vol,
            offset,
            len,
            data,
        } if model.vols.contains_key(&vol) => {
            let bytes = bytes_of(&data, len as usize);
            p.open_volume(&name(vol))
                .unwrap()
                .write(offset, &bytes, false)
                .unwrap();
            model.change(vol, offset, &bytes);
        }
        Op::Trim { vol, offset, len } | Op::WriteZeroes { vol, offset, len }
            if model.vols.contains_key(&vol) =>
        {
            let v = p.open_volume(&name(vol)).unwrap();
            match op {
                Op::Trim { .. } => v.trim(offset, len, false),
                _ => v.write_zeroes(offset, len, false),
            }
            .unwrap();
            // Both read as zeros afterwards, to the byte (a partial block's other
            // bytes kept; the pool here is never full, where a trim may leave a
            // partial block as it was).
            model.change(vol, offset, &vec![0; len as usize]);
        }
        Op::Clone { src, dst }
            if model.vols.contains_key(&src) && !model.vols.contains_key(&dst) =>
        {
            p.clone_volume(&name(src), &name(dst)).unwrap();
            let copy = model.vols[&src].clone();
            model.vols.insert(dst, copy);
            model.durable(); // volume operations checkpoint everything
        }
        Op::Delete { vol } if model.snaps.keys().any(|(v, _)| *v == vol) => {
            let refused = p.delete_volume(&name(vol), false);
            assert!(refused.is_err(), "a volume with snapshots was deleted");
        }
        Op::Delete { vol } if model.vols.contains_key(&vol) => {
            p.delete_volume(&name(vol), false).unwrap();
            model.vols.remove(&vol);
            model.durable();
        }
        Op::Snapshot { vol, snap }
            if model.vols.contains_key(&vol) && !model.snaps.contains_key(&(vol, snap)) =>
        {
            p.snapshot_volume(&name(vol), &format!("s{snap}")).unwrap();
            model.snaps.insert((vol, snap), model.vols[&vol].clone());
            model.durable(); // volume operations checkpoint everything
                             // A snapshot is never written.
            let s = p.open_volume(&snap_name(vol, snap)).unwrap();
            assert!(s.write(0, &[1u8; 512], false).is_err());
            assert!(s.trim(0, BLOCK as u64, false).is_err());
        }
        Op::Rollback { vol, snap } if model.snaps.contains_key(&(vol, snap)) => {
            p.rollback_volume(&name(vol), &format!("s{snap}")).unwrap();
            model.vols.insert(vol, model.snaps[&(vol, snap)].clone());
            model.durable();
        }
        Op::DeleteSnapshot { vol, snap } if model.snaps.contains_key(&(vol, snap)) => {
            p.delete_volume(&snap_name(vol, snap), false).unwrap();
            model.snaps.remove(&(vol, snap));
            model.durable();
        }
        Op::Create { vol } if !model.vols.contains_key(&vol) => {
            p.create_volume(&name(vol), VOL_BLOCKS * BLOCK as u64)
                .unwrap();
            model
                .vols
                .insert(vol, vec![0; (VOL_BLOCKS as usize) * BLOCK]);
            model.durable();
        }
        Op::Flush => {
            p.flush().unwrap();
            model.durable();
        }
        Op::Compact => {
            // Moves live fragments; must change no byte and survive a later crash.
            p.compact().unwrap();
        }
        Op::Reopen => {
            drop(p);
            t.reopen();
            model.durable();
        }
        Op::Crash(seed) => {
            drop(p);
            t.crash(match seed % 3 {
                0 => CrashMode::DropAll,
                1 => CrashMode::KeepAll,
                _ => CrashMode::Random(seed),
            });
            // Each block: the flushed content or a later one; adopt what is there.
            for ((vol, b), allowed) in std::mem::take(&mut model.maybe) {
                if !model.vols.contains_key(&vol) {
                    continue;
                }
                let mut got = vec![0u8; BLOCK];
                t.pool()
                    .open_volume(&name(vol))
                    .unwrap()
                    .read(b * BLOCK as u64, &mut got)
                    .unwrap();
                assert!(
                    allowed.contains(&got),
                    "volume {vol} block {b} after crash holds none of its {} possible contents",
                    allowed.len()
                );
                let at = (b as usize) * BLOCK;
                model.vols.get_mut(&vol).unwrap()[at..at + BLOCK].copy_from_slice(&got);
            }
        }
        _ => {}
    }
}

/// Every volume and snapshot reads as the model's; the audit and a scrub are clean.
fn check_end(t: &TestPool, model: &Model) {
    let p = t.pool();
    for (vol, bytes) in &model.vols {
        let mut got = vec![0u8; bytes.len()];
        p.open_volume(&name(*vol))
            .unwrap()
            .read(0, &mut got)
            .unwrap();
        for b in 0..VOL_BLOCKS as usize {
            assert!(
                got[b * BLOCK..(b + 1) * BLOCK] == bytes[b * BLOCK..(b + 1) * BLOCK],
                "volume {vol} block {b} differs from the model"
            );
        }
    }
    for ((vol, snap), bytes) in &model.snaps {
        let mut got = vec![0u8; bytes.len()];
        p.open_volume(&snap_name(*vol, *snap))
            .unwrap()
            .read(0, &mut got)
            .unwrap();
        assert!(
            got == *bytes,
            "snapshot {vol}@{snap} differs from the model"
        );
    }
    let audit = p.audit();
    assert!(audit.problems.is_empty(), "audit: {:?}", audit.problems);
    // The pages the clones, snapshots and rollbacks share, read back from the device
    // and checked as the load checks them: a healthy pool scrubs clean.
    let scrub = scrub_to_end(p);
    assert_eq!(scrub.errors_found, 0, "scrub: {:#?}", scrub.findings);
}

proptest! {
    // 128 cases by default (about 20 s); `FEWERBYTES_SOAK=1` runs 2,048 (about 5 min).
    #![proptest_config(ProptestConfig {
        cases: if std::env::var("FEWERBYTES_SOAK").is_ok_and(|v| v == "1") { 2048 } else { 128 },
        ..ProptestConfig::default()
    })]
    #[test]
    fn engine_matches_model(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops, fewerbytes_engine::Compression::Lz4);
    }
}

proptest! {
    // A zstd pool: the same model, fewer cases (32 by default, 512 with
    // `FEWERBYTES_SOAK=1`); only how fragments are encoded differs.
    #![proptest_config(ProptestConfig {
        cases: if std::env::var("FEWERBYTES_SOAK").is_ok_and(|v| v == "1") { 512 } else { 32 },
        ..ProptestConfig::default()
    })]
    #[test]
    fn engine_matches_model_with_zstd(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops, fewerbytes_engine::Compression::Zstd { level: 3 });
    }
}

/// A step of the healing model: one of the model's operations, or a damaged block
/// healed by a write ([`heal_step`]).
#[derive(Debug, Clone)]
enum HealStep {
    Op(Op),
    /// Damage the block `pick` chooses (or a random block `plant`ed first), find it
    /// damaged (after a reopen too, if `reopen`), and write its good data to block
    /// `at` of volume `via`.
    Heal {
        pick: u64,
        plant: bool,
        via: u8,
        at: u64,
        reopen: bool,
    },
}

fn heal_step_strategy() -> impl Strategy<Value = HealStep> {
    prop_oneof![
        8 => op().prop_map(HealStep::Op),
        2 => (any::<u64>(), any::<bool>(), 0u8..3, 0..VOL_BLOCKS, any::<bool>()).prop_map(|(pick, plant, via, at, reopen)| HealStep::Heal { pick, plant, via, at, reopen }),
    ]
}

/// Every block of a volume or snapshot the model holds `data` in.
fn holders(model: &Model, data: &[u8]) -> Vec<(String, u64)> {
    let vols = model.vols.iter().map(|(v, b)| (name(*v), b));
    let snaps = model.snaps.iter().map(|((v, s), b)| (snap_name(*v, *s), b));
    let mut out = Vec::new();
    for (n, bytes) in vols.chain(snaps) {
        for (lbn, block) in bytes.chunks(BLOCK).enumerate() {
            if block == data {
                out.push((n.clone(), lbn as u64));
            }
        }
    }
    out
}

/// The good data of a block the model knows that is stored whole (nonzero and
/// incompressible, so its bytes can be found on the device), chosen by `pick`; or,
/// with none or `plant`, a fresh random block written to a volume first.
fn heal_target(t: &TestPool, model: &mut Model, pick: u64, plant: bool) -> Vec<u8> {
    let zeros = vec![0u8; BLOCK];
    let whole: Vec<&[u8]> = model
        .vols
        .values()
        .flat_map(|bytes| bytes.chunks(BLOCK))
        .filter(|b| *b != zeros.as_slice())
        .filter(|b| {
            fewerbytes_engine::compress_block(fewerbytes_engine::Compression::Lz4, b).is_none()
        })
        .collect();
    if !plant && !whole.is_empty() {
        return whole[(pick % whole.len() as u64) as usize].to_vec();
    }
    let vols: Vec<u8> = model.vols.keys().copied().collect();
    let vol = vols[(pick % vols.len() as u64) as usize];
    let lbn = (pick >> 8) % VOL_BLOCKS;
    let good = random_block(pick);
    t.pool()
        .open_volume(&name(vol))
        .unwrap()
        .write(lbn * BLOCK as u64, &good, false)
        .unwrap();
    model.change(vol, lbn * BLOCK as u64, &good);
    good
}

/// Flip a bit of every copy of `good` on the device (a drive returning bad bytes):
/// the live object's, and any stale copy of it in a freed block.
fn flip_stored_copies(t: &TestPool, good: &[u8]) {
    use fewerbytes_engine::storage::Storage as _;
    let image = t.dev.crash_image(CrashMode::KeepAll);
    let mut flipped = 0;
    for (i, block) in image.chunks_exact(BLOCK).enumerate() {
        if block == good {
            let mut bad = block.to_vec();
            bad[BLOCK / 2] ^= 0x10;
            t.dev.write_at(&bad, (i * BLOCK) as u64).unwrap();
            flipped += 1;
        }
    }
    assert!(
        flipped > 0,
        "the block's stored bytes are not on the device"
    );
}

/// Read block `lbn` of `vol`: it must fail as damage, never return bytes.
fn assert_reads_damaged(p: &std::sync::Arc<fewerbytes_engine::Pool>, vol: &str, lbn: u64) {
    let mut got = vec![0u8; BLOCK];
    match p
        .open_volume(vol)
        .unwrap()
        .read(lbn * BLOCK as u64, &mut got)
    {
        Err(e) => assert!(
            fewerbytes_engine::read_damage(&e).is_some(),
            "{vol} block {lbn}: the read failed, but not as damage: {e}"
        ),
        Ok(()) => panic!("{vol} block {lbn}: a damaged block read without an error"),
    }
}

/// A damaged block healed by a write (ARCHITECTURE.md, "Healing a damaged block"):
/// every volume and snapshot block holding the data reads as damage (never other
/// bytes) until the good data is written through any volume (one mapping it, a
/// clone, another); then, the write flushed, every one reads good. The damaged-object
/// set lives in memory (heal.rs): after a reopen no damage is known until a read
/// meets it again.
fn heal_step(
    t: &mut TestPool,
    model: &mut Model,
    pick: u64,
    plant: bool,
    via: u8,
    at: u64,
    reopen: bool,
) {
    if model.vols.is_empty() {
        return;
    }
    let good = heal_target(t, model, pick, plant);
    t.pool().flush().unwrap();
    model.durable();
    let holding = holders(model, &good);
    // One stored object holds the data (a write while the dedup index was still
    // being built after an open may have stored another copy: not this case).
    let objects: std::collections::BTreeSet<Option<u64>> = holding
        .iter()
        .map(|(n, lbn)| t.pool().object_of(n, *lbn).unwrap())
        .collect();
    if objects.len() != 1 {
        return;
    }
    // Reopened first, as heal.rs's tests do: a block written since the open may
    // still be read from memory, which no drive's bad bytes reach.
    t.reopen();
    flip_stored_copies(t, &good);
    for (n, lbn) in &holding {
        assert_reads_damaged(t.pool(), n, *lbn);
    }
    assert_eq!(
        t.pool().stats().damaged_objects_known,
        1,
        "the damage found"
    );
    if reopen {
        t.reopen();
        model.durable();
        assert_eq!(
            t.pool().stats().damaged_objects_known,
            0,
            "a reopened pool knows no damage"
        );
        let (n, lbn) = &holding[(pick % holding.len() as u64) as usize];
        assert_reads_damaged(t.pool(), n, *lbn);
        assert_eq!(
            t.pool().stats().damaged_objects_known,
            1,
            "the damage found again"
        );
    }
    let vols: Vec<u8> = model.vols.keys().copied().collect();
    let via = if model.vols.contains_key(&via) {
        via
    } else {
        vols[(pick % vols.len() as u64) as usize]
    };
    let healed = t.pool().stats().damaged_objects_healed;
    t.pool()
        .open_volume(&name(via))
        .unwrap()
        .write(at * BLOCK as u64, &good, false)
        .unwrap();
    model.change(via, at * BLOCK as u64, &good);
    t.pool().flush().unwrap();
    model.durable();
    let stats = t.pool().stats();
    assert_eq!(
        stats.damaged_objects_healed,
        healed + 1,
        "the write healed the object"
    );
    assert_eq!(stats.damaged_objects_known, 0);
    for (n, lbn) in holders(model, &good) {
        let mut got = vec![0u8; BLOCK];
        t.pool()
            .open_volume(&n)
            .unwrap()
            .read(lbn * BLOCK as u64, &mut got)
            .unwrap_or_else(|e| panic!("{n} block {lbn} after the heal: {e}"));
        assert!(
            got == good,
            "{n} block {lbn} after the heal reads other bytes"
        );
    }
}

fn run_heal(steps: Vec<HealStep>) {
    let (mut t, mut model) = start(fewerbytes_engine::Compression::Lz4);
    for step in steps {
        match step {
            HealStep::Op(op) => apply(&mut t, &mut model, op),
            HealStep::Heal {
                pick,
                plant,
                via,
                at,
                reopen,
            } => heal_step(&mut t, &mut model, pick, plant, via, at, reopen),
        }
    }
    check_end(&t, &model);
}

proptest! {
    // 8 cases by default (a few seconds); `FEWERBYTES_SOAK=1` runs 256.
    #![proptest_config(ProptestConfig {
        cases: if std::env::var("FEWERBYTES_SOAK").is_ok_and(|v| v == "1") { 256 } else { 8 },
        ..ProptestConfig::default()
    })]
    #[test]
    fn damaged_blocks_heal_by_writes_beside_model_ops(steps in proptest::collection::vec(heal_step_strategy(), 1..24)) {
        run_heal(steps);
    }
}

/// A receive's engine steps beside ordinary writers (`volume receive` in
/// crates/cli/src/receive.rs): an in-place receive into `v0` from its snapshot
/// `v0@s` and a receive of a new `v2` from the live volume `v1`, each reading a
/// frozen internal clone of its base and writing a hidden partial volume, while
/// `v0` and `v1` are written. Interleaved with these, in any order.
#[derive(Debug, Clone)]
enum RecvOp {
    /// A client writes the in-place target `v0` (`true`) or the live base `v1`.
    Write {
        target: bool,
        offset: u64,
        len: u64,
        data: Data,
    },
    /// A stream record lands in the in-place receive's partial (`true`) or the
    /// new volume's.
    Record {
        in_place: bool,
        offset: u64,
        len: u64,
        data: Data,
    },
    /// A stream record naming blocks of the base: the receive reads them from its
    /// frozen copy (never the live base) into its partial volume.
    BaseRef {
        in_place: bool,
        lbn: u64,
        blocks: u64,
    },
    /// The in-place receive's checked final step.
    FinishInPlace,
    /// The new volume's final step (the partial renamed to `v2`).
    FinishNew,
    Flush,
    Reopen,
}

fn recv_op() -> impl Strategy<Value = RecvOp> {
    let data = prop_oneof![
        Just(Data::Zero),
        (0u8..4).prop_map(Data::Dup),
        any::<u64>().prop_map(Data::Compressible),
        any::<u64>().prop_map(Data::Random),
    ];
    prop_oneof![
        4 => (any::<bool>(), byte_range(), data.clone()).prop_map(|(target, (offset, len), data)| RecvOp::Write { target, offset, len, data }),
        4 => (any::<bool>(), byte_range(), data).prop_map(|(in_place, (offset, len), data)| RecvOp::Record { in_place, offset, len, data }),
        3 => (any::<bool>(), 0..VOL_BLOCKS, 1u64..=8).prop_map(|(in_place, lbn, blocks)| RecvOp::BaseRef { in_place, lbn, blocks: blocks.min(VOL_BLOCKS - lbn) }),
        1 => Just(RecvOp::FinishInPlace),
        1 => Just(RecvOp::FinishNew),
        1 => Just(RecvOp::Flush),
        1 => Just(RecvOp::Reopen),
    ]
}

/// The two receives' hidden volumes, as receive.rs names them.
struct RecvNames {
    frozen_target_base: fewerbytes_engine::InternalName,
    partial_target: fewerbytes_engine::InternalName,
    frozen_new_base: fewerbytes_engine::InternalName,
    partial_new: fewerbytes_engine::InternalName,
}

/// What the receive model expects: the user volumes' bytes, and the partial
/// volumes' while their receives run.
struct RecvModel {
    vols: BTreeMap<String, Vec<u8>>,
    partial_target: Option<Vec<u8>>,
    partial_new: Option<Vec<u8>>,
    /// `v1` when the new volume's receive froze it.
    frozen_new: Vec<u8>,
    /// Whether `v0` was written since the in-place receive froze its base.
    target_written: bool,
}

impl RecvModel {
    /// The internal volumes that must exist now.
    fn internal(&self, n: &RecvNames) -> Vec<String> {
        let mut names = Vec::new();
        if self.partial_target.is_some() {
            names.push(n.frozen_target_base.as_str().to_string());
            names.push(n.partial_target.as_str().to_string());
        }
        if self.partial_new.is_some() {
            names.push(n.frozen_new_base.as_str().to_string());
            names.push(n.partial_new.as_str().to_string());
        }
        names.sort();
        names
    }
}

fn put(bytes: &mut [u8], offset: u64, new: &[u8]) {
    bytes[offset as usize..offset as usize + new.len()].copy_from_slice(new);
}

/// Before the ops: `v0` written and snapshotted as `v0@s` (the stream's base),
/// `v1` written; then both receives begin as receive.rs's `begin` does: the base
/// frozen as an internal clone, the partial cloned from the frozen copy.
fn begin_receives(
    p: &std::sync::Arc<fewerbytes_engine::Pool>,
    seed: u64,
) -> (RecvNames, RecvModel) {
    use fewerbytes_engine::{InternalName, Provisioning};
    let mut vols = BTreeMap::new();
    for (v, salt) in [(0u8, 1u64), (1, 2)] {
        let bytes = bytes_of(
            &Data::Compressible(seed ^ salt),
            VOL_BLOCKS as usize * BLOCK,
        );
        p.create_volume(&name(v), VOL_BLOCKS * BLOCK as u64)
            .unwrap();
        p.open_volume(&name(v))
            .unwrap()
            .write(0, &bytes, false)
            .unwrap();
        vols.insert(name(v), bytes);
    }
    p.snapshot_volume("v0", "s").unwrap();
    vols.insert("v0@s".to_string(), vols["v0"].clone());
    let n = RecvNames {
        frozen_target_base: InternalName::new("base", "v0").unwrap(),
        partial_target: InternalName::new("receiving", "v0").unwrap(),
        frozen_new_base: InternalName::new("base", "v2").unwrap(),
        partial_new: InternalName::new("receiving", "v2").unwrap(),
    };
    let internal = p.internal();
    for (base, frozen, partial) in [
        ("v0@s", &n.frozen_target_base, &n.partial_target),
        ("v1", &n.frozen_new_base, &n.partial_new),
    ] {
        internal.clone(base, frozen, Provisioning::THIN).unwrap();
        internal
            .clone(frozen.as_str(), partial, Provisioning::THIN)
            .unwrap();
    }
    let model = RecvModel {
        partial_target: Some(vols["v0@s"].clone()),
        partial_new: Some(vols["v1"].clone()),
        frozen_new: vols["v1"].clone(),
        vols,
        target_written: false,
    };
    (n, model)
}

/// A base reference of either receive: blocks `lbns` read from its frozen base
/// and written to its partial, as receive.rs copies a base-referenced block.
fn base_ref(
    p: &std::sync::Arc<fewerbytes_engine::Pool>,
    n: &RecvNames,
    m: &mut RecvModel,
    in_place: bool,
    lbns: std::ops::Range<u64>,
) {
    let (frozen, partial, base, bytes) = match in_place {
        true => (
            &n.frozen_target_base,
            &n.partial_target,
            &m.vols["v0@s"],
            m.partial_target.as_mut(),
        ),
        false => (
            &n.frozen_new_base,
            &n.partial_new,
            &m.frozen_new,
            m.partial_new.as_mut(),
        ),
    };
    let Some(bytes) = bytes else { return };
    let (at, len) = (
        lbns.start as usize * BLOCK,
        (lbns.end - lbns.start) as usize * BLOCK,
    );
    let mut copy = vec![0u8; len];
    let internal = p.internal();
    internal
        .open(frozen.as_str())
        .unwrap()
        .read(at as u64, &mut copy)
        .unwrap();
    assert!(
        copy == base[at..at + len],
        "the frozen base '{}' reads otherwise than its base did when frozen",
        frozen.as_str()
    );
    internal
        .open(partial.as_str())
        .unwrap()
        .write(at as u64, &copy, false)
        .unwrap();
    bytes[at..at + len].copy_from_slice(&copy);
}

/// The in-place receive's final step: `v0` rolled to its partial in one call that
/// refuses when `v0` was written since the frozen base. A write since is never
/// lost: when `v0` reads otherwise than the base, the step must refuse (and `v0`
/// keep what was written); with no write since, it must be taken. Either way the
/// receive's hidden volumes are then removed (finished, or abandoned).
fn finish_in_place(p: &std::sync::Arc<fewerbytes_engine::Pool>, n: &RecvNames, m: &mut RecvModel) {
    let Some(received) = m.partial_target.take() else {
        return;
    };
    let internal = p.internal();
    let step = internal.rollback(
        "v0",
        n.partial_target.as_str(),
        Some(n.frozen_target_base.as_str()),
    );
    let differs = m.vols["v0"] != m.vols["v0@s"];
    match step {
        Ok(_) => {
            assert!(
                !differs,
                "the final step was taken over writes made to v0 after the receive froze its base"
            );
            m.vols.insert("v0".to_string(), received);
        }
        Err(e) => assert!(
            m.target_written,
            "the final step refused a target nobody wrote since the base: {e}"
        ),
    }
    internal.delete(n.partial_target.as_str(), false).unwrap();
    internal
        .delete(n.frozen_target_base.as_str(), false)
        .unwrap();
}

/// The new volume's final step: its partial renamed to `v2`, the frozen base gone.
fn finish_new(p: &std::sync::Arc<fewerbytes_engine::Pool>, n: &RecvNames, m: &mut RecvModel) {
    let Some(received) = m.partial_new.take() else {
        return;
    };
    let internal = p.internal();
    internal.rename(n.partial_new.as_str(), "v2").unwrap();
    internal.delete(n.frozen_new_base.as_str(), false).unwrap();
    m.vols.insert("v2".to_string(), received);
}

/// No internal volume is a user's: unlisted, unopenable; exactly those the
/// receives under way made exist.
fn check_hidden(p: &std::sync::Arc<fewerbytes_engine::Pool>, n: &RecvNames, m: &RecvModel) {
    let listed: Vec<String> = p.list_volumes().into_iter().map(|v| v.name).collect();
    let sized: Vec<String> = p.volume_sizes().into_iter().map(|(name, _)| name).collect();
    for name in listed.iter().chain(&sized) {
        assert!(
            !fewerbytes_engine::is_internal_name(name),
            "internal volume '{name}' is listed as a user volume"
        );
    }
    let mut internal = p.internal().names();
    internal.sort();
    let expected = m.internal(n);
    assert_eq!(internal, expected, "the pool's internal volumes");
    for name in &expected {
        assert!(p.open_volume(name).is_err(), "a user opened '{name}'");
    }
}

fn run_receive(seed: u64, ops: Vec<RecvOp>) {
    let mut t = create(64 << 20, None);
    let (n, mut m) = begin_receives(t.pool(), seed);
    check_hidden(t.pool(), &n, &m);
    let ops = ops
        .into_iter()
        .chain([RecvOp::FinishInPlace, RecvOp::FinishNew]);
    for op in ops {
        let p = t.pool().clone();
        match op {
            RecvOp::Write {
                target,
                offset,
                len,
                data,
            } => {
                let bytes = bytes_of(&data, len as usize);
                let vol = if target { "v0" } else { "v1" };
                p.open_volume(vol)
                    .unwrap()
                    .write(offset, &bytes, false)
                    .unwrap();
                put(m.vols.get_mut(vol).unwrap(), offset, &bytes);
                m.target_written |= target && m.partial_target.is_some();
            }
            RecvOp::Record {
                in_place,
                offset,
                len,
                data,
            } => {
                let (partial, bytes) = match in_place {
                    true => (&n.partial_target, m.partial_target.as_mut()),
                    false => (&n.partial_new, m.partial_new.as_mut()),
                };
                let Some(bytes) = bytes else { continue };
                let record = bytes_of(&data, len as usize);
                let volume = p.internal().open(partial.as_str()).unwrap();
                volume.write(offset, &record, false).unwrap();
                put(bytes, offset, &record);
            }
            RecvOp::BaseRef {
                in_place,
                lbn,
                blocks,
            } => base_ref(&p, &n, &mut m, in_place, lbn..lbn + blocks),
            RecvOp::FinishInPlace => finish_in_place(&p, &n, &mut m),
            RecvOp::FinishNew => finish_new(&p, &n, &mut m),
            RecvOp::Flush => p.flush().unwrap(),
            RecvOp::Reopen => {
                drop(p);
                t.reopen();
            }
        }
        check_hidden(t.pool(), &n, &m);
    }
    for (vol, bytes) in &m.vols {
        assert!(
            read_all(t.pool(), vol) == *bytes,
            "volume {vol} differs from the model"
        );
    }
    let audit = t.pool().audit();
    assert!(audit.problems.is_empty(), "audit: {:?}", audit.problems);
}

proptest! {
    // 48 cases by default (a few seconds); `FEWERBYTES_SOAK=1` runs 1,024.
    #![proptest_config(ProptestConfig {
        cases: if std::env::var("FEWERBYTES_SOAK").is_ok_and(|v| v == "1") { 1024 } else { 48 },
        ..ProptestConfig::default()
    })]
    #[test]
    fn receives_beside_writers_match_model(seed in any::<u64>(), ops in proptest::collection::vec(recv_op(), 0..24)) {
        run_receive(seed, ops);
    }
}
