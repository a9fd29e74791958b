//! A pool on a Ceph RBD image (a one-node cluster from scripts/ceph/cluster.sh,
//! started by this binary and stopped when it exits): made through the engine's
//! API on `open_rbd`, written, closed, reopened and read back; and a process
//! killed with SIGKILL after a flush, whose image is refused to a plain open (the
//! dead client still holds its lock) and whose pool, taken over, reopens with every
//! flushed block; and a pool on a Ceph pool that fills (a quota): its writes are
//! refused with the no-space error, never held, it reads on, loses no flushed block,
//! and takes writes again once the quota is lifted.

#[path = "../../storage/tests/ceph/mod.rs"]
mod ceph;
use ceph::*;
use fewerbytes_engine::storage::{
    open_rbd, DeviceOptions, RbdStorage, Storage, StorageError, TakeOver,
};
use fewerbytes_engine::{CreateOptions, Mode, OpenOptions, Pool, Volume};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

const BLOCK: usize = 4096;
const MIB: u64 = 1 << 20;
/// Blocks each test writes: noise (stored whole) and, every fourth, a repeat
/// (deduplicated), so both paths cross the device.
const BLOCKS: u64 = 2000;
/// The child process of the SIGKILL test: runs its writer when set.
const CHILD_ENV: &str = "FEWERBYTES_RBD_CHILD";

fn block(seed: u64) -> Vec<u8> {
    noise(if seed % 4 == 3 { 7 } else { seed })
}

/// Incompressible bytes, different for each `seed`: each needs a block of its own.
fn noise(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn device(image: &str, conf: &Path) -> Arc<dyn Storage> {
    Arc::from(open_rbd(POOL, image, None, None, Some(conf)).expect("open the image"))
}

fn open_pool(image: &str, conf: &Path) -> Arc<Pool> {
    Pool::open_devices(
        device(image, conf),
        None,
        &OpenOptions {
            threads: Some(2),
            ..OpenOptions::default()
        },
    )
    .expect("open the pool on the image")
}

fn write_blocks(pool: &Arc<Pool>) {
    pool.create_volume("vm", 64 * MIB).expect("create volume");
    let vol = pool.open_volume("vm").expect("open volume");
    for lbn in 0..BLOCKS {
        vol.write(lbn * BLOCK as u64, &block(lbn), false)
            .expect("write");
    }
    vol.flush().expect("flush");
}

fn check_blocks(pool: &Arc<Pool>) {
    let vol = pool.open_volume("vm").expect("open volume");
    let mut buf = vec![0u8; BLOCK];
    for lbn in 0..BLOCKS {
        vol.read(lbn * BLOCK as u64, &mut buf).expect("read");
        assert!(buf == block(lbn), "block {lbn} reads back other bytes");
    }
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
}

fn new_pool_image(prefix: &str) -> String {
    let image = new_image(prefix, 256);
    Pool::format(
        device(&image, &cluster().conf),
        None,
        None,
        &CreateOptions::default(),
    )
    .expect("format a pool on the image");
    image
}

#[test]
fn a_pool_on_an_rbd_image_keeps_its_blocks_across_a_close() {
    let image = new_pool_image("pool");
    let pool = open_pool(&image, &cluster().conf);
    write_blocks(&pool);
    check_blocks(&pool);
    pool.close().expect("close");
    let pool = open_pool(&image, &cluster().conf);
    check_blocks(&pool);
    pool.close().expect("close");
}

/// The child's half of the SIGKILL test: open, write, flush, say so, and wait to
/// be killed.
#[test]
fn sigkill_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (image, conf) = spec.split_once(' ').expect("image and conf");
    let pool = open_pool(image, Path::new(conf));
    write_blocks(&pool);
    println!("flushed");
    // More writes, never flushed: the kill may leave any of them or none.
    let vol = pool.open_volume("vm").expect("open volume");
    for lbn in 0..BLOCKS {
        vol.write((BLOCKS + lbn) * BLOCK as u64, &block(lbn + 99), false)
            .expect("write");
    }
    std::thread::sleep(std::time::Duration::from_secs(600));
    panic!("the parent never killed this process");
}

#[test]
fn a_pool_whose_process_was_killed_reopens_with_every_flushed_block() {
    let image = new_pool_image("killed");
    let conf = cluster().conf.display().to_string();
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "sigkill_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, format!("{image} {conf}"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the child");
    let stdout = child.stdout.take().expect("child stdout");
    let flushed = BufReader::new(stdout)
        .lines()
        .map_while(|l| l.ok())
        .any(|l| l.trim_end().ends_with("flushed"));
    // SIGKILL: no close, no unwinding, librbd's cache and lock left as they were.
    child.kill().expect("kill the child");
    child.wait().expect("reap the child");
    assert!(flushed, "the child never flushed");
    // The dead client still holds the image's exclusive lock: a plain open is
    // refused, naming it; a take-over blocklists it, breaks the lock and opens.
    match open_rbd(POOL, &image, None, None, Some(&cluster().conf)) {
        Err(StorageError::Owned { owner, .. }) => assert!(!owner.is_empty()),
        Err(other) => panic!("the held image was refused for another reason: {other}"),
        Ok(_) => panic!("an image whose lock a dead client holds was opened without a take-over"),
    }
    let taken = RbdStorage::open_with(
        POOL,
        &image,
        None,
        None,
        Some(&cluster().conf),
        &DeviceOptions {
            take_over: Some(TakeOver::default()),
            ..DeviceOptions::default()
        },
    )
    .expect("take the image over");
    let pool = Pool::open_devices(
        Arc::new(taken),
        None,
        &OpenOptions {
            threads: Some(2),
            ..OpenOptions::default()
        },
    )
    .expect("open the pool taken over");
    check_blocks(&pool);
    pool.close().expect("close");
}

fn read_block(vol: &Volume, lbn: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK];
    vol.read(lbn * BLOCK as u64, &mut buf).expect("a read");
    buf
}

/// The open options of the full-pool tests.
fn full_pool_options() -> OpenOptions {
    OpenOptions {
        threads: Some(2),
        ..OpenOptions::default()
    }
}

/// A new pool on `open_device`'s image with volume `vm` holding the first blocks
/// written and flushed (their count is returned), then the Ceph pool under it
/// filled by a quota below what it holds, and seen full.
fn fill_under_a_pool(
    ceph_pool: &str,
    open_device: &dyn Fn() -> Arc<dyn Storage>,
) -> (Arc<Pool>, Volume, u64) {
    Pool::format(open_device(), None, None, &CreateOptions::default()).expect("format");
    let pool =
        Pool::open_devices(open_device(), None, &full_pool_options()).expect("open the pool");
    pool.create_volume("vm", 64 * MIB).expect("create volume");
    let vol = pool.open_volume("vm").expect("open volume");
    let flushed = 256u64;
    for lbn in 0..flushed {
        vol.write(lbn * BLOCK as u64, &noise(lbn), false)
            .expect("write");
    }
    vol.flush().expect("flush");
    set_quota_bytes(ceph_pool, MIB);
    wait_pool_full(ceph_pool, true);
    (pool, vol, flushed)
}

/// What the NBD client of a pool on a full Ceph pool sees: the pool's Ceph pool
/// (one of this test's own) is filled by a quota below what it holds. librbd's
/// default would hold every write and flush until the pool had room; here, with
/// librbd's cache off (`DeviceOptions::write_through`), a write fails with the
/// no-space error (ENOSPC over NBD), the pool stays writable (not latched), every
/// flushed block reads back, and once the quota is lifted the refused write succeeds
/// without a reopen, as on a full file system.
#[test]
fn a_full_ceph_pool_refuses_writes_with_no_space_and_takes_them_once_space_is_back() {
    let ceph_pool = new_pool("full-engine");
    let image = new_image_in(&ceph_pool, "pool", 256);
    let conf = &cluster().conf;
    let write_through = DeviceOptions {
        write_through: true,
        ..DeviceOptions::default()
    };
    let open_device = || -> Arc<dyn Storage> {
        Arc::new(
            RbdStorage::open_with(&ceph_pool, &image, None, None, Some(conf), &write_through)
                .expect("open the image"),
        )
    };
    let (pool, vol, flushed) = fill_under_a_pool(&ceph_pool, &open_device);

    let limit = std::time::Duration::from_secs(120);
    let guard = watchdog("the engine's I/O on a full Ceph pool", limit);
    // Each new block must land in the image's objects past what they hold, which a
    // full pool refuses; the engine keeps some in memory first.
    let mut acknowledged = flushed;
    let refused = loop {
        assert!(
            acknowledged < flushed + 8192,
            "32 MiB written to a full Ceph pool without a refusal"
        );
        match vol.write(acknowledged * BLOCK as u64, &noise(acknowledged), false) {
            Ok(()) => acknowledged += 1,
            Err(e) => break e,
        }
    };
    assert!(refused.is_no_space(), "not a no-space refusal: {refused}");
    eprintln!("write {acknowledged} found no space: {refused}");
    assert_eq!(
        pool.stats().mode,
        Mode::Normal,
        "a full Ceph pool latched the pool"
    );
    // A flush commits what it can: done, or refused for want of space, not held.
    if let Err(e) = vol.flush() {
        assert!(e.is_no_space(), "a flush on a full Ceph pool: {e}");
    }
    for lbn in 0..acknowledged {
        assert!(read_block(&vol, lbn) == noise(lbn), "block {lbn}");
    }
    drop(guard);

    set_quota_bytes(&ceph_pool, 0);
    wait_pool_full(&ceph_pool, false);
    let guard = watchdog("the engine's I/O once space is back", limit);
    vol.write(acknowledged * BLOCK as u64, &noise(acknowledged), false)
        .expect("the refused write succeeds once space is back, without a reopen");
    vol.flush().expect("flush");
    assert_eq!(pool.stats().mode, Mode::Normal);
    drop(vol);
    pool.close().expect("close");
    drop(guard);
    let pool = Pool::open_devices(open_device(), None, &full_pool_options()).expect("reopen");
    let vol = pool.open_volume("vm").expect("open volume");
    for lbn in 0..=acknowledged {
        assert!(
            read_block(&vol, lbn) == noise(lbn),
            "block {lbn} after a reopen"
        );
    }
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    drop(vol);
    pool.close().expect("close");
}

/// The same with librbd's cache on (its default, which fewerbytes keeps): a write is
/// acknowledged by the cache, and the OSD's refusal comes back from the next flush,
/// which fails: the pool latches read-only rather than hold anything. Every block
/// flushed before reads back, then and after a reopen once the quota is lifted.
#[test]
fn with_the_cache_on_a_full_ceph_pool_fails_a_flush_and_loses_no_flushed_block() {
    let ceph_pool = new_pool("full-cached");
    let image = new_image_in(&ceph_pool, "pool", 256);
    let conf = &cluster().conf;
    let open_device = || -> Arc<dyn Storage> {
        Arc::from(open_rbd(&ceph_pool, &image, None, None, Some(conf)).expect("open the image"))
    };
    let (pool, vol, mut flushed) = fill_under_a_pool(&ceph_pool, &open_device);

    let limit = std::time::Duration::from_secs(120);
    let guard = watchdog("the engine's I/O on a full Ceph pool, cache on", limit);
    // Steps of 64 new blocks, each flushed, until one is refused (the OSD may act on
    // the full flag a while after the monitors show it).
    let refused = loop {
        assert!(
            flushed < 256 + 8192,
            "32 MiB written and flushed to a full Ceph pool without a refusal"
        );
        let step = (flushed..flushed + 64)
            .try_for_each(|lbn| vol.write(lbn * BLOCK as u64, &noise(lbn), false))
            .and_then(|()| vol.flush());
        match step {
            Ok(()) => flushed += 64,
            Err(e) => break e,
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    eprintln!("after {flushed} blocks flushed: {refused}");
    assert!(
        refused.is_no_space() || pool.stats().mode != Mode::Normal,
        "refused, but neither for want of space nor latched: {refused}"
    );
    for lbn in 0..flushed {
        assert!(read_block(&vol, lbn) == noise(lbn), "block {lbn}");
    }
    drop(vol);
    // A latched pool closes without its final checkpoint; either way, not held.
    let _ = pool.close();
    drop(guard);

    set_quota_bytes(&ceph_pool, 0);
    wait_pool_full(&ceph_pool, false);
    let guard = watchdog("the engine's reopen once space is back, cache on", limit);
    let pool = Pool::open_devices(open_device(), None, &full_pool_options()).expect("reopen");
    let vol = pool.open_volume("vm").expect("open volume");
    for lbn in 0..flushed {
        assert!(
            read_block(&vol, lbn) == noise(lbn),
            "block {lbn} after a reopen"
        );
    }
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    vol.write(flushed * BLOCK as u64, &noise(flushed), false)
        .expect("a write once space is back");
    vol.flush().expect("flush");
    drop(vol);
    pool.close().expect("close");
    drop(guard);
}
