//! In-process write throughput of the engine (no NBD): THREADS threads write the
//! seed's mix (75% duplicate, 50% compressible) as 4 KiB random writes, then flush.
//! With `random` as the fourth argument every block is new random data instead; a
//! fifth names the pool's compression (lz4, zstd, zstd:LEVEL, none).
//!
//!   cargo run --release -p fewerbytes-engine --example writebench -- /var/tmp/wb.pool 4 65536
//!   cargo run --release -p fewerbytes-engine --example writebench -- /var/tmp/wb.pool 2 65536 random zstd
//!
//! `WRITEBENCH_FLUSH_EVERY=N` makes each thread flush after every N of its writes (a
//! guest that syncs often: small journal commits).

use fewerbytes_engine::{Compression, CreateOptions, OpenOptions, Pool};
use rand::{Rng, RngCore, SeedableRng};
use std::path::PathBuf;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = PathBuf::from(
        args.get(1)
            .cloned()
            .unwrap_or_else(|| "/var/tmp/writebench.pool".into()),
    );
    let threads: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2);
    let writes: u64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(65536);
    let random = args.get(4).is_some_and(|s| s == "random");
    let compression: Compression = args
        .get(5)
        .map(|s| {
            s.parse()
                .expect("compression: lz4, zstd, zstd:LEVEL or none")
        })
        .unwrap_or_default();
    let flush_every: u64 = std::env::var("WRITEBENCH_FLUSH_EVERY")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let _ = std::fs::remove_file(&path);
    let volume_bytes: u64 = 2 << 30;
    Pool::create(&CreateOptions {
        path: path.clone(),
        size_bytes: Some(4 << 30),
        compression,
        ..Default::default()
    })
    .expect("create");
    let pool = Pool::open(&path, &OpenOptions::default()).expect("open");
    pool.create_volume("v", volume_bytes).expect("volume");
    // Pre-generate the uniques so generation is not measured.
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let uniques: Vec<Vec<u8>> = (0..4096)
        .map(|_| {
            let mut b = vec![0u8; 4096];
            for c in b.chunks_mut(512) {
                rng.fill_bytes(&mut c[..256]);
            }
            b
        })
        .collect();
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let pool = pool.clone();
            let uniques = &uniques;
            s.spawn(move || {
                let vol = pool.open_volume("v").unwrap();
                let mut rng = rand::rngs::StdRng::seed_from_u64(t);
                let mut fresh = vec![0u8; 4096];
                for n in 1..=writes / threads {
                    let lbn = rng.gen_range(0..volume_bytes / 4096);
                    if random {
                        rng.fill_bytes(&mut fresh);
                        vol.write(lbn * 4096, &fresh, false).unwrap();
                    } else if rng.gen_range(0..4) == 0 {
                        for c in fresh.chunks_mut(512) {
                            rng.fill_bytes(&mut c[..256]);
                        }
                        vol.write(lbn * 4096, &fresh, false).unwrap();
                    } else {
                        vol.write(lbn * 4096, &uniques[rng.gen_range(0..uniques.len())], false)
                            .unwrap();
                    }
                    if flush_every > 0 && n % flush_every == 0 {
                        vol.flush().unwrap();
                    }
                }
            });
        }
    });
    pool.flush().unwrap();
    let secs = start.elapsed().as_secs_f64();
    let st = pool.stats();
    println!(
        "{threads} threads, {writes} writes ({}, {compression}): {:.0} writes/s, {:.1} MiB/s; data written {:.1}% of guest bytes, {} checkpoints, {} commits",
        if random { "random" } else { "mix" },
        writes as f64 / secs,
        writes as f64 * 4096.0 / secs / 1048576.0,
        100.0 * st.data_device.write_bytes as f64 / (writes * 4096) as f64,
        st.checkpoints,
        st.journal_commits
    );
    let journal_bytes = st
        .metadata_written_by_region
        .iter()
        .find(|(region, _)| region.contains("journal"))
        .map_or(0, |(_, bytes)| *bytes);
    println!(
        "journal: {journal_bytes} bytes written, {:.2}% of guest bytes, {:.0} bytes per commit",
        100.0 * journal_bytes as f64 / (writes * 4096) as f64,
        journal_bytes as f64 / st.journal_commits.max(1) as f64
    );
    pool.close().unwrap();
    let _ = std::fs::remove_file(&path);
}
