//! Writes the seed corpora under `fuzz/corpus/<target>/`: valid structures made by
//! the encoders and the engine, a tiny pool image (with and without a journal to
//! replay), and recorded NBD handshakes with a few requests.
//!
//!     cargo run --release --no-default-features --bin make_seeds   # from fuzz/
//!
//! The pool's nonce and key are random, so a run rewrites the pool seeds with other
//! bytes of the same shape; the committed corpus is one such run.

use fewerbytes_engine::{CreateOptions, OpenOptions, Pool};
use fewerbytes_format::journal::SECTOR_MAGIC;
use fewerbytes_format::location::{Codec, Location, MapEntry, ObjectId};
use fewerbytes_format::page::{decode_page, PageKind, PAGE_MAGIC};
use fewerbytes_format::superblock::{DataLabel, SuperBlock};
use fewerbytes_format::{BLOCK_BYTES, SECTOR_BYTES};
use fewerbytes_fuzz::nbd::{handshake, sample_requests, Mode};
use fewerbytes_fuzz::{u32_at, u64_at, PoolImage, SparseStorage, IMAGE_READ_VOLUMES, IMAGE_RESEAL};
use fewerbytes_storage::Storage;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const POOL_BYTES: u64 = 64 << 20;

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let (journaled, clean) = make_pool();
    let mut w = Seeds { root };

    for (name, blocks) in [("journaled", &journaled), ("clean", &clean)] {
        for flags in [0, IMAGE_RESEAL | IMAGE_READ_VOLUMES] {
            let image = PoolImage {
                flags,
                device_bytes: POOL_BYTES,
                blocks: blocks.clone(),
            };
            w.put(
                "pool_open",
                &format!("{name}-flags{flags}"),
                &image.encode(),
            );
        }
    }

    for (n, block) in &clean {
        let magic = u64_at(&block[..], 0);
        if magic == fewerbytes_format::superblock::SUPER_MAGIC {
            let sb = SuperBlock::decode(&block[..]).expect("the pool's super block decodes");
            w.put("superblock", &format!("block{n}"), &flagged(1, &block[..]));
            w.put(
                "superblock",
                &format!("block{n}-raw"),
                &flagged(0, &block[..]),
            );
            let _ = sb;
        } else if u32_at(&block[..], 0) == PAGE_MAGIC {
            let kind = block[9];
            let flags = 1 | 2 | 32 | ((kind.wrapping_sub(1) & 7) << 2);
            w.put(
                "page",
                &format!("slot-block{n}-kind{kind}"),
                &flagged(flags, &block[..]),
            );
            if kind == PageKind::Catalog as u8 {
                let slot = u64_at(&block[..], 24);
                let nonce = u64_at(&block[..], 16);
                let (h, payload) = decode_page(&block[..], PageKind::Catalog, nonce, slot)
                    .expect("the pool's catalog page decodes");
                w.put(
                    "catalog",
                    &format!("block{n}"),
                    &payload[..h.count as usize],
                );
            }
        }
    }
    let mut label = [0u8; BLOCK_BYTES];
    DataLabel {
        nonce: 0x1234_5678_9abc_def0,
        metadata_path: "/var/lib/fewerbytes/meta.pool".into(),
    }
    .encode(&mut label);
    w.put("superblock", "data-label", &flagged(1, &label));

    let mut sectors = 0;
    for (n, block) in &journaled {
        for (i, sector) in block.chunks(SECTOR_BYTES).enumerate() {
            if u32_at(sector, 0) == SECTOR_MAGIC && sectors < 8 {
                w.put(
                    "journal_sector",
                    &format!("block{n}-sector{i}"),
                    &flagged(3, sector),
                );
                sectors += 1;
            }
        }
    }
    assert!(sectors > 0, "the journaled image holds journal sectors");

    let words: Vec<u64> = vec![
        MapEntry::Unmapped.encode(),
        MapEntry::Zero.encode(),
        MapEntry::Object(ObjectId(7)).encode(),
        Location::Block { pbn: 12345 }.encode(),
        Location::Fragment {
            addr_bytes: 4000,
            len_bytes: 200,
            codec: Codec::Lz4,
        }
        .encode(),
        Location::Fragment {
            addr_bytes: (1 << 48) - 1,
            len_bytes: 4095,
            codec: Codec::Lz4,
        }
        .encode(),
    ];
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    w.put("location", "words", &bytes);

    for (i, mode) in [
        Mode::Simple,
        Mode::Structured,
        Mode::StructuredWithMeta,
        Mode::Extended,
    ]
    .into_iter()
    .enumerate()
    {
        let mut conversation = handshake(mode);
        conversation.extend(sample_requests(mode));
        w.put("nbd_handshake", &format!("{mode:?}"), &conversation);
        let mut requests = vec![i as u8];
        requests.extend(sample_requests(mode));
        w.put("nbd_requests", &format!("{mode:?}"), &requests);
    }
    w.put("nbd_handshake", "export-name", &old_style_export_name());
}

/// A pool with two volumes holding random, duplicate, zero and compressible blocks:
/// its image after a flush (the journal holds records to replay) and after a clean close.
type Blocks = Vec<(u64, Box<[u8; BLOCK_BYTES]>)>;
fn make_pool() -> (Blocks, Blocks) {
    let storage = Arc::new(SparseStorage::new("seed.pool", POOL_BYTES));
    let opts = CreateOptions {
        path: "seed.pool".into(),
        ..CreateOptions::default()
    };
    Pool::format(storage.clone() as Arc<dyn Storage>, None, None, &opts).expect("format");
    let open = OpenOptions {
        threads: Some(1),
        ..OpenOptions::default()
    };
    let pool = Pool::open_devices(storage.clone(), None, &open).expect("open the new pool");
    pool.create_volume("vm-100-disk-0", 1 << 20)
        .expect("create volume");
    pool.create_volume("empty", 64 << 10)
        .expect("create volume");
    let volume = pool.open_volume("vm-100-disk-0").expect("open volume");
    let mut random = [0u8; BLOCK_BYTES];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for b in random.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let text: Vec<u8> = b"fewerbytes stores each block once. "
        .iter()
        .copied()
        .cycle()
        .take(BLOCK_BYTES)
        .collect();
    volume.write(0, &random, false).expect("write");
    volume
        .write(4096, &random, false)
        .expect("write a duplicate");
    volume
        .write(8192, &[0u8; BLOCK_BYTES], false)
        .expect("write zeros");
    volume
        .write(12288, &text, false)
        .expect("write compressible");
    volume
        .write(16384, &text[..2048], true)
        .expect("partial FUA write");
    volume.trim(4096, 4096, false).expect("trim");
    pool.flush().expect("flush");
    let journaled = storage.nonzero_blocks();
    drop(volume);
    pool.close().expect("close");
    (journaled, storage.nonzero_blocks())
}

/// A client that uses the oldest fixed-newstyle ending, NBD_OPT_EXPORT_NAME.
fn old_style_export_name() -> Vec<u8> {
    use fewerbytes_nbd::protocol::*;
    let mut out = Vec::new();
    out.extend_from_slice(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
    out.extend_from_slice(&1u32.to_be_bytes());
    out.extend_from_slice(b"b");
    out.extend(sample_requests(Mode::Simple));
    out
}

fn flagged(flags: u8, bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![flags];
    out.extend_from_slice(bytes);
    out
}

struct Seeds {
    root: PathBuf,
}

impl Seeds {
    fn put(&mut self, target: &str, name: &str, bytes: &[u8]) {
        let dir = self.root.join(target);
        std::fs::create_dir_all(&dir).expect("corpus directory");
        let path: &Path = &dir.join(format!("seed-{name}"));
        std::fs::write(path, bytes).expect("write a seed");
        println!("{} ({} bytes)", path.display(), bytes.len());
    }
}
