//! Rolling a volume back to a snapshot (`Pool::rollback_volume`): the volume then
//! holds the snapshot's bytes at the snapshot's size, what only the rolled-back
//! writes held is freed, the snapshot is untouched, and the step is durable on
//! return. Refused while the volume is open. (Crashes in the middle: the crash
//! simulation's workloads roll back too.)

mod common;

use common::{create, read_all, write_blocks, BLOCK};
use fewerbytes_engine::EngineError;

const BLOCKS: u64 = 64;

#[test]
fn a_rolled_back_volume_reads_its_snapshot_and_frees_what_only_it_held() {
    let mut t = create(64 << 20, None);
    let p = t.pool().clone();
    p.create_volume("vm", BLOCKS * BLOCK as u64)
        .expect("create");
    write_blocks(&p, "vm", 0, BLOCKS, 1);
    p.clone_volume("vm", "snap").expect("snapshot");
    let at_snapshot = read_all(&p, "vm");
    let objects_at_snapshot = p.stats().objects;
    // After the snapshot: half the blocks overwritten, and the volume grown.
    write_blocks(&p, "vm", 0, BLOCKS / 2, 1000);
    p.resize_volume("vm", 2 * BLOCKS * BLOCK as u64, false)
        .expect("grow");
    write_blocks(&p, "vm", BLOCKS, 4, 2000);
    assert_eq!(p.stats().objects, objects_at_snapshot + BLOCKS / 2 + 4);
    assert_ne!(read_all(&p, "vm")[..at_snapshot.len()], at_snapshot[..]);

    let info = p.rollback_volume("vm", "snap").expect("rollback");
    assert_eq!(
        info.size_bytes,
        BLOCKS * BLOCK as u64,
        "the snapshot's size"
    );
    assert_eq!(read_all(&p, "vm"), at_snapshot);
    assert_eq!(
        read_all(&p, "snap"),
        at_snapshot,
        "the snapshot is untouched"
    );
    assert_eq!(
        p.stats().objects,
        objects_at_snapshot,
        "the blocks only the rolled-back writes held are freed"
    );
    assert!(p.audit().problems.is_empty(), "{:?}", p.audit().problems);

    // Durable on return: a crash right after keeps it.
    t.crash(fewerbytes_engine::storage::CrashMode::DropAll);
    let p = t.pool().clone();
    assert_eq!(read_all(&p, "vm"), at_snapshot);
    assert_eq!(p.stats().objects, objects_at_snapshot);
    assert!(p.audit().problems.is_empty(), "{:?}", p.audit().problems);
    // The volume is written again after it, and the snapshot stays as it was.
    write_blocks(&p, "vm", 0, 1, 3000);
    assert_eq!(read_all(&p, "snap"), at_snapshot);
    let names: Vec<String> = p.list_volumes().into_iter().map(|v| v.name).collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

#[test]
fn a_rollback_is_refused_while_the_volume_is_open_or_its_snapshot_is_missing() {
    let t = create(64 << 20, None);
    let p = t.pool().clone();
    p.create_volume("vm", BLOCKS * BLOCK as u64)
        .expect("create");
    write_blocks(&p, "vm", 0, 8, 1);
    p.clone_volume("vm", "snap").expect("snapshot");
    write_blocks(&p, "vm", 0, 8, 100);
    let written = read_all(&p, "vm");

    let open = p.open_volume("vm").expect("open");
    match p.rollback_volume("vm", "snap") {
        Err(EngineError::Refused(why)) => {
            assert!(why.contains("'vm' is open by 1 client"), "{why}");
        }
        other => panic!("a rollback of an open volume: {other:?}"),
    }
    drop(open);
    assert!(matches!(
        p.rollback_volume("vm", "nothing"),
        Err(EngineError::VolumeNotFound(_))
    ));
    assert!(matches!(
        p.rollback_volume("vm", "vm"),
        Err(EngineError::Refused(_))
    ));
    assert_eq!(read_all(&p, "vm"), written, "a refusal changes nothing");
    p.rollback_volume("vm", "snap")
        .expect("rollback once closed");
    assert_ne!(read_all(&p, "vm"), written);
}
