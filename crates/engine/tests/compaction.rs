//! Overwriting compressed data leaves packed blocks partly dead (packing waste).
//! Compaction moves the live fragments out so the space comes back, without
//! changing a byte a guest reads, and stays exact across a crash.

mod common;
use common::*;
use fewerbytes_engine::storage::CrashMode;

#[test]
fn compaction_reclaims_packing_waste_and_keeps_every_byte() {
    let mut t = create(256 << 20, None);
    let p = t.pool().clone();
    let blocks = 8192u64; // 32 MiB volume
    p.create_volume("v", blocks * BLOCK as u64).unwrap();
    let vol = p.open_volume("v").unwrap();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(3);
    let mut current = vec![Vec::new(); blocks as usize];
    // Two passes: the second overwrites every other block, so every packed block
    // written by the first loses about half its fragments.
    for pass in 0..2u64 {
        for b in (0..blocks).filter(|b| pass == 0 || b % 2 == 1) {
            let mut data = vec![0u8; BLOCK];
            compressible(&mut rng, &mut data);
            vol.write(b * BLOCK as u64, &data, false).unwrap();
            current[b as usize] = data;
        }
        vol.flush().unwrap();
    }
    // Every other fragment is dead: about half of each packed block. Compaction
    // (in the background, and here explicitly until nothing is left to do) moves
    // the live halves together.
    // The background compactor works on the same slabs at the same time, so one
    // explicit round that empties nothing does not mean nothing is left: stop after
    // three such rounds in a row, each after a flush (which ends the packers' open
    // blocks, the ones compaction must leave alone).
    let mut emptied = 0;
    let mut idle = 0;
    for _ in 0..200 {
        let n = p.compact().unwrap();
        emptied += n;
        idle = if n == 0 { idle + 1 } else { 0 };
        if idle == 3 {
            break;
        }
        vol.flush().unwrap();
    }
    vol.flush().unwrap();
    let after = p.stats();
    eprintln!(
        "after compaction: waste {} bytes for {} compressed, data used {} bytes, {} blocks emptied ({emptied} by the last calls)",
        after.packing_waste_bytes, after.compressed_bytes, after.space.stored_bytes, after.compacted_blocks
    );
    assert!(after.compacted_blocks > 0, "nothing was compacted");
    assert!(
        after.packing_waste_bytes * 3 < after.compressed_bytes,
        "packing waste {} is still over a third of the compressed bytes {}",
        after.packing_waste_bytes,
        after.compressed_bytes
    );
    let check = |t: &TestPool| {
        let vol = t.pool().open_volume("v").unwrap();
        let mut buf = vec![0u8; BLOCK];
        for (b, want) in current.iter().enumerate() {
            vol.read(b as u64 * BLOCK as u64, &mut buf).unwrap();
            assert!(&buf == want, "block {b} changed");
        }
        let audit = t.pool().audit();
        assert!(
            audit.problems.is_empty(),
            "{:?}",
            &audit.problems[..audit.problems.len().min(5)]
        );
    };
    check(&t);
    drop(vol);
    drop(p);
    t.crash(CrashMode::DropAll);
    check(&t);
}
