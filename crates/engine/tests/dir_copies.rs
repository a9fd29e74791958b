//! Two copies of every directory page (format version 3, `docs/format.md`,
//! "Version 3: two copies of every directory page"). A directory page that did not
//! change between the two newest checkpoints is shared by both super block copies:
//! one bad copy of it must lose nothing. For a block-map tree of two levels (its
//! level-1 and its top page) and the count table's tree (a level-1 page): flip bytes
//! in one copy of a page both checkpoints share, and the pool opens with every byte
//! intact, counts the repair, and its next checkpoint writes both copies anew (the
//! other copy damaged then, it still opens); both copies bad is a clear corruption
//! error naming both.
//!
//! Fails before version 3: a directory page had one copy, and the same flip made the
//! open fail (the older super block copy shares the page, so it fails too).

mod common;
use common::*;
use fewerbytes_engine::{Compression, CreateOptions, EngineError, OpenOptions, Pool, Provisioning};
use fewerbytes_format::catalog::Catalog;
use fewerbytes_format::page::{decode_page_ref, PageKind, PageRef, ADDRESS_DATA_REGION};
use fewerbytes_format::superblock::SuperBlock;
use fewerbytes_format::Reader;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// A sparse pool file of 8 GiB with overcommit: 256 slabs (18,944 count pages, a
/// count table of two levels).
const POOL_BYTES: u64 = 8 << 30;
/// A thin 4 GiB volume: 2,081 map pages, 9 level-1 directory pages under one
/// level-2 page (two levels).
const VOLUME_BYTES: u64 = 4 << 30;
const OPTS: OpenOptions = OpenOptions {
    threads: Some(1),
    index_memory_bytes: None,
    no_discard: false,
    hold_index_build: false,
    take_over: None,
    saved_index: fewerbytes_engine::SavedIndex::Off,
};

/// Blocks written, each with its own content: under level-1 directory pages 0, 4
/// and 8.
fn probes() -> Vec<u64> {
    let last = VOLUME_BYTES / BLOCK as u64 - 1;
    vec![0, 1, 504 * 252 * 4 + 7, last]
}

/// A sparse pool file, removed when dropped.
struct PoolFile(PathBuf);

impl Drop for PoolFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn read_block(path: &Path, at_bytes: u64) -> Vec<u8> {
    let mut buf = vec![0u8; BLOCK];
    File::open(path)
        .unwrap()
        .read_exact_at(&mut buf, at_bytes)
        .unwrap();
    buf
}

fn write_block(path: &Path, at_bytes: u64, bytes: &[u8]) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .write_all_at(bytes, at_bytes)
        .unwrap();
}

/// The super block copies of the pool file, newest first.
fn super_blocks(path: &Path) -> Vec<SuperBlock> {
    let mut copies: Vec<SuperBlock> = (0..2)
        .filter_map(|c| SuperBlock::decode(&read_block(path, c * BLOCK as u64)).ok())
        .collect();
    copies.sort_by_key(|sb| std::cmp::Reverse(sb.generation));
    copies
}

/// Where the page at `address` lies in the pool file.
fn offset_of(sb: &SuperBlock, address: u64) -> u64 {
    if address & ADDRESS_DATA_REGION != 0 {
        sb.data_offset_bytes + (address & !ADDRESS_DATA_REGION) * BLOCK as u64
    } else {
        (sb.pages_start_block + address) * BLOCK as u64
    }
}

/// The copy at `address` of the page `r` names, verified; its payload.
fn read_copy(path: &Path, sb: &SuperBlock, kind: PageKind, r: &PageRef, address: u64) -> Vec<u8> {
    let block = read_block(path, offset_of(sb, address));
    let (_, payload) = decode_page_ref(&block, kind, sb.nonce, r)
        .unwrap_or_else(|e| panic!("the copy at {address:#x} verifies: {e}"));
    payload.to_vec()
}

fn catalog_of(path: &Path, sb: &SuperBlock) -> Catalog {
    let mut stream = Vec::new();
    for r in &sb.catalog {
        let block = read_block(path, offset_of(sb, r.address));
        let (h, payload) = decode_page_ref(&block, PageKind::Catalog, sb.nonce, r).unwrap();
        stream.extend_from_slice(&payload[..h.count as usize]);
    }
    stream.truncate(sb.catalog_bytes as usize);
    Catalog::decode(&stream).unwrap()
}

/// Which directory page a test damages.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// Level-1 page `k` of the volume's block-map tree (two levels).
    MapLevel1(usize),
    /// The top (level-2) page of the volume's block-map tree.
    MapTop,
    /// Level-1 page 0 of the count table's tree (two levels).
    CountLevel1,
}

/// The twinned reference of `target` in the checkpoint of `sb`.
fn target_ref(path: &Path, sb: &SuperBlock, target: Target) -> PageRef {
    let catalog = catalog_of(path, sb);
    let (root, k) = match target {
        Target::MapLevel1(k) => (&catalog.volumes[0].map, Some(k)),
        Target::MapTop => (&catalog.volumes[0].map, None),
        Target::CountLevel1 => (&catalog.objects, Some(0)),
    };
    assert_eq!(root.depth, 2, "{target:?}: a tree of two levels");
    let top = root.top[0];
    assert_ne!(top.twin, 0, "a top-list reference names two copies");
    let Some(k) = k else { return top };
    let payload = read_copy(path, sb, PageKind::Directory, &top, top.address);
    let mut r = Reader::new("directory page", &payload);
    r.seek(k * 24);
    let child = PageRef::decode_twinned(&mut r).unwrap();
    assert!(!child.is_none(), "{target:?} was written");
    child
}

/// Change bytes in the payload of the copy at `address` (again on a copy damaged
/// before, it stays damaged).
fn damage(path: &Path, sb: &SuperBlock, address: u64) {
    let at = offset_of(sb, address);
    let mut block = read_block(path, at);
    for b in &mut block[200..232] {
        *b = b.wrapping_add(1);
    }
    write_block(path, at, &block);
}

/// The pool file with the volume written at the probes, then two checkpoints and a
/// close that touch no table page.
fn written_pool(name: &str) -> PoolFile {
    let path = std::env::temp_dir().join(format!(
        "fewerbytes-copies-{name}-{}.pool",
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
    pool.create_volume_with("v", VOLUME_BYTES, Provisioning::THIN)
        .unwrap();
    let vol = pool.open_volume("v").unwrap();
    for lbn in probes() {
        vol.write(lbn * BLOCK as u64, &random_block(lbn), false)
            .unwrap();
    }
    vol.flush().unwrap();
    drop(vol);
    // A setting rewritten is made durable by two checkpoints, which write no table
    // page: the directory pages are shared by both super block copies.
    pool.set_compression(Compression::None).unwrap();
    pool.close().unwrap();
    file
}

/// Open, check every probe and the blocks beside them, and the repair counter.
fn open_and_check(path: &Path, repaired: u64) {
    let pool = Pool::open(path, &OPTS).unwrap_or_else(|e| panic!("the pool opens: {e}"));
    let vol = pool.open_volume("v").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for lbn in probes() {
        vol.read(lbn * BLOCK as u64, &mut buf).unwrap();
        assert!(buf == random_block(lbn), "block {lbn} reads back");
        vol.read((lbn ^ 2) * BLOCK as u64, &mut buf).unwrap();
        assert!(
            buf.iter().all(|b| *b == 0),
            "block {} is unwritten",
            lbn ^ 2
        );
    }
    drop(vol);
    assert_eq!(
        pool.stats().metadata_copies_repaired,
        repaired,
        "directory page copies read from their twin"
    );
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    pool.close().unwrap();
}

fn one_bad_copy_is_repaired(target: Target) {
    let file = written_pool(&format!("{target:?}").to_lowercase().replace(['(', ')'], ""));
    let path = &file.0;
    let [newest, older] = <[SuperBlock; 2]>::try_from(super_blocks(path)).unwrap();
    let r = target_ref(path, &newest, target);
    assert_eq!(
        r,
        target_ref(path, &older, target),
        "{target:?} is shared by both checkpoints"
    );
    // Both copies are the same page.
    assert_eq!(
        read_copy(path, &newest, PageKind::Directory, &r, r.address),
        read_copy(path, &newest, PageKind::Directory, &r, r.twin)
    );
    damage(path, &newest, r.address);
    open_and_check(path, 1);
    // The open's checkpoint wrote both copies anew, elsewhere, and they verify.
    let newest = super_blocks(path).remove(0);
    let again = target_ref(path, &newest, target);
    assert!(
        again.address != r.address && again.twin != r.twin,
        "{target:?} rewritten: {r:?} then {again:?}"
    );
    read_copy(path, &newest, PageKind::Directory, &again, again.address);
    read_copy(path, &newest, PageKind::Directory, &again, again.twin);
    // The other copy damaged now: it still opens, from the first (which reads good:
    // nothing to repair).
    damage(path, &newest, again.twin);
    open_and_check(path, 0);
    // Both copies of the page bad: named, both copies. A map's directory page then
    // costs the volume range under it (damaged, the rest served); a count table's
    // stops the open with a corruption error.
    let newest = super_blocks(path).remove(0);
    let last = target_ref(path, &newest, target);
    damage(path, &newest, last.address);
    damage(path, &newest, last.twin);
    let first_block = offset_of(&newest, last.address) / BLOCK as u64;
    let twin_block = offset_of(&newest, last.twin) / BLOCK as u64;
    let names_both = |reason: &str| {
        assert!(reason.contains("both copies"), "{target:?}: {reason}");
        assert!(
            reason.contains(&format!("block {twin_block}")),
            "{target:?}: {reason}"
        );
    };
    match (target, Pool::open_read_only(path, &OPTS)) {
        (
            Target::CountLevel1,
            Err(EngineError::Corrupt {
                region,
                block,
                reason,
                ..
            }),
        ) => {
            assert_eq!(region, "directory page");
            assert_eq!(block, first_block);
            names_both(&reason);
        }
        (Target::MapLevel1(_) | Target::MapTop, Ok(pool)) => {
            let ranges = pool.damaged_ranges();
            assert_eq!(ranges.len(), 1, "{target:?}: {ranges:?}");
            assert_eq!(ranges[0].block, first_block, "{target:?}");
            names_both(&ranges[0].reason);
        }
        (_, Err(e)) => panic!("{target:?}: not reported as expected: {e}"),
        (_, Ok(_)) => panic!("{target:?}: a page with both copies bad was loaded whole"),
    }
}

#[test]
fn one_bad_copy_of_a_level_1_map_directory_page_loses_nothing() {
    one_bad_copy_is_repaired(Target::MapLevel1(4));
}

#[test]
fn one_bad_copy_of_the_top_map_directory_page_loses_nothing() {
    one_bad_copy_is_repaired(Target::MapTop);
}

#[test]
fn one_bad_copy_of_a_count_table_directory_page_loses_nothing() {
    one_bad_copy_is_repaired(Target::CountLevel1);
}

#[test]
fn a_read_only_open_reads_a_damaged_page_from_its_twin_and_writes_nothing() {
    let file = written_pool("read-only");
    let path = &file.0;
    let newest = super_blocks(path).remove(0);
    let r = target_ref(path, &newest, Target::MapLevel1(0));
    damage(path, &newest, r.address);
    let at = offset_of(&newest, r.address);
    let before = [
        read_block(path, 0),
        read_block(path, BLOCK as u64),
        read_block(path, at),
    ];
    let pool = Pool::open_read_only(path, &OPTS).unwrap();
    let vol = pool.open_volume("v").unwrap();
    let mut buf = vec![0u8; BLOCK];
    vol.read(0, &mut buf).unwrap();
    assert!(buf == random_block(0));
    drop(vol);
    assert_eq!(pool.stats().metadata_copies_repaired, 1);
    pool.close().unwrap();
    let after = [
        read_block(path, 0),
        read_block(path, BLOCK as u64),
        read_block(path, at),
    ];
    assert!(
        before == after,
        "a read-only open repairs nothing on the device"
    );
}
