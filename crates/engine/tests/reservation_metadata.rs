//! Reservations count the metadata their data will need (`reservation.rs`, "Metadata
//! kept"): in a pool whose page store is full, every page goes to a data block, and a
//! pool of fragments needs about 4% of its data for block-map, count and fingerprint
//! pages. A thick volume that reserved all it could must still write its whole
//! reservation, with every checkpoint in between finding room for its pages, however
//! much a thin volume takes meanwhile; the thin volume's writes get ENOSPC first.

mod common;

use common::*;
use fewerbytes_engine::{CreateOptions, EngineError, Pool, Provisioning};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const B: u64 = BLOCK as u64;

/// A 128 MiB pool whose page store has 8 slots: every page past them lies in the
/// data region (flags bit 3), as it would in a large pool whose page store is full.
fn pool_without_page_store() -> TestPool {
    let opts = CreateOptions {
        page_slots: Some(8),
        ..CreateOptions::default()
    };
    create_with(128 * MIB, None, &opts)
}

/// A unique block that compresses to about 1,400 bytes: packed at almost three to a
/// block, each its own object, so the most metadata pages per data block.
fn fragment_block(seed: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for byte in b.iter_mut().take(1400) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *byte = x as u8;
    }
    b
}

/// Take a checkpoint now, as every volume operation does: rename the volume `tick`
/// back and forth (`n` says which way). It must succeed.
fn checkpoint(pool: &Arc<Pool>, n: u64, when: &str) {
    let (from, to) = if n.is_multiple_of(2) {
        ("tick", "tock")
    } else {
        ("tock", "tick")
    };
    pool.rename_volume(from, to)
        .unwrap_or_else(|e| panic!("the checkpoint {when} failed: {e}"));
}

#[test]
fn a_thick_volume_writes_its_whole_reservation_of_fragments_while_a_thin_one_takes_the_rest() {
    let t = pool_without_page_store();
    let pool = t.pool().clone();
    pool.create_volume_with("tick", MIB, Provisioning::THIN)
        .unwrap();
    pool.create_volume_with("scratch", 1 << 30, Provisioning::THIN)
        .unwrap();
    // All it may: the largest reservation the pool grants.
    let reservable = pool.info().space.reservable_bytes;
    assert!(reservable > 64 * MIB, "only {reservable} bytes reservable");
    pool.create_volume("db", reservable)
        .unwrap_or_else(|e| panic!("pool info offered {reservable} bytes: {e}"));
    let info = pool.info();
    assert!(
        info.space.metadata_kept_bytes > 0,
        "nothing kept for the pages of {reservable} reserved bytes: {info:?}"
    );
    let db = pool.open_volume("db").unwrap();
    let scratch = pool.open_volume("scratch").unwrap();
    let blocks = reservable / B;
    let (mut thin_written, mut thin_refused) = (0u64, 0u64);
    let mut checkpoints = 0u64;
    // The thick volume writes its reservation 64 blocks at a time; each time, the
    // thin volume takes up to 192 blocks of what the fragments leave free (a third
    // of a block each), until it is refused; a checkpoint every 8 rounds.
    for (round, first) in (0..blocks).step_by(64).enumerate() {
        for lbn in first..(first + 64).min(blocks) {
            db.write(lbn * B, &fragment_block(1 << 40 | lbn), false)
                .unwrap_or_else(|e| {
                    panic!("block {lbn} of the {blocks} the thick volume reserved: {e}")
                });
        }
        for _ in 0..192 {
            match scratch.write(thin_written * B, &fragment_block(thin_written), false) {
                Ok(()) => thin_written += 1,
                Err(e) => {
                    assert!(e.is_no_space(), "a thin write failed otherwise: {e}");
                    thin_refused += 1;
                    break;
                }
            }
        }
        if round % 8 == 7 {
            checkpoint(&pool, checkpoints, &format!("after round {round}"));
            checkpoints += 1;
        }
    }
    db.flush().unwrap();
    checkpoint(&pool, checkpoints, "after the last write");
    assert!(
        thin_refused > 0,
        "the thin volume was never refused ({thin_written} blocks written)"
    );
    assert!(
        thin_written > blocks / 2,
        "the thin volume took only {thin_written} blocks beside {blocks} of fragments"
    );
    assert_eq!(pool.latched_reason(), None);
    let stats = pool.stats();
    assert!(
        stats.space.metadata_in_data_bytes > 0,
        "no page went to the data region"
    );
    let mut buf = vec![0u8; BLOCK];
    for lbn in [0, blocks / 2, blocks - 1] {
        db.read(lbn * B, &mut buf).unwrap();
        assert!(
            buf == fragment_block(1 << 40 | lbn),
            "block {lbn} reads back wrong"
        );
    }
    for lbn in [0, thin_written - 1] {
        scratch.read(lbn * B, &mut buf).unwrap();
        assert!(
            buf == fragment_block(lbn),
            "thin block {lbn} reads back wrong"
        );
    }
    let db_info = pool
        .list_volumes()
        .into_iter()
        .find(|v| v.name == "db")
        .unwrap();
    assert_eq!(db_info.reserved_unused_bytes, 0);
    assert!(pool.audit().problems.is_empty());
}

#[test]
fn a_thick_volume_of_whole_blocks_writes_its_whole_reservation_with_checkpoints_between() {
    let mut t = pool_without_page_store();
    let pool = t.pool().clone();
    pool.create_volume_with("tick", MIB, Provisioning::THIN)
        .unwrap();
    let reservable = pool.info().space.reservable_bytes;
    pool.create_volume("db", reservable).unwrap();
    let db = pool.open_volume("db").unwrap();
    let blocks = reservable / B;
    for first in (0..blocks).step_by(512) {
        for lbn in first..(first + 512).min(blocks) {
            db.write(lbn * B, &random_block(lbn), false)
                .unwrap_or_else(|e| panic!("block {lbn} of {blocks}: {e}"));
        }
        checkpoint(&pool, first / 512, &format!("after block {first}"));
    }
    db.flush().unwrap();
    assert_eq!(pool.latched_reason(), None);
    drop(db);
    drop(pool);
    t.reopen();
    let db = t.pool().open_volume("db").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for lbn in [0, blocks / 2, blocks - 1] {
        db.read(lbn * B, &mut buf).unwrap();
        assert!(buf == random_block(lbn), "block {lbn} reads back wrong");
    }
    assert!(t.pool().audit().problems.is_empty());
}

#[test]
fn a_reservation_past_its_data_and_metadata_is_refused_with_the_numbers() {
    let t = pool_without_page_store();
    let pool = t.pool();
    let info = pool.info();
    let reservable = info.space.reservable_bytes;
    // The data region less the reserve (trims and deletes, and each slab's headroom
    // for a checkpoint's copies): what a reservation could take if its pages needed
    // no room.
    let data_only = info.space.data_bytes - info.reserve_bytes;
    assert!(
        reservable < data_only,
        "a reservation of every free block ({data_only} bytes) would leave no room for \
         its pages, yet {reservable} bytes are offered"
    );
    match pool.create_volume("big", reservable + B) {
        Err(EngineError::Refused(why)) => {
            assert!(why.contains("kept for the metadata pages"), "{why}");
            assert!(why.contains("free for reservations"), "{why}");
            assert!(why.contains("--thin"), "{why}");
        }
        other => panic!("one block past what pool info offers: {other:?}"),
    }
    assert!(pool.list_volumes().is_empty());
    pool.create_volume("big", reservable)
        .unwrap_or_else(|e| panic!("what pool info offers, {reservable} bytes: {e}"));
    let after = pool.info();
    // Past that, a few blocks at most: a volume needs map and object pages of its own.
    assert!(after.space.reservable_bytes < 16 * B, "{after:?}");
    assert!(after.space.metadata_kept_bytes > 0, "{after:?}");
}

#[test]
fn thin_writes_get_enospc_before_a_checkpoint_finds_no_room() {
    let t = pool_without_page_store();
    let pool = t.pool().clone();
    pool.create_volume_with("tick", MIB, Provisioning::THIN)
        .unwrap();
    pool.create_volume_with("scratch", 1 << 30, Provisioning::THIN)
        .unwrap();
    let scratch = pool.open_volume("scratch").unwrap();
    let mut written = 0u64;
    let mut checkpoints = 0u64;
    let full = loop {
        match scratch.write(written * B, &fragment_block(written), false) {
            Ok(()) => written += 1,
            Err(e) => break e,
        }
        if written.is_multiple_of(1024) {
            checkpoint(&pool, checkpoints, &format!("after {written} blocks"));
            checkpoints += 1;
        }
        assert!(written < (1 << 30) / B, "the thin volume never filled");
    };
    assert!(full.is_no_space(), "{full}");
    scratch.flush().unwrap();
    // The pool is full of data and its pages, and still checkpoints.
    checkpoint(&pool, checkpoints, "once the thin volume was full");
    assert_eq!(pool.latched_reason(), None);
    let mut buf = vec![0u8; BLOCK];
    for lbn in [0, written / 2, written - 1] {
        scratch.read(lbn * B, &mut buf).unwrap();
        assert!(buf == fragment_block(lbn), "block {lbn} reads back wrong");
    }
    assert!(pool.audit().problems.is_empty());
}

/// A clone shares its source's map pages (`page_share.rs`): with the data region
/// full and no page-store slot free, a clone of a volume of 1,024 map pages still
/// fits, since it writes only its own directory pages, and is exact after a reopen.
/// (Before shared pages it had to write all 1,024 and was refused.)
#[test]
fn a_clone_in_a_full_pool_writes_only_its_directory_pages() {
    let mut t = pool_without_page_store();
    let pool = t.pool().clone();
    pool.create_volume_with("tick", MIB, Provisioning::THIN)
        .unwrap();
    // A thin source with one block in each of 1,024 map pages.
    pool.create_volume_with("src", 4 << 30, Provisioning::THIN)
        .unwrap();
    let src = pool.open_volume("src").unwrap();
    for page in 0..1024u64 {
        src.write(page * 504 * B, &random_block(1 << 41 | page), false)
            .unwrap();
    }
    drop(src);
    checkpoint(&pool, 0, "after the source was written");
    // Fill the data region with a thin volume until writes are refused.
    pool.create_volume_with("fill", 1 << 30, Provisioning::THIN)
        .unwrap();
    let fill = pool.open_volume("fill").unwrap();
    let mut filled = 0u64;
    loop {
        match fill.write(filled * B, &random_block(filled), false) {
            Ok(()) => filled += 1,
            Err(EngineError::NoSpace(_)) => break,
            Err(e) => panic!("block {filled} of the fill: {e}"),
        }
    }
    drop(fill);
    let names =
        |pool: &Pool| -> Vec<String> { pool.list_volumes().into_iter().map(|v| v.name).collect() };
    pool.clone_volume_with("src", "copy", Provisioning::THIN)
        .expect("a clone that writes only its directory pages fits a full pool");
    assert!(names(&pool).contains(&"copy".to_string()));
    t.reopen();
    let mut after = names(t.pool());
    after.sort();
    assert_eq!(after, ["copy", "fill", "src", "tock"], "after a reopen");
    let copy = t.pool().open_volume("copy").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for page in [0u64, 511, 1023] {
        copy.read(page * 504 * B, &mut buf).unwrap();
        assert!(
            buf == random_block(1 << 41 | page),
            "page {page}'s block reads back wrong in the clone"
        );
    }
    drop(copy);
    let audit = t.pool().audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
}
