//! Compression per pool: zstd stores fewer bytes than LZ4, a pool holding both
//! codecs' fragments reads back after reopening, a corrupt zstd fragment is a
//! corruption error, and random data is stored whole.

mod common;

use common::*;
use fewerbytes_engine::storage::{CrashMode, FaultStorage, Storage};
use fewerbytes_engine::{Compression, CreateOptions, EngineError, OpenOptions, Pool};
use rand::{rngs::StdRng, Rng, RngCore, SeedableRng};
use std::sync::Arc;

const ZSTD: Compression = Compression::Zstd { level: 3 };
const VOLUME_BYTES: u64 = 16 << 20;

fn pool_with(compression: Compression) -> TestPool {
    let options = CreateOptions {
        compression,
        ..Default::default()
    };
    let t = create_with(128 << 20, None, &options);
    t.pool().create_volume("v", VOLUME_BYTES).expect("volume");
    t
}

/// Text-like blocks: words of a small vocabulary with numbers between them, as
/// logs and configuration files are. LZ4 finds the repeated words; zstd also
/// entropy-codes what is left.
fn text_block(rng: &mut StdRng) -> Vec<u8> {
    const WORDS: [&str; 24] = [
        "error", "warning", "volume", "pool", "block", "flush", "kernel", "systemd", "network",
        "started", "stopped", "session", "user", "root", "disk", "mount", "device", "service",
        "the", "a", "of", "to", "in", "for",
    ];
    let mut out = Vec::with_capacity(BLOCK + 32);
    while out.len() < BLOCK {
        let word = WORDS[rng.gen_range(0..WORDS.len())];
        out.extend_from_slice(word.as_bytes());
        out.extend_from_slice(format!(" {} ", rng.gen_range(0..100_000u32)).as_bytes());
    }
    out.truncate(BLOCK);
    out
}

fn write_blocks(t: &TestPool, first_lbn: u64, blocks: &[Vec<u8>]) {
    let v = t.pool().open_volume("v").expect("open volume");
    for (i, b) in blocks.iter().enumerate() {
        v.write((first_lbn + i as u64) * BLOCK as u64, b, false)
            .expect("write");
    }
    t.pool().flush().expect("flush");
}

fn assert_reads_back(t: &TestPool, first_lbn: u64, blocks: &[Vec<u8>], case: &str) {
    let v = t.pool().open_volume("v").expect("open volume");
    let mut got = vec![0u8; BLOCK];
    for (i, b) in blocks.iter().enumerate() {
        v.read((first_lbn + i as u64) * BLOCK as u64, &mut got)
            .expect("read");
        assert!(got == *b, "{case}: block {i} reads back different bytes");
    }
}

#[test]
fn zstd_stores_fewer_bytes_than_lz4_on_text() {
    let mut rng = StdRng::seed_from_u64(14);
    let blocks: Vec<Vec<u8>> = (0..512).map(|_| text_block(&mut rng)).collect();
    let mut stored = Vec::new();
    for compression in [Compression::Lz4, ZSTD, Compression::None] {
        let t = pool_with(compression);
        write_blocks(&t, 0, &blocks);
        assert_reads_back(&t, 0, &blocks, &compression.to_string());
        let stats = t.pool().stats();
        assert_eq!(stats.compression, compression);
        eprintln!(
            "{compression}: {} fragments, {} bytes compressed, {} whole blocks, {} bytes of data blocks",
            stats.compressed_fragments, stats.compressed_bytes, stats.whole_blocks, stats.space.stored_bytes
        );
        stored.push(stats.space.stored_bytes);
    }
    let (lz4, zstd, none) = (stored[0], stored[1], stored[2]);
    assert_eq!(none, 512 * BLOCK as u64, "none stores every block whole");
    assert!(lz4 < none, "LZ4 saves nothing on text: {lz4} bytes");
    // A user sees it in `stats`: zstd's data takes at least a tenth less room.
    assert!(
        zstd * 10 <= lz4 * 9,
        "zstd stores {zstd} bytes, LZ4 {lz4}: not a tenth fewer"
    );
}

#[test]
fn a_pool_holding_both_codecs_reads_back_after_reopen() {
    let mut t = pool_with(Compression::Lz4);
    let mut rng = StdRng::seed_from_u64(7);
    let mut lz4_blocks: Vec<Vec<u8>> = (0..200).map(|_| text_block(&mut rng)).collect();
    lz4_blocks.extend((0..56).map(|_| {
        let mut b = vec![0u8; BLOCK];
        compressible(&mut rng, &mut b);
        b
    }));
    write_blocks(&t, 0, &lz4_blocks);
    t.pool().set_compression(ZSTD).expect("set compression");
    let zstd_blocks: Vec<Vec<u8>> = (0..256).map(|_| text_block(&mut rng)).collect();
    write_blocks(&t, 1000, &zstd_blocks);
    let before = t.pool().stats();
    assert_eq!(before.compressed_fragments, 512);
    assert_eq!(before.zstd_fragments, 256);

    t.reopen();
    assert_eq!(t.pool().info().compression, ZSTD, "the setting survives");
    assert_reads_back(&t, 0, &lz4_blocks, "LZ4 fragments after reopen");
    assert_reads_back(&t, 1000, &zstd_blocks, "zstd fragments after reopen");
    // A crash that keeps nothing unflushed: the same, from the journal and checkpoint.
    t.crash(CrashMode::DropAll);
    assert_reads_back(&t, 0, &lz4_blocks, "LZ4 fragments after a crash");
    assert_reads_back(&t, 1000, &zstd_blocks, "zstd fragments after a crash");
    // Back to LZ4: old zstd fragments still read, new blocks are LZ4.
    t.pool()
        .set_compression(Compression::Lz4)
        .expect("set back");
    write_blocks(&t, 2000, &zstd_blocks[..10]);
    t.pool().compact().expect("compact");
    t.reopen();
    assert_reads_back(&t, 1000, &zstd_blocks, "zstd fragments after compaction");
    assert_reads_back(&t, 2000, &zstd_blocks[..10], "dedup of zstd fragments");
    let audit = t.pool().audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
}

#[test]
fn random_data_is_stored_whole_without_a_codec() {
    for compression in [Compression::Lz4, ZSTD] {
        let t = pool_with(compression);
        let mut rng = StdRng::seed_from_u64(3);
        let blocks: Vec<Vec<u8>> = (0..64)
            .map(|_| {
                let mut b = vec![0u8; BLOCK];
                rng.fill_bytes(&mut b);
                b
            })
            .collect();
        write_blocks(&t, 0, &blocks);
        let stats = t.pool().stats();
        assert_eq!(stats.whole_blocks, 64, "{compression}");
        assert_eq!(stats.compressed_fragments, 0, "{compression}");
        assert_reads_back(&t, 0, &blocks, &compression.to_string());
    }
}

/// The zstd frame's magic number, as it starts every zstd fragment on the device.
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

#[test]
fn a_corrupt_zstd_fragment_is_a_corruption_error_naming_it() {
    let mut t = pool_with(ZSTD);
    let mut rng = StdRng::seed_from_u64(11);
    let block = text_block(&mut rng);
    write_blocks(&t, 5, std::slice::from_ref(&block));
    t.reopen();
    let pool = t.pool.take().expect("open");
    pool.close().expect("close");
    let mut image = t.dev.crash_image(CrashMode::KeepAll);
    let data_offset = newest_super_block(&image).data_offset_bytes as usize;
    let at = image[data_offset..]
        .windows(4)
        .position(|w| w == ZSTD_MAGIC)
        .expect("a zstd fragment in the data region")
        + data_offset;
    image[at..at + 4].copy_from_slice(b"junk");
    let pool = Pool::open_devices(
        Arc::new(FaultStorage::from_image("data", image)) as Arc<dyn Storage>,
        None,
        &OpenOptions {
            threads: Some(2),
            ..Default::default()
        },
    )
    .expect("open: fragments are read when asked for");
    let v = pool.open_volume("v").expect("volume");
    let mut got = vec![0u8; BLOCK];
    match v.read(5 * BLOCK as u64, &mut got) {
        Err(EngineError::Corrupt {
            region: "data",
            reason,
            ..
        }) => assert!(
            reason.contains("zstd fragment does not decode")
                && reason.contains("fragment in data block"),
            "{reason}"
        ),
        other => panic!("a corrupt zstd fragment read as {other:?}"),
    }
    // The other blocks of the volume (unwritten: zeros) still read.
    v.read(0, &mut got).expect("an unwritten block reads");
}
