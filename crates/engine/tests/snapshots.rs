//! Snapshots (`Pool::snapshot_volume`) and the shared block-map pages under them
//! and under clones (format flag bit 7): a snapshot is the volume at one point in
//! time, read-only, reached as `VOLUME@SNAPSHOT`; taking one writes no block-map
//! page whatever the volume's size; a write below a shared page makes it the
//! volume's own; deleting a snapshot frees only what it alone held; a reopen finds
//! the sharing again. (Crashes inside each step: the crash simulation and the model
//! test take, roll back to and delete snapshots.)

mod common;

use common::{create, random_block, read_all, write_blocks, BLOCK};
use fewerbytes_engine::{EngineError, Pool};

/// Four block-map pages' worth (504 entries each).
const BLOCKS: u64 = 4 * 504;

/// Bytes of block-map pages the pool has written since it opened.
fn map_bytes_written(pool: &Pool) -> u64 {
    pool.stats()
        .metadata_written_by_region
        .iter()
        .find(|(region, _)| region.contains("map"))
        .map(|(_, bytes)| *bytes)
        .expect("a block-map region in the written bytes")
}

fn audit_clean(pool: &Pool) {
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "audit: {:?}", audit.problems);
}

#[test]
fn a_snapshot_keeps_its_point_in_time_and_writes_no_map_page() {
    let mut t = create(64 << 20, None);
    let p = t.pool().clone();
    p.create_volume("vm", BLOCKS * BLOCK as u64)
        .expect("create");
    write_blocks(&p, "vm", 0, BLOCKS, 1);
    // Pages changed since the last checkpoint are written once, by a checkpoint the
    // snapshot takes first, then shared like the rest.
    let before = map_bytes_written(&p);
    p.snapshot_volume("vm", "first").expect("snapshot");
    assert_eq!(map_bytes_written(&p) - before, 4 * BLOCK as u64);
    // The volume's pages are durable now: the next snapshot writes none.
    let before = map_bytes_written(&p);
    let info = p.snapshot_volume("vm", "before").expect("snapshot");
    assert_eq!(info.name, "vm@before");
    assert_eq!(info.snapshot_of.as_deref(), Some("vm"));
    assert!(info.guid.is_some() && info.created > 0);
    assert_eq!(
        map_bytes_written(&p),
        before,
        "taking a snapshot wrote block-map pages: its cost follows the volume's size"
    );
    assert_eq!(p.info().shared_map_pages, 4);
    assert!(
        p.info().shared_maps,
        "flag bit 7 is set while pages are shared"
    );
    p.delete_volume("vm@first", false).expect("delete");
    let at_snapshot = read_all(&p, "vm");

    // A write into the first page makes that page the volume's own; the snapshot
    // keeps the old bytes.
    write_blocks(&p, "vm", 3, 2, 1000);
    assert_eq!(p.info().shared_map_pages, 3);
    assert_eq!(read_all(&p, "vm@before"), at_snapshot);
    assert_ne!(read_all(&p, "vm"), at_snapshot);
    audit_clean(&p);

    // A reopen finds the sharing from the trees.
    let now = read_all(&p, "vm");
    drop(p);
    t.reopen();
    let p = t.pool().clone();
    assert_eq!(p.info().shared_map_pages, 3);
    assert_eq!(read_all(&p, "vm@before"), at_snapshot);
    assert_eq!(read_all(&p, "vm"), now);
    audit_clean(&p);
    assert_eq!(
        p.snapshots("vm").expect("list")[0].name,
        "vm@before",
        "the snapshot is listed with its volume"
    );
    assert!(
        p.list_volumes().iter().all(|v| v.name == "vm"),
        "volume list leaves snapshots out"
    );
}

#[test]
fn a_snapshot_is_never_written_and_its_volume_is_not_deleted_under_it() {
    let t = create(64 << 20, None);
    let p = t.pool().clone();
    p.create_volume("vm", BLOCKS * BLOCK as u64)
        .expect("create");
    write_blocks(&p, "vm", 0, 8, 1);
    p.snapshot_volume("vm", "s").expect("snapshot");
    let snap = p.open_volume("vm@s").expect("open the snapshot");
    assert!(snap.is_snapshot());
    for refused in [
        snap.write(0, &random_block(9), false),
        snap.trim(0, BLOCK as u64, false),
        snap.write_zeroes(0, BLOCK as u64, false),
    ] {
        assert!(
            matches!(refused, Err(EngineError::ReadOnly(_))),
            "{refused:?}"
        );
    }
    drop(snap);
    assert!(p
        .resize_volume("vm@s", 2 * BLOCKS * BLOCK as u64, false)
        .is_err());
    assert!(p.rename_volume("vm@s", "other").is_err());
    assert!(
        p.snapshot_volume("vm", "s").is_err(),
        "a second snapshot named s"
    );
    assert!(
        p.snapshot_volume("vm@s", "t").is_err(),
        "a snapshot of a snapshot"
    );
    let refused = p
        .delete_volume("vm", false)
        .expect_err("a volume with snapshots");
    assert!(refused.to_string().contains("snapshot"), "{refused}");
    // A clone of the snapshot is a volume like any other.
    p.clone_volume("vm@s", "copy").expect("clone of a snapshot");
    write_blocks(&p, "copy", 0, 1, 77);
    audit_clean(&p);
}

#[test]
fn deleting_a_snapshot_frees_only_what_it_alone_held_and_clears_the_flag() {
    let t = create(64 << 20, None);
    let p = t.pool().clone();
    p.create_volume("vm", BLOCKS * BLOCK as u64)
        .expect("create");
    write_blocks(&p, "vm", 0, BLOCKS, 1);
    let objects_before = p.stats().objects;
    p.snapshot_volume("vm", "s").expect("snapshot");
    // Half the volume rewritten: the snapshot alone holds the old half.
    write_blocks(&p, "vm", 0, BLOCKS / 2, 5000);
    assert_eq!(p.stats().objects, objects_before + BLOCKS / 2);
    let snapshot = &p.snapshots("vm").expect("list")[0];
    assert_eq!(
        snapshot.exclusive_stored_bytes,
        p.list_volumes()[0].exclusive_stored_bytes,
        "each holds half the blocks alone"
    );
    p.delete_volume("vm@s", false).expect("delete the snapshot");
    assert_eq!(
        p.stats().objects,
        objects_before,
        "the blocks only the snapshot held are freed, the shared ones kept"
    );
    assert_eq!(p.info().shared_map_pages, 0);
    assert!(
        !p.info().shared_maps,
        "no page shared and no snapshot: older engines may open the pool again"
    );
    audit_clean(&p);
    p.delete_volume("vm", false).expect("delete");
    assert_eq!(p.stats().objects, 0);
    audit_clean(&p);
}

#[test]
fn a_rollback_to_its_own_snapshot_keeps_the_volume_and_its_snapshots() {
    let mut t = create(64 << 20, None);
    let p = t.pool().clone();
    let id = p
        .create_volume("vm", BLOCKS * BLOCK as u64)
        .expect("create")
        .id;
    write_blocks(&p, "vm", 0, BLOCKS, 1);
    p.snapshot_volume("vm", "s").expect("snapshot");
    let at_snapshot = read_all(&p, "vm");
    write_blocks(&p, "vm", 100, 600, 9000);
    p.resize_volume("vm", 2 * BLOCKS * BLOCK as u64, false)
        .expect("grow");
    let open = p.open_volume("vm").expect("open");
    assert!(p.rollback_volume("vm", "s").is_err(), "refused while open");
    drop(open);
    let info = p.rollback_volume("vm", "s").expect("rollback");
    assert_eq!(info.id, id, "the volume keeps its id");
    assert_eq!(
        info.size_bytes,
        BLOCKS * BLOCK as u64,
        "and takes the snapshot's size"
    );
    assert_eq!(read_all(&p, "vm"), at_snapshot);
    assert_eq!(p.info().shared_map_pages, 4, "every page shared again");
    audit_clean(&p);
    drop(p);
    t.reopen();
    let p = t.pool().clone();
    assert_eq!(read_all(&p, "vm"), at_snapshot);
    assert_eq!(read_all(&p, "vm@s"), at_snapshot);
    assert_eq!(
        p.changed_extents("vm", "s")
            .expect("diff")
            .iter()
            .filter(|r| r.changed)
            .count(),
        0
    );
    audit_clean(&p);
}

#[test]
fn clones_share_pages_until_written_and_a_shrink_leaves_them_to_the_other_tree() {
    let mut t = create(64 << 20, None);
    let p = t.pool().clone();
    p.create_volume("base", BLOCKS * BLOCK as u64)
        .expect("create");
    write_blocks(&p, "base", 0, BLOCKS, 1);
    // Closed and opened again: every page durable.
    drop(p);
    t.reopen();
    let p = t.pool().clone();
    let template = read_all(&p, "base");
    let before = map_bytes_written(&p);
    p.clone_volume("base", "a").expect("clone");
    p.clone_volume("base", "b").expect("clone");
    assert_eq!(map_bytes_written(&p), before, "clones write no map page");
    assert_eq!(p.info().shared_map_pages, 4);
    // One clone shrinks past two pages, the other trims one page away.
    p.resize_volume("a", 2 * 504 * BLOCK as u64, true)
        .expect("shrink");
    p.open_volume("b")
        .expect("open")
        .trim(0, 504 * BLOCK as u64, false)
        .expect("trim");
    p.delete_volume("base", false).expect("delete the template");
    assert_eq!(
        read_all(&p, "a"),
        template[..2 * 504 * BLOCK],
        "the shrunk clone keeps the pages below its end"
    );
    let b = read_all(&p, "b");
    assert!(b[..504 * BLOCK].iter().all(|&x| x == 0));
    assert_eq!(b[504 * BLOCK..], template[504 * BLOCK..]);
    audit_clean(&p);
    drop(p);
    t.reopen();
    let p = t.pool().clone();
    assert_eq!(read_all(&p, "b")[504 * BLOCK..], template[504 * BLOCK..]);
    audit_clean(&p);
}

#[test]
fn a_snapshot_takes_no_memory_for_the_map_pages_it_shares() {
    let t = create(64 << 20, None);
    let p = t.pool().clone();
    p.create_volume("vm", BLOCKS * BLOCK as u64)
        .expect("create");
    write_blocks(&p, "vm", 0, BLOCKS, 1);
    let alone = p.list_volumes()[0].map_memory_bytes;
    p.snapshot_volume("vm", "s").expect("snapshot");
    let snapshot = &p.snapshots("vm").expect("list")[0];
    assert_eq!(snapshot.map_pages, 4);
    let vm = &p.list_volumes()[0];
    assert!(
        snapshot.map_memory_bytes < 4 * 4032 && vm.map_memory_bytes < 4 * 4032,
        "shared entries are held once: volume {} bytes, snapshot {} bytes (alone: {alone})",
        vm.map_memory_bytes,
        snapshot.map_memory_bytes
    );
    // A write gives the volume a page of its own again.
    write_blocks(&p, "vm", 0, 1, 99);
    assert!(p.list_volumes()[0].map_memory_bytes >= 4032);
}
