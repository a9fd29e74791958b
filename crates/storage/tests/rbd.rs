//! `RbdStorage` on a real one-node Ceph cluster (scripts/ceph/cluster.sh, started
//! by the first test and stopped when the binary exits): what is written reads
//! back, also through a second open after a flush; discards give the space back to
//! the cluster; the length follows `rbd resize`, and a shrunk image fails a flush;
//! bad names and a second opener get clear errors. One owner: a read-write open
//! holds the image's exclusive lock and keeps it from another writer; an image that
//! cannot be locked is refused, naming the `rbd` command that fixes it; and an owner
//! the cluster blocklisted is told so while idle, and finds its writes and flushes
//! fenced, with nothing landed. A batch of writes (librbd's aio) reads back, writes
//! nothing when one of its writes is past the end, fails with librbd's error when
//! refused, and is fenced like a single write. A full Ceph pool, with librbd's cache
//! off (`DeviceOptions::write_through`), refuses new writes with the no-space error
//! (never holds them) and takes them again once space is back.

mod ceph;
use ceph::*;
use fewerbytes_storage::{
    open_rbd, DeviceOptions, DiscardOutcome, RbdStorage, Storage, StorageError,
};
use std::process::Command;

const MIB: u64 = 1 << 20;

fn open(image: &str) -> RbdStorage {
    RbdStorage::open(POOL, image, None, None, Some(&cluster().conf)).expect("open the image")
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn writes_read_back_and_survive_a_reopen_after_a_flush() {
    let image = new_image("roundtrip", 64);
    let dev = open_rbd(POOL, &image, None, None, Some(&cluster().conf)).expect("open");
    assert_eq!(dev.len_bytes(), 64 * MIB);
    assert_eq!(dev.name(), format!("rbd:{POOL}/{image}"));
    // Unaligned, across an object boundary (4 MiB objects), and a large one.
    let writes: [(u64, usize); 4] = [
        (0, 4096),
        (4 * MIB - 1000, 3000),
        (12345, 517),
        (20 * MIB, 9 * MIB as usize),
    ];
    for (i, &(at, len)) in writes.iter().enumerate() {
        dev.write_at(&pattern(i as u64, len), at).expect("write");
    }
    for (i, &(at, len)) in writes.iter().enumerate() {
        let mut buf = vec![0u8; len];
        dev.read_at(&mut buf, at).expect("read");
        assert!(
            buf == pattern(i as u64, len),
            "write {i} at {at} reads back other bytes"
        );
    }
    dev.flush().expect("flush");
    let counted = dev.counters().snapshot();
    assert_eq!(counted.writes, 4);
    assert_eq!(counted.flushes, 1);
    drop(dev);

    let dev = open(&image);
    for (i, &(at, len)) in writes.iter().enumerate() {
        let mut buf = vec![0u8; len];
        dev.read_at(&mut buf, at).expect("read after reopen");
        assert!(
            buf == pattern(i as u64, len),
            "write {i} at {at} was lost by the reopen"
        );
    }
    let mut never_written = vec![1u8; 4096];
    dev.read_at(&mut never_written, 40 * MIB).expect("read");
    assert!(
        never_written.iter().all(|&b| b == 0),
        "a new image reads as zeros"
    );
}

/// A batch (`write_batch`, librbd's aio): more writes than it keeps in flight at
/// once, 4 KiB pages scattered over the image and one across an object boundary,
/// read back through the handle and after a reopen; counted one write each.
#[test]
fn a_batch_of_writes_reads_back_and_survives_a_reopen() {
    let image = new_image("batch", 64);
    let dev = open(&image);
    let mut writes: Vec<(u64, Vec<u8>)> = (0..300u64)
        .map(|i| ((i * 37 % 300) * 128 * 1024, pattern(100 + i, 4096)))
        .collect();
    writes.push((40 * MIB - 5000, pattern(99, 3 * MIB as usize)));
    let batch: Vec<(u64, &[u8])> = writes.iter().map(|(at, b)| (*at, &b[..])).collect();
    dev.write_batch(&batch).expect("write the batch");
    let check = |dev: &RbdStorage, when: &str| {
        for (at, bytes) in &writes {
            assert!(
                read(dev, *at, bytes.len()) == *bytes,
                "the batch's write at {at} reads back other bytes {when}"
            );
        }
    };
    check(&dev, "at once");
    dev.flush().expect("flush");
    assert_eq!(dev.counters().snapshot().writes, writes.len() as u64);
    drop(dev);
    check(&open(&image), "after a reopen");
}

/// A batch with one write past the end writes none of them; a batch librbd refuses
/// (an image opened read-only: each request completes with EROFS) fails with that
/// error once every request has completed.
#[test]
fn a_batch_past_the_end_or_refused_fails_and_writes_nothing() {
    let image = new_image("batch-refused", 8);
    let dev = open(&image);
    let page = pattern(7, 4096);
    let err = dev
        .write_batch(&[(0, &page[..]), (8 * MIB - 2048, &page[..])])
        .unwrap_err();
    assert!(matches!(err, StorageError::OutOfBounds { .. }), "{err}");
    assert!(
        read(&dev, 0, 4096).iter().all(|&b| b == 0),
        "a refused batch wrote"
    );
    drop(dev);

    let reader = open_read_only(&image);
    let batch: Vec<(u64, &[u8])> = (0..100u64).map(|i| (i * 8192, &page[..])).collect();
    let err = reader.write_batch(&batch).unwrap_err();
    assert!(err.to_string().contains("ead-only"), "{err}");
    assert_eq!(reader.counters().snapshot().writes, 0);
    assert!(
        read(&reader, 0, 4096).iter().all(|&b| b == 0),
        "a refused batch wrote"
    );
}

#[test]
fn requests_past_the_end_are_refused_and_change_nothing() {
    let image = new_image("bounds", 8);
    let dev = open(&image);
    let err = dev.write_at(&[7u8; 4096], 8 * MIB - 2048).unwrap_err();
    assert!(matches!(err, StorageError::OutOfBounds { .. }), "{err}");
    let err = dev.read_at(&mut [0u8; 1], 8 * MIB).unwrap_err();
    assert!(matches!(err, StorageError::OutOfBounds { .. }), "{err}");
    let mut tail = vec![1u8; 2048];
    dev.read_at(&mut tail, 8 * MIB - 2048).expect("read");
    assert!(tail.iter().all(|&b| b == 0), "a refused write wrote");
}

#[test]
fn a_discard_gives_whole_objects_back_to_the_cluster() {
    let image = new_image("discard", 32);
    let dev = open(&image);
    dev.write_at(&pattern(1, 16 * MIB as usize), 0)
        .expect("write");
    dev.flush().expect("flush");
    let before = used_bytes(&image);
    assert!(before >= 16 * MIB, "16 MiB written, {before} bytes used");
    // 4096 bytes either side are kept: only the whole pages inside are discarded.
    assert_eq!(
        dev.discard(0, 12 * MIB).expect("discard"),
        DiscardOutcome::Discarded
    );
    dev.flush().expect("flush");
    let after = used_bytes(&image);
    assert!(
        after <= before - 12 * MIB,
        "a 12 MiB discard left {after} of {before} bytes used"
    );
    let mut kept = vec![0u8; 4 * MIB as usize];
    dev.read_at(&mut kept, 12 * MIB).expect("read");
    assert!(
        kept == pattern(1, 16 * MIB as usize)[12 * MIB as usize..],
        "the discard reached past its range"
    );
    assert_eq!(dev.counters().snapshot().discard_bytes, 12 * MIB);
    dev.set_discard_enabled(false);
    assert_eq!(
        dev.discard(0, 4 * MIB).expect("discard"),
        DiscardOutcome::Disabled
    );
}

#[test]
fn the_length_follows_a_resize_and_a_shrunk_image_fails_the_flush() {
    let image = new_image("resize", 16);
    let dev = open(&image);
    rbd(&["resize", "--size", "48M", &format!("{POOL}/{image}")]);
    assert_eq!(dev.refresh_len().expect("refresh"), 48 * MIB);
    dev.write_at(&[5u8; 4096], 40 * MIB)
        .expect("a write into the grown part");
    dev.flush().expect("flush");

    rbd(&[
        "resize",
        "--allow-shrink",
        "--no-progress",
        "--size",
        "8M",
        &format!("{POOL}/{image}"),
    ]);
    let err = dev.flush().unwrap_err();
    assert!(
        matches!(err, StorageError::Shrunk { len_bytes, expected_bytes, .. } if len_bytes == 8 * MIB && expected_bytes == 48 * MIB),
        "{err}"
    );
}

#[test]
fn the_image_reports_its_features() {
    let image = new_image("features", 8);
    let dev = open(&image);
    // Ceph 16's default features for a new image.
    let features = dev.feature_names();
    for f in [
        "layering",
        "exclusive-lock",
        "object-map",
        "fast-diff",
        "deep-flatten",
    ] {
        assert!(features.contains(&f), "{f} missing from {features:?}");
    }
}

#[test]
fn bad_names_and_a_second_opener_get_clear_errors() {
    let conf = &cluster().conf;
    let err = open_rbd(POOL, "no-such-image", None, None, Some(conf))
        .err()
        .expect("a missing image is refused");
    let msg = err.to_string();
    assert!(msg.contains("no image no-such-image in pool rbd"), "{msg}");
    let err = open_rbd("no-such-pool", "x", None, None, Some(conf))
        .err()
        .expect("a missing pool is refused");
    assert!(err.to_string().contains("no pool no-such-pool"), "{err}");
    let missing_conf = cluster().dir.join("nowhere.conf");
    let err = open_rbd(POOL, "x", None, None, Some(&missing_conf))
        .err()
        .expect("a missing conf is refused");
    assert!(err.to_string().contains("nowhere.conf"), "{err}");

    let image = new_image("twice", 8);
    let first = open(&image);
    let err = open_rbd(POOL, &image, None, None, Some(conf))
        .err()
        .expect("a second opener in the process is refused");
    assert!(matches!(err, StorageError::Locked { .. }), "{err}");
    drop(first);
    open(&image);
}

/// The child's half of the next test: in a mount namespace where librados is not a
/// library, open an image and print the error.
#[test]
fn without_librados_child() {
    if std::env::var_os("FEWERBYTES_RBD_NO_LIB_CHILD").is_none() {
        return;
    }
    let err = open_rbd(POOL, "x", None, None, None)
        .err()
        .expect("no librados, no image");
    println!("open error: {err}");
}

#[test]
fn a_machine_without_librbd_gets_an_error_naming_the_package() {
    // librados as the dynamic loader finds it, hidden behind /dev/null in a private
    // mount namespace for a child run of this binary (needs root, as CI is).
    let lib = std::fs::canonicalize("/usr/lib/x86_64-linux-gnu/librados.so.2")
        .or_else(|_| std::fs::canonicalize("/usr/lib/librados.so.2"))
        .expect("librados.so.2 is installed here (apt-get install librbd1)");
    let exe = std::env::current_exe().expect("test binary");
    let out = std::process::Command::new("unshare")
        .args(["-m", "sh", "-c"])
        .arg(r#"mount --bind /dev/null "$1" && exec "$2" --exact without_librados_child --nocapture"#)
        .args(["sh", &lib.display().to_string(), &exe.display().to_string()])
        .env("FEWERBYTES_RBD_NO_LIB_CHILD", "1")
        .output()
        .expect("run unshare (util-linux)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.contains("open error: "))
        .unwrap_or_else(|| panic!("no error printed: {stdout}"));
    assert!(
        line.contains("could not open rbd:rbd/x: librados.so.2 cannot be loaded")
            && line.contains("install librbd1 (apt-get install librbd1)"),
        "{line}"
    );
}

fn open_read_only(image: &str) -> RbdStorage {
    let options = DeviceOptions {
        read_only: true,
        ..DeviceOptions::default()
    };
    RbdStorage::open_with(POOL, image, None, None, Some(&cluster().conf), &options)
        .expect("open the image read-only")
}

fn read(dev: &RbdStorage, offset_bytes: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    dev.read_at(&mut buf, offset_bytes).expect("read");
    buf
}

#[test]
fn an_image_without_exclusive_lock_is_refused_for_writing() {
    let image = format!("nolock-{}", std::process::id());
    rbd(&[
        "create",
        "--size",
        "8M",
        "--image-feature",
        "layering",
        &format!("{POOL}/{image}"),
    ]);
    let err = open_rbd(POOL, &image, None, None, Some(&cluster().conf))
        .err()
        .expect("an image without exclusive-lock is refused read-write");
    let msg = err.to_string();
    assert!(matches!(err, StorageError::NotLockable { .. }), "{msg}");
    assert!(
        msg.contains(&format!("rbd feature enable {POOL}/{image} exclusive-lock")),
        "{msg}"
    );
    // Reading takes no lock.
    assert_eq!(open_read_only(&image).len_bytes(), 8 * MIB);
}

#[test]
fn the_owner_keeps_its_lock_from_another_writer() {
    let image = new_image("owned", 16);
    let dev = open(&image);
    let mine = pattern(11, 64 * 1024);
    dev.write_at(&mine, 0).expect("write");
    dev.flush().expect("flush");
    let holder = lock_holder(&image).expect("the open holds the image's lock");
    // Another client writes at the same offset: librbd asks the holder for the lock,
    // which (taken with rbd_lock_acquire) refuses to hand it over.
    let out = Command::new("rbd")
        .arg("-c")
        .arg(&cluster().conf)
        .args([
            "bench",
            "--io-type",
            "write",
            "--io-size",
            "4K",
            "--io-total",
            "64K",
        ])
        .args(["--io-pattern", "seq", &format!("{POOL}/{image}")])
        .output()
        .expect("run rbd bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "another client wrote the owned image: {stderr}"
    );
    assert!(stderr.contains("Read-only file system"), "{stderr}");
    assert_eq!(lock_holder(&image).as_deref(), Some(holder.as_str()));
    // Nothing of the other writer's reached the image, and the owner goes on.
    assert!(read(&open_read_only(&image), 0, mine.len()) == mine);
    dev.write_at(&pattern(12, 4096), 0)
        .expect("the owner still writes");
    dev.flush().expect("and flushes");
}

#[test]
fn a_blocklisted_owner_finds_its_writes_fenced_and_nothing_lands() {
    let image = new_image("fenced", 16);
    let dev = open(&image);
    let before = pattern(21, 64 * 1024);
    dev.write_at(&before, 0).expect("write");
    dev.flush().expect("flush");
    let holder = lock_holder(&image).expect("the open holds the image's lock");
    let (told, fenced) = std::sync::mpsc::channel();
    let told = std::sync::Mutex::new(told);
    dev.on_fenced(Box::new(move |e| {
        let _ = told.lock().map(|t| t.send(e.to_string()));
    }));
    // What a take-over does first: the owner's client address is blocklisted.
    ceph(&["osd", "blocklist", "add", &holder, "600"]);
    assert!(blocklisted(&holder));
    // The owner learns it with nothing written: its watch on the header is dropped.
    let said = fenced
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the owner was not told it was fenced");
    assert!(said.contains("fenced"), "{said}");
    let write = dev.write_at(&pattern(22, 64 * 1024), 0);
    let flush = dev.flush();
    // librbd's cache may take the write, but then the flush cannot succeed: the
    // write is never reported durable.
    let first = match (write, flush) {
        (Err(e), _) | (Ok(()), Err(e)) => e,
        (Ok(()), Ok(())) => panic!("a blocklisted owner's write was flushed"),
    };
    assert!(first.is_fenced(), "not reported as fenced: {first}");
    assert!(first.to_string().contains("fenced"), "{first}");
    // The same for a batch (aio writes).
    let page = pattern(23, 4096);
    let batch = dev.write_batch(&[(0, &page[..]), (8192, &page[..])]);
    let flush = dev.flush();
    let first = match (batch, flush) {
        (Err(e), _) | (Ok(()), Err(e)) => e,
        (Ok(()), Ok(())) => panic!("a blocklisted owner's batch was flushed"),
    };
    assert!(first.is_fenced(), "a batch not reported as fenced: {first}");
    drop(dev);
    assert!(read(&open_read_only(&image), 0, before.len()) == before);
}

/// What a full Ceph pool does to a writer: this test's own pool, filled by a quota set
/// below what it holds. librbd's default is to hold every write (and an open) until
/// the pool has room again, with no timeout; an `RbdStorage` with librbd's cache off
/// gets the no-space error instead, from the write itself, and keeps reading,
/// flushing and opening.
#[test]
fn a_full_pool_refuses_new_writes_with_no_space_and_takes_them_once_space_is_back() {
    let pool = new_pool("full-storage");
    // Sparse: 1,024 objects of 4 MiB, each a new object to write into.
    let image = new_image_in(&pool, "full", 4096);
    let conf = &cluster().conf;
    let write_through = DeviceOptions {
        write_through: true,
        ..DeviceOptions::default()
    };
    let open_full = || {
        RbdStorage::open_with(&pool, &image, None, None, Some(conf), &write_through).expect("open")
    };
    let dev = open_full();
    let flushed = pattern(31, 4 * MIB as usize);
    dev.write_at(&flushed, 0).expect("write object 0");
    dev.flush().expect("flush");
    set_quota_bytes(&pool, MIB);
    wait_pool_full(&pool, true);

    let limit = std::time::Duration::from_secs(120);
    let guard = watchdog("a librbd call on a full pool", limit);
    // The OSD may act on the map that flags the pool full a while after the
    // monitors show it (a loaded machine): a write into a new object is refused from
    // then on. One new object every 50 ms, for up to 1,000 of them.
    let refused = (1..1024u64).find_map(|object| {
        let written = dev.write_at(&pattern(40 + object, 4096), object * 4 * MIB);
        if written.is_ok() {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        written.err().map(|e| (object, e))
    });
    let (object, err) =
        refused.expect("1,023 writes into new objects of a full pool all succeeded");
    assert!(err.is_no_space(), "not reported as no space: {err}");
    assert!(err.to_string().contains("found no space"), "{err}");
    // Rewriting bytes an object already holds adds nothing: allowed while full.
    let rewritten = pattern(32, 4096);
    dev.write_at(&rewritten, 8192)
        .expect("an overwrite inside object 0");
    dev.flush().expect("a flush on a full pool");
    let mut expected = flushed.clone();
    expected[8192..8192 + 4096].copy_from_slice(&rewritten);
    assert!(read(&dev, 0, expected.len()) == expected);
    // Opening takes the image's lock, a write to its header: also not held.
    drop(dev);
    let dev = open_full();
    assert!(
        read(&dev, 0, expected.len()) == expected,
        "lost by a reopen"
    );
    drop(guard);

    set_quota_bytes(&pool, 0);
    wait_pool_full(&pool, false);
    let guard = watchdog("a librbd call once space is back", limit);
    let late = pattern(50, 4096);
    dev.write_at(&late, object * 4 * MIB)
        .expect("the refused write succeeds once space is back");
    dev.flush().expect("flush");
    assert!(read(&dev, object * 4 * MIB, late.len()) == late);
    assert!(read(&dev, 0, expected.len()) == expected);
    drop(guard);
}
