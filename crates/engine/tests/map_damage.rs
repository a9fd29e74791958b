//! A block-map page that fails its checks at open, in a page both super block copies
//! share, loses at most the 504 blocks it maps (`map_damage.rs`): the pool opens
//! (read-write and read-only), every other volume and every other block of the
//! volume reads back, the damaged range is refused for reads, writes, trims and
//! zeroes, the checkpoint keeps the failed page as it is, `audit` names the range,
//! and a repair clears it (it reads as zeros) without freeing what another volume
//! still shares. Journal records into the damaged range replayed after a crash add
//! references and drop none: nothing another volume shares is freed. Deleting the
//! damaged volume is allowed (its leak stays counted until a repair).
//!
//! Before this, the open failed ("corrupt block map page …") and no volume of the
//! pool could be read.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, FaultStorage, Storage};
use fewerbytes_engine::{Compression, EngineError, OpenOptions, Pool, RepairOptions, BLOCK_BYTES};
use fewerbytes_format::page::{decode_page, PageKind};
use std::collections::BTreeMap;
use std::sync::Arc;

const VOLUME_BYTES: u64 = 8 << 20;
const VOLUME_BLOCKS: u64 = VOLUME_BYTES / BLOCK as u64;
/// Blocks one map page maps.
const PER_PAGE: u64 = 504;
/// The map page of volume "a" that is damaged, and the blocks it maps.
const PAGE: u64 = 1;
const DAMAGED: std::ops::Range<u64> = PAGE * PER_PAGE..(PAGE + 1) * PER_PAGE;
const OPTS: OpenOptions = OpenOptions {
    threads: Some(2),
    index_memory_bytes: None,
    no_discard: false,
    hold_index_build: false,
    take_over: None,
    saved_index: fewerbytes_engine::SavedIndex::Off,
};

/// What each (volume, block) should read: the seed of its random block (0: zeros).
type Model = BTreeMap<(&'static str, u64), u64>;

fn write(pool: &Arc<Pool>, model: &mut Model, volume: &'static str, lbn: u64, seed: u64) {
    let vol = pool.open_volume(volume).unwrap();
    vol.write(lbn * BLOCK as u64, &random_block(seed), false)
        .unwrap();
    model.insert((volume, lbn), seed);
}

/// Checkpoints taken now, touching no map page (a setting made durable by two).
fn checkpoint(pool: &Arc<Pool>) {
    pool.set_compression(Compression::Lz4).unwrap();
}

/// Volumes "a" and "b" written whole; "b"'s blocks over "a"'s damaged range are the
/// same data as "a"'s there, so they share objects (deduplicated) with the page
/// that will be lost.
fn two_volumes() -> (TestPool, Model) {
    let t = create(96 << 20, None);
    let pool = t.pool();
    pool.create_volume("a", VOLUME_BYTES).unwrap();
    pool.create_volume("b", VOLUME_BYTES).unwrap();
    let mut model = Model::new();
    for lbn in 0..VOLUME_BLOCKS {
        write(pool, &mut model, "a", lbn, 1_000_000 + lbn);
        let b_seed = if DAMAGED.contains(&lbn) {
            1_000_000 + lbn
        } else {
            2_000_000 + lbn
        };
        write(pool, &mut model, "b", lbn, b_seed);
    }
    pool.flush().unwrap();
    (t, model)
}

fn volume_id(pool: &Arc<Pool>, name: &str) -> u64 {
    pool.list_volumes()
        .iter()
        .find(|v| v.name == name)
        .unwrap()
        .id
}

/// The block (on the device) of the newest copy of map page `index` of volume `owner`.
fn map_page_block(image: &[u8], owner: u64, index: u64) -> u64 {
    let sb = newest_super_block(image);
    (1..sb.page_slots)
        .filter_map(|slot| {
            let block = sb.pages_start_block + slot;
            let bytes = image.get(block as usize * BLOCK..(block as usize + 1) * BLOCK)?;
            let (h, _) = decode_page(bytes, PageKind::Map, sb.nonce, slot).ok()?;
            (h.owner == owner && h.index == index).then_some((h.generation, block))
        })
        .max()
        .map(|(_, block)| block)
        .expect("the map page is in the page store")
}

fn flip(image: &mut [u8], block: u64) {
    image[block as usize * BLOCK + 1000] ^= 0x40;
}

/// Close the pool, open it again and take checkpoints that leave map page `PAGE` of
/// the tree whose pages name `owner` as it is (both super block copies then reach it,
/// so the older copy cannot stand in), close it, and flip a bit of that page in the
/// image: the image and the page's block.
fn image_with_a_bad_page(t: &mut TestPool, owner: u64) -> (Vec<u8>, u64) {
    t.pool.take().unwrap().close().unwrap();
    t.open();
    checkpoint(t.pool());
    t.pool.take().unwrap().close().unwrap();
    let mut image = t.dev.crash_image(CrashMode::KeepAll);
    let block = map_page_block(&image, owner, PAGE);
    flip(&mut image, block);
    (image, block)
}

fn open_image(image: Vec<u8>) -> (Arc<FaultStorage>, Arc<Pool>) {
    let dev = Arc::new(FaultStorage::from_image("data", image));
    let pool = Pool::open_devices(dev.clone() as Arc<dyn Storage>, None, &OPTS)
        .unwrap_or_else(|e| panic!("a damaged map page stopped the whole pool: {e}"));
    (dev, pool)
}

/// Every block of the model outside `skip` (of volume "a") reads back.
fn verify(pool: &Arc<Pool>, model: &Model, skip: std::ops::Range<u64>, what: &str) {
    let mut buf = vec![0u8; BLOCK];
    for (&(volume, lbn), &seed) in model {
        if volume == "a" && skip.contains(&lbn) {
            continue;
        }
        let vol = pool.open_volume(volume).unwrap();
        vol.read(lbn * BLOCK as u64, &mut buf)
            .unwrap_or_else(|e| panic!("{what}: volume {volume} block {lbn}: {e}"));
        let want = if seed == 0 {
            vec![0u8; BLOCK]
        } else {
            random_block(seed)
        };
        assert!(buf == want, "{what}: volume {volume} block {lbn} differs");
    }
}

/// Every request into the damaged range is refused, naming it; the rest of "a" works.
fn assert_refused(pool: &Arc<Pool>, model: &mut Model, read_only: bool) {
    let block = BLOCK as u64;
    let ranges = pool.damaged_ranges();
    assert_eq!(ranges.len(), 1, "{ranges:?}");
    let range = &ranges[0];
    assert_eq!(range.volume, "a");
    assert_eq!(range.offset_bytes, DAMAGED.start * block);
    assert_eq!(range.len_bytes, PER_PAGE * block);
    assert_eq!(range.region, "block map page");
    assert_eq!(pool.stats().damaged_ranges, ranges);
    assert_eq!(pool.info().damaged_range_count, 1);
    let a = pool.open_volume("a").unwrap();
    assert_eq!(a.damaged_ranges(), ranges);
    let mut buf = vec![0u8; BLOCK];
    let damaged = |r: Result<(), EngineError>, what: &str| match r {
        Err(EngineError::Damaged { range: r, .. }) => assert_eq!(*r, ranges[0], "{what}"),
        other => panic!("{what} into the damaged range: {other:?}"),
    };
    damaged(a.read(DAMAGED.start * block, &mut buf), "a read");
    damaged(a.read((DAMAGED.end - 1) * block, &mut buf), "a read");
    // A read that only starts before it still touches it.
    let mut two = vec![0u8; 2 * BLOCK];
    damaged(
        a.read((DAMAGED.start - 1) * block, &mut two),
        "a straddling read",
    );
    // Block status reports it as data, so a copy reads it (and fails) rather than
    // take it for zeros.
    let extents = a.extents(DAMAGED.start * block, PER_PAGE * block).unwrap();
    assert!(extents.iter().all(|e| e.data), "{extents:?}");
    if read_only {
        return;
    }
    damaged(a.write(700 * block, &random_block(9), false), "a write");
    damaged(
        a.write(700 * block + 10, &[1u8; 100], false),
        "a partial write",
    );
    damaged(a.trim(DAMAGED.start * block, block, false), "a trim");
    damaged(
        a.write_zeroes(800 * block, 4 * block, false),
        "a write-zeroes",
    );
    // Writes elsewhere in the volume work.
    write(pool, model, "a", 3, 3_000_003);
    write(pool, model, "a", DAMAGED.end, 3_000_000 + DAMAGED.end);
    a.trim(1500 * block, block, false).unwrap();
    model.insert(("a", 1500), 0);
    // What would walk the lost entries is refused; the message names the range.
    for refused in [
        pool.clone_volume("a", "copy").unwrap_err(),
        pool.resize_volume("a", 2 * VOLUME_BYTES, false)
            .unwrap_err(),
    ] {
        assert!(refused.to_string().contains("damaged ranges"), "{refused}");
    }
}

/// No audit problem says a count is below the references the maps hold (or an
/// object they name is free): a leak is allowed, a free of something referenced not.
fn assert_no_count_below_its_references(problems: &[String], what: &str) {
    for p in problems {
        assert!(!p.contains("which is free"), "{what}: {p}");
        // "object N: stored count C but maps hold E references"
        if let Some(rest) = p.split("stored count ").nth(1) {
            let mut words = rest.split_whitespace();
            let stored: u64 = words.next().unwrap().parse().unwrap();
            let held: u64 = words.nth(3).unwrap().parse().unwrap();
            assert!(stored >= held, "{what}: a count below its references: {p}");
        }
    }
}

#[test]
fn a_bad_map_page_both_copies_share_loses_only_the_blocks_it_maps() {
    let (mut t, model) = two_volumes();
    let mut model = model;
    let id = volume_id(t.pool(), "a");
    let (image, block) = image_with_a_bad_page(&mut t, id);
    let flipped = image[block as usize * BLOCK..(block as usize + 1) * BLOCK].to_vec();

    // Read-only: nothing written, the damaged range refused, the rest served.
    let ro_dev = Arc::new(FaultStorage::from_image("data", image.clone()));
    let ro = Pool::open_devices_read_only(ro_dev as Arc<dyn Storage>, None, &OPTS)
        .unwrap_or_else(|e| panic!("a damaged map page stopped a read-only open: {e}"));
    assert_refused(&ro, &mut model, true);
    assert_eq!(ro.damaged_ranges()[0].block, block);
    verify(&ro, &model, DAMAGED, "read-only");
    drop(ro);

    // Read-write: the same, and writes elsewhere work.
    let (dev, pool) = open_image(image);
    assert_eq!(
        pool.stats().metadata_copies_repaired,
        0,
        "the newest copy opened, with the range damaged (no fall-back)"
    );
    assert_refused(&pool, &mut model, false);
    verify(&pool, &model, DAMAGED, "read-write");
    let audit = pool.audit();
    assert!(
        audit.problems.first().is_some_and(|p| p.contains(&format!(
            "volume 'a' bytes {}..{}",
            DAMAGED.start * BLOCK as u64,
            DAMAGED.end * BLOCK as u64 - 1
        ))),
        "{:?}",
        audit.problems
    );
    // The objects the lost entries named keep their counts: "b" shares them.
    assert_no_count_below_its_references(&audit.problems, "damaged");
    assert!(
        audit.problems.iter().any(|p| p.contains("stored count")),
        "the lost entries' objects read as a leak: {:?}",
        audit.problems
    );
    // A scrub finds the page and cannot rewrite it (its entries are unknown): it
    // leaves it as it is, and the pool keeps serving.
    let scrub = scrub_to_end(&pool);
    assert_eq!(scrub.errors_found, 1, "{scrub:#?}");
    assert_eq!(scrub.repaired, 0, "{scrub:#?}");
    assert!(pool.latched_reason().is_none());
    assert_eq!(pool.damaged_ranges().len(), 1);
    checkpoint(&pool);
    pool.close().unwrap();

    // Checkpoints kept the failed page's reference and never wrote over it.
    let image = dev.crash_image(CrashMode::KeepAll);
    assert!(
        image[block as usize * BLOCK..(block as usize + 1) * BLOCK] == flipped[..],
        "a checkpoint wrote over the damaged map page"
    );
    let (dev, pool) = open_image(image);
    assert_eq!(
        pool.damaged_ranges().len(),
        1,
        "the damage is kept across opens"
    );
    verify(&pool, &model, DAMAGED, "reopened");
    pool.close().unwrap();

    // The repair clears the range: it reads as zeros, "b" keeps every block.
    let dev = Arc::new(FaultStorage::from_image(
        "data",
        dev.crash_image(CrashMode::KeepAll),
    ));
    let pool = Pool::open_devices_for_repair(dev.clone() as Arc<dyn Storage>, None, &OPTS).unwrap();
    let report = pool
        .repair(
            &RepairOptions {
                apply: true,
                verify_data: false,
            },
            &|_, _, _| {},
        )
        .unwrap();
    assert!(
        report
            .repairs
            .iter()
            .any(|r| r.contains("volume 'a' bytes")),
        "{:?}",
        report.repairs
    );
    assert_eq!(report.lost_bytes, PER_PAGE * BLOCK as u64);
    pool.close().unwrap();
    let (_dev, pool) = open_image(dev.crash_image(CrashMode::KeepAll));
    assert!(pool.damaged_ranges().is_empty());
    for lbn in DAMAGED {
        model.insert(("a", lbn), 0);
    }
    verify(&pool, &model, 0..0, "repaired");
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    // And the range takes writes again.
    write(&pool, &mut model, "a", 600, 4_000_600);
    verify(&pool, &model, 0..0, "rewritten");
    pool.close().unwrap();
}

/// After a crash, the journal holds writes into the page that is then found damaged:
/// replay sets no entry there, adds the new entries' references and drops none, so
/// nothing "b" shares is freed, and the repair then frees only the leak.
#[test]
fn journal_records_into_a_damaged_page_add_references_and_drop_none() {
    let (t, mut model) = two_volumes();
    let id = volume_id(t.pool(), "a");
    checkpoint(t.pool());
    checkpoint(t.pool());
    // Both copies reach page 1 as it is now; these writes are only in the journal.
    let generation = newest_super_block(&t.dev.crash_image(CrashMode::KeepAll)).generation;
    for lbn in DAMAGED.start..DAMAGED.start + 8 {
        // New data, and data "b" holds elsewhere (a shared object gains a reference).
        write(t.pool(), &mut model, "a", lbn, 5_000_000 + lbn);
        write(t.pool(), &mut model, "a", lbn + 8, 2_000_000 + lbn);
    }
    write(t.pool(), &mut model, "a", 5, 6_000_005);
    t.pool().flush().unwrap();
    let mut image = t.dev.crash_image(CrashMode::DropAll);
    assert_eq!(
        newest_super_block(&image).generation,
        generation,
        "no checkpoint was taken after the writes into the page"
    );
    let block = map_page_block(&image, id, PAGE);
    flip(&mut image, block);
    let (dev, pool) = open_image(image);
    assert_eq!(pool.damaged_ranges().len(), 1);
    // The journal's write outside the range was replayed; every block of "b" reads.
    verify(&pool, &model, DAMAGED, "after replay");
    assert_no_count_below_its_references(&pool.audit().problems, "after replay");
    pool.close().unwrap();
    let dev = Arc::new(FaultStorage::from_image(
        "data",
        dev.crash_image(CrashMode::KeepAll),
    ));
    let pool = Pool::open_devices_for_repair(dev.clone() as Arc<dyn Storage>, None, &OPTS).unwrap();
    pool.repair(
        &RepairOptions {
            apply: true,
            verify_data: false,
        },
        &|_, _, _| {},
    )
    .unwrap();
    pool.close().unwrap();
    let (_dev, pool) = open_image(dev.crash_image(CrashMode::KeepAll));
    for lbn in DAMAGED {
        model.insert(("a", lbn), 0);
    }
    verify(&pool, &model, 0..0, "repaired");
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    assert_eq!(BLOCK, BLOCK_BYTES);
    pool.close().unwrap();
}

/// Deleting a volume with a damaged range is allowed while serving: the lost
/// entries' objects stay counted (a leak), so "b", which shares them, keeps every
/// block; a repair then frees the leak.
#[test]
fn a_volume_with_a_damaged_range_can_be_deleted_and_its_leak_is_repaired() {
    let (mut t, mut model) = two_volumes();
    let id = volume_id(t.pool(), "a");
    let (image, _) = image_with_a_bad_page(&mut t, id);
    let (dev, pool) = open_image(image);
    assert_eq!(pool.damaged_ranges().len(), 1);
    pool.delete_volume("a", false).unwrap();
    assert!(pool.damaged_ranges().is_empty());
    model.retain(|(v, _), _| *v == "b");
    verify(&pool, &model, 0..0, "a deleted");
    assert_no_count_below_its_references(&pool.audit().problems, "a deleted");
    pool.close().unwrap();
    let (dev, pool) = open_image(dev.crash_image(CrashMode::KeepAll));
    verify(&pool, &model, 0..0, "reopened");
    pool.close().unwrap();
    let dev = Arc::new(FaultStorage::from_image(
        "data",
        dev.crash_image(CrashMode::KeepAll),
    ));
    let pool = Pool::open_devices_for_repair(dev.clone() as Arc<dyn Storage>, None, &OPTS).unwrap();
    let report = pool
        .repair(
            &RepairOptions {
                apply: true,
                verify_data: false,
            },
            &|_, _, _| {},
        )
        .unwrap();
    assert!(
        report.repairs.iter().any(|r| r.contains("→ 1")),
        "the shared objects' counts come down to b's one reference: {:?}",
        report.repairs
    );
    pool.close().unwrap();
    let (_dev, pool) = open_image(dev.crash_image(CrashMode::KeepAll));
    verify(&pool, &model, 0..0, "repaired");
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    pool.close().unwrap();
}

/// A volume whose map page is damaged, rolled back to a snapshot taken before the
/// page changed (so the snapshot reaches its own, good copy), reads the snapshot
/// whole: the rollback leaves the damaged page and its range with the old map.
#[test]
fn a_damaged_volume_rolled_back_to_a_snapshot_reads_the_snapshot_whole() {
    let (mut t, mut model) = two_volumes();
    let id = volume_id(t.pool(), "a");
    t.pool().snapshot_volume("a", "good").unwrap();
    // The volume makes the page its own: a new copy the snapshot does not reach.
    let lbn = PAGE * PER_PAGE + 3;
    write(t.pool(), &mut model, "a", lbn, 3_000_000);
    let (image, _) = image_with_a_bad_page(&mut t, id);
    let (dev, pool) = open_image(image);
    assert_eq!(
        pool.damaged_ranges().len(),
        1,
        "only the volume's own copy failed"
    );
    pool.rollback_volume("a", "good").unwrap();
    assert!(pool.damaged_ranges().is_empty());
    model.insert(("a", lbn), 1_000_000 + lbn);
    verify(&pool, &model, 0..0, "rolled back");
    assert_no_count_below_its_references(&pool.audit().problems, "rolled back");
    pool.close().unwrap();
    let (_dev, pool) = open_image(dev.crash_image(CrashMode::KeepAll));
    verify(&pool, &model, 0..0, "reopened");
    assert_no_count_below_its_references(&pool.audit().problems, "reopened");
    pool.close().unwrap();
}

/// A bad map page a snapshot shares is one copy: the volume and its snapshot both
/// lose the range it maps, and both are named, the snapshot as `VOLUME@SNAPSHOT`
/// (before, as its bare name, which no command takes); the repair clears both and
/// the rest of each reads back.
#[test]
fn a_bad_map_page_a_snapshot_shares_damages_and_names_both() {
    let (mut t, model) = two_volumes();
    let id = volume_id(t.pool(), "a");
    t.pool().snapshot_volume("a", "s").unwrap();
    let (image, block) = image_with_a_bad_page(&mut t, id);
    let (dev, pool) = open_image(image);
    let ranges = pool.damaged_ranges();
    let names: Vec<&str> = ranges.iter().map(|r| r.volume.as_str()).collect();
    assert_eq!(names, ["a", "a@s"], "{ranges:#?}");
    for r in &ranges {
        assert_eq!(r.offset_bytes, DAMAGED.start * BLOCK as u64);
        assert_eq!(r.block, block, "one page, one block: {r:#?}");
    }
    let problems = pool.audit().problems;
    for name in ["a", "a@s"] {
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with(&format!("volume '{name}' bytes {}", DAMAGED.start * 4096))),
            "{problems:?}"
        );
    }
    let snapshot = pool.open_volume("a@s").unwrap();
    let mut buf = vec![0u8; BLOCK];
    assert!(matches!(
        snapshot.read(DAMAGED.start * BLOCK as u64, &mut buf),
        Err(EngineError::Damaged { .. })
    ));
    drop(snapshot);
    pool.close().unwrap();
    let dev = Arc::new(FaultStorage::from_image(
        "data",
        dev.crash_image(CrashMode::KeepAll),
    ));
    let pool = Pool::open_devices_for_repair(dev.clone() as Arc<dyn Storage>, None, &OPTS).unwrap();
    let report = pool
        .repair(
            &RepairOptions {
                apply: true,
                verify_data: false,
            },
            &|_, _, _| {},
        )
        .unwrap();
    for name in ["a", "a@s"] {
        assert!(
            report
                .repairs
                .iter()
                .any(|r| r.starts_with(&format!("volume '{name}' bytes"))
                    && r.contains("now reads as zeros")),
            "{:?}",
            report.repairs
        );
    }
    pool.close().unwrap();
    let (_dev, pool) = open_image(dev.crash_image(CrashMode::KeepAll));
    assert!(pool.damaged_ranges().is_empty());
    verify(&pool, &model, DAMAGED, "repaired");
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    pool.close().unwrap();
}
