//! Writes a drive acknowledged but lost, or put at the wrong place, during a
//! checkpoint (format version 2 and 3; in 3 a lost write of a directory page's first
//! copy is read from its second, and one of its second copy, which an open does not
//! read, is found and rewritten by the scrub). Each metadata page's crc and generation
//! are held by its parent, so a stale page left in a slot, or a page missing from
//! its slot, is detected at the next open; it is never loaded, and no read ever
//! returns stale data. The open then takes the older super block copy, whose pages
//! are whole (deferred frees), with the journal since its replay point: every write
//! reads back, and the newest copy counts as damaged (`metadata_copies_repaired`).
//! Where the older copy is hit too, the open fails with corruption naming the
//! newest's page region and block, or, for a block-map page or map directory page,
//! opens with the range it maps refused as damaged (`map_damage.rs`), naming the
//! same block.
//!
//! Each case runs a workload (writes, a close and reopen, random overwrites), then
//! installs the fault at write k of the closing checkpoint, for every k, and reopens.

mod common;
use common::*;
use fewerbytes_engine::storage::{
    CrashMode, FaultPlan, FaultStorage, IoCounters, Storage, StorageError,
};
use fewerbytes_engine::{CreateOptions, EngineError, OpenOptions, Pool};
use fewerbytes_format::page::{decode_page, encode_page, PageHeader, PageKind};
use fewerbytes_format::superblock::SuperBlock;
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::Arc;

const DEVICE_BYTES: u64 = 64 << 20;
const OPTS: OpenOptions = OpenOptions {
    threads: Some(1),
    index_memory_bytes: None,
    no_discard: false,
    hold_index_build: false,
    take_over: None,
    saved_index: fewerbytes_engine::SavedIndex::Off,
};

/// A `FaultStorage` that remembers the offset of every write, so a test knows what
/// write k was.
struct Recording {
    inner: Arc<FaultStorage>,
    offsets: Mutex<Vec<u64>>,
}

impl Storage for Recording {
    fn read_at(&self, buf: &mut [u8], offset_bytes: u64) -> Result<(), StorageError> {
        self.inner.read_at(buf, offset_bytes)
    }
    fn write_at(&self, buf: &[u8], offset_bytes: u64) -> Result<(), StorageError> {
        self.offsets.lock().push(offset_bytes);
        self.inner.write_at(buf, offset_bytes)
    }
    fn flush(&self) -> Result<(), StorageError> {
        self.inner.flush()
    }
    fn len_bytes(&self) -> u64 {
        self.inner.len_bytes()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn counters(&self) -> &IoCounters {
        self.inner.counters()
    }
}

/// What each volume's blocks should read as.
type Model = BTreeMap<(&'static str, u64), Vec<u8>>;

/// Make a pool, write a workload with a checkpoint in the middle and random
/// overwrites after it, flush; then install `fault` and close (the closing
/// checkpoint meets it). Returns the device, the model, and the offsets of the
/// closing checkpoint's writes (write k of the plan is entry k).
fn run(fault: impl Fn(u64) -> FaultPlan, k: u64) -> (Arc<FaultStorage>, Model, Vec<u64>) {
    let dev = Arc::new(FaultStorage::new("data", DEVICE_BYTES));
    let rec = Arc::new(Recording {
        inner: dev.clone(),
        offsets: Mutex::new(Vec::new()),
    });
    Pool::format(
        rec.clone() as Arc<dyn Storage>,
        None,
        None,
        &CreateOptions::default(),
    )
    .unwrap();
    let pool = Pool::open_devices(rec.clone() as Arc<dyn Storage>, None, &OPTS).unwrap();
    let mut model = Model::new();
    let mut mix = Mix::new(11);
    pool.create_volume("a", 4 << 20).unwrap();
    let a = pool.open_volume("a").unwrap();
    for lbn in 0..600u64 {
        let b = mix.next_block();
        a.write(lbn * BLOCK as u64, &b, false).unwrap();
        model.insert(("a", lbn), b);
    }
    drop(a);
    pool.create_volume("b", 2 << 20).unwrap();
    // Reopened, the page store hands out slots from its start again: the closing
    // checkpoint's pages go to slots that hold older, valid pages, which a lost write
    // leaves in place (they pass their own checks, not their parent's).
    pool.close().unwrap();
    let pool = Pool::open_devices(rec.clone() as Arc<dyn Storage>, None, &OPTS).unwrap();
    let a = pool.open_volume("a").unwrap();
    let b = pool.open_volume("b").unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    for _ in 0..150 {
        let lbn = rng.gen_range(0..1024u64);
        let block = mix.next_block();
        a.write(lbn * BLOCK as u64, &block, false).unwrap();
        model.insert(("a", lbn), block);
        let lbn = rng.gen_range(0..512u64);
        let block = mix.next_block();
        b.write(lbn * BLOCK as u64, &block, false).unwrap();
        model.insert(("b", lbn), block);
    }
    a.trim(900 * BLOCK as u64, 20 * BLOCK as u64, false)
        .unwrap();
    for lbn in 900..920 {
        model.remove(&("a", lbn));
    }
    a.flush().unwrap();
    drop((a, b));
    let start = rec.offsets.lock().len();
    dev.set_plan(fault(k));
    pool.close().unwrap();
    let offsets = rec.offsets.lock()[start..].to_vec();
    (dev, model, offsets)
}

/// Every block reads back as the model says, or fails as corrupt data; never other
/// bytes. Returns whether every read succeeded.
fn assert_no_stale_reads(pool: &Arc<Pool>, model: &Model, case: &str) -> bool {
    let mut clean = true;
    let mut buf = vec![0u8; BLOCK];
    for (name, blocks) in [("a", 1024u64), ("b", 512)] {
        let vol = pool.open_volume(name).unwrap();
        for lbn in 0..blocks {
            let want = model
                .get(&(name, lbn))
                .cloned()
                .unwrap_or_else(|| vec![0; BLOCK]);
            match vol.read(lbn * BLOCK as u64, &mut buf) {
                Ok(()) => assert!(buf == want, "{case}: {name} block {lbn} reads stale bytes"),
                Err(EngineError::Corrupt { region: "data", .. }) => clean = false,
                // A map page both super block copies lost: its blocks are refused.
                Err(EngineError::Damaged { .. }) => clean = false,
                Err(e) => panic!("{case}: {name} block {lbn}: {e}"),
            }
        }
    }
    clean
}

const PAGE_REGIONS: [&str; 7] = [
    "block map page",
    "slab object page",
    "directory page",
    "catalog page",
    "object count page",
    "fingerprint page",
    "counters page",
];

/// Reopen after the fault and check what the module's header promises. Returns
/// whether write k was a metadata page write.
fn check_case(fault_name: &str, fault: impl Fn(u64) -> FaultPlan, k: u64) -> Option<bool> {
    let (dev, model, offsets) = run(&fault, k);
    let at = *offsets.get(k as usize)?;
    let image = dev.crash_image(CrashMode::KeepAll);
    let sb = newest_super_block(&image);
    let block = at / BLOCK as u64;
    let is_page = (sb.pages_start_block..sb.pages_start_block + sb.page_slots).contains(&block);
    let case = format!("{fault_name} at write {k} (block {block})");
    let reopened = Pool::open_devices(
        Arc::new(FaultStorage::from_image("data", image)) as Arc<dyn Storage>,
        None,
        &OPTS,
    );
    let allowed_blocks: Vec<u64> = match fault(k).misdirect_write {
        Some((_, to)) => vec![block, to / BLOCK as u64],
        None => vec![block],
    };
    match reopened {
        Err(EngineError::Corrupt {
            region,
            block: named,
            reason,
            ..
        }) => {
            if is_page {
                eprintln!("{case}: corrupt {region} at block {named}: {reason}");
                assert!(
                    PAGE_REGIONS.contains(&region),
                    "{case}: region {region} ({reason})"
                );
                assert!(
                    allowed_blocks.contains(&named),
                    "{case}: names block {named} ({region}: {reason})"
                );
            }
        }
        Err(e) => panic!("{case}: not reported as corruption: {e}"),
        Ok(pool) => {
            // Where the older copy is hit too, a lost map page (or map directory
            // page) of the newest costs only the range it maps, refused by reads.
            let damaged = pool.damaged_ranges();
            for range in &damaged {
                eprintln!("{case}: {}", range.describe());
                assert!(
                    allowed_blocks.contains(&range.block),
                    "{case}: damage named at block {} ({})",
                    range.block,
                    range.reason
                );
            }
            if is_page && damaged.is_empty() && pool.stats().metadata_copies_repaired == 0 {
                // The open reads a directory page's first copy only: a lost write of
                // its second copy is found by the scrub, which rewrites the page.
                let s = scrub_to_end(&pool);
                assert!(
                    s.findings.iter().any(|f| f.region == "directory"
                        && f.what.contains("its second copy")
                        && f.repaired),
                    "{case}: a lost or misdirected page write went undetected (the open \
                     did not fall back to the older super block copy, nor read a \
                     directory page's second copy, and the scrub found no bad second \
                     copy): {s:#?}"
                );
            }
            if assert_no_stale_reads(&pool, &model, &case) {
                let audit = pool.audit();
                assert!(audit.problems.is_empty(), "{case}: {:?}", audit.problems);
            }
        }
    }
    Some(is_page)
}

fn every_write_of_the_checkpoint(fault_name: &str, fault: impl Fn(u64) -> FaultPlan) {
    let mut pages = 0;
    let mut k = 0;
    while let Some(is_page) = check_case(fault_name, &fault, k) {
        pages += u32::from(is_page);
        k += 1;
    }
    eprintln!("{fault_name}: {pages} metadata page writes of the checkpoint's {k} writes checked");
    assert!(
        pages >= 8,
        "the closing checkpoint wrote {pages} metadata pages of {k} writes"
    );
}

#[test]
fn a_lost_page_write_is_detected_at_open() {
    every_write_of_the_checkpoint("lost write", |k| FaultPlan {
        lose_write: Some(k),
        ..FaultPlan::default()
    });
}

#[test]
fn a_misdirected_page_write_is_detected_at_open() {
    // The page lands on a slot near the start of the page store, where the first
    // checkpoints wrote: it overwrites an older page, and its own slot keeps a
    // stale one.
    every_write_of_the_checkpoint("misdirected write", |k| FaultPlan {
        misdirect_write: Some((k, MISDIRECT_TARGET_BYTES)),
        ..FaultPlan::default()
    });
}

/// Where misdirected writes land: a page-store slot near the start of the store
/// (block 300 of a 64 MiB pool lies inside its page store, which follows the
/// 256-block journal).
const MISDIRECT_TARGET_BYTES: u64 = 300 * BLOCK as u64;

#[test]
fn the_target_of_misdirected_writes_is_in_the_page_store() {
    let (dev, _, _) = run(|_| FaultPlan::default(), 0);
    let image = dev.crash_image(CrashMode::KeepAll);
    let sb = SuperBlock::decode(&image[..BLOCK]).unwrap();
    let block = MISDIRECT_TARGET_BYTES / BLOCK as u64;
    assert!((sb.pages_start_block..sb.pages_start_block + sb.page_slots).contains(&block));
}

/// The newest page of `kind` and `index` in `image` (any slot, live or retired), as
/// (slot, header, payload).
fn newest_page(
    image: &[u8],
    sb: &SuperBlock,
    kind: PageKind,
    index: u64,
) -> (u64, PageHeader, Vec<u8>) {
    (1..sb.page_slots)
        .filter_map(|slot| {
            let at = ((sb.pages_start_block + slot) as usize) * BLOCK;
            decode_page(&image[at..at + BLOCK], kind, sb.nonce, slot)
                .ok()
                .filter(|(h, _)| h.index == index)
                .map(|(h, payload)| (slot, h, payload.to_vec()))
        })
        .max_by_key(|(_, h, _)| h.generation)
        .expect("a page of that kind")
}

#[test]
fn an_older_copy_of_the_same_page_in_its_slot_is_refused_by_its_parent() {
    // The case only a parent-held checksum catches: the slot holds the very page its
    // parent points to (kind, owner, index, slot, nonce all right, checksum valid),
    // one checkpoint older. A drive that lost the newer write leaves exactly that
    // when the slot held the page before (copy-on-write reuses retired slots).
    let mut t = create(DEVICE_BYTES, None);
    t.pool().create_volume("a", 4 << 20).unwrap();
    let a = t.pool().open_volume("a").unwrap();
    a.write(0, &[1; BLOCK], false).unwrap();
    drop(a);
    t.reopen();
    let before = t.dev.crash_image(CrashMode::KeepAll);
    let old = newest_page(&before, &newest_super_block(&before), PageKind::Map, 0);
    let a = t.pool().open_volume("a").unwrap();
    a.write(0, &[2; BLOCK], false).unwrap();
    drop(a);
    t.pool.take().unwrap().close().unwrap();
    let mut image = t.dev.crash_image(CrashMode::KeepAll);
    let sb = newest_super_block(&image);
    let (slot, current, _) = newest_page(&image, &sb, PageKind::Map, 0);
    assert!(old.1.generation < current.generation);
    // The older page as it would be had it been written to this slot.
    let stale = PageHeader { slot, ..old.1 };
    let mut page = [0u8; BLOCK];
    encode_page(&stale, &old.2, &mut page);
    let at = ((sb.pages_start_block + slot) as usize) * BLOCK;
    image[at..at + BLOCK].copy_from_slice(&page);
    assert!(
        decode_page(&page, PageKind::Map, sb.nonce, slot).is_ok(),
        "the stale page passes every check of its own"
    );
    let reopened = Pool::open_devices(
        Arc::new(FaultStorage::from_image("data", image)) as Arc<dyn Storage>,
        None,
        &OPTS,
    );
    // Refused by its parent: the open falls back to the older copy (its own map
    // page, whole) and the journal, so block 0 reads its newest contents.
    let pool = match reopened {
        Ok(pool) => pool,
        Err(e) => panic!("the older super block copy did not open the pool: {e}"),
    };
    assert_eq!(
        pool.stats().metadata_copies_repaired,
        1,
        "the stale page was not detected"
    );
    let mut got = vec![0u8; BLOCK];
    pool.open_volume("a").unwrap().read(0, &mut got).unwrap();
    assert!(got == [2; BLOCK], "block 0 reads back its newest contents");
}
