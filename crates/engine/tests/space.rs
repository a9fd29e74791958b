//! Space: the seed's mix (75% duplicate, 50% compressible in 512-byte chunks) written
//! in 4 KiB requests with a flush every 256 stores reaches the drive as at most 15% of
//! the guest bytes as data and at most 2% as metadata, counted by the engine's own
//! per-device byte counters. The workload is seeded, but the figure is not exact: when
//! the commit thread's group commits (each rewrites a partial packed block's sector)
//! and the compaction thread run depends on the machine's load (13.2% on an idle
//! machine, 13.6% at load 20, 14.27% once in CI beside parallel builds). So the bound
//! here is a regression guard above that noise; the target (14%, and 13.5% for issue
//! work) is measured in docs/benchmarks.md, not asserted.

mod common;
use common::*;
use fewerbytes_engine::storage::Storage;
use rand::{Rng, SeedableRng};

#[test]
fn seed_mix_reaches_the_drive_as_at_most_15_percent_data_and_2_percent_metadata() {
    let mut t = create(1 << 30, Some(64 << 20));
    let p = t.pool().clone();
    let volume_bytes: u64 = 512 << 20;
    p.create_volume("mix", volume_bytes).unwrap();
    let vol = p.open_volume("mix").unwrap();
    let data_before = t.dev.counters().snapshot().write_bytes;
    let meta_before = t.meta.as_ref().unwrap().counters().snapshot().write_bytes;
    let mut mix = Mix::new(75);
    let mut rng = rand::rngs::StdRng::seed_from_u64(50);
    let writes = 65_536u64;
    for n in 0..writes {
        let lbn = rng.gen_range(0..volume_bytes / BLOCK as u64);
        vol.write(lbn * BLOCK as u64, &mix.next_block(), false)
            .unwrap();
        if n % 256 == 255 {
            vol.flush().unwrap();
        }
    }
    vol.flush().unwrap();
    assert!(p.audit().problems.is_empty());
    let regions = p.stats().metadata_written_by_region;
    drop(vol);
    drop(p);
    // Closing takes the final checkpoint: its block-map and slab pages count too.
    t.pool.take().unwrap().close().unwrap();
    let guest = (writes * BLOCK as u64) as f64;
    let data = (t.dev.counters().snapshot().write_bytes - data_before) as f64;
    let meta = (t.meta.as_ref().unwrap().counters().snapshot().write_bytes - meta_before) as f64;
    eprintln!(
        "guest {guest} B, data {:.2}%, metadata {:.2}% (before close: {regions:?})",
        100.0 * data / guest,
        100.0 * meta / guest
    );
    assert!(
        data / guest <= 0.15,
        "data is {:.2}% of guest bytes",
        100.0 * data / guest
    );
    assert!(
        meta / guest <= 0.02,
        "metadata is {:.2}% of guest bytes",
        100.0 * meta / guest
    );
}
