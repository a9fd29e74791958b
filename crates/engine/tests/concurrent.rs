//! Many threads writing, trimming and flushing at once, across background
//! checkpoints; then a crash. Flushed data must read back exactly and the
//! reference counts must audit clean, before and after the crash.

mod common;
use common::*;
use fewerbytes_engine::storage::CrashMode;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

const THREADS: u64 = 4;
const BLOCKS_PER_THREAD: u64 = 512;

#[test]
fn concurrent_writers_survive_checkpoints_and_a_crash() {
    let mut t = create(64 << 20, None);
    let p = t.pool().clone();
    p.create_volume("a", THREADS * BLOCKS_PER_THREAD * BLOCK as u64)
        .unwrap();
    let expected: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|n| {
                let p = Arc::clone(&p);
                s.spawn(move || {
                    let vol = p.open_volume("a").unwrap();
                    let mut mix = Mix::new(n);
                    let mut rng = rand::rngs::StdRng::seed_from_u64(100 + n);
                    let base = n * BLOCKS_PER_THREAD;
                    let mut mine = vec![vec![0u8; BLOCK]; BLOCKS_PER_THREAD as usize];
                    // Each thread owns its range; 12 passes of overwrites force
                    // frees, stale advice and several checkpoints.
                    for i in 0..BLOCKS_PER_THREAD * 12 {
                        let b = rng.gen_range(0..BLOCKS_PER_THREAD);
                        if i % 97 == 0 {
                            vol.trim((base + b) * BLOCK as u64, BLOCK as u64, false)
                                .unwrap();
                            mine[b as usize] = vec![0; BLOCK];
                            continue;
                        }
                        let data = mix.next_block();
                        vol.write((base + b) * BLOCK as u64, &data, i % 50 == 0)
                            .unwrap();
                        mine[b as usize] = data;
                        if i % 300 == 0 {
                            vol.flush().unwrap();
                        }
                    }
                    vol.flush().unwrap();
                    mine
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        p.stats().checkpoints > 1,
        "the run should span background checkpoints"
    );
    let verify = |t: &TestPool| {
        let vol = t.pool().open_volume("a").unwrap();
        let mut buf = vec![0u8; BLOCK];
        for (n, blocks) in expected.iter().enumerate() {
            for (b, want) in blocks.iter().enumerate() {
                vol.read(
                    ((n as u64) * BLOCKS_PER_THREAD + b as u64) * BLOCK as u64,
                    &mut buf,
                )
                .unwrap();
                assert!(&buf == want, "thread {n} block {b}");
            }
        }
        let audit = t.pool().audit();
        assert!(
            audit.problems.is_empty(),
            "{:?}",
            &audit.problems[..audit.problems.len().min(5)]
        );
    };
    verify(&t);
    drop(p);
    t.crash(CrashMode::Random(7));
    verify(&t);
}
