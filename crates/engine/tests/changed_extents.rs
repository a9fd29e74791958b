//! Changed blocks of a volume against a snapshot of it (`Volume::changed_extents`,
//! `Pool::changed_extents`: what `volume diff` and the NBD context
//! `qemu:dirty-bitmap:SNAP` answer): exactly the blocks whose data differs, on a
//! thin 4 PiB volume as on a small one, found by walking the map pages written (a
//! walk over every page of 4 PiB would not end within the test run).

mod common;

use common::{create, random_block, BLOCK};
use fewerbytes_engine::{ChangedExtent, Provisioning};
use fewerbytes_format::dir_tree::MAX_VOLUME_BYTES;

const B: u64 = BLOCK as u64;

/// The changed runs as (offset, length) in bytes.
fn changed(runs: &[ChangedExtent]) -> Vec<(u64, u64)> {
    let mut at = 0;
    let mut out = Vec::new();
    for run in runs {
        if run.changed {
            out.push((at, run.len_bytes));
        }
        at += run.len_bytes;
    }
    out
}

#[test]
fn a_thin_4_pib_volume_differs_from_its_snapshot_exactly_where_written_since() {
    let t = create(64 << 20, None);
    let pool = t.pool().clone();
    pool.create_volume_with("vm", MAX_VOLUME_BYTES, Provisioning::THIN)
        .unwrap();
    let last = MAX_VOLUME_BYTES / B - 1;
    let vol = pool.open_volume("vm").unwrap();
    for (k, lbn) in [0, 1 << 30, last].into_iter().enumerate() {
        vol.write(lbn * B, &random_block(k as u64), false).unwrap();
    }
    pool.clone_volume_with("vm", "snap", Provisioning::THIN)
        .unwrap();
    assert_eq!(
        changed(&pool.changed_extents("vm", "snap").unwrap()),
        [],
        "a fresh snapshot: nothing changed"
    );
    // Since: a block at 3 TiB, in a page never written before, a rewrite of the last block
    // with other bytes, a rewrite of the first with the same bytes (it dedups to the
    // same stored block: no change), and a trim of the block at 4 TiB (block 2^30).
    vol.write((3 << 40) / B * B, &random_block(10), false)
        .unwrap();
    vol.write(last * B, &random_block(11), false).unwrap();
    vol.write(0, &random_block(0), false).unwrap();
    vol.trim((1 << 30) * B, B, false).unwrap();
    let expected = [((3 << 40) / B * B, B), ((1 << 30) * B, B), (last * B, B)];
    let runs = pool.changed_extents("vm", "snap").unwrap();
    assert_eq!(changed(&runs), expected);
    assert_eq!(
        runs.iter().map(|r| r.len_bytes).sum::<u64>(),
        MAX_VOLUME_BYTES,
        "the runs cover the volume"
    );
    // Through a handle, over a range that starts and ends inside blocks.
    let snap = pool.open_volume("snap").unwrap();
    let around = vol
        .changed_extents(&snap, (1 << 30) * B - 100, 2 * B)
        .unwrap();
    assert_eq!(
        around,
        [
            ChangedExtent {
                len_bytes: 100,
                changed: false
            },
            ChangedExtent {
                len_bytes: B,
                changed: true
            },
            ChangedExtent {
                len_bytes: B - 100,
                changed: false
            },
        ]
    );
    // The other way round, the same blocks differ.
    assert_eq!(
        changed(&pool.changed_extents("snap", "vm").unwrap()),
        expected
    );
}
