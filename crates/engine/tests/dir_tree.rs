//! Directory trees (`docs/format.md`, "Directory trees"): a table too large for four
//! level-1 directory pages gets more levels, and the catalog holds only the top
//! list. On a sparse 300 GiB pool file with overcommit, a 1 TiB volume (532,610 map
//! pages: 2,114 level-1, 13 level-2 and one level-3 directory page; format version 3
//! puts 168 twinned references in a page above level 1) written at its first,
//! middle and last blocks reads back after a reopen, and so do the count and
//! fingerprint tables (9,600 slabs: depth 3 each); a stale level-2 directory page is
//! refused by its parent and its second copy read instead; with both copies stale
//! and the older super block copy gone, the range under it is marked damaged, the
//! page and both its copies named.

mod common;
use common::*;
use fewerbytes_engine::{CreateOptions, EngineError, OpenOptions, Pool, Provisioning};
use fewerbytes_format::page::{decode_page, encode_page, PageHeader, PageKind};
use fewerbytes_format::superblock::SuperBlock;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const POOL_BYTES: u64 = 300 << 30;
const VOLUME_BYTES: u64 = 1 << 40;
const OPTS: OpenOptions = OpenOptions {
    threads: Some(1),
    index_memory_bytes: None,
    no_discard: false,
    hold_index_build: false,
    take_over: None,
    saved_index: fewerbytes_engine::SavedIndex::Off,
};

/// First, middle and last block of the volume, each with its own content.
fn probes() -> [(u64, u8); 3] {
    let last = VOLUME_BYTES / BLOCK as u64 - 1;
    [(0, 0x11), (last / 2, 0x22), (last, 0x33)]
}

/// A sparse pool file, removed when dropped.
struct PoolFile(PathBuf);

impl Drop for PoolFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// An overcommitted sparse pool file (its page store sized for 4 times its data)
/// holding the thin 1 TiB volume "big".
fn big_pool(name: &str) -> (PoolFile, Arc<Pool>) {
    let path = std::env::temp_dir().join(format!(
        "fewerbytes-tree-{name}-{}.pool",
        std::process::id()
    ));
    let file = PoolFile(path.clone());
    Pool::create(&CreateOptions {
        path: path.clone(),
        size_bytes: Some(POOL_BYTES),
        overcommit: true,
        ..CreateOptions::default()
    })
    .unwrap();
    let pool = Pool::open(&path, &OPTS).unwrap();
    pool.create_volume_with("big", VOLUME_BYTES, Provisioning::THIN)
        .unwrap();
    (file, pool)
}

/// Write the probe blocks, each byte mapped by `fill`.
fn write_probes(pool: &Arc<Pool>, fill: impl Fn(u8) -> u8) {
    let vol = pool.open_volume("big").unwrap();
    for (lbn, byte) in probes() {
        vol.write(lbn * BLOCK as u64, &[fill(byte); BLOCK], false)
            .unwrap();
    }
}

fn read_block(path: &Path, block: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK];
    File::open(path)
        .unwrap()
        .read_exact_at(&mut buf, block * BLOCK as u64)
        .unwrap();
    buf
}

/// The super block an open of the pool file would take.
fn super_block_of(path: &Path) -> SuperBlock {
    newest_super_block(&[read_block(path, 0), read_block(path, 1)].concat())
}

/// The directory pages of `level` in the pool file (any slot, live or retired) of
/// the volume with id `owner`, as (slot, header, payload): both copies of each
/// (the second copy's header names the first's slot, not its own). Slots past the
/// last written one read as zeros and are skipped.
fn directory_pages(path: &Path, owner: u64, level: u8) -> Vec<(u64, PageHeader, Vec<u8>)> {
    let sb = super_block_of(path);
    let file = File::open(path).unwrap();
    let mut block = vec![0u8; BLOCK];
    let mut pages = Vec::new();
    for slot in 1..sb.page_slots.min(1 << 16) {
        let at = (sb.pages_start_block + slot) * BLOCK as u64;
        file.read_exact_at(&mut block, at).unwrap();
        let named = u64::from_le_bytes(block[24..32].try_into().unwrap());
        if let Ok((h, payload)) = decode_page(&block, PageKind::Directory, sb.nonce, named) {
            if h.level == level && h.owner == owner {
                pages.push((slot, h, payload.to_vec()));
            }
        }
    }
    pages
}

fn volume_id(pool: &Arc<Pool>) -> u64 {
    pool.list_volumes().first().unwrap().id
}

#[test]
fn a_volume_whose_map_needs_three_levels_reads_back_after_reopen() {
    let (file, pool) = big_pool("read-back");
    let id = volume_id(&pool);
    write_probes(&pool, |b| b);
    pool.close().unwrap();
    // The written map pages (0, 266,305 and 532,609) under level-1 directory pages
    // 0, 1,056 and 2,113, under level-2 pages 0, 6 and 12, under level-3 page 0;
    // each written twice.
    for (level, indexes) in [(1, vec![0, 1056, 2113]), (2, vec![0, 6, 12]), (3, vec![0])] {
        let pages = directory_pages(&file.0, id, level);
        let mut found: Vec<u64> = pages.iter().map(|(_, h, _)| h.index).collect();
        found.sort_unstable();
        found.dedup();
        assert_eq!(found, indexes, "level {level}");
        for (slot, h, _) in pages.iter().filter(|(slot, h, _)| *slot == h.slot) {
            let twins = pages
                .iter()
                .filter(|(s, t, _)| s != slot && t.slot == *slot && t.generation == h.generation)
                .count();
            assert_eq!(
                twins, 1,
                "level {level} page {} has its second copy",
                h.index
            );
        }
    }
    assert!(directory_pages(&file.0, id, 4).is_empty());
    let pool = Pool::open(&file.0, &OPTS).unwrap();
    let vol = pool.open_volume("big").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for (lbn, byte) in probes() {
        vol.read(lbn * BLOCK as u64, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == byte), "block {lbn}");
        vol.read((lbn ^ 1) * BLOCK as u64, &mut buf).unwrap();
        assert!(
            buf.iter().all(|b| *b == 0),
            "block {} is unwritten",
            lbn ^ 1
        );
    }
    drop(vol);
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    pool.close().unwrap();
}

// A stale directory page of the newest checkpoint is refused by its parent's
// reference, and its second copy read instead; with both copies stale and the older
// super block copy gone, the open is refused, naming the page.
#[test]
fn a_stale_level_2_directory_page_is_refused_by_its_parent() {
    let (file, pool) = big_pool("stale");
    let id = volume_id(&pool);
    write_probes(&pool, |b| b);
    pool.close().unwrap();
    // Level-2 page 0 covers the first block; rewriting that block rewrites it.
    let older = directory_pages(&file.0, id, 2)
        .into_iter()
        .filter(|(_, h, _)| h.index == 0)
        .max_by_key(|(_, h, _)| h.generation)
        .unwrap();
    let pool = Pool::open(&file.0, &OPTS).unwrap();
    write_probes(&pool, |b| !b);
    pool.close().unwrap();
    let sb = super_block_of(&file.0);
    let pages = directory_pages(&file.0, id, 2);
    let (slot, current, _) = pages
        .iter()
        .filter(|(s, h, _)| h.index == 0 && *s == h.slot)
        .max_by_key(|(_, h, _)| h.generation)
        .unwrap()
        .clone();
    let (twin, ..) = pages
        .iter()
        .find(|(s, h, _)| *s != slot && h.slot == slot && h.generation == current.generation)
        .unwrap()
        .clone();
    assert!(older.1.generation < current.generation);
    // The drive lost the newer writes: both slots hold the older page, which passes
    // every check of its own.
    let stale = PageHeader { slot, ..older.1 };
    let mut page = [0u8; BLOCK];
    encode_page(&stale, &older.2, &mut page);
    assert!(decode_page(&page, PageKind::Directory, sb.nonce, slot).is_ok());
    let block = sb.pages_start_block + slot;
    let twin_block = sb.pages_start_block + twin;
    let saved_twin = read_block(&file.0, twin_block);
    let pool_file = std::fs::OpenOptions::new()
        .write(true)
        .open(&file.0)
        .unwrap();
    for b in [block, twin_block] {
        pool_file.write_all_at(&page, b * BLOCK as u64).unwrap();
    }
    // With the older super block copy gone too, nothing else reaches the blocks the
    // stale page maps: the pool opens with them damaged (refused, naming the page and
    // both its copies), and the volume's other blocks read back. Read-only, so
    // nothing is written.
    let older_copy = 1 - sb.generation % 2;
    let saved = read_block(&file.0, older_copy);
    pool_file
        .write_all_at(&[0u8; BLOCK], older_copy * BLOCK as u64)
        .unwrap();
    let pool = Pool::open_read_only(&file.0, &OPTS)
        .unwrap_or_else(|e| panic!("a stale map directory page stopped the pool: {e}"));
    let ranges = pool.damaged_ranges();
    assert_eq!(ranges.len(), 1, "{ranges:?}");
    let range = &ranges[0];
    assert_eq!(range.region, "map directory page");
    assert_eq!(range.level, 2);
    assert_eq!(range.block, block);
    for named in [
        "lost or misdirected write".to_string(),
        "both copies".to_string(),
        format!("block {twin_block}"),
    ] {
        assert!(range.reason.contains(&named), "{}", range.reason);
    }
    // Level-2 page 0 maps 168 level-1 pages (version 3) of 252 map pages of 504 blocks.
    assert_eq!(range.offset_bytes, 0);
    assert_eq!(range.len_bytes, 168 * 252 * 504 * BLOCK as u64);
    let vol = pool.open_volume("big").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for (lbn, byte) in probes() {
        match vol.read(lbn * BLOCK as u64, &mut buf) {
            Err(EngineError::Damaged { .. }) if lbn == 0 => {}
            Ok(()) if lbn > 0 => assert!(buf.iter().all(|&b| b == !byte), "block {lbn}"),
            other => panic!("block {lbn}: {other:?}"),
        }
    }
    drop(vol);
    drop(pool);
    // With its second copy whole (and the older super block copy back), the pool
    // opens from the newest copy, reading that page from its second copy.
    pool_file
        .write_all_at(&saved_twin, twin_block * BLOCK as u64)
        .unwrap();
    pool_file
        .write_all_at(&saved, older_copy * BLOCK as u64)
        .unwrap();
    let pool = Pool::open(&file.0, &OPTS).expect("opens with the second copy");
    let vol = pool.open_volume("big").unwrap();
    for (lbn, byte) in probes() {
        let mut buf = vec![0u8; BLOCK];
        vol.read(lbn * BLOCK as u64, &mut buf).unwrap();
        assert!(
            buf.iter().all(|&b| b == !byte),
            "block {lbn} does not read back its last write"
        );
    }
    assert_eq!(pool.stats().metadata_copies_repaired, 1);
    pool.close().unwrap();
}

#[test]
fn a_volume_past_the_format_maximum_is_refused() {
    let (_file, pool) = big_pool("maximum");
    let max = fewerbytes_format::dir_tree::MAX_VOLUME_BYTES;
    match pool.create_volume("larger", max + BLOCK as u64) {
        Err(EngineError::Refused(why)) => assert!(why.contains("at most 4.00 PiB"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_volume_shrunk_then_grown_reads_zeros_where_it_was_cut_off() {
    // A directory page over the new end of a shrunk volume must be rewritten: if it
    // kept the references of the pages cut off, growing the volume again would bring
    // their old blocks back (or point into slots reused since).
    let mut t = create(64 << 20, None);
    let pool = t.pool().clone();
    pool.create_volume("v", 8 << 20).unwrap();
    let vol = pool.open_volume("v").unwrap();
    vol.write(2000 * BLOCK as u64, &[7; BLOCK], false).unwrap();
    drop(vol);
    t.reopen();
    let pool = t.pool().clone();
    pool.resize_volume("v", 504 * BLOCK as u64, true).unwrap();
    pool.resize_volume("v", 8 << 20, false).unwrap();
    drop(pool);
    t.reopen();
    let vol = t.pool().open_volume("v").unwrap();
    let mut buf = vec![0u8; BLOCK];
    vol.read(2000 * BLOCK as u64, &mut buf).unwrap();
    assert!(
        buf.iter().all(|b| *b == 0),
        "a block cut off by the shrink came back"
    );
}

// A level-1 directory page both super block copies share, flipped: the 252 map pages
// under it (127,008 blocks) are damaged, the rest of the volume reads, checkpoints
// keep the failed page, and a repair rewrites the directory pages over the range,
// which then reads as zeros and takes writes again.
#[test]
fn a_bad_level_1_directory_page_damages_only_its_range_until_repaired() {
    let (file, pool) = big_pool("dir-damage");
    let id = volume_id(&pool);
    write_probes(&pool, |b| b);
    pool.close().unwrap();
    // An open and a close: two checkpoints that rewrite no directory page.
    Pool::open(&file.0, &OPTS).unwrap().close().unwrap();
    // Level-1 page 1,056 covers the middle probe (map page 266,305); both its copies
    // (the slot its header names, and the twin holding the same page) go bad.
    let copies = directory_pages(&file.0, id, 1);
    let (slot, header, _) = copies
        .iter()
        .filter(|(s, h, _)| h.index == 1056 && *s == h.slot)
        .max_by_key(|(_, h, _)| h.generation)
        .cloned()
        .unwrap();
    let twin = copies
        .iter()
        .find(|(s, h, _)| *s != slot && h.slot == slot && h.generation == header.generation)
        .map(|(s, ..)| *s)
        .unwrap();
    let sb = super_block_of(&file.0);
    let block = sb.pages_start_block + slot;
    let mut page = read_block(&file.0, block);
    page[2000] ^= 0x04;
    let pool_file = std::fs::OpenOptions::new()
        .write(true)
        .open(&file.0)
        .unwrap();
    for b in [block, sb.pages_start_block + twin] {
        pool_file.write_all_at(&page, b * BLOCK as u64).unwrap();
    }
    let first = 1056 * 252 * 504 * BLOCK as u64;
    let len = 252 * 504 * BLOCK as u64;
    let [low, middle, high] = probes();

    let pool = Pool::open(&file.0, &OPTS).expect("a bad directory page stopped the pool");
    let ranges = pool.damaged_ranges();
    assert_eq!(ranges.len(), 1, "{ranges:?}");
    assert_eq!(
        (ranges[0].region.as_str(), ranges[0].level, ranges[0].block),
        ("map directory page", 1, block)
    );
    assert_eq!((ranges[0].offset_bytes, ranges[0].len_bytes), (first, len));
    assert_eq!(header.level, 1);
    let vol = pool.open_volume("big").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for (lbn, byte) in [low, high] {
        vol.read(lbn * BLOCK as u64, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == byte), "block {lbn}");
    }
    for at in [middle.0 * BLOCK as u64, first, first + len - BLOCK as u64] {
        assert!(matches!(
            vol.read(at, &mut buf),
            Err(EngineError::Damaged { .. })
        ));
        assert!(matches!(
            vol.write(at, &[7u8; BLOCK], false),
            Err(EngineError::Damaged { .. })
        ));
    }
    // A write elsewhere (a sibling level-1 page under the same level-2 page) makes
    // the checkpoint rewrite the level-2 page over the damaged one: its reference is
    // kept as it is.
    vol.write((first + len) + 7 * BLOCK as u64, &[9u8; BLOCK], false)
        .unwrap();
    drop(vol);
    pool.close().unwrap();
    assert!(
        read_block(&file.0, block) == page,
        "the failed page was overwritten"
    );
    let pool = Pool::open(&file.0, &OPTS).unwrap();
    assert_eq!(pool.damaged_ranges(), ranges, "kept across opens");
    pool.close().unwrap();

    let pool = Pool::open_for_repair(&file.0, &OPTS).unwrap();
    let report = pool
        .repair(
            &fewerbytes_engine::RepairOptions {
                apply: true,
                verify_data: false,
            },
            &|_, _, _| {},
        )
        .unwrap();
    assert_eq!(report.lost_bytes, len, "{:?}", report.repairs);
    pool.close().unwrap();
    let pool = Pool::open(&file.0, &OPTS).unwrap();
    assert!(pool.damaged_ranges().is_empty());
    let vol = pool.open_volume("big").unwrap();
    vol.read(middle.0 * BLOCK as u64, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "the cleared range reads zeros");
    vol.write(middle.0 * BLOCK as u64, &[5u8; BLOCK], false)
        .unwrap();
    for (lbn, byte) in [low, high] {
        vol.read(lbn * BLOCK as u64, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == byte), "block {lbn}");
    }
    drop(vol);
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    pool.close().unwrap();
    let pool = Pool::open(&file.0, &OPTS).unwrap();
    let vol = pool.open_volume("big").unwrap();
    vol.read(middle.0 * BLOCK as u64, &mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 5));
    drop(vol);
    pool.close().unwrap();
}
