//! Decode of a committed pool image of format version 1. The image was made by
//! `make_fixture` below (run it by hand when the format version changes, and keep
//! the old fixture: new code must still read it). It holds a volume written with
//! the seed mix, a clone of it, a trimmed range, and records still in the journal,
//! so opening it exercises the super block, catalog, directories, map and object
//! pages, journal replay, and fragment and whole-block reads.
//!
//! File layout: repeated (u64 little-endian byte offset, 4096 bytes) for every
//! non-zero block of a 64 MiB device.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, FaultStorage, Storage};
use fewerbytes_engine::{OpenOptions, Pool};
use std::sync::Arc;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/pool-v1.blocks");
const DEVICE_BYTES: u64 = 64 << 20;

fn expected_blocks() -> Vec<Vec<u8>> {
    let mut mix = Mix::new(2026);
    (0..512).map(|_| mix.next_block()).collect()
}

#[test]
#[ignore = "writes the fixture; run by hand with --ignored when the format version changes"]
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
    std::fs::write(FIXTURE, out).unwrap();
}

#[test]
fn format_v1_fixture_opens_and_reads_back() {
    let raw = std::fs::read(FIXTURE).expect("fixture present");
    let mut image = vec![0u8; DEVICE_BYTES as usize];
    for rec in raw.chunks(8 + BLOCK) {
        let at = u64::from_le_bytes(rec[..8].try_into().unwrap()) as usize;
        image[at..at + BLOCK].copy_from_slice(&rec[8..]);
    }
    let dev = Arc::new(FaultStorage::from_image("fixture", image));
    let pool = Pool::open_devices(dev as Arc<dyn Storage>, None, &OpenOptions::default())
        .expect("the v1 fixture opens");
    let names: Vec<String> = pool.list_volumes().into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["base", "clone"]);
    let expected = expected_blocks();
    let base = pool.open_volume("base").unwrap();
    let clone = pool.open_volume("clone").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for (i, b) in expected.iter().enumerate() {
        base.read((i * BLOCK) as u64, &mut buf).unwrap();
        assert_eq!(&buf, b, "base block {i}");
        clone.read((i * BLOCK) as u64, &mut buf).unwrap();
        let want = match i {
            0..64 => vec![0u8; BLOCK],
            64 => vec![0x5a; BLOCK],
            _ => b.clone(),
        };
        assert_eq!(buf, want, "clone block {i}");
    }
    assert!(pool.audit().problems.is_empty());
}
