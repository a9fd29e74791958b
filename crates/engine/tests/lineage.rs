//! Map pages shared along a lineage (format flag bit 7): a clone, a snapshot or a
//! rollback reaches its source's pages, which name the source's lineage, so every
//! reader of a page's owner (the load behind `check`, repair and `send`, and the
//! scrub) must take a page naming the volume's lineage and nothing else.
//!
//! Regression: the scrub expected every map page to name its own volume's id, so a
//! healthy pool with one clone reported each shared page as damage ("the page names
//! owner 1 … expected owner 2") and advised trimming good data; a damaged page a
//! snapshot shares was reported once per tree, the snapshot by its bare name.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, Storage};
use fewerbytes_engine::{Compression, OpenOptions, ScrubFinding};
use fewerbytes_format::page::{decode_page, encode_page, PageKind};

/// Blocks one map page maps.
const PER_PAGE: u64 = 504;

/// The device block and slot of the newest copy of map page `index` whose header
/// names `owner`, found by scanning the page store as a person with a hex editor would.
fn map_page(image: &[u8], owner: u64, index: u64) -> (u64, u64) {
    let sb = newest_super_block(image);
    (1..sb.page_slots)
        .filter_map(|slot| {
            let block = sb.pages_start_block + slot;
            let bytes = image.get(block as usize * BLOCK..(block as usize + 1) * BLOCK)?;
            let (h, _) = decode_page(bytes, PageKind::Map, sb.nonce, slot).ok()?;
            (h.owner == owner && h.index == index).then_some((h.generation, block, slot))
        })
        .max()
        .map(|(_, block, slot)| (block, slot))
        .expect("the map page is in the page store")
}

/// Solve `sum of x_i * columns[i] = target` over GF(2): which columns to add.
fn solve_gf2(columns: &[u32; 32], target: u32) -> u32 {
    // basis[b]: a sum of columns whose highest set bit is b, and which columns.
    let mut basis = [(0u32, 0u32); 32];
    for (i, &column) in columns.iter().enumerate() {
        let (mut v, mut m) = (column, 1u32 << i);
        for b in (0..32).rev() {
            if v >> b & 1 == 0 {
                continue;
            }
            if basis[b].0 == 0 {
                basis[b] = (v, m);
                break;
            }
            v ^= basis[b].0;
            m ^= basis[b].1;
        }
    }
    let (mut v, mut m) = (target, 0u32);
    for b in (0..32).rev() {
        if v >> b & 1 == 1 {
            assert_ne!(basis[b].0, 0, "the crc cannot be kept with these bytes");
            v ^= basis[b].0;
            m ^= basis[b].1;
        }
    }
    m
}

/// The page at `slot` (`bytes`) rewritten to name `owner`, every checksum still good:
/// its last 4 payload bytes chosen so its crc stays the one its parent holds (crc32c
/// is affine in the bytes). A misplaced page that only its owner gives away.
fn forged_owner(bytes: &[u8], nonce: u64, slot: u64, owner: u64) -> Vec<u8> {
    let (header, payload) = decode_page(bytes, PageKind::Map, nonce, slot).expect("a map page");
    let payload = payload.to_vec();
    let mut out = [0u8; BLOCK];
    let want = encode_page(&header, &payload, &mut out);
    let mut forged = header;
    forged.owner = owner;
    let last = payload.len() - 4;
    let encode = |patch: u32| {
        let mut p = payload.clone();
        for (i, byte) in patch.to_le_bytes().iter().enumerate() {
            p[last + i] ^= byte;
        }
        let mut out = [0u8; BLOCK];
        let crc = encode_page(&forged, &p, &mut out);
        (crc, out)
    };
    let base = encode(0).0;
    let columns: [u32; 32] = std::array::from_fn(|i| encode(1 << i).0 ^ base);
    let (crc, out) = encode(solve_gf2(&columns, want ^ base));
    assert_eq!(crc, want, "the forged page keeps its crc");
    out.to_vec()
}

fn volume_id(t: &TestPool, name: &str) -> u64 {
    t.pool()
        .list_volumes()
        .iter()
        .find(|v| v.name == name)
        .expect("the volume")
        .id
}

fn map_findings(s: &fewerbytes_engine::ScrubStatus) -> Vec<&ScrubFinding> {
    s.findings.iter().filter(|f| f.region == "map").collect()
}

#[test]
fn a_pool_with_clones_snapshots_and_rollbacks_scrubs_clean() {
    let mut t = create(64 << 20, None);
    let pool = t.pool().clone();
    pool.create_volume("src", 4 << 20).unwrap();
    // Three map pages written (blocks in pages 0, 1 and 2).
    for lbn in [0, 1, PER_PAGE + 7, 2 * PER_PAGE + 1] {
        write_blocks(&pool, "src", lbn, 1, 100 + lbn);
    }
    pool.clone_volume("src", "c1").unwrap();
    pool.snapshot_volume("src", "s1").unwrap();
    // src makes page 0 its own; the snapshot keeps the old one.
    write_blocks(&pool, "src", 3, 1, 900);
    pool.clone_volume("src@s1", "c2").unwrap();
    pool.clone_volume("c1", "c3").unwrap();
    write_blocks(&pool, "c3", PER_PAGE + 8, 1, 901);
    pool.snapshot_volume("c3", "s").unwrap();
    pool.rollback_volume("src", "s1").unwrap();
    // The volume the line began with goes; the clones keep its lineage.
    pool.delete_volume("c1", false).unwrap();
    let images: Vec<(String, Vec<u8>)> = ["src", "src@s1", "c2", "c3", "c3@s"]
        .iter()
        .map(|n| (n.to_string(), read_all(&pool, n)))
        .collect();
    let shared = pool.shared_map_pages();
    assert!(shared > 0, "the clones and snapshots share pages");
    drop(pool);

    for when in ["open", "reopened"] {
        let pool = t.pool().clone();
        let s = scrub_to_end(&pool);
        assert_eq!(s.errors_found, 0, "{when}: {s:#?}");
        assert!(s.findings.is_empty(), "{when}: {s:#?}");
        assert!(s.stopped.is_none(), "{when}: {s:#?}");
        assert_eq!(s.bytes_verified, s.bytes_total, "{when}: {s:#?}");
        // Nothing "repaired" by unsharing: the pages are still shared.
        assert_eq!(pool.shared_map_pages(), shared, "{when}");
        for (name, bytes) in &images {
            assert!(read_all(&pool, name) == *bytes, "{when}: {name} changed");
        }
        let audit = pool.audit();
        assert!(audit.problems.is_empty(), "{when}: {:?}", audit.problems);
        drop(pool);
        t.reopen();
    }
}

#[test]
fn a_map_page_naming_another_owner_than_its_lineage_is_damage() {
    // a: its own line. b and its clone c: one line, whose pages name b's id. c's
    // own page 0 (written after the clone) names b's id too.
    let mut t = create(64 << 20, None);
    let pool = t.pool().clone();
    pool.create_volume("a", 4 << 20).unwrap();
    pool.create_volume("b", 4 << 20).unwrap();
    write_blocks(&pool, "a", 0, 4, 10);
    write_blocks(&pool, "b", 0, 4, 20);
    pool.clone_volume("b", "c").unwrap();
    write_blocks(&pool, "c", 1, 1, 30);
    drop(pool);
    t.reopen();
    let (a, b, c) = (volume_id(&t, "a"), volume_id(&t, "b"), volume_id(&t, "c"));
    let want_a = read_all(t.pool(), "a");
    let want_c = read_all(t.pool(), "c");
    let image = t.dev.crash_image(CrashMode::KeepAll);
    let nonce = newest_super_block(&image).nonce;
    // a's page names b's line; c's own page names c's id, which is not its lineage.
    let (a_block, a_slot) = map_page(&image, a, 0);
    let (c_block, c_slot) = map_page(&image, b, 0);
    for (block, slot, owner) in [(a_block, a_slot, b), (c_block, c_slot, c)] {
        let at = block as usize * BLOCK;
        let forged = forged_owner(&image[at..at + BLOCK], nonce, slot, owner);
        t.dev.write_at(&forged, at as u64).unwrap();
    }

    // The scrub of the open pool finds both and rewrites them from memory.
    let pool = t.pool().clone();
    let s = scrub_to_end(&pool);
    let maps = map_findings(&s);
    assert_eq!(maps.len(), 2, "{s:#?}");
    assert_eq!(s.errors_found, 2, "{s:#?}");
    for (volume, named, expected) in [("a", b, a), ("c", c, b)] {
        let f = maps
            .iter()
            .find(|f| f.what.contains(&format!("of volume '{volume}'")))
            .unwrap_or_else(|| panic!("no finding for {volume}: {s:#?}"));
        assert!(
            f.what.contains(&format!(
                "names owner {named} index 0 level 0, expected owner {expected}"
            )),
            "{f:#?}"
        );
        assert!(f.repaired, "{f:#?}");
    }
    assert_eq!(scrub_to_end(&pool).errors_found, 0);
    drop(pool);
    t.reopen();
    assert!(read_all(t.pool(), "a") == want_a);
    assert!(read_all(t.pool(), "c") == want_c);

    // A forged page at open: the load takes the same rule, so the range is damaged.
    // Checkpoints that leave the page as it is first, so both super block copies
    // reach it (the older copy cannot stand in).
    t.pool().set_compression(Compression::Lz4).unwrap();
    t.close();
    let image = t.dev.crash_image(CrashMode::KeepAll);
    let (block, slot) = map_page(&image, a, 0);
    let at = block as usize * BLOCK;
    let forged = forged_owner(&image[at..at + BLOCK], nonce, slot, b);
    let mut image = image;
    image[at..at + BLOCK].copy_from_slice(&forged);
    let dev = std::sync::Arc::new(fewerbytes_engine::storage::FaultStorage::from_image(
        "data", image,
    ));
    let pool = fewerbytes_engine::Pool::open_devices(
        dev as std::sync::Arc<dyn Storage>,
        None,
        &OpenOptions {
            threads: Some(2),
            ..OpenOptions::default()
        },
    )
    .expect("a damaged map page leaves the rest of the pool open");
    let ranges = pool.damaged_ranges();
    assert_eq!(ranges.len(), 1, "{ranges:#?}");
    assert_eq!(ranges[0].volume, "a");
    assert!(
        ranges[0]
            .reason
            .contains(&format!("names owner {b} index 0, expected owner {a}")),
        "{ranges:#?}"
    );
    assert!(read_all(&pool, "c") == want_c);
}

#[test]
fn a_damaged_page_a_snapshot_shares_is_one_finding_naming_both() {
    let mut t = create(64 << 20, None);
    let pool = t.pool().clone();
    pool.create_volume("sv", 4 << 20).unwrap();
    write_blocks(&pool, "sv", 0, 2 * PER_PAGE, 500);
    pool.snapshot_volume("sv", "s").unwrap();
    drop(pool);
    t.reopen();
    let sv = volume_id(&t, "sv");
    let want = read_all(t.pool(), "sv");
    let image = t.dev.crash_image(CrashMode::KeepAll);
    let (block, _) = map_page(&image, sv, 1);
    t.dev
        .write_at(&[0xa5; 32], block * BLOCK as u64 + 1000)
        .unwrap();

    let pool = t.pool().clone();
    let s = scrub_to_end(&pool);
    assert_eq!(s.errors_found, 1, "one page, one error: {s:#?}");
    let f = map_findings(&s)[0];
    let range = format!("bytes {}..{}", PER_PAGE * 4096, 2 * PER_PAGE * 4096 - 1);
    assert_eq!(
        f.volumes,
        vec![
            format!("volume 'sv' {range}"),
            format!("volume 'sv@s' {range}")
        ],
        "{f:#?}"
    );
    assert!(f.repaired, "{f:#?}");
    // Every tree that reached the page now reaches a good copy.
    assert_eq!(scrub_to_end(&pool).errors_found, 0);
    drop(pool);
    t.reopen();
    assert!(t.pool().damaged_ranges().is_empty());
    assert!(read_all(t.pool(), "sv") == want);
    assert!(read_all(t.pool(), "sv@s") == want);
    let audit = t.pool().audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
}
