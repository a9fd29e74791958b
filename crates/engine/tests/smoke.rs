//! Basic behaviour a user would notice: data reads back, zeros cost nothing,
//! duplicates cost nothing, clones share, deletes free, reopen keeps everything.

mod common;
use common::*;
use fewerbytes_engine::storage::CrashMode;

#[test]
fn written_data_reads_back_after_reopen_and_crash() {
    let mut t = create(64 << 20, None);
    t.pool().create_volume("a", 4 << 20).unwrap();
    let vol = t.pool().open_volume("a").unwrap();
    let mut mix = Mix::new(1);
    let blocks: Vec<Vec<u8>> = (0..200).map(|_| mix.next_block()).collect();
    for (i, b) in blocks.iter().enumerate() {
        vol.write((i * BLOCK) as u64, b, false).unwrap();
    }
    // A partial write at an odd sector.
    vol.write(512 * 3, &[0xab; 1024], false).unwrap();
    let mut expect0 = blocks[0].clone();
    expect0[1536..2560].fill(0xab);
    vol.flush().unwrap();
    drop(vol);
    let check = |t: &TestPool| {
        let vol = t.pool().open_volume("a").unwrap();
        let mut buf = vec![0u8; BLOCK];
        vol.read(0, &mut buf).unwrap();
        assert_eq!(buf, expect0);
        for (i, b) in blocks.iter().enumerate().skip(1) {
            vol.read((i * BLOCK) as u64, &mut buf).unwrap();
            assert_eq!(&buf, b, "block {i}");
        }
        let audit = t.pool().audit();
        assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    };
    check(&t);
    t.reopen();
    check(&t);
    t.crash(CrashMode::DropAll);
    check(&t);
}

#[test]
fn zeros_and_duplicates_store_nothing_new() {
    let t = create(64 << 20, None);
    let p = t.pool();
    p.create_volume("a", 8 << 20).unwrap();
    let vol = p.open_volume("a").unwrap();
    vol.write(0, &vec![0u8; 1 << 20], false).unwrap();
    vol.flush().unwrap();
    assert_eq!(
        p.stats().space.stored_bytes,
        0,
        "zero blocks must not be stored"
    );
    let mut block = vec![0u8; BLOCK];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut block);
    vol.write(0, &block, false).unwrap();
    let used = p.stats().space.stored_bytes;
    for i in 1..100u64 {
        vol.write(i * BLOCK as u64, &block, false).unwrap();
    }
    assert_eq!(
        p.stats().space.stored_bytes,
        used,
        "duplicates must not add data"
    );
    // Compressible blocks, and random ones, stored through the same volume.
    for i in 100..120u64 {
        let text = format!("block {i} of a compressible run ").repeat(150);
        vol.write(i * BLOCK as u64, &text.as_bytes()[..BLOCK], false)
            .unwrap();
        rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut block);
        vol.write((i + 100) * BLOCK as u64, &block, false).unwrap();
    }
    // One volume did every write: its counters are the pool's.
    let stats = p.stats();
    let (pool_counters, vol_counters) = (stats.counters, stats.volumes[0].counters);
    assert!(pool_counters.compressed_writes >= 20 && pool_counters.uncompressed_writes >= 21);
    for (what, pool_n, vol_n) in [
        (
            "blocks written",
            pool_counters.blocks_written,
            vol_counters.blocks_written,
        ),
        (
            "zero blocks",
            pool_counters.zero_blocks_written,
            vol_counters.zero_blocks_written,
        ),
        (
            "dedup hits",
            pool_counters.dedup_hits,
            vol_counters.dedup_hits,
        ),
        (
            "advice valid",
            pool_counters.advice_valid,
            vol_counters.advice_valid,
        ),
        (
            "advice stale",
            pool_counters.advice_stale,
            vol_counters.advice_stale,
        ),
        (
            "compressed",
            pool_counters.compressed_writes,
            vol_counters.compressed_writes,
        ),
        (
            "uncompressed",
            pool_counters.uncompressed_writes,
            vol_counters.uncompressed_writes,
        ),
        (
            "guest bytes",
            pool_counters.guest_bytes_written,
            vol_counters.guest_bytes_written,
        ),
    ] {
        assert_eq!(
            pool_n, vol_n,
            "{what}: the pool counted {pool_n}, the volume {vol_n}"
        );
    }
    let used = p.stats().space.stored_bytes;
    p.clone_volume("a", "b").unwrap();
    assert_eq!(
        p.stats().space.stored_bytes,
        used,
        "a clone must not add data"
    );
    drop(vol);
    p.delete_volume("a", false).unwrap();
    p.delete_volume("b", false).unwrap();
    assert!(p.audit().problems.is_empty());
}

#[test]
fn a_rename_moves_nothing_is_durable_on_return_and_refuses_an_open_volume() {
    let mut t = create(64 << 20, None);
    t.pool().create_volume("old", 4 << 20).unwrap();
    t.pool().create_volume("taken", 4 << 20).unwrap();
    let vol = t.pool().open_volume("old").unwrap();
    let block = Mix::new(7).next_block();
    vol.write(0, &block, false).unwrap();
    vol.flush().unwrap();
    let err = t.pool().rename_volume("old", "new").unwrap_err();
    assert!(err.to_string().contains("disconnect"), "{err}");
    drop(vol);
    let stored = t.pool().stats().objects;
    assert!(t.pool().rename_volume("old", "taken").is_err());
    assert!(t.pool().rename_volume("old", "..").is_err());
    t.pool().rename_volume("old", "new").unwrap();
    assert_eq!(t.pool().stats().objects, stored, "nothing stored again");
    // Durable on return: a crash that keeps nothing unflushed keeps the new name.
    t.crash(CrashMode::DropAll);
    assert!(t.pool().open_volume("old").is_err());
    let vol = t.pool().open_volume("new").unwrap();
    let mut buf = vec![0u8; BLOCK];
    vol.read(0, &mut buf).unwrap();
    assert_eq!(buf, block);
    assert!(t.pool().audit().problems.is_empty());
}
