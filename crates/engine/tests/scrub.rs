//! The online scrub (`Pool::scrub_start`): bytes damaged on the device under an
//! open pool are found, a damaged metadata page is rewritten from memory, a
//! damaged data block is named with the volume and range that map it, and the
//! scrub can be paused and resumed.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, Storage};
use fewerbytes_engine::{Pool, ScrubState, ScrubStatus};
use fewerbytes_format::page::{decode_page, PageKind};

/// Wait for the scrub to end (no timing asserted: it always ends).
fn wait_done(pool: &Pool) -> ScrubStatus {
    loop {
        let s = pool.scrub_status();
        if s.state == ScrubState::Done {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Byte offset of the newest block-map page of `owner` (a volume id) in `image`,
/// found by scanning the page store as a person with a hex editor would.
fn newest_map_page(image: &[u8], owner: u64) -> usize {
    let sb = newest_super_block(image);
    (1..sb.page_slots)
        .filter_map(|slot| {
            let at = (sb.pages_start_block + slot) as usize * BLOCK;
            let (h, _) =
                decode_page(image.get(at..at + BLOCK)?, PageKind::Map, sb.nonce, slot).ok()?;
            (h.owner == owner).then_some((h.generation, at))
        })
        .max()
        .map(|(_, at)| at)
        .expect("a block-map page of the volume")
}

#[test]
fn scrub_finds_a_damaged_map_page_and_data_block_repairs_the_page_and_names_the_data() {
    // Before the scrub, nothing read a pool's pages after open: a page damaged on
    // the drive under a running pool was found only at the next open, and a
    // damaged block only when a guest read it.
    let mut t = create(64 << 20, None);
    let a = t.pool().create_volume("a", 4 << 20).unwrap();
    let b = t.pool().create_volume("b", 4 << 20).unwrap();
    for (name, seed) in [("a", 100u64), ("b", 200)] {
        let v = t.pool().open_volume(name).unwrap();
        for i in 0..8u64 {
            v.write(i * BLOCK as u64, &random_block(seed + i), false)
                .unwrap();
        }
    }
    // Pages and data on the device: a clean close and open.
    t.reopen();
    let image = t.dev.crash_image(CrashMode::KeepAll);
    let map_at = newest_map_page(&image, a.id);
    let target = random_block(203);
    let data_at = image
        .chunks(BLOCK)
        .position(|c| c == &target[..])
        .expect("volume b's block 3 stored whole")
        * BLOCK;
    // Damage both under the open pool.
    t.dev.write_at(&[0xa5; 64], (map_at + 1000) as u64).unwrap();
    t.dev.write_at(&[0x5a; 16], (data_at + 100) as u64).unwrap();

    let pool = t.pool().clone();
    pool.scrub_start(0).unwrap();
    let s = wait_done(&pool);
    assert_eq!(s.errors_found, 2, "{s:#?}");
    assert_eq!(s.repaired, 1, "{s:#?}");
    assert!(s.stopped.is_none(), "{s:#?}");
    assert!(s.bytes_verified >= s.bytes_total.min(s.bytes_verified));
    let page = s
        .findings
        .iter()
        .find(|f| f.region == "map")
        .expect("the map page");
    assert!(page.repaired, "{page:#?}");
    assert!(page.what.contains("volume 'a'"), "{page:#?}");
    let data = s
        .findings
        .iter()
        .find(|f| f.region == "data")
        .expect("the data block");
    assert!(!data.repaired);
    // Named as every report of damage names it: volume bytes, then the pool block.
    assert_eq!(
        data.volumes,
        vec![format!(
            "volume 'b' bytes 12288..16383 (pool block {})",
            data_at / BLOCK
        )]
    );

    // A second scrub finds only the data block.
    pool.scrub_start(0).unwrap();
    let s = wait_done(&pool);
    assert_eq!(s.errors_found, 1, "{s:#?}");
    assert_eq!(s.findings[0].region, "data");
    drop(pool);

    // The rewritten page is what the next open loads: volume a reads back whole.
    t.reopen();
    let v = t.pool().open_volume("a").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for i in 0..8u64 {
        v.read(i * BLOCK as u64, &mut buf).unwrap();
        assert_eq!(buf, random_block(100 + i), "volume a block {i}");
    }
    let _ = b;
}

/// Byte offset of the newest page of `kind` (of `owner`, if given) in `image`.
fn newest_page(image: &[u8], kind: PageKind, owner: Option<u64>) -> usize {
    let sb = newest_super_block(image);
    (1..sb.page_slots)
        .filter_map(|slot| {
            let at = (sb.pages_start_block + slot) as usize * BLOCK;
            let (h, _) = decode_page(image.get(at..at + BLOCK)?, kind, sb.nonce, slot).ok()?;
            owner
                .is_none_or(|o| h.owner == o)
                .then_some((h.generation, at))
        })
        .max()
        .map(|(_, at)| at)
        .unwrap_or_else(|| panic!("a {} in the page store", kind.name()))
}

#[test]
fn every_kind_of_damaged_page_is_rewritten_from_memory() {
    // The catalog (rewritten by any checkpoint), the counters page (rewritten only
    // when asked), a directory page (rewritten through a page below it), a count
    // page and a fingerprint page (through their records).
    let mut t = create(64 << 20, None);
    let a = t.pool().create_volume("a", 4 << 20).unwrap();
    let v = t.pool().open_volume("a").unwrap();
    for i in 0..8u64 {
        v.write(i * BLOCK as u64, &random_block(300 + i), false)
            .unwrap();
    }
    drop(v);
    t.reopen();
    let image = t.dev.crash_image(CrashMode::KeepAll);
    let damaged = [
        ("catalog", newest_page(&image, PageKind::Catalog, None)),
        ("counters", newest_page(&image, PageKind::Counters, None)),
        (
            "directory",
            newest_page(&image, PageKind::Directory, Some(a.id)),
        ),
        ("counts", newest_page(&image, PageKind::Counts, None)),
        (
            "fingerprints",
            newest_page(&image, PageKind::Fingerprints, None),
        ),
    ];
    for (_, at) in damaged {
        t.dev.write_at(&[0xee; 32], (at + 2000) as u64).unwrap();
    }
    let pool = t.pool().clone();
    pool.scrub_start(0).unwrap();
    let s = wait_done(&pool);
    for (region, _) in damaged {
        let f = s
            .findings
            .iter()
            .find(|f| f.region == region)
            .unwrap_or_else(|| panic!("no {region} finding: {s:#?}"));
        assert!(f.repaired, "{f:#?}");
    }
    assert_eq!(s.errors_found, 5, "{s:#?}");
    assert_eq!(s.repaired, 5, "{s:#?}");
    pool.scrub_start(0).unwrap();
    assert_eq!(wait_done(&pool).errors_found, 0);
    drop(pool);
    t.reopen();
    let v = t.pool().open_volume("a").unwrap();
    let mut buf = vec![0u8; BLOCK];
    for i in 0..8u64 {
        v.read(i * BLOCK as u64, &mut buf).unwrap();
        assert_eq!(buf, random_block(300 + i), "block {i}");
    }
}

#[test]
fn a_damaged_super_block_copy_is_rewritten_by_the_scrub() {
    let t = create(64 << 20, None);
    t.pool().create_volume("a", 4 << 20).unwrap();
    let pool = t.pool().clone();
    // Copy 0 and copy 1 alternate; damage the older one (past every used field,
    // as a bit rot would).
    let image = t.dev.crash_image(CrashMode::KeepAll);
    let newest = newest_super_block(&image).generation;
    let older = 1 - newest % 2;
    t.dev
        .write_at(&[0xff; 8], older * BLOCK as u64 + 3000)
        .unwrap();
    pool.scrub_start(0).unwrap();
    let s = wait_done(&pool);
    assert_eq!(s.errors_found, 1, "{s:#?}");
    assert_eq!(s.repaired, 1, "{s:#?}");
    assert_eq!(s.findings[0].region, "super block");
    pool.scrub_start(0).unwrap();
    assert_eq!(wait_done(&pool).errors_found, 0);
}

#[test]
fn a_scrub_pauses_and_resumes() {
    let t = create(64 << 20, None);
    t.pool().create_volume("a", 4 << 20).unwrap();
    let v = t.pool().open_volume("a").unwrap();
    for i in 0..64u64 {
        v.write(i * BLOCK as u64, &random_block(i), false).unwrap();
    }
    let pool = t.pool().clone();
    // Slow enough (4 KiB/s) that it is still running when paused.
    pool.scrub_start(4096).unwrap();
    let paused = pool.scrub_pause().unwrap();
    assert_eq!(paused.state, ScrubState::Paused);
    assert!(
        pool.scrub_start(0).is_err(),
        "a second scrub while one is paused"
    );
    assert!(pool.scrub_pause().is_err(), "pausing a paused scrub");
    let resumed = pool.scrub_resume().unwrap();
    assert_eq!(resumed.state, ScrubState::Running);
    assert!(pool.scrub_resume().is_err(), "resuming a running scrub");
    // Closing the pool stops a scrub that has not finished (at 4 KiB/s it has
    // minutes to go): the close waits for its thread, which sees the close within
    // its next nap instead of reading on.
    drop(v);
    drop(pool);
    let mut t = t;
    t.pool.take().unwrap().close().unwrap();
}

#[test]
fn a_scrub_under_writes_checkpoints_and_compaction_finds_nothing() {
    // The scrub reads pages and blocks the pool keeps moving: a page's slot retired
    // by a checkpoint, a fragment moved by compaction, an object freed by an
    // overwrite, a volume deleted. None of that is damage, and none may be reported.
    use std::sync::atomic::{AtomicU64, Ordering};
    let t = create(64 << 20, None);
    t.pool().create_volume("a", 8 << 20).unwrap();
    let pool = t.pool().clone();
    let writes = std::sync::Arc::new(AtomicU64::new(0));
    const WRITES: u64 = 30_000;
    let writer = {
        let pool = pool.clone();
        let writes = writes.clone();
        std::thread::spawn(move || {
            let v = pool.open_volume("a").unwrap();
            let mut mix = Mix::new(7);
            for n in 1..=WRITES {
                // Compressible blocks become fragments; overwrites free them.
                let lbn = (n * 7919) % 2048;
                v.write(lbn * BLOCK as u64, &mix.next_block(), false)
                    .unwrap();
                writes.store(n, Ordering::Relaxed);
                if n % 1000 == 0 {
                    pool.flush().unwrap();
                    pool.compact().unwrap();
                    // A volume operation takes a checkpoint; the delete retires pages.
                    pool.create_volume("b", 1 << 20).unwrap();
                    let b = pool.open_volume("b").unwrap();
                    b.write(0, &random_block(n), false).unwrap();
                    drop(b);
                    pool.delete_volume("b", false).unwrap();
                }
            }
        })
    };
    let mut scrubs = 0;
    while scrubs < 5 || writes.load(Ordering::Relaxed) < WRITES {
        pool.scrub_start(0).unwrap();
        let s = wait_done(&pool);
        assert_eq!(s.errors_found, 0, "{s:#?}");
        assert!(s.stopped.is_none(), "{s:#?}");
        scrubs += 1;
    }
    writer.join().unwrap();
    eprintln!(
        "{scrubs} scrubs beside {WRITES} writes and {} checkpoints",
        pool.stats().checkpoints
    );
}
