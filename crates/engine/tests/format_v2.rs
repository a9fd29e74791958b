//! What format version 2 records beside the tables: the open-by-host marker, and
//! the counters page a later version writes (this one keeps it).

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, FaultStorage, Storage};
use fewerbytes_engine::{EngineError, OpenOptions, Pool};
use fewerbytes_format::page::{
    encode_page, ref_generation, PageHeader, PageKind, PageRef, PAGE_PAYLOAD_BYTES,
};
use fewerbytes_format::FORMAT_VERSION;
use std::sync::Arc;

const OPTS: OpenOptions = OpenOptions {
    threads: Some(1),
    index_memory_bytes: None,
};

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

#[test]
fn a_counters_page_of_a_later_version_is_verified_and_kept() {
    let mut t = create(64 << 20, None);
    t.pool.take().unwrap().close().unwrap();
    let mut image = t.dev.crash_image(CrashMode::KeepAll);
    let mut sb = newest_super_block(&image);
    // A counters page in the lowest slot never written: free, and among the first
    // the page store hands out (from its start, at every open).
    let slot = (1..sb.page_slots)
        .find(|s| {
            let at = ((sb.pages_start_block + s) as usize) * BLOCK;
            image[at..at + BLOCK].iter().all(|b| *b == 0)
        })
        .unwrap();
    let mut payload = vec![0u8; PAGE_PAYLOAD_BYTES];
    payload[..8].copy_from_slice(&12345u64.to_le_bytes());
    let header = PageHeader {
        version: FORMAT_VERSION,
        kind: PageKind::Counters,
        level: 0,
        count: 1,
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
    };
    let mut block = [0u8; BLOCK];
    sb.encode(&mut block);
    let copy = (sb.generation % 2) as usize * BLOCK;
    image[copy..copy + BLOCK].copy_from_slice(&block);

    let (dev, pool) = open_image(image.clone()).expect("a pool with a counters page opens");
    // Enough writes and checkpoints that the page store hands out that slot, were it
    // not kept.
    pool.create_volume("a", 8 << 20).unwrap();
    let vol = pool.open_volume("a").unwrap();
    for round in 0..6u8 {
        for lbn in 0..2048u64 {
            vol.write(lbn * BLOCK as u64, &[round ^ lbn as u8; BLOCK], false)
                .unwrap();
        }
        pool.create_volume(&format!("ck{round}"), 4096).unwrap();
    }
    drop(vol);
    pool.close().unwrap();
    let after = dev.crash_image(CrashMode::KeepAll);
    assert_eq!(newest_super_block(&after).counters, sb.counters);
    assert_eq!(
        &after[at..at + BLOCK],
        &page[..],
        "the counters page is kept"
    );
    open_image(after).expect("and still verifies");

    // A stale counters page is corruption like any other page.
    let mut stale = image;
    stale[at + PAGE_PAYLOAD_BYTES] ^= 1;
    let mut page = [0u8; BLOCK];
    page.copy_from_slice(&stale[at..at + BLOCK]);
    fewerbytes_format::seal_checksum(&mut page, 4);
    stale[at..at + BLOCK].copy_from_slice(&page);
    match open_image(stale) {
        Err(EngineError::Corrupt { region, block, .. }) => {
            assert_eq!(region, "counters page");
            assert_eq!(block, sb.pages_start_block + slot);
        }
        Err(e) => panic!("not reported as corruption: {e}"),
        Ok(_) => panic!("a stale counters page was accepted"),
    }
}
