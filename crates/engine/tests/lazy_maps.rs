//! Block maps whose memory follows what is written (`map_pages.rs`), and thin volumes
//! that may promise up to the format's maximum (docs/format.md "Format maxima": 4,096
//! volumes of at most 4 PiB each) whatever the pool's size.
//!
//! On a 64 MiB pool: thin volumes of 4 PiB (and one of 4 PiB less a block) written at
//! their first, middle and last blocks hold three map pages each in memory, read back
//! after a reopen and after a crash that replays the journal, and check clean; a clone
//! of one shares its pages and takes its own writes; a shrink frees what lay past the
//! new end and a growth back reads zeros there; a delete frees the volume's pages; a
//! volume past 4 PiB is refused, at create and at resize. Before block maps were
//! sparse, one such volume asked for 87 GB of page slots at create.

mod common;

use common::*;
use fewerbytes_engine::{EngineError, Pool, Provisioning, RepairOptions, VolumeInfo};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
/// The largest volume the format allows: 2⁵² bytes (4 PiB).
const MAX_VOLUME_BYTES: u64 = 1 << 52;
const B: u64 = BLOCK as u64;

/// The first, middle and last block of a volume of `size_bytes`.
fn probes(size_bytes: u64) -> [u64; 3] {
    let last = size_bytes / B - 1;
    [0, last / 2, last]
}

/// The thin volumes the test makes: three of 4 PiB and one a block short of it.
const VOLUMES: [(&str, u64); 4] = [
    ("a", MAX_VOLUME_BYTES),
    ("b", MAX_VOLUME_BYTES),
    ("c", MAX_VOLUME_BYTES - B),
    ("d", MAX_VOLUME_BYTES),
];

fn volume(pool: &Pool, name: &str) -> VolumeInfo {
    pool.list_volumes()
        .into_iter()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

fn read_block(pool: &Arc<Pool>, name: &str, lbn: u64) -> Vec<u8> {
    let vol = pool.open_volume(name).unwrap();
    let mut buf = vec![0u8; BLOCK];
    vol.read(lbn * B, &mut buf).unwrap();
    buf
}

/// Every probe of every volume still in `VOLUMES` reads what was written there.
fn assert_probes(pool: &Arc<Pool>, names: &[&str]) {
    for (v, (name, size)) in VOLUMES.iter().enumerate() {
        if !names.contains(name) {
            continue;
        }
        for (k, lbn) in probes(*size).into_iter().enumerate() {
            assert!(
                read_block(pool, name, lbn) == random_block((v * 3 + k) as u64),
                "volume {name} block {lbn}"
            );
        }
    }
}

/// No problem found by the audit nor by `check` (a repair that changes nothing).
fn assert_check_clean(pool: &Pool) {
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    let report = pool
        .repair(&RepairOptions::default(), &|_, _, _| {})
        .unwrap();
    assert!(report.repairs.is_empty(), "{:?}", report.repairs);
    assert!(report.damage_left.is_empty(), "{:?}", report.damage_left);
}

/// Metadata pages in use: page-store slots and data blocks holding pages.
fn metadata_pages(pool: &Pool) -> u64 {
    let limits = pool.stats().limits;
    let figure = |name: &str| {
        limits
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("no limit {name} in {limits:?}"))
    };
    figure("page store slots in use") + figure("data blocks holding metadata pages")
}

/// The process's resident memory, in KiB (`VmRSS`).
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn thin_4_pib_volumes_on_a_64_mib_pool_hold_only_the_pages_written() {
    let mut t = create(64 * MIB, None);
    let pool = t.pool().clone();
    let rss_before = rss_kib();
    for (name, size) in VOLUMES {
        pool.create_volume_with(name, size, Provisioning::THIN)
            .unwrap();
    }
    for (v, (name, size)) in VOLUMES.iter().enumerate() {
        let vol = pool.open_volume(name).unwrap();
        for (k, lbn) in probes(*size).into_iter().enumerate() {
            vol.write(lbn * B, &random_block((v * 3 + k) as u64), false)
                .unwrap();
        }
    }
    assert_eq!(pool.info().space.promised_bytes, 4 * MAX_VOLUME_BYTES - B);
    // Three pages written, three pages in memory, whatever the size.
    for (name, _) in VOLUMES {
        let v = volume(&pool, name);
        assert_eq!(v.map_pages, 3, "volume {name}");
        assert!(
            v.map_memory_bytes <= 3 * 8192,
            "volume {name}: {} bytes of block map",
            v.map_memory_bytes
        );
    }
    let rss_grown_kib = rss_kib().saturating_sub(rss_before);
    eprintln!(
        "four thin 4 PiB volumes, three blocks written in each: {} bytes of block map \
         each, resident memory grew by {rss_grown_kib} KiB",
        volume(&pool, "a").map_memory_bytes
    );
    assert!(
        rss_grown_kib < 64 * 1024,
        "resident memory grew by {rss_grown_kib} KiB"
    );
    assert_probes(&pool, &["a", "b", "c", "d"]);

    // Past the format's maximum: refused, at create and at resize, nothing changed.
    for refused in [
        pool.create_volume_with("e", MAX_VOLUME_BYTES + B, Provisioning::THIN),
        pool.resize_volume("a", MAX_VOLUME_BYTES + B, false),
    ] {
        match refused {
            Err(EngineError::Refused(why)) => {
                assert!(why.contains("a volume is at most 4.00 PiB"), "{why}")
            }
            other => panic!("a volume past 4 PiB was not refused: {other:?}"),
        }
    }
    assert_eq!(volume(&pool, "a").size_bytes, MAX_VOLUME_BYTES);

    // A checkpoint, a close and a reopen: only the pages written are loaded.
    drop(pool);
    t.reopen();
    let pool = t.pool().clone();
    for (name, _) in VOLUMES {
        assert_eq!(volume(&pool, name).map_pages, 3, "volume {name}");
    }
    assert_probes(&pool, &["a", "b", "c", "d"]);
    assert_check_clean(&pool);

    // A write the journal holds, replayed after a crash into a page not in memory.
    let replayed = MAX_VOLUME_BYTES / B / 4;
    pool.open_volume("b")
        .unwrap()
        .write(replayed * B, &random_block(100), true)
        .unwrap();
    drop(pool);
    t.crash(fewerbytes_engine::storage::CrashMode::DropAll);
    let pool = t.pool().clone();
    assert!(read_block(&pool, "b", replayed) == random_block(100));
    assert_eq!(volume(&pool, "b").map_pages, 4);
    assert_probes(&pool, &["a", "b", "c", "d"]);

    // A clone shares the written pages and takes its own writes.
    pool.clone_volume_with("a", "a2", Provisioning::THIN)
        .unwrap();
    assert_eq!(volume(&pool, "a2").map_pages, 3);
    let own = MAX_VOLUME_BYTES / B / 3;
    pool.open_volume("a2")
        .unwrap()
        .write(own * B, &random_block(200), false)
        .unwrap();
    assert!(read_block(&pool, "a2", own) == random_block(200));
    assert!(read_block(&pool, "a", own) == vec![0u8; BLOCK]);
    for (k, lbn) in probes(MAX_VOLUME_BYTES).into_iter().enumerate() {
        assert!(read_block(&pool, "a2", lbn) == random_block(k as u64));
    }
    assert_eq!(volume(&pool, "a2").map_pages, 4);
    assert_eq!(volume(&pool, "a").map_pages, 3);

    // Shrunk to 1 GiB, "b" keeps its first block only; grown back, the rest reads zeros.
    pool.resize_volume("b", 1 << 30, true).unwrap();
    assert_eq!(volume(&pool, "b").map_pages, 1);
    assert_eq!(volume(&pool, "b").logical_used_bytes, B);
    pool.resize_volume("b", MAX_VOLUME_BYTES, false).unwrap();
    assert!(read_block(&pool, "b", 0) == random_block(3));
    for lbn in [
        replayed,
        probes(MAX_VOLUME_BYTES)[1],
        MAX_VOLUME_BYTES / B - 1,
    ] {
        assert!(
            read_block(&pool, "b", lbn) == vec![0u8; BLOCK],
            "block {lbn}"
        );
    }
    assert_eq!(volume(&pool, "b").map_pages, 1);

    // A delete frees the volume's pages: its three map pages and the ten directory
    // pages above them (three at each of levels 1 to 3, and the top one).
    let before = metadata_pages(&pool);
    pool.delete_volume("d", false).unwrap();
    let after = metadata_pages(&pool);
    assert!(
        after + 13 <= before,
        "metadata pages in use: {before} before the delete, {after} after"
    );

    drop(pool);
    t.reopen();
    let pool = t.pool().clone();
    assert_probes(&pool, &["a", "c"]);
    assert!(read_block(&pool, "a2", own) == random_block(200));
    assert!(read_block(&pool, "b", 0) == random_block(3));
    assert_check_clean(&pool);
}
