//! Metadata bytes of one checkpoint, by region, on a simple workload: a 256 MiB
//! volume of a 1 GiB pool written whole with the seed's mix (one checkpoint), then
//! 2,000 random 4 KiB overwrites and the checkpoint a volume operation takes.

mod common;
use common::*;
use rand::{Rng, SeedableRng};

fn regions(t: &TestPool) -> Vec<(String, u64)> {
    t.pool().stats().metadata_written_by_region
}

fn delta(before: &[(String, u64)], after: &[(String, u64)]) -> Vec<(String, u64)> {
    after
        .iter()
        .map(|(name, bytes)| {
            let was = before
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0, |(_, b)| *b);
            (name.clone(), bytes - was)
        })
        .filter(|(_, b)| *b > 0)
        .collect()
}

#[test]
#[ignore = "a measurement: prints a checkpoint's metadata bytes by region; run by hand with --ignored --nocapture"]
fn checkpoint_metadata_bytes() {
    let t = create(1 << 30, None);
    t.pool().create_volume("a", 256 << 20).unwrap();
    let vol = t.pool().open_volume("a").unwrap();
    let mut mix = Mix::new(7);
    let blocks = (256 << 20) / BLOCK as u64;
    for lbn in 0..blocks {
        vol.write(lbn * BLOCK as u64, &mix.next_block(), false)
            .unwrap();
    }
    vol.flush().unwrap();
    let before = regions(&t);
    t.pool().create_volume("ck1", 4096).unwrap();
    let after = regions(&t);
    println!(
        "checkpoint after {blocks} sequential writes: {:?}",
        delta(&before, &after)
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for _ in 0..2000 {
        let lbn = rng.gen_range(0..blocks);
        vol.write(lbn * BLOCK as u64, &mix.next_block(), false)
            .unwrap();
    }
    vol.flush().unwrap();
    let before = regions(&t);
    t.pool().create_volume("ck2", 4096).unwrap();
    let after = regions(&t);
    println!(
        "checkpoint after 2000 random overwrites: {:?}",
        delta(&before, &after)
    );
}
