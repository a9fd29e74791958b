//! Internal volumes (`Pool::internal`): a name with a leading `%` that no user call
//! makes, lists, opens or changes; and the rollback that refuses, in the same step,
//! a volume written since a given point, so a write acknowledged before the step
//! is never discarded by it, with a writer racing it.

mod common;

use common::{create, random_block, read_all, write_blocks, BLOCK};
use fewerbytes_engine::{is_internal_name, InternalName, Provisioning};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const BLOCKS: u64 = 256;

#[test]
fn internal_volumes_are_unknown_to_every_user_call() {
    let t = create(64 << 20, None);
    let p = t.pool().clone();
    p.create_volume("vm", BLOCKS * BLOCK as u64)
        .expect("create");
    let hidden = InternalName::new("receive", "vm").expect("internal name");
    assert!(is_internal_name(hidden.as_str()));
    assert_eq!(InternalName::parse(hidden.as_str()), Some(hidden.clone()));
    assert_eq!(InternalName::parse("vm"), None);
    p.internal()
        .clone("vm", &hidden, Provisioning::THIN)
        .expect("internal clone");
    let name = hidden.as_str();
    assert_eq!(p.internal().names(), [name]);
    assert!(p.volume_sizes().iter().all(|(n, _)| n == "vm"));
    assert!(p.list_volumes().iter().all(|v| v.name == "vm"));
    assert!(p.open_volume(name).is_err());
    assert!(p.delete_volume(name, true).is_err());
    assert!(p.rename_volume(name, "mine").is_err());
    assert!(p.clone_volume(name, "mine").is_err());
    assert!(p.snapshot_volume(name, "s").is_err());
    assert!(p.rollback_volume("vm", name).is_err());
    assert!(p.create_volume(name, BLOCK as u64).is_err());
    assert!(p.volume_limited(name).is_none());
    p.internal().delete(name, false).expect("internal delete");
    assert!(p.internal().names().is_empty());
}

#[test]
fn a_rollback_refuses_a_volume_written_since_its_point() {
    let t = create(64 << 20, None);
    let p = t.pool().clone();
    p.create_volume("vm", BLOCKS * BLOCK as u64)
        .expect("create");
    write_blocks(&p, "vm", 0, 8, 1);
    p.snapshot_volume("vm", "s0").expect("snapshot");
    let since = InternalName::new("since", "vm").expect("name");
    p.internal()
        .clone("vm", &since, Provisioning::THIN)
        .expect("since");
    write_blocks(&p, "vm", 20, 1, 2);
    let written = read_all(&p, "vm");
    let refused = p.internal().rollback("vm", "vm@s0", Some(since.as_str()));
    assert!(refused.is_err(), "the write since the point was discarded");
    assert_eq!(read_all(&p, "vm"), written);
    assert!(p
        .internal()
        .written_since("vm", since.as_str())
        .expect("diff"));
    // Unchanged since a point taken now: the step is taken.
    p.internal().delete(since.as_str(), false).expect("delete");
    p.internal()
        .clone("vm", &since, Provisioning::THIN)
        .expect("since");
    p.internal()
        .rollback("vm", "vm@s0", Some(since.as_str()))
        .expect("rollback");
    assert_eq!(read_all(&p, "vm"), read_all(&p, "vm@s0"));
}

/// A writer opens the volume, writes block k with its own bytes, and closes it,
/// while rollbacks are tried against a point taken just before each: every write
/// begun after the point and done before a rollback returned must read back after
/// it (it either landed after the rollback, or made it refuse).
#[test]
fn a_racing_writer_never_loses_a_write_to_the_checked_rollback() {
    let t = create(64 << 20, None);
    let p = t.pool().clone();
    p.create_volume("vm", BLOCKS * BLOCK as u64)
        .expect("create");
    p.snapshot_volume("vm", "s0").expect("snapshot");
    let (started, done) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let writer = {
        let (p, started, done) = (p.clone(), started.clone(), done.clone());
        std::thread::spawn(move || {
            for k in 0..BLOCKS {
                started.store(k + 1, Ordering::SeqCst);
                let volume = p.open_volume("vm").expect("open");
                volume
                    .write(k * BLOCK as u64, &random_block(k), false)
                    .expect("write");
                volume.flush().expect("flush");
                drop(volume);
                done.store(k + 1, Ordering::SeqCst);
                // Closed a while: a rollback may be taken between two writes.
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        })
    };
    let since = InternalName::new("since", "vm").expect("name");
    let mut taken = 0u32;
    while done.load(Ordering::SeqCst) < BLOCKS {
        p.internal()
            .clone("vm", &since, Provisioning::THIN)
            .expect("since");
        // Writes with an index from here on began after the point was taken.
        let first_after = started.load(Ordering::SeqCst);
        // Room for a write to land between the point and the step (pacing only).
        std::thread::sleep(std::time::Duration::from_millis(2));
        let rolled = p.internal().rollback("vm", "vm@s0", Some(since.as_str()));
        let done_by = done.load(Ordering::SeqCst);
        if rolled.is_ok() {
            taken += 1;
            let volume = p.open_volume("vm").expect("open");
            let mut block = vec![0u8; BLOCK];
            for k in first_after..done_by {
                volume.read(k * BLOCK as u64, &mut block).expect("read");
                assert!(
                    block == random_block(k),
                    "block {k}, written after the point and before the rollback returned, was lost"
                );
            }
        }
        p.internal().delete(since.as_str(), false).expect("delete");
    }
    writer.join().expect("writer");
    // Quiet again: the step is taken (so the race above could take it too).
    p.internal()
        .clone("vm", &since, Provisioning::THIN)
        .expect("since");
    p.internal()
        .rollback("vm", "vm@s0", Some(since.as_str()))
        .expect("a rollback with no writer");
    eprintln!("{taken} rollbacks taken during the race");
}
