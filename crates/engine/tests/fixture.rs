//! Decode of committed pool images of format versions 1, 2 and 3, and the upgrades
//! of version 1 and version 2 to version 3. Each image was made by `make_fixture` below with the
//! code of its version (run it by hand when the format version changes, and keep
//! the older fixtures: new code must still read them). Each holds a volume written
//! with the seed mix, a clone of it, a trimmed range, and records still in the
//! journal, so opening it exercises the super block, catalog, directories, map and
//! object pages (count and fingerprint pages in v2 and v3, directory pages twice in
//! v3), journal replay, and fragment and whole-block reads. The v1 fixture with its
//! super block edited makes the harder upgrades: a page store too full for the v3
//! image (its pages go to data blocks), and a pool with room for it nowhere
//! (refused, nothing written).
//!
//! File layout: repeated (u64 little-endian byte offset, 4096 bytes) for every
//! non-zero block of a 64 MiB device.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, FaultPlan, FaultStorage, Storage};
use fewerbytes_engine::{EngineError, OpenOptions, Pool};
use fewerbytes_format::superblock::{SuperBlock, FLAG_DATA_REGION_PAGES, FLAG_UPGRADED_FROM_V1};
use std::sync::Arc;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/pool-v1.blocks");
const FIXTURE_V2: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/pool-v2.blocks");
const FIXTURE_V3: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/pool-v3.blocks");
const DEVICE_BYTES: u64 = 64 << 20;

fn expected_blocks() -> Vec<Vec<u8>> {
    let mut mix = Mix::new(2026);
    (0..512).map(|_| mix.next_block()).collect()
}

#[test]
#[ignore = "writes the fixture of the current format version (pool-v<N>.blocks); run by hand with --ignored when the format version changes, and keep the older ones"]
fn make_fixture() {
    let mut t = create(DEVICE_BYTES, None);
    let p = t.pool().clone();
    p.create_volume("base", 2 << 20).unwrap();
    let vol = p.open_volume("base").unwrap();
    for (i, b) in expected_blocks().iter().enumerate() {
        vol.write((i * BLOCK) as u64, b, false).unwrap();
    }
    drop(vol);
    p.clone_volume("base", "clone").unwrap();
    let clone = p.open_volume("clone").unwrap();
    clone.trim(0, 64 * BLOCK as u64, false).unwrap();
    clone
        .write(64 * BLOCK as u64, &[0x5a; BLOCK], false)
        .unwrap();
    clone.flush().unwrap(); // in the journal, not yet in a checkpoint
    drop(clone);
    drop(p);
    let image = t.dev.crash_image(CrashMode::DropAll);
    if let Some(p) = t.pool.take() {
        std::mem::forget(p);
    }
    let mut out = Vec::new();
    for (i, block) in image.chunks(BLOCK).enumerate() {
        if block.iter().any(|b| *b != 0) {
            out.extend_from_slice(&((i * BLOCK) as u64).to_le_bytes());
            out.extend_from_slice(block);
        }
    }
    let path = format!(
        "{}/tests/fixtures/pool-v{}.blocks",
        env!("CARGO_MANIFEST_DIR"),
        fewerbytes_format::FORMAT_VERSION
    );
    std::fs::write(path, out).unwrap();
}

/// The committed image of `fixture`, as a device's bytes.
fn image_of(fixture: &str) -> Vec<u8> {
    let raw = std::fs::read(fixture).expect("fixture present");
    let mut image = vec![0u8; DEVICE_BYTES as usize];
    for rec in raw.chunks(8 + BLOCK) {
        let at = u64::from_le_bytes(rec[..8].try_into().unwrap()) as usize;
        image[at..at + BLOCK].copy_from_slice(&rec[8..]);
    }
    image
}

fn open(image: Vec<u8>) -> Result<(Arc<FaultStorage>, Arc<Pool>), EngineError> {
    let dev = Arc::new(FaultStorage::from_image("fixture", image));
    let pool = Pool::open_devices(dev.clone() as Arc<dyn Storage>, None, &OPTS)?;
    Ok((dev, pool))
}

const OPTS: OpenOptions = OpenOptions {
    threads: Some(1),
    index_memory_bytes: None,
    no_discard: false,
    hold_index_build: false,
    take_over: None,
    saved_index: fewerbytes_engine::SavedIndex::Off,
};

/// The versions of the two super block copies of `image`, each `None` if invalid.
fn super_block_versions(image: &[u8]) -> [Option<u32>; 2] {
    [0, 1].map(|copy| {
        SuperBlock::decode(&image[copy * BLOCK..(copy + 1) * BLOCK])
            .ok()
            .map(|sb| sb.version)
    })
}

/// The fixture's volumes read back exactly, with `extra` (base block, content)
/// written on top, and the audit finds nothing.
fn assert_fixture_contents(pool: &Arc<Pool>, extra: Option<(usize, u8)>) {
    let names: Vec<String> = pool.list_volumes().into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["base", "clone"]);
    let expected = expected_blocks();
    let base = pool.open_volume("base").unwrap();
    let clone = pool.open_volume("clone").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for (i, b) in expected.iter().enumerate() {
        base.read((i * BLOCK) as u64, &mut buf).unwrap();
        match extra {
            Some((at, byte)) if at == i => assert_eq!(buf, vec![byte; BLOCK], "base block {i}"),
            _ => assert_eq!(&buf, b, "base block {i}"),
        }
        clone.read((i * BLOCK) as u64, &mut buf).unwrap();
        let want = match i {
            0..64 => vec![0u8; BLOCK],
            64 => vec![0x5a; BLOCK],
            _ => b.clone(),
        };
        assert_eq!(buf, want, "clone block {i}");
    }
    // Made without overcommit: both volumes open thick, reserving their size.
    for v in pool.list_volumes() {
        assert!(!v.thin, "{} opened thin", v.name);
        assert_eq!(v.reserved_bytes, v.size_bytes, "{}", v.name);
    }
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
}

#[test]
fn a_v1_pool_made_with_overcommit_opens_with_its_volumes_thin_and_keeps_them_so() {
    // Version 1 records no reservation: the pool's overcommit flag promised nothing
    // to any volume, so they open thin, and the upgrade records them thin.
    let mut image = image_of(FIXTURE);
    for copy in 0..2 {
        let block = &mut image[copy * BLOCK..(copy + 1) * BLOCK];
        if let Ok(mut sb) = SuperBlock::decode(block) {
            sb.flags |= fewerbytes_format::superblock::FLAG_OVERCOMMIT;
            let mut out = [0u8; BLOCK];
            sb.encode(&mut out);
            block.copy_from_slice(&out);
        }
    }
    let (dev, pool) = open(image).expect("the v1 fixture with overcommit opens read-write");
    let thin = |pool: &Arc<Pool>| -> Vec<(String, bool, u64)> {
        pool.list_volumes()
            .into_iter()
            .map(|v| (v.name, v.thin, v.reserved_bytes))
            .collect()
    };
    let expected = vec![
        ("base".to_string(), true, 0),
        ("clone".to_string(), true, 0),
    ];
    assert_eq!(thin(&pool), expected);
    pool.close().unwrap();
    let (_, pool) = open(dev.crash_image(CrashMode::KeepAll)).unwrap();
    assert_eq!(pool.info().format_version, 3);
    assert_eq!(thin(&pool), expected);
}

#[test]
fn format_v1_fixture_opens_and_reads_back() {
    let dev = Arc::new(FaultStorage::from_image("fixture", image_of(FIXTURE)));
    let pool = Pool::open_devices_read_only(dev as Arc<dyn Storage>, None, &OPTS)
        .expect("the v1 fixture opens");
    assert_eq!(pool.info().format_version, 1);
    assert_fixture_contents(&pool, None);
}

#[test]
fn format_v2_fixture_opens_and_reads_back() {
    let dev = Arc::new(FaultStorage::from_image("fixture", image_of(FIXTURE_V2)));
    let pool = Pool::open_devices_read_only(dev as Arc<dyn Storage>, None, &OPTS)
        .expect("the v2 fixture opens");
    assert_eq!(pool.info().format_version, 2);
    assert_fixture_contents(&pool, None);
    drop(pool);
    let (_, pool) = open(image_of(FIXTURE_V2)).expect("the v2 fixture opens read-write");
    assert_fixture_contents(&pool, None);
}

#[test]
fn format_v3_fixture_opens_and_reads_back() {
    let dev = Arc::new(FaultStorage::from_image("fixture", image_of(FIXTURE_V3)));
    let pool = Pool::open_devices_read_only(dev as Arc<dyn Storage>, None, &OPTS)
        .expect("the v3 fixture opens");
    assert_eq!(pool.info().format_version, 3);
    assert_fixture_contents(&pool, None);
    drop(pool);
    let (_, pool) = open(image_of(FIXTURE_V3)).expect("the v3 fixture opens read-write");
    assert_fixture_contents(&pool, None);
}

#[test]
fn a_read_only_open_of_a_v2_pool_writes_nothing() {
    let image = image_of(FIXTURE_V2);
    let dev = Arc::new(FaultStorage::from_image("fixture", image.clone()));
    let pool = Pool::open_devices_read_only(dev.clone() as Arc<dyn Storage>, None, &OPTS).unwrap();
    assert_eq!(pool.info().format_version, 2);
    assert_fixture_contents(&pool, None);
    pool.close().expect("a read-only pool closes cleanly");
    assert_eq!(dev.counters().snapshot().writes, 0);
    assert!(
        dev.crash_image(CrashMode::KeepAll) == image,
        "the image is unchanged"
    );
}

#[test]
fn a_v2_pool_is_upgraded_to_v3_by_its_first_read_write_open() {
    let (dev, pool) = open(image_of(FIXTURE_V2)).expect("the v2 fixture opens read-write");
    assert_eq!(pool.info().format_version, 3);
    pool.open_volume("base")
        .unwrap()
        .write(100 * BLOCK as u64, &[0x77; BLOCK], false)
        .unwrap();
    pool.close().unwrap();
    let image = dev.crash_image(CrashMode::KeepAll);
    // Both copies are v3, so v2 code refuses the pool instead of opening the older one.
    assert_eq!(super_block_versions(&image), [Some(3), Some(3)]);
    let sb = newest_super_block(&image);
    assert_eq!(sb.flags & FLAG_UPGRADED_FROM_V1, 0);
    // Every directory page the newest copy reaches has two copies (the open reads
    // them through twinned references), and its version-2 directory pages are gone
    // from the tree: a read-only open loads everything as version 3.
    let (_, pool) = open(image).unwrap();
    assert_eq!(pool.info().format_version, 3);
    assert_fixture_contents(&pool, Some((100, 0x77)));
    assert_eq!(pool.stats().metadata_copies_repaired, 0);
}

#[test]
fn a_crash_at_any_write_of_the_v2_upgrade_leaves_the_pool_whole() {
    crash_at_every_write_of_the_upgrade(&image_of(FIXTURE_V2), 2);
}

#[test]
fn a_read_only_open_of_a_v1_pool_writes_nothing() {
    let image = image_of(FIXTURE);
    let dev = Arc::new(FaultStorage::from_image("fixture", image.clone()));
    let pool = Pool::open_devices_read_only(dev.clone() as Arc<dyn Storage>, None, &OPTS).unwrap();
    assert_eq!(pool.info().format_version, 1);
    let base = pool.open_volume("base").unwrap();
    assert!(matches!(
        base.write(0, &[1; BLOCK], false),
        Err(EngineError::ReadOnly(_))
    ));
    drop(base);
    pool.close().expect("a read-only pool closes cleanly");
    assert_eq!(dev.counters().snapshot().writes, 0);
    assert!(
        dev.crash_image(CrashMode::KeepAll) == image,
        "the image is unchanged"
    );
}

#[test]
fn a_v1_pool_is_upgraded_to_v3_by_its_first_read_write_open() {
    let (dev, pool) = open(image_of(FIXTURE)).expect("the v1 fixture opens read-write");
    assert_eq!(pool.info().format_version, 3);
    pool.open_volume("base")
        .unwrap()
        .write(100 * BLOCK as u64, &[0x77; BLOCK], false)
        .unwrap();
    pool.close().unwrap();
    let image = dev.crash_image(CrashMode::KeepAll);
    // Both copies are v3, so v1 code refuses the pool instead of opening the older one.
    assert_eq!(super_block_versions(&image), [Some(3), Some(3)]);
    let (_, pool) = open(image).unwrap();
    assert_eq!(pool.info().format_version, 3);
    assert_fixture_contents(&pool, Some((100, 0x77)));
}

#[test]
fn a_crash_at_any_write_of_the_upgrade_leaves_the_pool_whole() {
    crash_at_every_write_of_the_upgrade(&image_of(FIXTURE), 1);
}

/// A crash at each write an upgrading open of `v1` (a pool of version `from`)
/// makes (each kept, dropped or partly kept) leaves a pool that opens read-only with
/// the fixture's contents, in version `from` (before the v3 super block) or 3
/// (after), and opens read-write as v3.
fn crash_at_every_write_of_the_upgrade(v1: &[u8], from: u32) {
    // How many writes the upgrading open makes.
    let (dev, pool) = open(v1.to_vec()).unwrap();
    let writes = dev.counters().snapshot().writes;
    drop(pool);
    assert!(
        writes > 10,
        "the upgrade writes every page ({writes} writes)"
    );
    let mut versions_seen = std::collections::BTreeSet::new();
    for k in 0..writes {
        for mode in [CrashMode::DropAll, CrashMode::KeepAll, CrashMode::Random(k)] {
            let dev = Arc::new(FaultStorage::from_image("fixture", v1.to_vec()));
            dev.set_plan(FaultPlan {
                fail_write: Some(k),
                ..FaultPlan::default()
            });
            let opened = Pool::open_devices(dev.clone() as Arc<dyn Storage>, None, &OPTS);
            assert!(
                opened.is_err(),
                "write {k} failed, and the open must say so"
            );
            let image = dev.crash_image(mode);
            let read_only = Pool::open_devices_read_only(
                Arc::new(FaultStorage::from_image("after", image.clone())) as Arc<dyn Storage>,
                None,
                &OPTS,
            )
            .unwrap_or_else(|e| panic!("crash at write {k} ({mode:?}): {e}"));
            versions_seen.insert(read_only.info().format_version);
            assert_fixture_contents(&read_only, None);
            drop(read_only);
            // And it still opens read-write (upgrading if it had not).
            let (_, pool) = open(image).unwrap_or_else(|e| panic!("write {k} ({mode:?}): {e}"));
            assert_eq!(pool.info().format_version, 3);
            assert_fixture_contents(&pool, None);
        }
    }
    assert_eq!(
        versions_seen.into_iter().collect::<Vec<_>>(),
        [from, 3],
        "crashes left both v{from} pools (before the v3 super block) and v3 pools (after)"
    );
}

/// The v1 fixture with its newest super block changed by `edit` (given the image,
/// to look at), the older copy as made.
fn edited_v1(edit: impl Fn(&mut SuperBlock, &[u8])) -> Vec<u8> {
    let mut image = image_of(FIXTURE);
    let mut sb = newest_super_block(&image);
    assert_eq!(sb.version, 1);
    edit(&mut sb, &image);
    let mut block = [0u8; BLOCK];
    sb.encode(&mut block);
    let copy = (sb.generation % 2) as usize * BLOCK;
    image[copy..copy + BLOCK].copy_from_slice(&block);
    image
}

/// Cut the page store of `sb` to end just past the last page the fixture wrote, so
/// the v3 image cannot fit in free slots beside the v1 one.
fn cut_page_store(sb: &mut SuperBlock, image: &[u8]) {
    let last_written = (1..sb.page_slots)
        .rev()
        .find(|s| {
            let at = ((sb.pages_start_block + s) as usize) * BLOCK;
            image[at..at + BLOCK].iter().any(|b| *b != 0)
        })
        .unwrap();
    sb.page_slots = last_written + 1;
}

/// The v1 fixture with a page store too small for the upgrade's pages.
fn v1_with_a_full_page_store() -> Vec<u8> {
    edited_v1(cut_page_store)
}

#[test]
fn a_v1_pool_whose_page_store_is_full_upgrades_with_pages_in_data_blocks() {
    let (dev, pool) = open(v1_with_a_full_page_store())
        .expect("the upgrade puts the pages the slots cannot hold in data blocks");
    assert_eq!(pool.info().format_version, 3);
    let in_data = pool.stats().space.metadata_in_data_bytes;
    assert!(in_data > 0, "no page went to a data block");
    assert_fixture_contents(&pool, None);
    pool.open_volume("base")
        .unwrap()
        .write(100 * BLOCK as u64, &[0x77; BLOCK], false)
        .unwrap();
    pool.close().unwrap();
    let image = dev.crash_image(CrashMode::KeepAll);
    assert_eq!(super_block_versions(&image), [Some(3), Some(3)]);
    let sb = newest_super_block(&image);
    assert_ne!(
        sb.flags & FLAG_DATA_REGION_PAGES,
        0,
        "flags bit 3 names pages in data blocks"
    );
    assert_ne!(sb.flags & FLAG_UPGRADED_FROM_V1, 0);
    let (_, pool) = open(image).unwrap();
    assert_eq!(pool.info().format_version, 3);
    assert_fixture_contents(&pool, Some((100, 0x77)));
}

#[test]
fn a_crash_at_any_write_of_an_upgrade_into_data_blocks_leaves_the_pool_whole() {
    crash_at_every_write_of_the_upgrade(&v1_with_a_full_page_store(), 1);
}

#[test]
fn a_v1_pool_without_room_for_its_upgrade_is_refused_read_write_and_left_as_it_was() {
    // Page store cut as above, and the data region cut to one slab of 64 blocks
    // (the fixture's data lies in its first 62): neither slots nor data blocks
    // hold the v3 image.
    let image = edited_v1(|sb, image| {
        cut_page_store(sb, image);
        sb.data_blocks = 64;
        sb.slab_count = 1;
    });
    let dev = Arc::new(FaultStorage::from_image("fixture", image.clone()));
    match Pool::open_devices(dev.clone() as Arc<dyn Storage>, None, &OPTS) {
        Err(EngineError::Refused(why)) => {
            eprintln!("refused: {why}");
            assert!(why.contains("upgrade to version 3 needs"), "{why}");
            assert!(why.contains("free slots"), "{why}");
            assert!(why.contains("free blocks"), "{why}");
            assert!(why.contains("nothing was written"), "{why}");
        }
        Err(e) => panic!("expected a refusal, got {e}"),
        Ok(_) => panic!("the upgrade fitted: the test's pool is too large"),
    }
    assert!(
        dev.crash_image(CrashMode::KeepAll) == image,
        "nothing was written"
    );
    let pool = Pool::open_devices_read_only(
        Arc::new(FaultStorage::from_image("fixture", image)) as Arc<dyn Storage>,
        None,
        &OPTS,
    )
    .expect("it still opens read-only");
    assert_fixture_contents(&pool, None);
}

#[test]
fn a_v1_pool_file_opens_read_only_unchanged_and_upgrades_read_write() {
    let path = std::env::temp_dir().join(format!("fewerbytes-v1-{}.pool", std::process::id()));
    let image = image_of(FIXTURE);
    std::fs::write(&path, &image).unwrap();
    let pool = Pool::open_read_only(&path, &OPTS).unwrap();
    assert_eq!(pool.info().format_version, 1);
    assert_fixture_contents(&pool, None);
    pool.close().unwrap();
    assert!(
        std::fs::read(&path).unwrap() == image,
        "the file is unchanged"
    );
    let pool = Pool::open(&path, &OPTS).unwrap();
    assert_eq!(pool.info().format_version, 3);
    pool.close().unwrap();
    std::fs::remove_file(&path).unwrap();
}

/// A version-1 pool whose block-map page failed its checks: its upgrade would write
/// every page afresh and lose the damaged range unlisted, so a read-write open is
/// refused (saying what to do), a read-only open serves everything else, and the
/// open for `check --repair` clears the range (listed as lost) and upgrades.
#[test]
fn a_v1_pool_with_a_damaged_map_page_is_upgraded_only_by_a_repair_that_lists_the_loss() {
    let mut image = image_of(FIXTURE);
    let sb = SuperBlock::decode(&image[..BLOCK])
        .ok()
        .into_iter()
        .chain(SuperBlock::decode(&image[BLOCK..2 * BLOCK]).ok())
        .max_by_key(|sb| sb.generation)
        .unwrap();
    // Map page 1 (blocks 504..512) of "base", the volume made first (lowest id).
    let (_, block) = (1..sb.page_slots)
        .filter_map(|slot| {
            let block = (sb.pages_start_block + slot) as usize;
            let bytes = &image[block * BLOCK..(block + 1) * BLOCK];
            let (h, _) = fewerbytes_format::page::decode_page(
                bytes,
                fewerbytes_format::page::PageKind::Map,
                sb.nonce,
                slot,
            )
            .ok()?;
            (h.index == 1).then_some((h.owner, block))
        })
        .min()
        .expect("base's map page 1");
    image[block * BLOCK + 500] ^= 0x10;
    let damaged = 504 * BLOCK as u64..512 * BLOCK as u64;

    match open(image.clone()) {
        Err(EngineError::Refused(why)) => {
            assert!(
                why.contains("format-version-1") && why.contains("check --repair"),
                "{why}"
            )
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a v1 pool with a damaged map page was upgraded"),
    }
    let dev = Arc::new(FaultStorage::from_image("fixture", image.clone()));
    let pool = Pool::open_devices_read_only(dev as Arc<dyn Storage>, None, &OPTS).unwrap();
    let ranges = pool.damaged_ranges();
    assert_eq!(ranges.len(), 1, "{ranges:?}");
    assert_eq!(ranges[0].volume, "base");
    assert_eq!(
        ranges[0].offset_bytes..ranges[0].offset_bytes + ranges[0].len_bytes,
        damaged
    );
    let expected = expected_blocks();
    let mut buf = vec![0u8; BLOCK];
    let clone = pool.open_volume("clone").unwrap();
    clone.read(damaged.start, &mut buf).unwrap();
    assert_eq!(buf, expected[504], "the clone keeps the blocks it shares");
    drop(clone);
    drop(pool);

    let dev = Arc::new(FaultStorage::from_image("fixture", image));
    let pool = Pool::open_devices_for_repair(dev.clone() as Arc<dyn Storage>, None, &OPTS)
        .expect("an open for repair clears the range and upgrades");
    let report = pool
        .repair(
            &fewerbytes_engine::RepairOptions {
                apply: true,
                verify_data: false,
            },
            &|_, _, _| {},
        )
        .unwrap();
    assert_eq!(
        report.lost_bytes,
        damaged.end - damaged.start,
        "{:?}",
        report.repairs
    );
    assert!(
        report
            .repairs
            .iter()
            .any(|r| r.contains("volume 'base' bytes 2064384..2097151")),
        "{:?}",
        report.repairs
    );
    pool.close().unwrap();
    let (_, pool) = open(dev.crash_image(CrashMode::KeepAll)).unwrap();
    assert_eq!(pool.info().format_version, 3);
    assert!(pool.damaged_ranges().is_empty());
    let base = pool.open_volume("base").unwrap();
    let clone = pool.open_volume("clone").unwrap();
    for (i, want) in expected.iter().enumerate().skip(504) {
        base.read((i * BLOCK) as u64, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "base block {i} reads zeros");
        clone.read((i * BLOCK) as u64, &mut buf).unwrap();
        assert_eq!(&buf, want, "clone block {i}");
    }
    base.read(0, &mut buf).unwrap();
    assert_eq!(buf, expected[0]);
    drop((base, clone));
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    pool.close().unwrap();
}
