//! Metadata that grows with what is stored: when the page store has no free slot, a
//! checkpoint puts pages in data-region blocks (docs/format.md, page references).
//! A pool with a tiny page store must keep taking writes across many volumes,
//! account those blocks as metadata, survive a reopen and a crash, pass the audit
//! and the repair's check, and give the blocks back when the pages move or go.

mod common;
use common::*;
use fewerbytes_engine::storage::CrashMode;
use fewerbytes_engine::{CreateOptions, Pool, Provisioning, RepairOptions};
use std::sync::Arc;

const VOLUMES: usize = 24;
/// Logical blocks one block-map page covers: writes this far apart land in
/// different map pages.
const MAP_PAGE_BLOCKS: u64 = 504;
const WRITES_PER_VOLUME: u64 = 6;

fn block_for(v: usize, k: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    for (i, x) in b.iter_mut().enumerate() {
        *x = (v as u64 * 131 + k * 7 + i as u64 / 16) as u8;
    }
    b[..8].copy_from_slice(&((v as u64) << 32 | k).to_le_bytes());
    b
}

fn offset(k: u64) -> u64 {
    k * MAP_PAGE_BLOCKS * BLOCK as u64
}

/// Every volume reads back what was written, the audit and the repair's check find
/// nothing, and the data region's figures add up.
fn assert_whole(pool: &Arc<Pool>, volumes: &[usize]) {
    for &v in volumes {
        let vol = pool.open_volume(&format!("v{v}")).expect("open volume");
        let mut buf = vec![0u8; BLOCK];
        for k in 0..WRITES_PER_VOLUME {
            vol.read(offset(k), &mut buf).expect("read");
            assert!(
                buf == block_for(v, k),
                "volume v{v}, write {k} reads back wrong"
            );
        }
    }
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    let report = pool
        .repair(&RepairOptions::default(), &|_, _, _| {})
        .expect("check");
    assert!(report.repairs.is_empty(), "{:?}", report.repairs);
    assert!(report.damage_left.is_empty(), "{:?}", report.damage_left);
    let s = pool.stats();
    let c = s.space;
    // Blocks packers hold open count in Stored and in Available: at most a run and
    // a fragment block per zone.
    let parts = c.stored_bytes + c.metadata_bytes + c.reserved_unused_bytes + c.kept_bytes;
    let open_max = (u64::from(fewerbytes_engine::RUN_BLOCKS) + 1) * s.threads as u64 * BLOCK as u64;
    assert!(
        parts >= c.used_bytes && parts - c.used_bytes <= open_max,
        "stored, metadata (pages in data blocks too), reserved unused and kept free make \
         up Used but for the blocks packers hold open: {c:?}"
    );
    assert_eq!(c.used_bytes + c.available_bytes, c.size_bytes, "{c:?}");
}

#[test]
fn a_tiny_page_store_spills_pages_into_data_blocks_and_keeps_everything() {
    // Thin volumes: many volumes, few blocks written in each.
    let opts = CreateOptions {
        page_slots: Some(8),
        ..CreateOptions::default()
    };
    let mut t = create_with(128 << 20, None, &opts);
    let volume_bytes = offset(WRITES_PER_VOLUME);
    for v in 0..VOLUMES {
        let name = format!("v{v}");
        t.pool()
            .create_volume_with(&name, volume_bytes, Provisioning::THIN)
            .expect("create");
        let vol = t.pool().open_volume(&name).expect("open volume");
        for k in 0..WRITES_PER_VOLUME {
            vol.write(offset(k), &block_for(v, k), false)
                .expect("write");
        }
        vol.flush().expect("flush");
    }
    let all: Vec<usize> = (0..VOLUMES).collect();
    // The next volume operation's checkpoint writes the last volume's pages.
    t.pool().create_volume("last", 1 << 20).expect("create");
    let spilled = t.pool().stats().space.metadata_in_data_bytes;
    // 24 volumes of 6 map pages each cannot fit in 7 slots.
    assert!(
        spilled >= (VOLUMES as u64 * WRITES_PER_VOLUME) * BLOCK as u64,
        "only {spilled} bytes of metadata pages in the data region"
    );
    let regions = t.pool().regions();
    let listed: u64 = regions
        .iter()
        .filter(|r| r.name.contains("metadata pages in the data region"))
        .map(|r| r.bytes)
        .sum();
    assert_eq!(
        listed, spilled,
        "list-metadata shows every block: {regions:?}"
    );
    assert_whole(t.pool(), &all);

    t.reopen();
    assert_whole(t.pool(), &all);
    assert!(t.pool().stats().space.metadata_in_data_bytes > 0);

    // More writes, then a crash that keeps only what was flushed.
    for v in 0..VOLUMES {
        let vol = t.pool().open_volume(&format!("v{v}")).expect("open volume");
        vol.write(offset(0), &block_for(v, 0), false)
            .expect("write");
        vol.flush().expect("flush");
    }
    t.crash(CrashMode::DropAll);
    assert_whole(t.pool(), &all);

    // Deleting volumes takes their pages out of the image: their data blocks come
    // back once the checkpoint that drops them is durable.
    let before = t.pool().stats().space.metadata_in_data_bytes;
    for v in 0..VOLUMES / 2 {
        t.pool()
            .delete_volume(&format!("v{v}"), false)
            .expect("delete");
    }
    t.pool().create_volume("after", 1 << 20).expect("create");
    let after = t.pool().stats().space.metadata_in_data_bytes;
    assert!(after < before, "metadata blocks {before} -> {after} bytes");
    let kept: Vec<usize> = (VOLUMES / 2..VOLUMES).collect();
    assert_whole(t.pool(), &kept);
    t.reopen();
    assert_whole(t.pool(), &kept);
}

#[test]
fn a_new_pool_reserves_at_most_two_percent_for_metadata() {
    let t = create(8 << 30, None);
    let info = t.pool().info();
    let device = info.data_device_bytes;
    // Everything that is not data region: super blocks, journal, page store, padding.
    let metadata = device - info.space.data_bytes;
    assert!(
        metadata * 100 <= device * 2,
        "an 8 GiB pool reserves {metadata} bytes for metadata"
    );
    assert!(info.metadata_regions_bytes <= metadata);
}

#[test]
fn a_damaged_page_in_a_data_block_is_reported_at_that_block() {
    let opts = CreateOptions {
        page_slots: Some(4),
        ..CreateOptions::default()
    };
    let t = create_with(128 << 20, None, &opts);
    for v in 0..8 {
        let name = format!("v{v}");
        t.pool()
            .create_volume(&name, offset(WRITES_PER_VOLUME))
            .expect("create");
        let vol = t.pool().open_volume(&name).expect("open volume");
        for k in 0..WRITES_PER_VOLUME {
            vol.write(offset(k), &block_for(v, k), false)
                .expect("write");
        }
    }
    let regions = t.pool().regions();
    let run = regions
        .iter()
        .find(|r| r.name.contains("metadata pages in the data region") && r.blocks > 0)
        .expect("pages in data blocks");
    // The image as it is (no close, whose checkpoint could move pages): the last
    // checkpoint's pages are the ones listed. A page with one copy (not a directory
    // page, which has a second: `dir_copies.rs`).
    let mut image = t.dev.crash_image(CrashMode::KeepAll);
    let block = (run.start_block..run.start_block + run.blocks)
        .find(|b| image[*b as usize * BLOCK + 9] != 3)
        .expect("a page other than a directory page in the data region");
    let image_kind = image[block as usize * BLOCK + 9];
    // One flipped byte in the page's payload: its checksum fails.
    image[block as usize * BLOCK + 1000] ^= 0x40;
    let dev = Arc::new(fewerbytes_engine::storage::FaultStorage::from_image(
        "data", image,
    ));
    let opened = Pool::open_devices(
        dev as Arc<dyn fewerbytes_engine::storage::Storage>,
        None,
        &fewerbytes_engine::OpenOptions {
            threads: Some(2),
            ..Default::default()
        },
    );
    // A block-map page costs only the range it maps (`map_damage.rs`): the pool
    // opens with that range damaged, named by the page's block. Any other page with
    // one copy stops the open, naming its block.
    let is_map_page = image_kind == 1;
    match opened {
        Ok(pool) if is_map_page => {
            let ranges = pool.damaged_ranges();
            assert_eq!(ranges.len(), 1, "{ranges:?}");
            assert_eq!(
                (ranges[0].block, ranges[0].device.as_str()),
                (block, "data"),
                "{ranges:?}"
            );
        }
        Ok(_) => panic!("a damaged page of kind {image_kind} was loaded"),
        Err(fewerbytes_engine::EngineError::Corrupt {
            block: b, device, ..
        }) if !is_map_page => {
            assert_eq!((b, device), (block, "data"));
        }
        Err(other) => panic!("page of kind {image_kind}: not reported as expected: {other}"),
    }
}
