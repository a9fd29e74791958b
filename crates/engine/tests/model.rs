//! The engine against a trivial model (volume → bytes), over random writes of
//! duplicate, zero, compressible and random data at any byte offset and length
//! (one byte, a few, across block boundaries, whole blocks), trims and write-zeroes
//! likewise, clones, snapshots (taken, rolled back to, deleted, written to and
//! refused), deletes, flushes, compaction, clean reopens and crashes that
//! keep none, all or a random subset of the unflushed writes (some torn at 512-byte
//! boundaries). Each case ends with a reference-count audit and a scrub.
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
    let options = fewerbytes_engine::CreateOptions {
        compression,
        ..Default::default()
    };
    let mut t = create_with(64 << 20, None, &options);
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
    for op in ops {
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
