//! A journal sector damaged on the drive after flushed writes and a kill. Replay used
//! to stop at the first sector that failed its checks as if it were the journal's
//! end: one flipped byte in the middle of the live journal silently lost every
//! flushed write after it (they read back as their old contents). Now a bad sector
//! with a whole later commit after it is damage: rebuilt from its group's parity,
//! or, when parity cannot rebuild it, the open refuses the pool naming the sector
//! and `check --repair` replays the rest and lists what was lost.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, FaultStorage, Storage};
use fewerbytes_engine::{EngineError, OpenOptions, Pool, RepairOptions};
use fewerbytes_format::journal::{decode_sector, Record};
use fewerbytes_format::superblock::SuperBlock;
use fewerbytes_format::SECTOR_BYTES;
use rand::{rngs::StdRng, Rng, RngCore, SeedableRng};
use std::sync::Arc;

const DEVICE_BYTES: u64 = 64 << 20;
const CHUNK: usize = 256 << 10;
const CHUNKS: usize = 64;
const OPTS: OpenOptions = OpenOptions {
    threads: Some(1),
    index_memory_bytes: Some(1 << 20),
    no_discard: false,
    hold_index_build: false,
    take_over: None,
    saved_index: fewerbytes_engine::SavedIndex::Off,
};
/// "FBJP": a parity sector's magic, read from the bytes (so this file also builds
/// against an engine without parity sectors, to see it fail there).
const PARITY_MAGIC: [u8; 4] = *b"FBJP";

/// 64 chunks of 256 KiB of noise written to volume "a" (every other one a block at a
/// time), each flushed; then the
/// process is killed (the pool is never closed): the device image, and the chunks.
/// With `dup_every` n, every nth block of a chunk repeats its first block (a
/// duplicate: a MapSet record, so records straddle sectors differently).
fn written_and_killed(seed: u64, dup_every: Option<usize>) -> (Vec<u8>, Vec<Vec<u8>>) {
    let t = create(DEVICE_BYTES, None);
    let pool = t.pool().clone();
    pool.create_volume("a", (CHUNK * CHUNKS) as u64).unwrap();
    let v = pool.open_volume("a").unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut chunks = Vec::new();
    for i in 0..CHUNKS {
        let mut chunk = vec![0u8; CHUNK];
        rng.fill_bytes(&mut chunk);
        if let Some(n) = dup_every {
            let first = chunk[..BLOCK].to_vec();
            for block in chunk.chunks_mut(BLOCK).skip(1).step_by(n) {
                block.copy_from_slice(&first);
            }
        }
        if i % 2 == 0 {
            // Stored new as runs of consecutive blocks (NewStoredRun records).
            v.write((i * CHUNK) as u64, &chunk, false).unwrap();
        } else {
            // A block at a time: a record each.
            for (b, block) in chunk.chunks(BLOCK).enumerate() {
                v.write((i * CHUNK + b * BLOCK) as u64, block, false)
                    .unwrap();
            }
        }
        v.flush().unwrap();
        chunks.push(chunk);
    }
    (t.dev.crash_image(CrashMode::DropAll), chunks)
}

/// Byte offsets in `image` of the live journal sectors (from the replay point, each
/// carrying its expected sequence number and the open generation), in order.
fn live_sectors(image: &[u8]) -> Vec<usize> {
    let sb: SuperBlock = newest_super_block(image);
    let start = sb.journal_start_block as usize * BLOCK;
    let mut live = Vec::new();
    for seq in sb.journal_replay_seq..sb.journal_replay_seq + sb.journal_sectors {
        let at = start + (seq % sb.journal_sectors) as usize * SECTOR_BYTES;
        let sector = &image[at..at + SECTOR_BYTES];
        let whole = match decode_sector(sector, sb.nonce) {
            Ok((h, _)) => h.seq == seq && h.open_gen == sb.open_gen,
            Err(_) => {
                sector[..4] == PARITY_MAGIC
                    && u64::from_le_bytes(sector[8..16].try_into().unwrap()) == seq
            }
        };
        if !whole {
            break;
        }
        live.push(at);
    }
    live
}

/// Set byte `byte` of the sector at `at` to `value` (or, if it holds that, to its
/// complement): a sector that no longer passes its checks.
fn flip(image: &mut [u8], at: usize, byte: usize, value: u8) {
    let b = &mut image[at + byte];
    *b = if *b == value { !value } else { value };
}

fn open_image(image: Vec<u8>) -> Result<Arc<Pool>, EngineError> {
    let dev = Arc::new(FaultStorage::from_image("data", image));
    Pool::open_devices(dev as Arc<dyn Storage>, None, &OPTS)
}

/// Which chunks of volume "a" do not read back as written.
fn chunks_changed(pool: &Arc<Pool>, chunks: &[Vec<u8>]) -> Vec<usize> {
    let v = pool.open_volume("a").unwrap();
    let mut buf = vec![0u8; CHUNK];
    (0..chunks.len())
        .filter(|&i| {
            v.read((i * CHUNK) as u64, &mut buf).unwrap();
            buf != chunks[i]
        })
        .collect()
}

#[test]
fn one_flipped_byte_in_the_middle_of_the_journal_loses_no_flushed_write() {
    let (mut image, chunks) = written_and_killed(1, None);
    let live = live_sectors(&image);
    assert!(
        live.len() > 100,
        "the chunks' records fill {} sectors",
        live.len()
    );
    // The case: sector 40 of 160.
    let at = live[live.len() * 40 / 160];
    flip(&mut image, at, 200, 0xff);
    let pool = open_image(image).expect("one bad journal sector is rebuilt from its parity");
    assert_eq!(
        chunks_changed(&pool, &chunks),
        Vec::<usize>::new(),
        "flushed chunks read back as their old contents"
    );
    assert_eq!(pool.audit().problems, Vec::<String>::new());
}

#[test]
fn two_bad_sectors_of_one_parity_group_refuse_the_open_and_repair_lists_the_loss() {
    let (mut image, chunks) = written_and_killed(2, Some(3));
    let live = live_sectors(&image);
    // Live sector k has sequence number replay_seq + k.
    let replay_seq = newest_super_block(&image).journal_replay_seq;
    // Two neighbouring record sectors of one group (its parity rebuilds only one),
    // from the middle on, the first storing a chunk's first block: the duplicates'
    // MapSet records after them then name an object never stored.
    let record = |at: usize| image[at..at + 4] != PARITY_MAGIC;
    let nonce = newest_super_block(&image).nonce;
    let stores_a_first_block = |at: usize| {
        decode_sector(&image[at..at + SECTOR_BYTES], nonce).is_ok_and(|(_, records)| {
            records.iter().any(|r| {
                matches!(r, Record::NewStored { lbn, .. } | Record::NewStoredRun { lbn, .. }
                    if *lbn % (CHUNK / BLOCK) as u64 == 0)
            })
        })
    };
    let k = (live.len() / 2..live.len() - 1)
        .find(|&k| record(live[k]) && record(live[k + 1]) && stores_a_first_block(live[k]))
        .expect("a sector storing a chunk's first block");
    flip(&mut image, live[k], 100, 0xff);
    flip(&mut image, live[k + 1], 100, 0xff);
    let first_seq = replay_seq + k as u64;

    for read_only in [false, true] {
        let dev = Arc::new(FaultStorage::from_image("data", image.clone()));
        let opened = if read_only {
            Pool::open_devices_read_only(dev as Arc<dyn Storage>, None, &OPTS)
        } else {
            Pool::open_devices(dev as Arc<dyn Storage>, None, &OPTS)
        };
        match opened {
            Err(EngineError::Corrupt { region, reason, .. }) => {
                assert_eq!(region, "journal");
                assert!(
                    reason.contains(&format!("seq {first_seq}")),
                    "the error names the sector: {reason}"
                );
            }
            Err(e) => panic!("another error: {e}"),
            Ok(_) => {
                panic!("a damaged journal opened (read_only {read_only}) as if it ended there")
            }
        }
    }

    let dev = Arc::new(FaultStorage::from_image("data", image));
    let pool = Pool::open_devices_for_repair(dev.clone() as Arc<dyn Storage>, None, &OPTS)
        .expect("an open for repair goes on");
    let report = pool
        .repair(
            &RepairOptions {
                apply: true,
                verify_data: false,
            },
            &|_, _, _| {},
        )
        .unwrap();
    let text = report.repairs.join("\n");
    assert!(
        text.contains(&format!("journal sector seq {first_seq}")),
        "the repair names the lost sector: {text}"
    );
    // Every block reads as written, or as before (zeros: the volume was new); each
    // block a repair made read as zeros is named with its bytes.
    let v = pool.open_volume("a").unwrap();
    let mut block = vec![0u8; BLOCK];
    let mut lost_blocks = 0;
    for lbn in 0..(CHUNK * CHUNKS / BLOCK) as u64 {
        v.read(lbn * BLOCK as u64, &mut block).unwrap();
        let want = &chunks[lbn as usize * BLOCK / CHUNK]
            [(lbn as usize * BLOCK) % CHUNK..(lbn as usize * BLOCK) % CHUNK + BLOCK];
        if block != want {
            assert!(block.iter().all(|&b| b == 0), "block {lbn} reads garbage");
            lost_blocks += 1;
        }
    }
    assert!(lost_blocks > 0, "two sectors of block changes were lost");
    assert!(
        lost_blocks < 64,
        "only what the two sectors held is lost, not every write after them: {lost_blocks} blocks"
    );
    let named = text.matches("volume a: block ").count();
    assert!(
        named > 0,
        "blocks whose object was in a lost sector are named: {text}"
    );
    assert!(named <= lost_blocks, "{text}");
    eprintln!("{lost_blocks} blocks lost; the repair said:\n{text}");
    pool.close().unwrap();
    let pool = open_image(dev.crash_image(CrashMode::DropAll)).expect("repaired pool opens");
    assert_eq!(pool.audit().problems, Vec::<String>::new());
}

/// The seed of the fuzz run: `FEWERBYTES_SEED` or a fixed one.
fn fuzz_seed() -> u64 {
    std::env::var("FEWERBYTES_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(26)
}

#[test]
fn a_flipped_byte_in_any_live_journal_sector_is_rebuilt_or_refused_never_silent() {
    let seed = fuzz_seed();
    let (image, chunks) = written_and_killed(seed, None);
    let live = live_sectors(&image);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut refused = 0;
    for (n, &at) in live.iter().enumerate() {
        let mut damaged = image.clone();
        let byte = rng.gen_range(0..SECTOR_BYTES);
        let value: u8 = rng.gen();
        flip(&mut damaged, at, byte, value);
        // Read-only: the open replays the journal the same way and skips its
        // checkpoint (quicker).
        let dev = Arc::new(FaultStorage::from_image("data", damaged));
        match Pool::open_devices_read_only(dev as Arc<dyn Storage>, None, &OPTS) {
            Ok(pool) => {
                let changed = chunks_changed(&pool, &chunks);
                assert!(
                    changed.is_empty(),
                    "FEWERBYTES_SEED={seed}: byte {byte} of live journal sector {n} of {} \
                     set to {value:#x}: the open went on and chunks {changed:?} lost flushed \
                     writes",
                    live.len()
                );
            }
            Err(EngineError::Corrupt {
                region: "journal", ..
            }) => refused += 1,
            Err(e) => panic!("FEWERBYTES_SEED={seed}: sector {n}: {e}"),
        }
    }
    // With parity every single bad sector is rebuilt.
    assert_eq!(refused, 0, "FEWERBYTES_SEED={seed}");
}
