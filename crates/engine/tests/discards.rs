//! Blocks freed by a delete, a trim or an overwrite are given back to the data device
//! (a hole punched in a pool file, BLKDISCARD) once the checkpoint that frees them is
//! durable: the device's allocated size falls, `stats` counts the discards, and
//! `set_discard_enabled(false)` keeps every block allocated. Page-store slots a
//! checkpoint retires (a deleted volume's map pages) are given back as well: a pool
//! file's allocation in its page store falls. (That no discard comes before the
//! checkpoint is the crash simulation's to prove: `tests/crash/`.)

mod common;
use common::*;
use fewerbytes_engine::{CreateOptions, OpenOptions, Pool, Provisioning};
use rand::{RngCore, SeedableRng};
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

/// `bytes` of incompressible data at offset 0 of a new volume `name`, flushed.
fn write_random(t: &TestPool, name: &str, bytes: u64) {
    t.pool().create_volume(name, 16 * MIB).unwrap();
    let vol = t.pool().open_volume(name).unwrap();
    let mut data = vec![0u8; bytes as usize];
    rand::rngs::StdRng::seed_from_u64(bytes).fill_bytes(&mut data);
    vol.write(0, &data, false).unwrap();
    vol.flush().unwrap();
}

#[test]
fn a_deleted_volume_gives_its_blocks_back_to_the_device() {
    let t = create(64 * MIB, None);
    write_random(&t, "a", 8 * MIB);
    let before = t.dev.written_bytes();
    t.pool().delete_volume("a", false).unwrap();
    let after = t.dev.written_bytes();
    assert!(
        after + 7 * MIB < before,
        "the device still holds {after} bytes after deleting 8 MiB (it held {before})"
    );
    let io = t.pool().stats().data_device;
    assert!(io.discards > 0, "discards counted: {io:?}");
    assert!(io.discard_bytes >= 7 * MIB, "discard bytes counted: {io:?}");
    assert!(
        io.discards < 64,
        "adjacent blocks are discarded together: {} calls for {} bytes",
        io.discards,
        io.discard_bytes
    );
}

#[test]
fn trimmed_and_overwritten_blocks_are_given_back_after_the_checkpoint() {
    let mut t = create(64 * MIB, None);
    write_random(&t, "a", 8 * MIB);
    let vol = t.pool().open_volume("a").unwrap();
    vol.trim(0, 4 * MIB, false).unwrap();
    vol.write_zeroes(4 * MIB, 2 * MIB, false).unwrap();
    vol.flush().unwrap();
    let before = t.dev.written_bytes();
    drop(vol);
    // The clean close takes the checkpoint that frees them.
    t.reopen();
    let after = t.dev.written_bytes();
    assert!(
        after + 5 * MIB < before,
        "the device still holds {after} bytes after trimming 6 MiB (it held {before})"
    );
    let vol = t.pool().open_volume("a").unwrap();
    let mut buf = vec![0u8; 2 * MIB as usize];
    vol.read(6 * MIB, &mut buf).unwrap();
    let mut want = vec![0u8; 8 * MIB as usize];
    rand::rngs::StdRng::seed_from_u64(8 * MIB).fill_bytes(&mut want);
    assert_eq!(buf, want[6 * MIB as usize..], "the blocks kept read back");
    assert!(t.pool().audit().problems.is_empty());
}

#[test]
fn with_discards_off_freed_blocks_stay_allocated() {
    let t = create(64 * MIB, None);
    t.pool().set_discard_enabled(false);
    write_random(&t, "a", 8 * MIB);
    let before = t.dev.written_bytes();
    t.pool().delete_volume("a", false).unwrap();
    assert!(t.dev.written_bytes() >= before, "nothing discarded");
    assert_eq!(t.pool().stats().data_device.discards, 0);
}

/// Blocks per map page (a volume's map page covers this many logical blocks).
const MAP_PAGE_BLOCKS: u64 = 504;
/// Map pages the volume "maps" holds: one block written under each.
const MAP_PAGES: u64 = 1000;

/// A pool file removed when dropped.
struct PoolFile(PathBuf);

impl Drop for PoolFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Bytes the file system holds for `path` in `[start, end)`, found with
/// `SEEK_DATA`/`SEEK_HOLE` (what `st_blocks` counts, for one range of the file).
fn allocated_between(path: &Path, start: u64, end: u64) -> u64 {
    let file = std::fs::File::open(path).expect("open the pool file");
    let fd = file.as_raw_fd();
    let (mut at, mut total) = (start, 0);
    while at < end {
        // SAFETY: lseek on a descriptor this function owns; no memory is passed.
        let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        if data < 0 || data as u64 >= end {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        assert!(hole >= data, "SEEK_HOLE after SEEK_DATA at {data}");
        let hole = (hole as u64).min(end);
        total += hole - data as u64;
        at = hole;
    }
    total
}

/// A 4 GiB sparse pool file holding volume "keep" (one random MiB) and volume
/// "maps", whose `MAP_PAGES` map pages each map one block (all the same bytes, so
/// they share one stored object): nearly all it holds is map pages. Closed and
/// reopened, so every page is in the page store. Returns the file, the open pool,
/// and the page store's byte range in the file.
fn pool_of_map_pages(name: &str) -> (PoolFile, Arc<Pool>, (u64, u64)) {
    let path = std::env::temp_dir().join(format!(
        "fewerbytes-slots-{name}-{}.pool",
        std::process::id()
    ));
    let file = PoolFile(path.clone());
    Pool::create(&CreateOptions {
        path: path.clone(),
        size_bytes: Some(4 << 30),
        ..CreateOptions::default()
    })
    .unwrap();
    let pool = Pool::open(&path, &OpenOptions::default()).unwrap();
    pool.create_volume("keep", MIB).unwrap();
    let keep = pool.open_volume("keep").unwrap();
    let mut data = vec![0u8; MIB as usize];
    rand::rngs::StdRng::seed_from_u64(7).fill_bytes(&mut data);
    keep.write(0, &data, false).unwrap();
    drop(keep);
    let maps_bytes = MAP_PAGES * MAP_PAGE_BLOCKS * BLOCK as u64;
    pool.create_volume_with("maps", maps_bytes, Provisioning::THIN)
        .unwrap();
    let maps = pool.open_volume("maps").unwrap();
    for p in 0..MAP_PAGES {
        maps.write(p * MAP_PAGE_BLOCKS * BLOCK as u64, &[0x5a; BLOCK], false)
            .unwrap();
    }
    drop(maps);
    pool.close().unwrap();
    let pool = Pool::open(&path, &OpenOptions::default()).unwrap();
    let store = pool
        .regions()
        .into_iter()
        .find(|r| r.name.starts_with("page store"))
        .expect("a page store region");
    let range = (
        store.start_block * BLOCK as u64,
        (store.start_block + store.blocks) * BLOCK as u64,
    );
    (file, pool, range)
}

/// A named figure of `stats().limits`.
fn limit(pool: &Pool, name: &str) -> u64 {
    pool.stats()
        .limits
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("stats has no limit named {name}"))
        .1
}

#[test]
fn a_deleted_volumes_map_pages_are_given_back_in_the_page_store() {
    let (file, pool, (start, end)) = pool_of_map_pages("delete");
    let held = allocated_between(&file.0, start, end);
    let pages_bytes = MAP_PAGES * BLOCK as u64;
    assert!(
        held >= pages_bytes,
        "the page store holds {held} bytes with {MAP_PAGES} map pages in it"
    );
    let file_before = std::fs::metadata(&file.0).map(|m| m.blocks()).unwrap() * 512;
    pool.delete_volume("maps", false).unwrap();
    let after = allocated_between(&file.0, start, end);
    assert!(
        after + pages_bytes * 9 / 10 <= held,
        "the page store holds {after} bytes after deleting {MAP_PAGES} map pages (it held {held})"
    );
    let file_after = std::fs::metadata(&file.0).map(|m| m.blocks()).unwrap() * 512;
    eprintln!(
        "page store allocation {held} -> {after} bytes, pool file {file_before} -> {file_after} bytes"
    );
    assert!(
        file_after + pages_bytes * 9 / 10 <= file_before,
        "the pool file's st_blocks fell from {file_before} bytes to only {file_after}"
    );
    assert!(
        limit(&pool, "page store slots discarded since open") >= MAP_PAGES,
        "stats count the slots discarded"
    );
    // Nothing still needed was discarded: the pool reopens whole.
    pool.close().unwrap();
    let pool = Pool::open(&file.0, &OpenOptions::default()).unwrap();
    let names: Vec<String> = pool.list_volumes().into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["keep"]);
    let mut want = vec![0u8; MIB as usize];
    rand::rngs::StdRng::seed_from_u64(7).fill_bytes(&mut want);
    let mut got = vec![0u8; MIB as usize];
    pool.open_volume("keep").unwrap().read(0, &mut got).unwrap();
    assert!(got == want, "volume keep reads back after the reopen");
    let audit = pool.audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
    // And takes more pages in the slots given back.
    pool.create_volume_with(
        "again",
        MAP_PAGES * MAP_PAGE_BLOCKS * BLOCK as u64,
        Provisioning::THIN,
    )
    .unwrap();
    let again = pool.open_volume("again").unwrap();
    for p in 0..MAP_PAGES {
        again
            .write(p * MAP_PAGE_BLOCKS * BLOCK as u64, &[0x33; BLOCK], false)
            .unwrap();
    }
    drop(again);
    pool.close().unwrap();
    let pool = Pool::open(&file.0, &OpenOptions::default()).unwrap();
    let mut block = vec![0u8; BLOCK];
    let again = pool.open_volume("again").unwrap();
    for p in [0, MAP_PAGES / 2, MAP_PAGES - 1] {
        again
            .read(p * MAP_PAGE_BLOCKS * BLOCK as u64, &mut block)
            .unwrap();
        assert_eq!(block, vec![0x33; BLOCK], "map page {p} of the new volume");
    }
    assert!(pool.audit().problems.is_empty());
}

#[test]
fn with_discards_off_retired_page_store_slots_stay_allocated() {
    let (file, pool, (start, end)) = pool_of_map_pages("nodiscard");
    pool.set_discard_enabled(false);
    // The open's own checkpoint, before the switch, may have discarded a few.
    let discarded = limit(&pool, "page store slots discarded since open");
    let held = allocated_between(&file.0, start, end);
    pool.delete_volume("maps", false).unwrap();
    assert!(
        allocated_between(&file.0, start, end) >= held,
        "a slot was discarded with discards off"
    );
    assert_eq!(
        limit(&pool, "page store slots discarded since open"),
        discarded
    );
}
