//! The incomplete mark (catalog volume flag bit 3) an import sets before it writes and
//! clears after its last flush: durable on return, so a crash part-way keeps it; kept
//! by a clone and a snapshot, which hold the same half-written bytes; refused on a
//! snapshot, which no import writes.

mod common;

use common::*;
use fewerbytes_engine::storage::CrashMode;

const MIB: u64 = 1 << 20;

fn marked(t: &TestPool, name: &str) -> bool {
    t.pool()
        .volume_incomplete(name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

#[test]
fn the_mark_survives_a_crash_and_is_kept_by_copies() {
    let mut t = create(64 * MIB, None);
    t.pool().create_volume("v", 8 * MIB).unwrap();
    assert!(!marked(&t, "v"));
    let info = t.pool().set_volume_incomplete("v", true).unwrap();
    assert!(info.incomplete);
    // Written after the mark and never flushed: the crash keeps the mark anyway.
    t.pool()
        .open_volume("v")
        .unwrap()
        .write(0, &vec![7u8; 4096], false)
        .unwrap();
    t.crash(CrashMode::DropAll);
    assert!(marked(&t, "v"), "a crash part-way lost the mark");

    t.pool().clone_volume("v", "c").unwrap();
    t.pool().snapshot_volume("v", "s").unwrap();
    assert!(
        marked(&t, "c"),
        "a clone of a half-written volume is not marked"
    );
    assert!(marked(&t, "v@s"), "a snapshot of it is not marked");
    let refused = t.pool().set_volume_incomplete("v@s", true);
    assert!(refused.is_err(), "a snapshot was marked: {refused:?}");

    t.pool().set_volume_incomplete("v", false).unwrap();
    t.crash(CrashMode::DropAll);
    assert!(!marked(&t, "v"), "the cleared mark came back");
    assert!(marked(&t, "c"));
    t.reopen();
    assert!(marked(&t, "c"));
    assert!(!marked(&t, "v"));
    assert!(t.pool().audit().problems.is_empty());
}
