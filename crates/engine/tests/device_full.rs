//! The device below the pool fills (a full host file system under a sparse pool
//! file, a full thin pool): writes fail with the no-space error (ENOSPC over NBD),
//! the pool is not latched, nothing it acknowledged is lost, reads go on, and once
//! space is back writes succeed again without a reopen.

mod common;
use common::*;
use fewerbytes_engine::storage::CrashMode;
use fewerbytes_engine::{Mode, Volume};
use rand::{RngCore, SeedableRng};

/// Incompressible bytes, different for each `seed`: each write needs a new block.
fn random_block(seed: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut b);
    b
}

fn read_block(vol: &Volume, lbn: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK];
    vol.read(lbn * BLOCK as u64, &mut buf).expect("a read");
    buf
}

/// Write blocks 0, 1, 2, ... with a flush after every `flush_every` until a write
/// or a flush finds no space. Returns the blocks acknowledged and how many of them
/// a flush made durable. (Every 8: a commit finds the device full; every 64: a
/// write closing a run of blocks does, and the next write fails.)
fn write_until_full(vol: &Volume, flush_every: u64) -> (u64, u64) {
    let mut acknowledged = 0u64;
    let mut flushed = 0u64;
    for lbn in 0..4096u64 {
        match vol.write(lbn * BLOCK as u64, &random_block(lbn), false) {
            Ok(()) => acknowledged = lbn + 1,
            Err(e) => {
                assert!(e.is_no_space(), "a write on a full device: {e}");
                eprintln!("write {lbn} found no space: {e}");
                return (acknowledged, flushed);
            }
        }
        if lbn % flush_every == flush_every - 1 {
            match vol.flush() {
                Ok(()) => flushed = acknowledged,
                Err(e) => {
                    assert!(e.is_no_space(), "a flush on a full device: {e}");
                    eprintln!("the flush after write {lbn} found no space: {e}");
                    return (acknowledged, flushed);
                }
            }
        }
    }
    panic!("4,096 blocks written without the device filling");
}

/// The pool on a 64 MiB device, volume "a", and room for 256 KiB more pages.
fn nearly_full() -> TestPool {
    let t = create(64 << 20, None);
    t.pool().create_volume("a", 32 << 20).unwrap();
    t.pool().flush().unwrap();
    t.dev
        .set_space_bytes(Some(t.dev.written_bytes() + (256 << 10)));
    t
}

#[test]
fn a_full_device_fails_writes_with_no_space_and_the_pool_resumes_once_space_is_back() {
    for flush_every in [8, 64] {
        full_then_space_again(flush_every);
    }
}

fn full_then_space_again(flush_every: u64) {
    let t = nearly_full();
    let vol = t.pool().open_volume("a").unwrap();
    let (acknowledged, flushed) = write_until_full(&vol, flush_every);
    assert!(
        acknowledged > 0,
        "some blocks fit before the device was full"
    );
    assert_eq!(
        t.pool().stats().mode,
        Mode::Normal,
        "a full device does not latch the pool"
    );
    // Writes keep failing with no space while the device is full, and change nothing.
    let err = vol
        .write(acknowledged * BLOCK as u64, &random_block(9_999), true)
        .unwrap_err();
    assert!(err.is_no_space(), "still full: {err}");
    // Everything acknowledged reads back, written or not.
    for lbn in 0..acknowledged {
        assert_eq!(read_block(&vol, lbn), random_block(lbn), "block {lbn}");
    }
    // Trims are taken while full.
    vol.trim(0, BLOCK as u64, false).unwrap();
    assert!(flushed <= acknowledged);

    t.dev.set_space_bytes(None);
    vol.write(
        acknowledged * BLOCK as u64,
        &random_block(acknowledged),
        true,
    )
    .expect("writes resume once space is back, without a reopen");
    vol.flush().unwrap();
    assert_eq!(read_block(&vol, 0), vec![0u8; BLOCK], "the trim holds");
    for lbn in 1..=acknowledged {
        assert_eq!(read_block(&vol, lbn), random_block(lbn), "block {lbn}");
    }
    assert_eq!(t.pool().stats().mode, Mode::Normal);
    assert!(t.pool().audit().problems.is_empty());
}

#[test]
fn a_crash_while_the_device_is_full_keeps_every_flushed_write() {
    let mut t = nearly_full();
    let vol = t.pool().open_volume("a").unwrap();
    let (acknowledged, flushed) = write_until_full(&vol, 8);
    drop(vol);
    for mode in [CrashMode::DropAll, CrashMode::Random(7), CrashMode::KeepAll] {
        t.crash(mode);
        let vol = t.pool().open_volume("a").unwrap();
        for lbn in 0..flushed {
            assert_eq!(read_block(&vol, lbn), random_block(lbn), "block {lbn}");
        }
        for lbn in flushed..acknowledged {
            let got = read_block(&vol, lbn);
            assert!(
                got == random_block(lbn) || got == vec![0u8; BLOCK],
                "block {lbn}, not flushed, reads its old or its new content"
            );
        }
        assert!(t.pool().audit().problems.is_empty());
        drop(vol);
    }
}

#[test]
fn a_full_device_closes_cleanly_once_space_is_back() {
    let mut t = nearly_full();
    let vol = t.pool().open_volume("a").unwrap();
    let (acknowledged, _) = write_until_full(&vol, 64);
    drop(vol);
    t.dev.set_space_bytes(None);
    t.reopen();
    let vol = t.pool().open_volume("a").unwrap();
    for lbn in 0..acknowledged {
        assert_eq!(read_block(&vol, lbn), random_block(lbn), "block {lbn}");
    }
    assert!(t.pool().audit().problems.is_empty());
}
