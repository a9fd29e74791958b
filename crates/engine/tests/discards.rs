//! Blocks freed by a delete, a trim or an overwrite are given back to the data device
//! (a hole punched in a pool file, BLKDISCARD) once the checkpoint that frees them is
//! durable: the device's allocated size falls, `stats` counts the discards, and
//! `set_discard_enabled(false)` keeps every block allocated. (That no discard comes
//! before the checkpoint is the crash simulation's to prove: `tests/crash/`.)

mod common;
use common::*;
use rand::{RngCore, SeedableRng};

const MIB: u64 = 1 << 20;

/// `bytes` of incompressible data at offset 0 of a new volume `name`, flushed.
fn write_random(t: &TestPool, name: &str, bytes: u64) {
    t.pool().create_volume(name, 16 * MIB).unwrap();
    let vol = t.pool().open_volume(name).unwrap();
    let mut data = vec![0u8; bytes as usize];
    rand::rngs::StdRng::seed_from_u64(bytes).fill_bytes(&mut data);
    vol.write(0, &data, false).unwrap();
    vol.flush().unwrap();
}

#[test]
fn a_deleted_volume_gives_its_blocks_back_to_the_device() {
    let t = create(64 * MIB, None);
    write_random(&t, "a", 8 * MIB);
    let before = t.dev.written_bytes();
    t.pool().delete_volume("a", false).unwrap();
    let after = t.dev.written_bytes();
    assert!(
        after + 7 * MIB < before,
        "the device still holds {after} bytes after deleting 8 MiB (it held {before})"
    );
    let io = t.pool().stats().data_device;
    assert!(io.discards > 0, "discards counted: {io:?}");
    assert!(io.discard_bytes >= 7 * MIB, "discard bytes counted: {io:?}");
    assert!(
        io.discards < 64,
        "adjacent blocks are discarded together: {} calls for {} bytes",
        io.discards,
        io.discard_bytes
    );
}

#[test]
fn trimmed_and_overwritten_blocks_are_given_back_after_the_checkpoint() {
    let mut t = create(64 * MIB, None);
    write_random(&t, "a", 8 * MIB);
    let vol = t.pool().open_volume("a").unwrap();
    vol.trim(0, 4 * MIB, false).unwrap();
    vol.write_zeroes(4 * MIB, 2 * MIB, false).unwrap();
    vol.flush().unwrap();
    let before = t.dev.written_bytes();
    drop(vol);
    // The clean close takes the checkpoint that frees them.
    t.reopen();
    let after = t.dev.written_bytes();
    assert!(
        after + 5 * MIB < before,
        "the device still holds {after} bytes after trimming 6 MiB (it held {before})"
    );
    let vol = t.pool().open_volume("a").unwrap();
    let mut buf = vec![0u8; 2 * MIB as usize];
    vol.read(6 * MIB, &mut buf).unwrap();
    let mut want = vec![0u8; 8 * MIB as usize];
    rand::rngs::StdRng::seed_from_u64(8 * MIB).fill_bytes(&mut want);
    assert_eq!(buf, want[6 * MIB as usize..], "the blocks kept read back");
    assert!(t.pool().audit().problems.is_empty());
}

#[test]
fn with_discards_off_freed_blocks_stay_allocated() {
    let t = create(64 * MIB, None);
    t.pool().set_discard_enabled(false);
    write_random(&t, "a", 8 * MIB);
    let before = t.dev.written_bytes();
    t.pool().delete_volume("a", false).unwrap();
    assert!(t.dev.written_bytes() >= before, "nothing discarded");
    assert_eq!(t.pool().stats().data_device.discards, 0);
}
