//! What format version 2 records beside the tables: the open-by-host marker, and
//! the counters page that keeps the pool's counters across restarts.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, FaultStorage, Storage};
use fewerbytes_engine::{EngineError, OpenOptions, Pool};
use fewerbytes_format::counters::decode_counters;
use fewerbytes_format::page::{
    decode_page_ref, encode_page, ref_generation, PageHeader, PageKind, PageRef, PAGE_PAYLOAD_BYTES,
};
use fewerbytes_format::FORMAT_VERSION;
use std::sync::Arc;

const OPTS: OpenOptions = OpenOptions {
    threads: Some(1),
    index_memory_bytes: None,
    no_discard: false,
    hold_index_build: false,
    take_over: None,
    saved_index: fewerbytes_engine::SavedIndex::Off,
};

/// `image` with its older super block copy zeroed: the damage forged in the newest
/// copy's pages is then reported, where the open would otherwise take the older
/// copy (whose pages are whole).
fn without_older_copy(mut image: Vec<u8>) -> Vec<u8> {
    let older = 1 - (newest_super_block(&image).generation % 2) as usize;
    image[older * BLOCK..(older + 1) * BLOCK].fill(0);
    image
}

fn open_image(image: Vec<u8>) -> Result<(Arc<FaultStorage>, Arc<Pool>), EngineError> {
    let dev = Arc::new(FaultStorage::from_image("data", image));
    let pool = Pool::open_devices(dev.clone() as Arc<dyn Storage>, None, &OPTS)?;
    Ok((dev, pool))
}

#[test]
fn an_open_pool_names_its_holder_and_a_clean_close_clears_it() {
    let mut t = create(64 << 20, None);
    let open = newest_super_block(&t.dev.crash_image(CrashMode::KeepAll));
    assert_eq!(open.version, FORMAT_VERSION);
    assert!(open.holder.is_set(), "{:?}", open.holder);
    assert_eq!(open.holder.pid, std::process::id());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    assert_eq!(open.holder.host, host.trim());
    t.pool.take().unwrap().close().unwrap();
    let closed = newest_super_block(&t.dev.crash_image(CrashMode::KeepAll));
    assert!(!closed.holder.is_set(), "{:?}", closed.holder);
}

/// `image` with a counters page of `count` counters (`values`, zero-padded) in the
/// lowest page-store slot never written, named by its newest super block. Returns
/// the image, that super block, and the page's byte offset.
fn with_counters_page(
    mut image: Vec<u8>,
    values: &[u64],
    count: u32,
) -> (Vec<u8>, fewerbytes_format::superblock::SuperBlock, usize) {
    let mut sb = newest_super_block(&image);
    // Free, and among the first the page store hands out (from its start, at every
    // open).
    let slot = (1..sb.page_slots)
        .find(|s| {
            let at = ((sb.pages_start_block + s) as usize) * BLOCK;
            image[at..at + BLOCK].iter().all(|b| *b == 0)
        })
        .unwrap();
    let mut payload = vec![0u8; PAGE_PAYLOAD_BYTES];
    for (i, v) in values.iter().enumerate() {
        payload[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    let header = PageHeader {
        version: FORMAT_VERSION,
        kind: PageKind::Counters,
        level: 0,
        count,
        nonce: sb.nonce,
        slot,
        generation: sb.generation,
        owner: 0,
        index: 0,
    };
    let mut page = [0u8; BLOCK];
    let crc = encode_page(&header, &payload, &mut page);
    let at = ((sb.pages_start_block + slot) as usize) * BLOCK;
    image[at..at + BLOCK].copy_from_slice(&page);
    sb.counters = PageRef {
        address: slot,
        crc,
        generation: ref_generation(sb.generation),
        twin: 0,
    };
    let mut block = [0u8; BLOCK];
    sb.encode(&mut block);
    let copy = (sb.generation % 2) as usize * BLOCK;
    image[copy..copy + BLOCK].copy_from_slice(&block);
    (image, sb, at)
}

/// The counters the newest super block of `image` names.
fn counters_of(image: &[u8]) -> Vec<u64> {
    let sb = newest_super_block(image);
    let slot = sb.counters.page_store_slot().expect("a counters page") as usize;
    let at = (sb.pages_start_block as usize + slot) * BLOCK;
    let (header, payload) = decode_page_ref(
        &image[at..at + BLOCK],
        PageKind::Counters,
        sb.nonce,
        &sb.counters,
    )
    .expect("the counters page verifies");
    decode_counters(header.count, payload).expect("and decodes")
}

#[test]
fn counters_go_on_from_the_last_checkpoint_after_a_restart() {
    let mut t = create(64 << 20, None);
    let pool = t.pool().clone();
    pool.create_volume("a", 8 << 20).unwrap();
    let vol = pool.open_volume("a").unwrap();
    for lbn in 0..100u64 {
        vol.write(lbn * BLOCK as u64, &[lbn as u8 + 1; BLOCK], false)
            .unwrap();
    }
    vol.trim(0, 10 * BLOCK as u64, false).unwrap();
    drop((vol, pool));
    t.reopen();
    let stats = t.pool().stats();
    assert_eq!(stats.counters.guest_bytes_written, 0, "since this open");
    assert_eq!(stats.counters_total.guest_bytes_written, 100 * BLOCK as u64);
    assert_eq!(stats.counters_total.blocks_written, 100);
    assert_eq!(stats.counters_total.trimmed_bytes, 10 * BLOCK as u64);

    // They add up over opens, and a checkpoint without new counts writes no page.
    let vol = t.pool().open_volume("a").unwrap();
    vol.write(0, &[9; BLOCK], false).unwrap();
    drop(vol);
    t.reopen();
    let total = t.pool().stats().counters_total;
    assert_eq!(total.guest_bytes_written, 101 * BLOCK as u64);
    let image = t.dev.crash_image(CrashMode::KeepAll);
    let page = newest_super_block(&image).counters;
    t.reopen();
    let image = t.dev.crash_image(CrashMode::KeepAll);
    assert_eq!(newest_super_block(&image).counters, page);
    assert_eq!(counters_of(&image)[0], 101 * BLOCK as u64);
}

#[test]
fn a_counters_page_is_loaded_and_the_counters_a_later_version_added_are_kept() {
    let mut t = create(64 << 20, None);
    t.pool.take().unwrap().close().unwrap();
    // Twelve known counters, then two this version does not know.
    let mut values: Vec<u64> = (1..=12).map(|i| i * 1000).collect();
    values.extend([77, 88]);
    let (image, sb, at) = with_counters_page(t.dev.crash_image(CrashMode::KeepAll), &values, 14);

    let (dev, pool) = open_image(image.clone()).expect("a pool with a counters page opens");
    assert_eq!(pool.stats().counters_total.guest_bytes_written, 1000);
    assert_eq!(pool.stats().counters_total.flushes, 12000);
    pool.create_volume("a", 8 << 20).unwrap();
    let vol = pool.open_volume("a").unwrap();
    for lbn in 0..8u64 {
        vol.write(lbn * BLOCK as u64, &[lbn as u8; BLOCK], false)
            .unwrap();
    }
    drop(vol);
    pool.close().unwrap();
    let after = counters_of(&dev.crash_image(CrashMode::KeepAll));
    assert_eq!(after.len(), 14);
    assert_eq!(after[0], 1000 + 8 * BLOCK as u64);
    assert_eq!(&after[12..], &[77, 88], "unknown counters are kept");

    // A stale counters page is corruption like any other page.
    let mut stale = image.clone();
    stale[at + PAGE_PAYLOAD_BYTES] ^= 1;
    let mut page = [0u8; BLOCK];
    page.copy_from_slice(&stale[at..at + BLOCK]);
    fewerbytes_format::seal_checksum(&mut page, 4);
    stale[at..at + BLOCK].copy_from_slice(&page);
    let slot = sb.counters.page_store_slot().unwrap();
    match open_image(without_older_copy(stale)) {
        Err(EngineError::Corrupt { region, block, .. }) => {
            assert_eq!(region, "counters page");
            assert_eq!(block, sb.pages_start_block + slot);
        }
        Err(e) => panic!("not reported as corruption: {e}"),
        Ok(_) => panic!("a stale counters page was accepted"),
    }
}

#[test]
fn a_counters_page_claiming_more_counters_than_it_holds_is_corrupt() {
    let mut t = create(64 << 20, None);
    t.pool.take().unwrap().close().unwrap();
    let (image, _, _) = with_counters_page(t.dev.crash_image(CrashMode::KeepAll), &[1, 2], 600);
    match open_image(without_older_copy(image)) {
        Err(EngineError::Corrupt { region, reason, .. }) => {
            assert_eq!(region, "counters page");
            assert!(reason.contains("600 counters"), "{reason}");
        }
        Err(e) => panic!("not reported as corruption: {e}"),
        Ok(_) => panic!("a counters page of 600 counters was accepted"),
    }
}
