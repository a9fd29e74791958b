//! Damage heals: a stored block whose bytes fail their fingerprint reads
//! as an error until its good data is written back; then every volume block naming
//! it reads good, across a reopen, and the scrub finds nothing. Before, the good
//! data deduplicated onto the damaged object (dedup advice reads no data), so the
//! write "succeeded" and every read still failed; only trimming the block in every
//! volume that mapped it, then writing, cleared it.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, FaultStorage, Image, IoLog, LogReplay, Storage};
use fewerbytes_engine::{compress_block, read_damage, OpenOptions, Pool, RepairOptions, Volume};
use rand::SeedableRng;
use std::sync::Arc;

const B: u64 = BLOCK as u64;

/// Flip one bit in the middle of the first copy of `stored` found on the pool's
/// device, under the open pool (a drive returning bad bytes).
fn flip_stored(t: &TestPool, stored: &[u8]) {
    let image = t.dev.crash_image(CrashMode::KeepAll);
    let at = image
        .windows(stored.len())
        .position(|w| w == stored)
        .expect("the stored bytes on the device");
    let mid = at + stored.len() / 2;
    t.dev.write_at(&[image[mid] ^ 0x10], mid as u64).unwrap();
}

fn read_block(v: &Volume, lbn: u64) -> Result<Vec<u8>, fewerbytes_engine::EngineError> {
    let mut buf = vec![0u8; BLOCK];
    v.read(lbn * B, &mut buf).map(|()| buf)
}

fn assert_damaged(v: &Volume, lbn: u64, what: &str) {
    match read_block(v, lbn) {
        Err(e) => assert!(read_damage(&e).is_some(), "{what}: not damage: {e}"),
        Ok(_) => panic!("{what}: a damaged block read without an error"),
    }
}

fn assert_reads(v: &Volume, lbn: u64, want: &[u8], what: &str) {
    match read_block(v, lbn) {
        Ok(got) => assert!(got == want, "{what}: reads other bytes"),
        Err(e) => panic!("{what}: {e}"),
    }
}

#[test]
fn a_write_of_the_good_data_heals_every_volume_block_naming_a_damaged_block() {
    let mut t = create(64 << 20, None);
    for name in ["a", "b"] {
        t.pool().create_volume(name, 4 << 20).unwrap();
    }
    let good = random_block(7);
    write_blocks(t.pool(), "a", 0, 8, 100);
    let a = t.pool().open_volume("a").unwrap();
    a.write(3 * B, &good, false).unwrap();
    // The same data in another volume, and a clone sharing a's map.
    let b = t.pool().open_volume("b").unwrap();
    b.write(5 * B, &good, false).unwrap();
    a.flush().unwrap();
    drop((a, b));
    t.pool().clone_volume("a", "c").unwrap();
    let object = t.pool().object_of("a", 3).unwrap();
    assert_eq!(
        t.pool().object_of("b", 5).unwrap(),
        object,
        "one stored copy"
    );
    t.reopen();
    flip_stored(&t, &good);

    let pool = t.pool().clone();
    let (a, b, c) = (
        pool.open_volume("a").unwrap(),
        pool.open_volume("b").unwrap(),
        pool.open_volume("c").unwrap(),
    );
    assert_damaged(&a, 3, "a's block 3");
    assert_eq!(pool.stats().damaged_objects_known, 1);

    // The good data written back over the block a read found damaged.
    a.write(3 * B, &good, false).unwrap();
    a.flush().unwrap();
    assert_reads(&a, 3, &good, "a's block 3, written back");
    assert_reads(&b, 5, &good, "b's block 5, which maps the same data");
    assert_reads(&c, 3, &good, "clone c's block 3");
    let stats = pool.stats();
    assert_eq!(stats.damaged_objects_healed, 1);
    assert_eq!(stats.damaged_objects_known, 0);
    // One stored copy still: the object was healed, not copied.
    assert_eq!(pool.object_of("b", 5).unwrap(), object);
    assert!(pool.audit().problems.is_empty(), "{:?}", pool.audit());
    drop((a, b, c, pool));

    t.reopen();
    let pool = t.pool().clone();
    for (name, lbn) in [("a", 3), ("b", 5), ("c", 3)] {
        let v = pool.open_volume(name).unwrap();
        assert_reads(
            &v,
            lbn,
            &good,
            &format!("{name}'s block {lbn} after a reopen"),
        );
    }
    // Data only: whether the scrub accepts a clone's shared map pages is not
    // what this test is about.
    let s = scrub_to_end(&pool);
    assert!(s.findings.iter().all(|f| f.region != "data"), "{s:#?}");
}

#[test]
fn a_damaged_fragment_the_scrub_found_heals_without_touching_its_neighbours() {
    let mut t = create(64 << 20, None);
    t.pool().create_volume("a", 4 << 20).unwrap();
    t.pool().create_volume("b", 4 << 20).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(37);
    let blocks: Vec<Vec<u8>> = (0..8)
        .map(|_| {
            let mut b = vec![0u8; BLOCK];
            compressible(&mut rng, &mut b);
            b
        })
        .collect();
    let a = t.pool().open_volume("a").unwrap();
    for (i, block) in blocks.iter().enumerate() {
        a.write(i as u64 * B, block, false).unwrap();
    }
    a.flush().unwrap();
    drop(a);
    let compression = t.pool().stats().compression;
    let (_, fragment) = compress_block(compression, &blocks[4]).expect("compressible");
    // Reopened: the server knows of no damage until the scrub finds it.
    t.reopen();
    flip_stored(&t, &fragment);
    t.reopen();
    let pool = t.pool().clone();
    let s = scrub_to_end(&pool);
    assert_eq!(s.errors_found, 1, "{s:#?}");
    assert_eq!(pool.stats().damaged_objects_known, 1);

    // Written into another volume: the object both name heals.
    let b = pool.open_volume("b").unwrap();
    b.write(9 * B, &blocks[4], false).unwrap();
    b.flush().unwrap();
    let a = pool.open_volume("a").unwrap();
    for (i, block) in blocks.iter().enumerate() {
        assert_reads(&a, i as u64, block, &format!("a's block {i}"));
    }
    assert_eq!(pool.stats().damaged_objects_healed, 1);
    drop((a, b, pool));
    t.reopen();
    let pool = t.pool().clone();
    pool.compact().unwrap();
    let a = pool.open_volume("a").unwrap();
    for (i, block) in blocks.iter().enumerate() {
        assert_reads(
            &a,
            i as u64,
            block,
            &format!("a's block {i} after a reopen"),
        );
    }
    let s = scrub_to_end(&pool);
    assert_eq!(s.errors_found, 0, "{s:#?}");
}

/// What a crash at one point of a heal left: the healed block reads as its good
/// data or fails as damage (never as other bytes); once the heal's flush returned,
/// it reads good; the counts audit clean.
fn check_crash_image(image: Image, good: &[u8], flushed: bool, what: &str) {
    let dev = Arc::new(FaultStorage::from_pages("data", image));
    let pool = Pool::open_devices(dev as Arc<dyn Storage>, None, &OpenOptions::default())
        .unwrap_or_else(|e| panic!("{what}: the pool does not open: {e}"));
    let a = pool.open_volume("a").unwrap();
    match read_block(&a, 2) {
        Ok(got) => assert!(got == good, "{what}: a's block 2 reads other bytes"),
        Err(e) => {
            assert!(read_damage(&e).is_some(), "{what}: {e}");
            assert!(!flushed, "{what}: a flushed heal is lost: {e}");
        }
    }
    let b = pool.open_volume("b").unwrap();
    if let Ok(got) = read_block(&b, 0) {
        assert!(
            got == good || got == vec![0u8; BLOCK],
            "{what}: b's block 0"
        );
    }
    assert!(
        pool.audit().problems.is_empty(),
        "{what}: {:?}",
        pool.audit()
    );
    drop((a, b));
    pool.close().unwrap();
}

#[test]
fn a_crash_at_every_write_of_a_heal_leaves_the_block_damaged_and_reported_or_good() {
    // The heal's writes (its fresh block, the journal, the checkpoint of the close)
    // are recorded; a crash before each of them, keeping none, all, or a seeded
    // subset of the unflushed writes torn at 512 bytes, is opened and checked.
    let good = random_block(11);
    let mut t = create(64 << 20, None);
    t.pool().create_volume("a", 4 << 20).unwrap();
    t.pool().create_volume("b", 4 << 20).unwrap();
    write_blocks(t.pool(), "a", 0, 4, 300);
    let a = t.pool().open_volume("a").unwrap();
    a.write(2 * B, &good, false).unwrap();
    a.flush().unwrap();
    drop(a);
    t.close();
    let mut base = t.dev.crash_image(CrashMode::KeepAll);
    let at = base
        .windows(BLOCK)
        .position(|w| w == good.as_slice())
        .expect("the stored block");
    base[at + 100] ^= 0x01;

    let log = IoLog::new();
    let dev = Arc::new(FaultStorage::from_image("data", base.clone()).record_into(log.clone(), 0));
    let pool = Pool::open_devices(dev as Arc<dyn Storage>, None, &OpenOptions::default()).unwrap();
    let opened = log.len();
    let (a, b) = (
        pool.open_volume("a").unwrap(),
        pool.open_volume("b").unwrap(),
    );
    assert_damaged(&a, 2, "before the heal");
    b.write(0, &good, false).unwrap();
    b.flush().unwrap();
    let flushed = log.len();
    assert_eq!(pool.stats().damaged_objects_healed, 1);
    drop((a, b));
    pool.close().unwrap();
    let events = log.take();
    assert!(flushed > opened, "the heal wrote nothing the log saw");

    let mut replay = LogReplay::new(vec![Image::from_bytes(&base)], &events);
    for n in opened..=events.len() {
        replay.seek(n);
        for mode in [
            CrashMode::DropAll,
            CrashMode::KeepAll,
            CrashMode::Random(n as u64),
        ] {
            let what = format!("a crash at event {n} of {} ({mode:?})", events.len());
            let image = replay.crash_images(mode).remove(0);
            check_crash_image(image, &good, n >= flushed, &what);
        }
    }
}

/// Open the pool on `t`'s device for repair and run `check --repair --verify-data`.
fn repair_with_verify(t: &mut TestPool) -> fewerbytes_engine::RepairReport {
    t.close();
    let pool = Pool::open_devices_for_repair(
        t.dev.clone() as Arc<dyn Storage>,
        None,
        &OpenOptions::default(),
    )
    .unwrap();
    let report = pool
        .repair(
            &RepairOptions {
                apply: true,
                verify_data: true,
            },
            &|_, _, _| {},
        )
        .unwrap();
    pool.close().unwrap();
    t.open();
    report
}

#[test]
fn check_repair_verify_data_heals_a_damaged_block_from_another_copy_of_its_data() {
    let mut t = create(64 << 20, None);
    t.pool().create_volume("a", 4 << 20).unwrap();
    t.pool().create_volume("b", 4 << 20).unwrap();
    let good = random_block(21);
    let a = t.pool().open_volume("a").unwrap();
    a.write(3 * B, &good, false).unwrap();
    a.flush().unwrap();
    drop(a);
    t.reopen();
    flip_stored(&t, &good);
    // A later copy of the same data the index did not know of (written while it
    // was still being built after an open): stored as an object of its own.
    t.close();
    t.open_with(&OpenOptions {
        threads: Some(2),
        hold_index_build: true,
        ..OpenOptions::default()
    });
    let b = t.pool().open_volume("b").unwrap();
    b.write(6 * B, &good, false).unwrap();
    b.flush().unwrap();
    drop(b);
    assert_ne!(
        t.pool().object_of("a", 3).unwrap(),
        t.pool().object_of("b", 6).unwrap(),
        "two stored copies"
    );
    t.pool().release_index_build();

    let report = repair_with_verify(&mut t);
    assert!(report.damage_left.is_empty(), "{report:#?}");
    assert!(
        report
            .repairs
            .iter()
            .any(|r| r.contains("healed from object")),
        "{report:#?}"
    );
    let a = t.pool().open_volume("a").unwrap();
    assert_reads(&a, 3, &good, "a's block 3 after the repair");
    let s = scrub_to_end(t.pool());
    assert_eq!(s.errors_found, 0, "{s:#?}");
}

#[test]
fn a_block_found_damaged_stays_reported_until_its_own_data_is_written() {
    // Other data written over one volume's block drops that volume's reference
    // only: the other volume naming the damaged block still reads an error.
    let mut t = create(64 << 20, None);
    t.pool().create_volume("a", 4 << 20).unwrap();
    let good = random_block(31);
    let a = t.pool().open_volume("a").unwrap();
    a.write(0, &good, false).unwrap();
    a.flush().unwrap();
    drop(a);
    t.pool().clone_volume("a", "c").unwrap();
    t.reopen();
    flip_stored(&t, &good);
    let a = t.pool().open_volume("a").unwrap();
    let c = t.pool().open_volume("c").unwrap();
    assert_damaged(&a, 0, "a's block 0");
    a.write(0, &random_block(32), false).unwrap();
    assert_damaged(
        &c,
        0,
        "c's block 0 after a's was overwritten with other data",
    );
    assert_eq!(t.pool().stats().damaged_objects_healed, 0);
    c.write(0, &good, false).unwrap();
    assert_reads(&c, 0, &good, "c's block 0 written back");
}

#[test]
fn a_damaged_block_heals_while_the_index_is_still_being_built() {
    // Right after an open the dedup index is built in the background: a write of
    // the good data finds the damaged block among those known damaged, not in the
    // index, and heals it all the same.
    let mut t = create(64 << 20, None);
    t.pool().create_volume("a", 4 << 20).unwrap();
    t.pool().create_volume("b", 4 << 20).unwrap();
    let good = random_block(41);
    let a = t.pool().open_volume("a").unwrap();
    a.write(B, &good, false).unwrap();
    a.flush().unwrap();
    drop(a);
    t.close();
    let mut image = t.dev.crash_image(CrashMode::KeepAll);
    let at = image
        .windows(BLOCK)
        .position(|w| w == good.as_slice())
        .expect("the stored block");
    image[at + 9] ^= 0x80;
    t.dev = Arc::new(FaultStorage::from_image("data", image));
    t.open_with(&OpenOptions {
        threads: Some(2),
        hold_index_build: true,
        ..OpenOptions::default()
    });
    let a = t.pool().open_volume("a").unwrap();
    assert_damaged(&a, 1, "a's block 1");
    let b = t.pool().open_volume("b").unwrap();
    b.write(7 * B, &good, false).unwrap();
    assert_reads(&a, 1, &good, "a's block 1 after b was written");
    assert_eq!(t.pool().stats().damaged_objects_healed, 1);
    assert_eq!(
        t.pool().object_of("a", 1).unwrap(),
        t.pool().object_of("b", 7).unwrap()
    );
    t.pool().release_index_build();
}

/// Open options keeping the saved index and the damaged-block hint in `dir`.
fn hinted(dir: &std::path::Path) -> OpenOptions {
    OpenOptions {
        threads: Some(2),
        saved_index: fewerbytes_engine::SavedIndex::At(dir.join("pool.index")),
        ..OpenOptions::default()
    }
}

fn hint_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("fb-heal-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `a` and `b` each map `good` (one stored object), clone `c` shares a's map, and a
/// read of a's block found it damaged; the pool is then closed.
fn damaged_then_closed(dir: &std::path::Path, good: &[u8]) -> TestPool {
    let mut t = create(64 << 20, None);
    for name in ["a", "b"] {
        t.pool().create_volume(name, 4 << 20).unwrap();
    }
    write_blocks(t.pool(), "a", 0, 8, 100);
    let a = t.pool().open_volume("a").unwrap();
    a.write(3 * B, good, false).unwrap();
    let b = t.pool().open_volume("b").unwrap();
    b.write(5 * B, good, false).unwrap();
    a.flush().unwrap();
    drop((a, b));
    t.pool().clone_volume("a", "c").unwrap();
    t.close();
    t.open_with(&hinted(dir));
    flip_stored(&t, good);
    let a = t.pool().open_volume("a").unwrap();
    assert_damaged(&a, 3, "a's block 3");
    drop(a);
    t.close();
    t
}

#[test]
fn a_write_of_the_good_data_after_a_restart_heals_a_block_found_damaged_before_it() {
    let dir = hint_dir("restart");
    let good = random_block(11);
    let mut t = damaged_then_closed(&dir, &good);
    assert!(dir.join("pool.damaged").exists(), "no hint beside the pool");

    // The restarted pool: no read of the block before the good data comes back.
    t.open_with(&hinted(&dir));
    let pool = t.pool().clone();
    let stats = pool.stats();
    assert_eq!(stats.damaged_objects_carried_over, 1);
    assert_eq!(stats.damaged_objects_known, 1);
    assert_eq!(pool.info().damaged_objects_carried_over, 1);
    let a = pool.open_volume("a").unwrap();
    a.write(3 * B, &good, false).unwrap();
    a.flush().unwrap();
    for (name, lbn) in [("a", 3), ("b", 5), ("c", 3)] {
        let v = pool.open_volume(name).unwrap();
        assert_reads(&v, lbn, &good, &format!("{name}'s block {lbn}, healed"));
    }
    assert_eq!(pool.stats().damaged_objects_healed, 1);
    assert_eq!(scrub_to_end(&pool).errors_found, 0);
    drop((a, pool));
    // Healed: the hint is gone, the next open carries nothing over.
    t.close();
    assert!(
        !dir.join("pool.damaged").exists(),
        "the healed block left in the hint"
    );
    t.open_with(&hinted(&dir));
    assert_eq!(t.pool().stats().damaged_objects_carried_over, 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_stale_forged_or_writable_by_others_hint_marks_nothing_damaged() {
    let dir = hint_dir("forged");
    let good = random_block(12);
    let mut t = damaged_then_closed(&dir, &good);
    let hint = dir.join("pool.damaged");
    let text = std::fs::read_to_string(&hint).unwrap();
    // Group-writable: refused, so the block is not known.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&hint, std::fs::Permissions::from_mode(0o664)).unwrap();
    t.open_with(&hinted(&dir));
    assert_eq!(t.pool().stats().damaged_objects_known, 0);
    // Healed the slow way (another block's data first, so the write does not dedup).
    let a = t.pool().open_volume("a").unwrap();
    for v in ["a", "b", "c"] {
        t.pool()
            .open_volume(v)
            .unwrap()
            .trim(0, 4 << 20, false)
            .unwrap();
    }
    a.write(3 * B, &good, false).unwrap();
    a.flush().unwrap();
    drop(a);
    t.close();

    // The old hint again (stale: its object is freed or holds good data), and
    // forged lines naming every object with a made-up fingerprint.
    let mut forged = text.clone();
    for o in 0..64u64 {
        forged.push_str(&format!("{o} {} forged\n", "ab".repeat(32)));
    }
    std::fs::write(&hint, forged).unwrap();
    std::fs::set_permissions(&hint, std::fs::Permissions::from_mode(0o600)).unwrap();
    t.open_with(&hinted(&dir));
    let pool = t.pool().clone();
    let stats = pool.stats();
    assert_eq!(stats.damaged_objects_known, 0);
    assert_eq!(stats.damaged_objects_carried_over, 0);
    let a = pool.open_volume("a").unwrap();
    assert_reads(&a, 3, &good, "a's block 3");
    drop((a, pool));
    std::fs::remove_dir_all(&dir).unwrap();
}
