//! `FileStorage` on what the kernel really gives it: a file's blocks freed by a
//! discard, a loop device's discards counted by the block layer, a full file system
//! saying so as its own error, a file or loop device that grew, and whole pages
//! written past the page cache (`O_DIRECT`) mixed with ordinary writes of the same
//! pages, on a disk's file system, a loop device, tmpfs, and ramfs (which refuses
//! `O_DIRECT`: the pages go through the cache).
//!
//! These tests need root (loop devices, mounts) and `losetup` and `mount`
//! (util-linux, mount: `scripts/test.sh` installs them). Every loop device and
//! mount is undone on drop, when a test fails as well.

#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

use fewerbytes_storage::{DiscardOutcome, FileStorage, PageBuf, Storage, PAGE_BYTES};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

const MIB: u64 = 1 << 20;

/// A fresh directory under cargo's scratch space for tests (on the build's disk, not a
/// tmpfs /tmp, so a file's allocated size is the disk file system's), removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(label: &str) -> Scratch {
        let path = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("storage-{label}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        Scratch(path)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `program args`, failing the test with what it said unless it exits 0.
fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} (util-linux / mount): {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A loop device over a file, detached on drop.
struct LoopDevice(String);

impl LoopDevice {
    fn attach(file: &Path) -> LoopDevice {
        let dev = run("losetup", &["-f", "--show", file.to_str().unwrap()]);
        let dev = dev.trim().to_string();
        assert!(dev.starts_with("/dev/loop"), "losetup printed {dev:?}");
        LoopDevice(dev)
    }

    /// `/sys/block/loopN/NAME`, trimmed.
    fn sys(&self, name: &str) -> String {
        let base = self.0.trim_start_matches("/dev/");
        std::fs::read_to_string(format!("/sys/block/{base}/{name}"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// Sectors discarded, from `/sys/block/loopN/stat` (its 14th field; see the
    /// kernel's Documentation/block/stat.rst).
    fn discarded_sectors(&self) -> u64 {
        let stat = self.sys("stat");
        let fields: Vec<&str> = stat.split_whitespace().collect();
        assert!(
            fields.len() >= 15,
            "this kernel's block stat has no discard fields: {stat}"
        );
        fields[13].parse().unwrap()
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

/// A mount, unmounted (lazily if busy) on drop.
struct Mount(PathBuf);

impl Mount {
    fn new(args: &[&str], at: &Path) -> Mount {
        std::fs::create_dir_all(at).unwrap();
        let mut all = args.to_vec();
        all.push(at.to_str().unwrap());
        run("mount", &all);
        Mount(at.to_path_buf())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// Bytes the file system allocated to `path` (`st_blocks` are 512 bytes each).
fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// Bytes that are not zeros and not all one value, so no layer could store them small.
fn data(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8 ^ seed)
        .collect()
}

#[test]
fn a_discard_frees_a_files_blocks_and_the_range_reads_zeros() {
    let dir = Scratch::new("punch");
    let path = dir.join("pool");
    let dev = FileStorage::create(&path, 8 * MIB).unwrap();
    dev.write_at(&data(4 * MIB, 1), 0).unwrap();
    dev.flush().unwrap();
    let before = allocated_bytes(&path);
    assert!(
        before >= 4 * MIB,
        "the file holds {before} bytes after 4 MiB were written"
    );

    assert_eq!(
        dev.discard(MIB, 2 * MIB).unwrap(),
        DiscardOutcome::Discarded
    );
    dev.flush().unwrap();
    let after = allocated_bytes(&path);
    assert!(
        after + 2 * MIB <= before,
        "a 2 MiB discard left the file at {after} bytes allocated (was {before})"
    );
    assert_eq!(dev.len_bytes(), 8 * MIB, "a punched hole keeps the length");
    let mut back = vec![1u8; (4 * MIB) as usize];
    dev.read_at(&mut back, 0).unwrap();
    let written = data(4 * MIB, 1);
    let (one, two) = (MIB as usize, 3 * MIB as usize);
    assert!(
        back[..one] == written[..one],
        "bytes before the hole changed"
    );
    assert!(
        back[one..two].iter().all(|b| *b == 0),
        "the hole does not read zeros"
    );
    assert!(
        back[two..] == written[two..],
        "bytes after the hole changed"
    );
    let io = dev.counters().snapshot();
    assert_eq!((io.discards, io.discard_bytes), (1, 2 * MIB));

    // Off: nothing is freed.
    dev.set_discard_enabled(false);
    assert_eq!(dev.discard(0, MIB).unwrap(), DiscardOutcome::Disabled);
    assert_eq!(allocated_bytes(&path), after);
}

#[test]
fn a_discard_on_a_loop_device_reaches_the_block_layer() {
    let dir = Scratch::new("blkdiscard");
    let backing = dir.join("backing");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    let loop_dev = LoopDevice::attach(&backing);
    let max: u64 = loop_dev.sys("queue/discard_max_bytes").parse().unwrap();
    assert!(
        max > 0,
        "{} takes no discards (queue/discard_max_bytes is 0): the file system under {} cannot punch holes",
        loop_dev.0,
        backing.display()
    );
    let dev = FileStorage::open(Path::new(&loop_dev.0)).unwrap();
    dev.write_at(&data(16 * MIB, 2), 0).unwrap();
    dev.flush().unwrap();
    let sectors_before = loop_dev.discarded_sectors();
    let allocated_before = allocated_bytes(&backing);

    assert_eq!(
        dev.discard(4 * MIB, 8 * MIB).unwrap(),
        DiscardOutcome::Discarded
    );
    dev.flush().unwrap();
    let sectors = loop_dev.discarded_sectors() - sectors_before;
    assert!(
        sectors >= 8 * MIB / 512,
        "the block layer counted {sectors} sectors discarded for an 8 MiB discard"
    );
    let allocated_after = allocated_bytes(&backing);
    assert!(
        allocated_after + 8 * MIB <= allocated_before,
        "the loop device's file still holds {allocated_after} bytes (was {allocated_before})"
    );
    let io = dev.counters().snapshot();
    assert_eq!((io.discards, io.discard_bytes), (1, 8 * MIB));
}

#[test]
fn a_write_on_a_full_file_system_says_no_space_until_space_is_freed() {
    let dir = Scratch::new("enospc");
    let mount = Mount::new(&["-t", "tmpfs", "-o", "size=2M", "tmpfs"], &dir.join("fs"));
    let filler = mount.0.join("filler");
    std::fs::write(&filler, vec![7u8; MIB as usize]).unwrap();
    // A sparse file far larger than the file system, as a pool file on a host that
    // fills: writes into its holes need blocks the file system no longer has.
    let dev = FileStorage::create(&mount.0.join("pool"), 16 * MIB).unwrap();
    let chunk = data(256 * 1024, 3);
    let mut offset = 0;
    let err = loop {
        assert!(
            offset < 16 * MIB,
            "16 MiB were written to a 2 MiB file system"
        );
        match dev.write_at(&chunk, offset) {
            Ok(()) => offset += chunk.len() as u64,
            Err(e) => break e,
        }
    };
    assert!(
        err.is_no_space(),
        "the full file system's error is not no-space: {err}"
    );
    assert!(err.to_string().contains("no space"), "the message: {err}");
    // Still full: the same write fails the same way, the device is not broken.
    let again = dev.write_at(&chunk, offset).unwrap_err();
    assert!(again.is_no_space(), "{again}");
    let mut back = vec![0u8; chunk.len()];
    dev.read_at(&mut back, 0).unwrap();
    assert!(
        back == chunk,
        "what was written before the file system filled reads back"
    );

    // Space freed on the host: the write goes through.
    std::fs::remove_file(&filler).unwrap();
    dev.write_at(&chunk, offset).unwrap();
    dev.flush().unwrap();

    // Filled again, space comes back by the pool's own discard.
    let mut next = offset + chunk.len() as u64;
    loop {
        assert!(
            next < 16 * MIB,
            "16 MiB were written to a 2 MiB file system"
        );
        match dev.write_at(&chunk, next) {
            Ok(()) => next += chunk.len() as u64,
            Err(e) if e.is_no_space() => break,
            Err(e) => panic!("not a no-space error: {e}"),
        }
    }
    assert_eq!(
        dev.discard(0, 512 * 1024).unwrap(),
        DiscardOutcome::Discarded
    );
    dev.write_at(&chunk, next).unwrap();
    dev.flush().unwrap();
    drop(dev);
}

#[test]
fn a_grown_file_or_loop_device_is_seen_after_refresh() {
    let dir = Scratch::new("grow");
    let path = dir.join("pool");
    let dev = FileStorage::create(&path, 4 * MIB).unwrap();
    run("truncate", &["-s", "6M", path.to_str().unwrap()]);
    assert_eq!(dev.len_bytes(), 4 * MIB, "measured at open until refreshed");
    assert!(
        dev.write_at(&[1; 4096], 5 * MIB).is_err(),
        "past the old end"
    );
    assert_eq!(dev.refresh_len().unwrap(), 6 * MIB);
    dev.write_at(&[1; 4096], 5 * MIB).unwrap();
    drop(dev);

    let backing = dir.join("backing");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    let loop_dev = LoopDevice::attach(&backing);
    let dev = FileStorage::open(Path::new(&loop_dev.0)).unwrap();
    assert_eq!(dev.len_bytes(), 4 * MIB);
    run("truncate", &["-s", "8M", backing.to_str().unwrap()]);
    assert_eq!(
        dev.refresh_len().unwrap(),
        4 * MIB,
        "the loop device has not grown yet"
    );
    run("losetup", &["-c", &loop_dev.0]);
    assert_eq!(dev.refresh_len().unwrap(), 8 * MIB);
    dev.write_at(&[2; 4096], 7 * MIB).unwrap();
    dev.flush().unwrap();
}

/// Pages of the range the direct-write tests write.
const MIXED_PAGES: usize = 16;

/// `bytes` in a page-aligned buffer.
fn page_buf(bytes: &[u8]) -> PageBuf {
    let mut buf = PageBuf::zeroed(bytes.len().div_ceil(PAGE_BYTES));
    buf.as_bytes_mut()[..bytes.len()].copy_from_slice(bytes);
    buf
}

/// Writes the first `MIXED_PAGES` pages of `dev` with direct and ordinary writes over
/// the same pages in turn, checking after each that a read returns what was written
/// last; then flushes, drops the device's cached pages and reads them from the device
/// itself (`O_DIRECT`, where `path` takes it): a page dirtied by an ordinary write
/// and then written direct must not have been written back over the direct bytes.
fn mix_direct_and_cached_writes(dev: &FileStorage, path: &Path) {
    let len = MIXED_PAGES * PAGE_BYTES;
    let page = PAGE_BYTES as u64;
    let mut model = vec![0u8; len];
    let mut write = |dev: &FileStorage, offset: usize, bytes: &[u8], direct: bool| {
        if direct {
            dev.write_pages(bytes, offset as u64).unwrap();
        } else {
            dev.write_at(bytes, offset as u64).unwrap();
        }
        model[offset..offset + bytes.len()].copy_from_slice(bytes);
        let mut back = vec![0u8; len];
        dev.read_at(&mut back, 0).unwrap();
        assert!(
            back == model,
            "after a {} write of {} bytes at {offset}, a read returned other bytes",
            if direct { "direct" } else { "cached" },
            bytes.len()
        );
    };
    // Cached pages, dirty, then direct writes over some of them.
    write(dev, 0, &data(len as u64, 1), false);
    write(
        dev,
        4 * PAGE_BYTES,
        page_buf(&data(8 * page, 2)).as_bytes(),
        true,
    );
    // A sector and a page written through the cache inside what was written direct,
    // then direct again over both.
    write(dev, 6 * PAGE_BYTES + 512, &data(512, 3), false);
    write(dev, 10 * PAGE_BYTES, &data(page, 4), false);
    write(
        dev,
        6 * PAGE_BYTES,
        page_buf(&data(6 * page, 5)).as_bytes(),
        true,
    );
    // Pages from memory that is not page-aligned: written through the cache.
    let offset_buf = page_buf(&data(3 * page, 6));
    write(
        dev,
        12 * PAGE_BYTES,
        &offset_buf.as_bytes()[512..512 + 2 * PAGE_BYTES],
        true,
    );
    write(dev, 0, page_buf(&data(2 * page, 7)).as_bytes(), true);
    dev.flush().unwrap();

    let file = std::fs::File::open(path).unwrap();
    // SAFETY: a valid descriptor; the call only advises the kernel. Clean pages (after
    // the flush) leave the cache.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise");
    let mut back = PageBuf::zeroed(MIXED_PAGES);
    let uncached = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path);
    match uncached {
        Ok(f) => f.read_exact_at(back.as_bytes_mut(), 0).unwrap(),
        Err(_) => file.read_exact_at(back.as_bytes_mut(), 0).unwrap(),
    }
    assert!(
        back.as_bytes() == model.as_slice(),
        "after the flush, the device holds other bytes than were written last"
    );
}

/// Pages written direct leave no copy in the page cache (the point of writing them
/// so): a read that may not wait for the device finds none.
fn direct_pages_are_not_cached(dev: &FileStorage) {
    let at = (MIXED_PAGES * PAGE_BYTES) as u64;
    dev.write_pages(page_buf(&data(4 * PAGE_BYTES as u64, 8)).as_bytes(), at)
        .unwrap();
    let mut buf = vec![0u8; 4 * PAGE_BYTES];
    assert!(
        !dev.read_at_cached(&mut buf, at).unwrap(),
        "pages written direct were found in the page cache"
    );
    dev.read_at(&mut buf, at).unwrap();
    assert!(
        buf == data(4 * PAGE_BYTES as u64, 8),
        "direct pages read back wrong"
    );
}

#[test]
fn direct_and_cached_writes_of_the_same_pages_read_back_the_last_on_a_disk() {
    let dir = Scratch::new("direct-file");
    let path = dir.join("pool");
    let dev = FileStorage::create(&path, 4 * MIB).unwrap();
    assert!(
        dev.writes_pages_direct(),
        "the build's disk file system took no O_DIRECT open"
    );
    mix_direct_and_cached_writes(&dev, &path);
    direct_pages_are_not_cached(&dev);
}

#[test]
fn direct_and_cached_writes_of_the_same_pages_read_back_the_last_on_a_loop_device() {
    let dir = Scratch::new("direct-loop");
    let backing = dir.join("backing");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    let loop_dev = LoopDevice::attach(&backing);
    let path = Path::new(&loop_dev.0);
    // Opened with O_EXCL, as a pool's device is: the direct descriptor opens without it.
    let dev = FileStorage::open(path).unwrap();
    assert!(
        dev.writes_pages_direct(),
        "a loop device took no O_DIRECT open"
    );
    mix_direct_and_cached_writes(&dev, path);
    direct_pages_are_not_cached(&dev);
}

#[test]
fn a_pool_file_on_tmpfs_takes_direct_and_cached_writes() {
    // tmpfs takes O_DIRECT since Linux 6.6 (as an ordinary write), and refused it
    // before: either way every write must read back.
    let dir = Path::new("/dev/shm").join(format!("fewerbytes-direct-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pool");
    let dev = FileStorage::create(&path, 4 * MIB).unwrap();
    mix_direct_and_cached_writes(&dev, &path);
    drop(dev);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_file_system_that_refuses_direct_writes_gets_them_through_the_cache() {
    // ramfs has no direct I/O at all: the open with O_DIRECT fails (EINVAL).
    let dir = Scratch::new("direct-ramfs");
    let _mount = Mount::new(&["-t", "ramfs", "none"], &dir.join("mnt"));
    let path = dir.join("mnt/pool");
    let dev = FileStorage::create(&path, 4 * MIB).unwrap();
    assert!(
        !dev.writes_pages_direct(),
        "ramfs took an O_DIRECT open: this test no longer tests the fallback"
    );
    mix_direct_and_cached_writes(&dev, &path);
    drop(dev);
}
