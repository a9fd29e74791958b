//! A failed write or flush latches the pool read-only: writes are refused with a
//! clear error, reads of what was flushed go on, stats show the mode, and reopening
//! (on a healthy device) clears it with flushed data intact.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, FaultPlan};
use fewerbytes_engine::{EngineError, Mode};

fn flushed_pool() -> (TestPool, Vec<u8>) {
    let t = create(64 << 20, None);
    t.pool().create_volume("a", 4 << 20).unwrap();
    let vol = t.pool().open_volume("a").unwrap();
    let mut mix = Mix::new(9);
    let block = mix.next_block();
    vol.write(0, &block, false).unwrap();
    vol.flush().unwrap();
    (t, block)
}

fn assert_latched(t: &TestPool, block: &[u8]) {
    let vol = t.pool().open_volume("a").unwrap();
    let err = vol.write(8192, &[7u8; BLOCK], true).unwrap_err();
    assert!(
        matches!(err, EngineError::ReadOnly(_)),
        "writes after a failure must be refused as read-only, got {err}"
    );
    let mut buf = vec![0u8; BLOCK];
    vol.read(0, &mut buf).unwrap();
    assert_eq!(buf, block, "reads go on after the latch");
    assert_eq!(t.pool().stats().mode, Mode::ReadOnly);
}

#[test]
fn a_failed_data_write_latches_read_only_and_reopen_clears_it() {
    let (mut t, block) = flushed_pool();
    t.dev.set_plan(FaultPlan {
        fail_write: Some(0),
        ..Default::default()
    });
    let vol = t.pool().open_volume("a").unwrap();
    let mut rng_block = vec![0u8; BLOCK];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut rng_block);
    // The whole-block write of random data hits the failing write.
    let first = vol.write(4096, &rng_block, true);
    assert!(first.is_err(), "the failing write must be reported");
    drop(vol);
    assert_latched(&t, &block);
    t.crash(CrashMode::KeepAll);
    let vol = t.pool().open_volume("a").unwrap();
    vol.write(8192, &[7u8; BLOCK], true)
        .expect("writable again after reopen");
    let mut buf = vec![0u8; BLOCK];
    vol.read(0, &mut buf).unwrap();
    assert_eq!(buf, block);
    assert!(t.pool().audit().problems.is_empty());
}

#[test]
fn a_failed_flush_latches_read_only() {
    let (t, block) = flushed_pool();
    t.dev.set_plan(FaultPlan {
        fail_flush: Some(0),
        ..Default::default()
    });
    let vol = t.pool().open_volume("a").unwrap();
    vol.write(4096, &[3u8; BLOCK], false).unwrap();
    assert!(vol.flush().is_err(), "a flush whose sync failed must fail");
    drop(vol);
    assert_latched(&t, &block);
}

/// Flipping a byte in any block of a pool image (metadata or data) either makes
/// opening fail with a typed corruption error naming the block, or makes reading the
/// damaged block fail with one (stored data is checked against its fingerprint; a
/// block-map page's range is refused as damaged, naming the page's block), or
/// (a block nothing refers to any more) changes nothing. Never a panic, never wrong data.
#[test]
fn corruption_anywhere_is_detected_or_harmless() {
    let (mut t, block) = flushed_pool();
    t.pool().clone_volume("a", "b").unwrap();
    t.reopen();
    let pool = t.pool.take().unwrap();
    pool.close().unwrap();
    let image = t.dev.crash_image(CrashMode::KeepAll);
    let used_blocks: Vec<usize> = image
        .chunks(BLOCK)
        .enumerate()
        .filter(|(_, b)| b.iter().any(|x| *x != 0))
        .map(|(i, _)| i)
        .collect();
    let (mut at_open, mut at_read, mut harmless) = (0, 0, 0);
    for &blk in &used_blocks {
        let mut bad = image.clone();
        bad[blk * BLOCK + 100] ^= 0x40;
        let dev = std::sync::Arc::new(fewerbytes_engine::storage::FaultStorage::from_image(
            "bad", bad,
        ));
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            fewerbytes_engine::Pool::open_devices(
                dev.clone(),
                None,
                &fewerbytes_engine::OpenOptions {
                    threads: Some(1),
                    index_memory_bytes: None,
                    no_discard: false,
                    hold_index_build: false,
                    take_over: None,
                    saved_index: fewerbytes_engine::SavedIndex::Off,
                },
            )
        }))
        .unwrap_or_else(|_| panic!("opening with block {blk} corrupted panicked"));
        match opened {
            Err(EngineError::Corrupt { .. }) => at_open += 1,
            Err(e) => panic!("block {blk}: expected a corruption error, got {e}"),
            Ok(pool) => {
                let mut buf = vec![0u8; BLOCK];
                let mut failed = false;
                for name in ["a", "b"] {
                    match pool.open_volume(name).unwrap().read(0, &mut buf) {
                        Ok(()) => assert!(
                            buf == block,
                            "block {blk} corrupted: volume {name} reads wrong data"
                        ),
                        Err(EngineError::Corrupt { .. }) => failed = true,
                        // A block-map page both super block copies share: only the
                        // range it maps is lost, refused naming the block.
                        Err(EngineError::Damaged { range, .. }) => {
                            assert_eq!(range.block, blk as u64, "block {blk}");
                            failed = true;
                        }
                        Err(e) => {
                            panic!("block {blk}: expected a corruption error on read, got {e}")
                        }
                    }
                }
                if failed {
                    at_read += 1;
                } else {
                    assert!(pool.audit().problems.is_empty());
                    harmless += 1;
                }
            }
        }
    }
    eprintln!(
        "{} blocks corrupted: {at_open} refused at open, {at_read} at read, {harmless} unused",
        used_blocks.len()
    );
    assert!(at_open > 0, "no metadata corruption was detected");
    assert!(at_read > 0, "the corrupted data block was not detected");
}

/// A full pool refuses new data with NoSpace (ENOSPC over NBD), also in part of a
/// block, keeps everything it acknowledged, still accepts duplicates and trims (also
/// of part of a block), and after a trim takes new data again (the trimmed blocks return at the next checkpoint, which the refusal asks for).
#[test]
fn a_full_pool_refuses_new_data_and_recovers_after_trim() {
    use fewerbytes_engine::storage::Storage;
    use std::sync::Arc;
    let dev = Arc::new(fewerbytes_engine::storage::FaultStorage::new(
        "data",
        64 << 20,
    ));
    let opts = fewerbytes_engine::CreateOptions {
        overcommit: true,
        ..Default::default()
    };
    fewerbytes_engine::Pool::format(dev.clone() as Arc<dyn Storage>, None, None, &opts).unwrap();
    let pool = fewerbytes_engine::Pool::open_devices(
        dev as Arc<dyn Storage>,
        None,
        &fewerbytes_engine::OpenOptions {
            threads: Some(1),
            index_memory_bytes: None,
            no_discard: false,
            hold_index_build: false,
            take_over: None,
            saved_index: fewerbytes_engine::SavedIndex::Off,
        },
    )
    .unwrap();
    let data_blocks = pool.info().space.data_bytes / BLOCK as u64;
    pool.create_volume_with(
        "big",
        2 * data_blocks * BLOCK as u64,
        fewerbytes_engine::Provisioning::THIN,
    )
    .unwrap();
    let vol = pool.open_volume("big").unwrap();
    let block_of = |i: u64| {
        let mut b = vec![0u8; BLOCK];
        rand::RngCore::fill_bytes(
            &mut <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(i),
            &mut b,
        );
        b
    };
    let mut written = 0u64;
    let err = loop {
        match vol.write(written * BLOCK as u64, &block_of(written), false) {
            Ok(()) => written += 1,
            Err(e) => break e,
        }
        assert!(
            written <= data_blocks,
            "more blocks stored than the pool holds"
        );
    };
    assert!(
        matches!(err, EngineError::NoSpace(_)),
        "a full pool must say so, got {err}"
    );
    assert_eq!(
        pool.stats().mode,
        Mode::Normal,
        "a full pool is not latched: it takes writes again once space is freed"
    );
    assert!(
        written > data_blocks * 9 / 10,
        "only {written} of {data_blocks} blocks stored before the pool was full"
    );
    vol.flush().unwrap();
    // A duplicate still fits: it stores nothing. (The last block stored is certain to
    // be in the index; older ones may have been evicted from a full bucket.)
    vol.write((written + 1) * BLOCK as u64, &block_of(written - 1), false)
        .unwrap();
    let mut buf = vec![0u8; BLOCK];
    for i in (0..written).step_by(97) {
        vol.read(i * BLOCK as u64, &mut buf).unwrap();
        assert!(
            buf == block_of(i),
            "block {i} changed after the pool filled"
        );
    }
    // Part of a block: a write or write-zeroes needs a new block for the result and
    // is refused with ENOSPC, leaving the block as it was; a trim never fails for want
    // of space, and on a full pool leaves a partial block as it was (NBD allows it).
    let b = 5 * BLOCK as u64;
    let err = vol.write(b + 100, &[0x5a; 100], false).unwrap_err();
    assert!(
        matches!(err, EngineError::NoSpace(_)),
        "a partial write on a full pool: {err}"
    );
    let err = vol.write_zeroes(b + 10, 10, false).unwrap_err();
    assert!(
        matches!(err, EngineError::NoSpace(_)),
        "a partial write-zeroes on a full pool: {err}"
    );
    vol.trim(b + 10, 10, false)
        .expect("a partial trim on a full pool succeeds");
    vol.read(b, &mut buf).unwrap();
    assert!(
        buf == block_of(5),
        "a refused partial request changed its block"
    );
    vol.trim(0, (written / 2) * BLOCK as u64, false).unwrap();
    // The trimmed blocks come back at the next checkpoint, which the write itself
    // takes when it finds no free block: the very next write succeeds.
    vol.write(written * BLOCK as u64, &block_of(1_000_000), false)
        .expect("space freed by the trim must be usable by the next write");
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
}

/// Thick on thick: a volume as large as the pool can address, filled with random
/// data and then overwritten completely by two writers at once, never sees a full
/// pool (freed blocks and other zones' unfilled runs come back when space runs short).
#[test]
fn a_thick_pool_never_refuses_an_overwrite() {
    let t = create(64 << 20, None);
    let p = t.pool().clone();
    let blocks = p.info().addressable_bytes / BLOCK as u64;
    p.create_volume("full", blocks * BLOCK as u64).unwrap();
    for pass in 0..2u64 {
        std::thread::scope(|s| {
            for half in 0..2u64 {
                let p = p.clone();
                s.spawn(move || {
                    let vol = p.open_volume("full").unwrap();
                    let mut rng =
                        <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(pass * 2 + half);
                    let mut data = vec![0u8; 16 * BLOCK];
                    let mut b = half * 16;
                    while b < blocks {
                        let n = (blocks - b).min(16);
                        rand::RngCore::fill_bytes(&mut rng, &mut data);
                        vol.write(b * BLOCK as u64, &data[..(n as usize) * BLOCK], false)
                            .unwrap_or_else(|e| {
                                panic!("pass {pass}: writing block {b} of {blocks} failed: {e}")
                            });
                        b += 32;
                    }
                });
            }
        });
    }
    p.flush().unwrap();
    assert!(p.audit().problems.is_empty());
}

#[test]
fn a_latched_pool_reports_failure_when_closed() {
    // Bug: a pool latched read-only by a failed flush closed with Ok(()), so `serve`
    // said "closed cleanly" and exited 0 although acknowledged writes could be lost.
    let (mut t, _block) = flushed_pool();
    t.dev.set_plan(FaultPlan {
        fail_flush: Some(0),
        ..Default::default()
    });
    let vol = t.pool().open_volume("a").unwrap();
    vol.write(4096, &[3u8; BLOCK], false).unwrap();
    assert!(vol.flush().is_err(), "a flush whose sync failed must fail");
    drop(vol);
    let pool = t.pool.take().unwrap();
    assert!(pool.latched_reason().is_some(), "the failed flush latched");
    let err = pool
        .close()
        .expect_err("closing a latched pool must report failure");
    assert!(
        matches!(err, EngineError::ClosedLatched(_)),
        "expected ClosedLatched, got {err}"
    );
    assert!(
        err.to_string().contains("did not close cleanly"),
        "the message says the close was not clean: {err}"
    );
}

#[test]
fn a_data_block_failing_its_fingerprint_is_named_by_volume_offset_and_data_block() {
    // Bug: a stored block that no longer matched its fingerprint was reported as
    // "corrupt metadata in data at block 0", naming neither the data block nor the
    // volume and offset that read it.
    let (mut t, _block) = flushed_pool();
    let vol = t.pool().open_volume("a").unwrap();
    let mut random = vec![0u8; BLOCK];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut random);
    vol.write(3 * BLOCK as u64, &random, true).unwrap();
    drop(vol);
    t.reopen();
    let pool = t.pool.take().unwrap();
    pool.close().unwrap();
    let mut image = t.dev.crash_image(CrashMode::KeepAll);
    let device_block = image
        .chunks(BLOCK)
        .position(|b| b == random.as_slice())
        .expect("the random block is stored whole");
    image[device_block * BLOCK + 7] ^= 0x01;
    let dev = std::sync::Arc::new(fewerbytes_engine::storage::FaultStorage::from_image(
        "bad", image,
    ));
    let pool = fewerbytes_engine::Pool::open_devices(
        dev,
        None,
        &fewerbytes_engine::OpenOptions {
            threads: Some(1),
            index_memory_bytes: None,
            no_discard: false,
            hold_index_build: false,
            take_over: None,
            saved_index: fewerbytes_engine::SavedIndex::Off,
        },
    )
    .expect("open");
    let mut buf = vec![0u8; BLOCK];
    let err = pool
        .open_volume("a")
        .unwrap()
        .read(3 * BLOCK as u64, &mut buf)
        .expect_err("a corrupted block must not be returned");
    let text = err.to_string();
    assert!(
        matches!(err, EngineError::Corrupt { region: "data", .. }),
        "{text}"
    );
    for part in [
        "damaged data".to_string(),
        format!("volume 'a' bytes 12288..16383 (pool block {device_block})"),
        "fingerprint".to_string(),
    ] {
        assert!(text.contains(&part), "the error lacks `{part}`: {text}");
    }
    assert!(!text.contains("metadata"), "data is not metadata: {text}");
}
