//! The dedup index is rebuilt in the background after an open: the pool serves at
//! once (reads and writes before the index has a single entry), writes meanwhile
//! are counted as stored without full dedup advice, frees during the rebuild leave
//! no entry behind, and once the index is ready a second copy of what was stored
//! before the open deduplicates. A read-only open never builds it.

mod common;

use common::{create, random_block, TestPool, BLOCK};
use fewerbytes_engine::{IndexState, OpenOptions, Pool};
use std::sync::Arc;

const BLOCKS: u64 = 200;

fn held_open() -> OpenOptions {
    OpenOptions {
        threads: Some(2),
        hold_index_build: true,
        take_over: None,
        ..OpenOptions::default()
    }
}

fn write_copy(pool: &Arc<Pool>, volume: &str, first_lbn: u64, seed: u64) {
    let vol = pool.open_volume(volume).expect("volume");
    for i in 0..BLOCKS {
        vol.write(
            (first_lbn + i) * BLOCK as u64,
            &random_block(seed + i),
            false,
        )
        .expect("write");
    }
    vol.flush().expect("flush");
}

fn index_entries_held(pool: &Pool) -> u64 {
    pool.stats()
        .limits
        .iter()
        .find(|(k, _)| k == "index entries held")
        .map(|(_, v)| *v)
        .expect("the 'index entries held' limit")
}

/// A pool holding `BLOCKS` distinct blocks in volume "a", closed.
fn pool_with_data() -> TestPool {
    let mut t = create(64 << 20, None);
    t.pool().create_volume("a", 8 << 20).expect("volume a");
    t.pool().create_volume("b", 8 << 20).expect("volume b");
    write_copy(t.pool(), "a", 0, 1000);
    t.close();
    t
}

#[test]
fn a_reopened_pool_serves_while_its_index_rebuilds_and_dedups_once_it_is_ready() {
    let mut t = pool_with_data();
    t.open_with(&held_open());
    let p = t.pool().clone();
    let status = p.index_status();
    assert_eq!(
        (status.state, status.percent),
        (IndexState::Rebuilding, 0),
        "the open returned before the index was built"
    );
    assert_eq!(p.info().index.state, IndexState::Rebuilding);
    // Served before the index holds anything: a second copy is written, stored
    // anew, and counted. (Nearly all of it: the second copy's own entries name
    // groups of objects, and a lookup whose tag matches one scans the group, where
    // it may find a block of the first copy that shares it. Verified, so a true
    // duplicate, but found by luck, not by the index.)
    assert_eq!(p.stats().objects, BLOCKS);
    let hits = p.stats().counters.dedup_hits;
    write_copy(&p, "b", 0, 1000);
    let stats = p.stats();
    let stored = stats.index.blocks_stored_while_rebuilding;
    assert_eq!(
        stats.objects,
        BLOCKS + stored,
        "what was stored meanwhile is counted"
    );
    assert_eq!(stored + stats.counters.dedup_hits - hits, BLOCKS);
    assert!(
        stored >= BLOCKS - BLOCKS / 10,
        "with no index yet, the second copy is stored: {stored} of {BLOCKS} blocks"
    );
    assert_eq!(
        stats.index.to_string().split(';').next(),
        Some("rebuilding 0%")
    );
    // Freed while the build waits: the first copy's objects (trimmed away).
    let a = p.open_volume("a").expect("a");
    a.trim(0, BLOCKS * BLOCK as u64, false).expect("trim");
    a.flush().expect("flush");
    drop(a);

    p.release_index_build();
    p.wait_index_built();
    let status = p.index_status();
    assert_eq!((status.state, status.percent), (IndexState::Ready, 100));
    assert_eq!(p.stats().objects, BLOCKS);
    // No entry left behind by the frees, none held twice (the writes and the build
    // both inserted the second copy): the index holds what a build from scratch
    // over the same objects holds. (Not simply one entry an object: in a pool with
    // room to grow, an entry names a group of objects, and two of a group with the
    // same tag in the same buckets share it.)
    let held = index_entries_held(&p);
    t.close();
    t.open();
    let p = t.pool().clone();
    p.wait_index_built();
    assert_eq!(
        index_entries_held(&p),
        held,
        "a build from scratch holds as many"
    );
    // A third copy finds the second one's blocks.
    let hits = p.stats().counters.dedup_hits;
    write_copy(&p, "a", 0, 1000);
    let stats = p.stats();
    assert_eq!(stats.objects, BLOCKS, "a copy after the rebuild dedups");
    assert_eq!(stats.counters.dedup_hits - hits, BLOCKS);
    assert_eq!(
        stats.index.blocks_stored_while_rebuilding, 0,
        "writes once the index is ready are not counted"
    );
    let audit = p.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
}

#[test]
fn after_a_crash_the_index_is_rebuilt_and_finds_what_was_stored_before() {
    let mut t = create(64 << 20, None);
    t.pool().create_volume("a", 8 << 20).expect("volume a");
    t.pool().create_volume("b", 8 << 20).expect("volume b");
    write_copy(t.pool(), "a", 0, 5000);
    t.crash(fewerbytes_engine::storage::CrashMode::DropAll);
    let p = t.pool().clone();
    p.wait_index_built();
    assert_eq!(p.index_status().state, IndexState::Ready);
    assert_eq!(p.stats().objects, BLOCKS);
    write_copy(&p, "b", 0, 5000);
    assert_eq!(
        p.stats().objects,
        BLOCKS,
        "the copy written after the crash's rebuild dedups"
    );
}

#[test]
fn a_read_only_open_never_builds_the_index() {
    let t = pool_with_data();
    let pool = Pool::open_devices_read_only(
        t.dev.clone() as Arc<dyn fewerbytes_engine::storage::Storage>,
        None,
        &OpenOptions::default(),
    )
    .expect("open read-only");
    pool.wait_index_built();
    let status = pool.index_status();
    assert_eq!(status.state, IndexState::NotBuilt);
    assert_eq!(index_entries_held(&pool), 0);
    assert_eq!(
        pool.info().index.to_string(),
        "not built (opened read-only)"
    );
}

#[test]
fn a_close_during_the_rebuild_stops_it_and_the_next_open_builds_it() {
    let mut t = pool_with_data();
    t.open_with(&held_open());
    assert_eq!(t.pool().index_status().state, IndexState::Rebuilding);
    t.close();
    t.open();
    let p = t.pool().clone();
    p.wait_index_built();
    write_copy(&p, "b", 0, 1000);
    assert_eq!(p.stats().objects, BLOCKS, "the copy dedups");
}
