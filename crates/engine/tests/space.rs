//! Space: the seed's mix (75% duplicate, 50% compressible in 512-byte chunks) written
//! in 4 KiB requests with a flush every 256 stores at most 14% of the guest bytes as
//! data (the performance target for the mix) and at most 2% as metadata, counted by the
//! engine's own per-device byte counters. The workload is seeded, but the figure is
//! not exact: when the commit thread's group commits and the compaction thread run
//! depends on the machine's load (13.2% on an idle machine, 13.6% at load 20).

mod common;
use common::*;
use fewerbytes_engine::storage::Storage;
use rand::{Rng, SeedableRng};

#[test]
fn seed_mix_reaches_the_drive_as_at_most_14_percent_data_and_2_percent_metadata() {
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
        data / guest <= 0.14,
        "data is {:.2}% of guest bytes",
        100.0 * data / guest
    );
    assert!(
        meta / guest <= 0.02,
        "metadata is {:.2}% of guest bytes",
        100.0 * meta / guest
    );
}
