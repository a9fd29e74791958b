//! `pool grow`: a pool whose device grew takes the new space into its data region
//! while open, keeps every block it held, stores new data in the new slabs, and
//! records the new size at the grow's checkpoint: a crash at any write of that
//! checkpoint leaves the pool at its old size or its new one, whole either way.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, FaultPlan, FaultStorage, Storage};
use fewerbytes_engine::{CreateOptions, OpenOptions, Pool};
use rand::{RngCore, SeedableRng};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
/// The device as made, and as grown.
const SMALL: u64 = 64 * MIB;
const LARGE: u64 = 256 * MIB;
/// Blocks written before the grow.
const BEFORE: u64 = 300;

/// Incompressible bytes, different for each `seed`: each block needs its own.
fn random_block(seed: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut b);
    b
}

fn open(dev: &Arc<FaultStorage>) -> Arc<Pool> {
    Pool::open_devices(
        dev.clone() as Arc<dyn Storage>,
        None,
        &OpenOptions {
            threads: Some(2),
            ..OpenOptions::default()
        },
    )
    .expect("open")
}

/// A 64 MiB pool whose metadata is sized for 256 MiB, volume "a" holding `BEFORE`
/// random blocks (flushed), on a device then grown to 256 MiB.
fn grown_device() -> (Arc<FaultStorage>, Arc<Pool>) {
    let dev = Arc::new(FaultStorage::new("data", SMALL));
    let opts = CreateOptions {
        max_size_bytes: Some(LARGE),
        ..CreateOptions::default()
    };
    Pool::format(dev.clone() as Arc<dyn Storage>, None, None, &opts).expect("format");
    let pool = open(&dev);
    pool.create_volume("a", 16 * MIB).unwrap();
    let vol = pool.open_volume("a").unwrap();
    for lbn in 0..BEFORE {
        vol.write(lbn * BLOCK as u64, &random_block(lbn), false)
            .unwrap();
    }
    vol.flush().unwrap();
    dev.grow(LARGE);
    (dev, pool)
}

/// Everything written before the grow reads back, and the audit is clean.
fn assert_whole(pool: &Arc<Pool>) {
    let vol = pool.open_volume("a").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for lbn in 0..BEFORE {
        vol.read(lbn * BLOCK as u64, &mut buf).unwrap();
        assert!(
            buf == random_block(lbn),
            "block {lbn} reads back other bytes"
        );
    }
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
}

#[test]
fn a_grown_device_gives_its_space_to_the_data_region_while_open() {
    let (dev, pool) = grown_device();
    let before = pool.stats();
    let report = pool.grow().expect("grow");
    assert_eq!(report.old_data_bytes, before.space.data_bytes);
    assert!(
        report.data_bytes > before.space.data_bytes + 150 * MIB,
        "{report:?}"
    );
    assert_eq!(report.untaken_bytes, 0, "{report:?}");
    let after = pool.stats();
    assert_eq!(after.space.data_bytes, report.data_bytes);
    assert!(after.space.available_bytes > before.space.available_bytes + 150 * MIB);

    // New data past what the old region could hold lands in the new slabs.
    let more_blocks = before.space.available_bytes / BLOCK as u64 + 1000;
    pool.create_volume("b", (more_blocks + 100) * BLOCK as u64)
        .expect("a volume the old region could not hold");
    let b = pool.open_volume("b").unwrap();
    for lbn in 0..more_blocks {
        b.write(lbn * BLOCK as u64, &random_block(1_000_000 + lbn), false)
            .unwrap();
    }
    b.flush().unwrap();
    drop(b);
    assert_whole(&pool);
    pool.close().unwrap();

    // Reopened, the pool has its new size and all of its data.
    let pool = open(&dev);
    assert_eq!(pool.info().space.data_bytes, report.data_bytes);
    assert_whole(&pool);
    let b = pool.open_volume("b").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for lbn in (0..more_blocks).step_by(97) {
        b.read(lbn * BLOCK as u64, &mut buf).unwrap();
        assert!(buf == random_block(1_000_000 + lbn), "b block {lbn}");
    }
    // A second grow with nothing new takes nothing.
    let again = pool.grow().unwrap();
    assert_eq!(again.data_bytes, again.old_data_bytes);
}

#[test]
fn a_pool_whose_pages_may_go_to_data_blocks_takes_the_whole_device_without_max_size() {
    // Made for 64 MiB with no `--max-size`: its page store was sized for that. A pool
    // made by this version puts pages past its page store in data blocks (flags bit
    // 3), so the page store does not limit the grow.
    let mut t = create(SMALL, None);
    t.dev.grow(LARGE);
    let report = t.pool().grow().expect("grow");
    assert_eq!(report.untaken_bytes, 0, "{report:?}");
    assert!(
        report.data_bytes > report.old_data_bytes + (LARGE - SMALL) * 9 / 10,
        "{report:?}"
    );
    // The new region holds data, and the pool's pages, across a reopen.
    let pool = t.pool().clone();
    let blocks = (LARGE - SMALL) / 2 / BLOCK as u64;
    pool.create_volume("b", blocks * BLOCK as u64).unwrap();
    let b = pool.open_volume("b").unwrap();
    for lbn in 0..blocks {
        b.write(lbn * BLOCK as u64, &random_block(2_000_000 + lbn), false)
            .unwrap();
    }
    b.flush().unwrap();
    drop(b);
    drop(pool);
    t.reopen();
    assert_eq!(t.pool().info().space.data_bytes, report.data_bytes);
    let audit = t.pool().audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    let b = t.pool().open_volume("b").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for lbn in (0..blocks).step_by(61) {
        b.read(lbn * BLOCK as u64, &mut buf).unwrap();
        assert!(buf == random_block(2_000_000 + lbn), "b block {lbn}");
    }
}

#[test]
fn a_crash_at_any_write_of_the_grow_leaves_the_old_size_or_the_new_one() {
    // The writes the grow makes.
    let (dev, pool) = grown_device();
    let old_bytes = pool.info().space.data_bytes;
    let writes_before = dev.counters().snapshot().writes;
    let new_bytes = pool.grow().unwrap().data_bytes;
    let writes = dev.counters().snapshot().writes - writes_before;
    drop(pool);
    assert!(
        writes > 2,
        "the grow's checkpoint writes pages and a super block"
    );

    let (mut old_seen, mut new_seen) = (0, 0);
    for fail_at in 0..=writes {
        for mode in [
            CrashMode::DropAll,
            CrashMode::KeepAll,
            CrashMode::Random(fail_at),
        ] {
            let (dev, pool) = grown_device();
            dev.set_plan(FaultPlan {
                fail_write: Some(fail_at),
                ..FaultPlan::default()
            });
            let grown = pool.grow();
            let image = dev.crash_image(mode);
            dev.set_plan(FaultPlan {
                fail_write: Some(0),
                fail_flush: Some(0),
                ..FaultPlan::default()
            });
            drop(pool);
            let dev = Arc::new(FaultStorage::from_image("data", image));
            let pool = open(&dev);
            let size = pool.info().space.data_bytes;
            if grown.is_ok() {
                assert_eq!(
                    size, new_bytes,
                    "a grow that returned is durable ({mode:?})"
                );
            }
            assert!(
                size == old_bytes || size == new_bytes,
                "crash at write {fail_at} ({mode:?}): data region {size}, neither {old_bytes} nor {new_bytes}"
            );
            if size == old_bytes {
                old_seen += 1;
            } else {
                new_seen += 1;
            }
            assert_whole(&pool);
            // And a grow after the crash takes the space.
            assert_eq!(pool.grow().unwrap().data_bytes, new_bytes);
            assert_whole(&pool);
        }
    }
    eprintln!("{writes} writes; crashes left the old size {old_seen} times, the new {new_seen}");
    assert!(old_seen > 0 && new_seen > 0);
}
