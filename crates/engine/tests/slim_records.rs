//! A block stored new is journalled as one `NewStored` record (27 bytes; a
//! `NewObject` with its 32-byte fingerprint and a `MapSet` took 64): replay after a
//! kill reads each such block back, checks its crc and computes its fingerprint.
//! The blocks read back whole, dedup against them works again, and a block
//! damaged on the drive before the replay reads as damaged, never as other data.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, FaultStorage, Storage};
use fewerbytes_engine::{EngineError, OpenOptions, Pool};
use std::sync::Arc;

const BLOCKS: u64 = 256;

/// Bytes the journal has written since the pool opened.
fn journal_bytes(pool: &Pool) -> u64 {
    pool.stats()
        .metadata_written_by_region
        .iter()
        .find(|(region, _)| region == "journal")
        .map(|(_, bytes)| *bytes)
        .expect("the journal's bytes")
}

/// Volume "a" of `BLOCKS` blocks of noise, each block its own, written and flushed;
/// the pool is never closed. Returns the pool (for its device) and the journal's
/// bytes for the writes.
fn written(seed: u64) -> (TestPool, u64) {
    let t = create(64 << 20, None);
    let pool = t.pool().clone();
    pool.create_volume("a", BLOCKS * BLOCK as u64).unwrap();
    let v = pool.open_volume("a").unwrap();
    let before = journal_bytes(&pool);
    let mut chunk = Vec::new();
    for i in 0..BLOCKS {
        chunk.extend_from_slice(&random_block(seed + i));
    }
    v.write(0, &chunk, false).unwrap();
    v.flush().unwrap();
    let bytes = journal_bytes(&pool) - before;
    (t, bytes)
}

#[test]
fn new_blocks_replay_from_their_data_after_a_kill_and_dedup_again() {
    let (mut t, bytes) = written(1000);
    // 27 bytes a block, and the sectors' headers and parity: well under the 64 a
    // NewObject and a MapSet took.
    assert!(
        bytes < BLOCKS * 40,
        "the journal wrote {bytes} bytes for {BLOCKS} new blocks"
    );
    t.crash(CrashMode::DropAll);
    let pool = t.pool().clone();
    let info = pool.info();
    assert_eq!(
        (info.replay_blocks_read_back, info.replay_blocks_damaged),
        (BLOCKS, 0),
        "the replay read every new block back"
    );
    let mut buf = vec![0u8; BLOCK];
    let v = pool.open_volume("a").unwrap();
    for i in 0..BLOCKS {
        v.read(i * BLOCK as u64, &mut buf).unwrap();
        assert!(buf == random_block(1000 + i), "block {i} after replay");
    }
    assert_eq!(pool.audit().problems, Vec::<String>::new());
    // The fingerprints replay computed find the blocks again: a second volume of
    // the same data stores nothing new.
    pool.wait_index_built();
    let objects = pool.stats().objects;
    pool.create_volume("b", BLOCKS * BLOCK as u64).unwrap();
    let b = pool.open_volume("b").unwrap();
    for i in 0..BLOCKS {
        b.write(i * BLOCK as u64, &random_block(1000 + i), false)
            .unwrap();
    }
    b.flush().unwrap();
    assert_eq!(pool.stats().objects, objects, "the copy was stored again");
    // And they survive the open's checkpoint: a clean reopen reads them whole.
    t.reopen();
    let v = t.pool().open_volume("a").unwrap();
    for i in 0..BLOCKS {
        v.read(i * BLOCK as u64, &mut buf).unwrap();
        assert!(buf == random_block(1000 + i), "block {i} after reopen");
    }
}

#[test]
fn a_new_block_damaged_on_the_drive_before_replay_reads_as_damaged() {
    let (t, _) = written(2000);
    let mut image = t.dev.crash_image(CrashMode::DropAll);
    let target = random_block(2000 + 5);
    let at = image
        .chunks(BLOCK)
        .position(|c| c == &target[..])
        .expect("block 5 stored whole")
        * BLOCK;
    image[at + 100] ^= 0x01;
    let dev = Arc::new(FaultStorage::from_image("data", image));
    let opts = OpenOptions {
        threads: Some(2),
        ..OpenOptions::default()
    };
    let pool = Pool::open_devices(dev as Arc<dyn Storage>, None, &opts).expect("the open");
    assert_eq!(pool.stats().replay_blocks_damaged, 1, "the open counts it");
    let v = pool.open_volume("a").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for i in 0..BLOCKS {
        let read = v.read(i * BLOCK as u64, &mut buf);
        if i == 5 {
            match read {
                Err(EngineError::Corrupt { region, .. }) => assert_eq!(region, "data"),
                other => panic!("block 5 read {other:?}, not a damaged block"),
            }
        } else {
            read.unwrap();
            assert!(buf == random_block(2000 + i), "block {i}");
        }
    }
    // The scrub names it with the volume's bytes.
    let s = scrub_to_end(&pool);
    assert_eq!(s.errors_found, 1, "{s:#?}");
    assert_eq!(
        s.findings[0].volumes,
        vec![format!(
            "volume 'a' bytes 20480..24575 (pool block {})",
            at / BLOCK
        )]
    );
}
