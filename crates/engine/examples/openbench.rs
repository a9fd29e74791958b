//! Open time of a pool holding GIB GiB of random data (every block distinct, stored
//! whole), after a clean close or after a crash (the filling process exits without
//! closing: the next open replays the journal). With `small` after `clean` or
//! `crash`, every block is distinct but compresses to a few dozen bytes (a unique
//! 16-byte head, zeros after): as many objects and fingerprints, a fraction of the
//! disk (64 GiB stored in about 2 GiB of pool file).
//!
//!   cargo run --release -p fewerbytes-engine --example openbench -- fill /var/tmp/ob.pool 8 clean
//!   cargo run --release -p fewerbytes-engine --example openbench -- open /var/tmp/ob.pool
//!   cargo run --release -p fewerbytes-engine --example openbench -- fill /var/tmp/ob.pool 8 crash
//!   cargo run --release -p fewerbytes-engine --example openbench -- open /var/tmp/ob.pool
//!
//! `open` prints the seconds until `Pool::open` returned (the pool serves from
//! then on) and until the dedup index was ready, then closes the pool cleanly. As
//! the command line does, a clean close saves the index beside the pool
//! (`<pool>.index`) and an open loads it; `open-rebuild` removes that file first,
//! so the open rebuilds the index from the object records (the baseline).
//!
//!   cargo run --release -p fewerbytes-engine --example openbench -- open-rebuild /var/tmp/ob.pool

use fewerbytes_engine::{CreateOptions, OpenOptions, Pool, SavedIndex};
use rand::{RngCore, SeedableRng};
use std::path::{Path, PathBuf};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("open");
    let path = PathBuf::from(
        args.get(2)
            .cloned()
            .unwrap_or_else(|| "/var/tmp/openbench.pool".into()),
    );
    match mode {
        "fill" => {
            let gib: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(8);
            let crash = args.get(4).is_some_and(|s| s == "crash");
            let small = args.get(5).is_some_and(|s| s == "small");
            fill(&path, gib, crash, small);
        }
        "open-rebuild" => {
            let mut saved = path.clone().into_os_string();
            saved.push(".index");
            match std::fs::remove_file(&saved) {
                Ok(()) => eprintln!("removed {}", PathBuf::from(saved).display()),
                Err(e) => eprintln!("no saved index removed: {e}"),
            }
            open(&path);
        }
        _ => open(&path),
    }
}

fn fill(path: &Path, gib: u64, crash: bool, small: bool) {
    let _ = std::fs::remove_file(path);
    // Room for the data, the metadata (2%) and the reserve.
    Pool::create(&CreateOptions {
        path: path.to_path_buf(),
        size_bytes: Some((gib + gib / 8 + 1) << 30),
        ..Default::default()
    })
    .expect("create");
    let pool = Pool::open(path, &saving()).expect("open");
    pool.create_volume("v", gib << 30).expect("volume");
    let start = Instant::now();
    let threads = 2u64;
    let chunk = 1u64 << 20;
    let chunks = (gib << 30) / chunk;
    std::thread::scope(|s| {
        for t in 0..threads {
            let vol = pool.open_volume("v").expect("open volume");
            s.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(t + 1);
                let mut buf = vec![0u8; chunk as usize];
                let mut c = t;
                while c < chunks {
                    if small {
                        for block in buf.chunks_mut(4096) {
                            rng.fill_bytes(&mut block[..16]);
                        }
                    } else {
                        rng.fill_bytes(&mut buf);
                    }
                    vol.write(c * chunk, &buf, false).expect("write");
                    c += threads;
                }
                vol.flush().expect("flush");
            });
        }
    });
    pool.flush().expect("flush");
    eprintln!(
        "filled {gib} GiB of {} in {:.1} s",
        if small {
            "distinct compressible blocks"
        } else {
            "random data"
        },
        start.elapsed().as_secs_f64()
    );
    if crash {
        // No close: the next open finds the pool as a crash leaves it (every write
        // flushed, its journal not yet checkpointed).
        eprintln!("exiting without closing (a crash)");
        std::process::exit(0);
    }
    // Saved by the close only once built (as after a day of serving).
    pool.wait_index_built();
    let closing = Instant::now();
    pool.close().expect("close");
    println!(
        "close (final checkpoint and the saved index) took {:.2} s",
        closing.elapsed().as_secs_f64()
    );
}

/// The command line's opens: the index saved beside the pool.
fn saving() -> OpenOptions {
    OpenOptions {
        saved_index: SavedIndex::Beside,
        ..OpenOptions::default()
    }
}

fn open(path: &Path) {
    let start = Instant::now();
    let pool = Pool::open(path, &saving()).expect("open");
    let opened = start.elapsed().as_secs_f64();
    pool.wait_index_built();
    let ready = start.elapsed().as_secs_f64();
    let stats = pool.stats();
    println!(
        "open returned after {opened:.2} s; dedup index ready after {ready:.2} s ({} objects, \
         index {})",
        stats.objects, stats.index
    );
    let closing = Instant::now();
    pool.close().expect("close");
    println!(
        "close (final checkpoint and the saved index) took {:.2} s",
        closing.elapsed().as_secs_f64()
    );
}
