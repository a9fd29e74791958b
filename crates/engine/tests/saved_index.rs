//! The dedup index saved at a clean close and loaded by the next open
//! (`index_save.rs`): a reopened pool dedups a second copy at once, with no rebuild;
//! a saved index that is torn, flipped, stale (an older close's, or a crash since),
//! another pool's or of another shape is detected and rebuilt, never trusted.

mod common;

use common::{create, random_block, TestPool, BLOCK};
use fewerbytes_engine::storage::CrashMode;
use fewerbytes_engine::{IndexState, OpenOptions, Pool, SavedIndex};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

const BLOCKS: u64 = 300;

fn saving(path: &Path) -> OpenOptions {
    OpenOptions {
        threads: Some(2),
        saved_index: SavedIndex::At(path.to_path_buf()),
        ..OpenOptions::default()
    }
}

/// The build held: a rebuild shows as "rebuilding", never as ready by chance.
fn saving_held(path: &Path) -> OpenOptions {
    OpenOptions {
        hold_index_build: true,
        take_over: None,
        ..saving(path)
    }
}

fn write_copy(pool: &Arc<Pool>, volume: &str, seed: u64) {
    let vol = pool.open_volume(volume).expect("volume");
    for i in 0..BLOCKS {
        vol.write(i * BLOCK as u64, &random_block(seed + i), false)
            .expect("write");
    }
    vol.flush().expect("flush");
}

/// A directory of its own, removed with it.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("fb-saved-index-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Dir(dir)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Saved {
    t: TestPool,
    dir: Dir,
}

impl Saved {
    fn path(&self) -> PathBuf {
        self.dir.0.join("pool.index")
    }

    /// Reopen with the saved index, the build held.
    fn open(&mut self) {
        let opts = saving_held(&self.path());
        self.t.open_with(&opts);
    }
}

/// A pool holding `BLOCKS` distinct blocks in volume "a", its index built and saved
/// by a clean close.
fn saved_pool() -> Saved {
    let dir = Dir::new();
    let mut t = create(64 << 20, None);
    t.pool().create_volume("a", 8 << 20).expect("volume a");
    t.pool().create_volume("b", 8 << 20).expect("volume b");
    t.close();
    let s = Saved { t, dir };
    let mut s = s;
    s.t.open_with(&saving(&s.path()));
    write_copy(s.t.pool(), "a", 1000);
    s.t.pool().wait_index_built();
    s.t.close();
    assert!(
        s.path().exists(),
        "a clean close with a ready index saves it"
    );
    s
}

/// Whether the open loaded the saved index (ready at once, not rebuilt).
fn loaded(pool: &Pool) -> bool {
    let status = pool.index_status();
    match (status.state, status.loaded) {
        (IndexState::Ready, true) => true,
        (IndexState::Rebuilding, false) => false,
        other => panic!("the index is {other:?}: neither loaded nor rebuilding"),
    }
}

#[test]
fn a_clean_restart_loads_the_saved_index_and_dedups_at_once() {
    let mut s = saved_pool();
    s.open();
    let p = s.t.pool().clone();
    assert!(loaded(&p), "the saved index was not loaded");
    assert!(
        p.index_status().to_string().contains("loaded"),
        "{}",
        p.index_status()
    );
    assert!(!s.path().exists(), "a loaded index's file is removed");
    // The build is held and never ran: the second copy finds the first through the
    // loaded table alone.
    write_copy(&p, "b", 1000);
    let stats = p.stats();
    assert_eq!(stats.objects, BLOCKS, "the second copy deduplicated");
    assert_eq!(stats.index.blocks_stored_while_rebuilding, 0);
    // Saved again by the next close, and loaded again.
    s.t.close();
    assert!(s.path().exists());
    s.open();
    assert!(loaded(s.t.pool()));
}

#[test]
fn a_flipped_byte_anywhere_in_the_saved_index_is_caught_and_rebuilt() {
    let mut s = saved_pool();
    let len = std::fs::metadata(s.path()).expect("saved index").len() as usize;
    // The header, a shard in the middle, the last shard's checksum, the end marker.
    for at in [20, len / 2, len - 9, len - 1] {
        // Each close saves the index of its own checkpoint: flip that one.
        let mut bad = std::fs::read(s.path()).expect("saved index");
        assert_eq!(bad.len(), len);
        bad[at] ^= 0x40;
        std::fs::write(s.path(), &bad).expect("write");
        s.open();
        let p = s.t.pool().clone();
        assert!(!loaded(&p), "a flip at byte {at} of {len} was trusted");
        assert!(!s.path().exists(), "a refused file is removed");
        p.release_index_build();
        p.wait_index_built();
        // Rebuilt, it dedups as before.
        write_copy(&p, "b", 1000);
        assert_eq!(p.stats().objects, BLOCKS, "flip at {at}: rebuilt index");
        p.delete_volume("b", false).expect("delete b");
        p.create_volume("b", 8 << 20).expect("volume b");
        s.t.close();
    }
}

#[test]
fn a_torn_or_empty_saved_index_is_rebuilt() {
    let mut s = saved_pool();
    let len = std::fs::metadata(s.path()).expect("saved index").len() as usize;
    for cut in [0, 50, len / 3, len - 1, len + 1] {
        let mut bytes = std::fs::read(s.path()).expect("saved index");
        bytes.resize(cut, 0);
        std::fs::write(s.path(), &bytes).expect("write");
        s.open();
        let p = s.t.pool().clone();
        assert!(!loaded(&p), "a file of {cut} bytes of {len} was trusted");
        p.release_index_build();
        p.wait_index_built();
        s.t.close();
    }
}

#[test]
fn an_older_close_s_index_is_stale_and_rebuilt() {
    let mut s = saved_pool();
    let older = std::fs::read(s.path()).expect("saved index");
    // Another open and close: the pool's state moved on (a volume freed).
    s.open();
    s.t.pool().delete_volume("a", false).expect("delete a");
    s.t.close();
    std::fs::write(s.path(), &older).expect("the older file back");
    s.open();
    let p = s.t.pool().clone();
    assert!(!loaded(&p), "an older close's index was trusted");
    p.release_index_build();
    p.wait_index_built();
    // Nothing of "a" is left to find: a stale table would have named its objects.
    write_copy(&p, "b", 1000);
    assert_eq!(p.stats().objects, BLOCKS);
}

#[test]
fn a_crash_after_the_open_makes_the_saved_index_stale() {
    let mut s = saved_pool();
    let saved = std::fs::read(s.path()).expect("saved index");
    s.open();
    assert!(loaded(s.t.pool()));
    // Written and flushed, then killed: the journal holds what the index missed.
    s.t.pool().delete_volume("a", false).expect("delete a");
    write_copy(s.t.pool(), "b", 5000);
    // Even the file put back (it was removed at the load) is not trusted.
    std::fs::write(s.path(), &saved).expect("the file back");
    let opts = saving_held(&s.path());
    s.t.crash_then_open_with(CrashMode::KeepAll, &opts);
    let p = s.t.pool().clone();
    assert!(!loaded(&p), "a saved index was trusted after a crash");
    p.release_index_build();
    p.wait_index_built();
    assert_eq!(p.stats().objects, BLOCKS, "b's blocks, a's freed");
}

#[test]
fn an_index_of_another_pool_or_another_size_is_not_loaded() {
    let mut s = saved_pool();
    let ours = std::fs::read(s.path()).expect("saved index");
    // Another pool's saved index, of the same shape.
    let other = saved_pool();
    std::fs::write(s.path(), std::fs::read(other.path()).expect("other")).expect("write");
    s.open();
    assert!(!loaded(s.t.pool()), "another pool's index was trusted");
    s.t.close();
    // This pool's, opened with another index memory.
    std::fs::write(s.path(), &ours).expect("write");
    let opts = OpenOptions {
        index_memory_bytes: Some(1 << 20),
        ..saving_held(&s.path())
    };
    s.t.open_with(&opts);
    assert!(!loaded(s.t.pool()), "an index of another shape was loaded");
}

#[test]
fn a_close_before_the_index_is_built_saves_nothing() {
    let mut s = saved_pool();
    std::fs::remove_file(s.path()).expect("remove");
    s.open(); // held: never ready
    assert!(!loaded(s.t.pool()));
    s.t.close();
    assert!(!s.path().exists(), "a partial index was saved");
}

#[test]
fn a_read_only_open_leaves_the_saved_index_alone() {
    let s = saved_pool();
    let before = std::fs::read(s.path()).expect("saved index");
    let p = Pool::open_devices_read_only(
        s.t.dev.clone() as Arc<dyn fewerbytes_engine::storage::Storage>,
        None,
        &saving(&s.path()),
    )
    .expect("open read-only");
    assert_eq!(p.index_status().state, IndexState::NotBuilt);
    p.close().expect("close");
    assert_eq!(std::fs::read(s.path()).expect("still there"), before);
}

#[test]
fn an_empty_table_saves_as_a_few_kib_and_loads_as_empty() {
    let dir = Dir::new();
    let path = dir.0.join("pool.index");
    // 256 MiB of pool: a table of about a MiB, nothing in it.
    let mut t = create(256 << 20, None);
    t.close();
    t.open_with(&saving(&path));
    t.pool().wait_index_built();
    let memory = t.pool().stats().limits;
    t.close();
    let len = std::fs::metadata(&path).expect("saved").len();
    assert!(
        len < 8 << 10,
        "an empty table saved as {len} bytes (runs of zeros must not be saved); {memory:?}"
    );
    t.open_with(&saving_held(&path));
    let p = t.pool().clone();
    assert!(loaded(&p));
    // Loaded empty: a first copy is stored, a second found through the table.
    p.create_volume("c", 8 << 20).expect("volume");
    write_copy(&p, "c", 77);
    p.create_volume("d", 8 << 20).expect("volume");
    write_copy(&p, "d", 77);
    assert_eq!(p.stats().objects, BLOCKS);
}
