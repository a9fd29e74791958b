//! Writes of part of a block racing other writes of the same block: no update is
//! lost. Two threads loop over their operations on one block at once; after each
//! of its writes, a thread reads the block back and checks what no order of the
//! two threads' operations could have changed since.

mod common;
use common::*;
use fewerbytes_engine::Volume;
use std::sync::atomic::{AtomicBool, Ordering};

/// Iterations of the checking thread: the other loops meanwhile, and they overlap
/// thousands of times.
const ITERATIONS: u32 = 2000;

/// How long a checker lets the other thread run before it reads (see `block`).
const SETTLE: std::time::Duration = std::time::Duration::from_micros(100);

/// The block both threads work on.
const AT: u64 = BLOCK as u64;

/// Run `a` and `b` on volume "v" at once: `b` `ITERATIONS` times, `a` until `b` is
/// done (so the two always overlap), each with its iteration number; each checks
/// its own view and panics on a lost update.
fn race(a: impl Fn(&Volume, u32) + Sync, b: impl Fn(&Volume, u32) + Sync) {
    let t = create(64 << 20, None);
    let p = t.pool().clone();
    p.create_volume("v", 1 << 20).unwrap();
    let vol = p.open_volume("v").unwrap();
    let b_done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let (va, vb) = (vol.clone(), vol.clone());
        let (a, b, b_done) = (&a, &b, &b_done);
        s.spawn(move || {
            let mut i = 0u32;
            while !b_done.load(Ordering::Acquire) {
                a(&va, i);
                i = i.wrapping_add(1);
            }
        });
        s.spawn(move || {
            // Set even if `b` panics, so `a` stops and the panic is reported.
            struct Done<'a>(&'a AtomicBool);
            impl Drop for Done<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Release);
                }
            }
            let _done = Done(b_done);
            (0..ITERATIONS).for_each(|i| b(&vb, i));
        });
    });
    let audit = p.audit();
    assert!(audit.problems.is_empty(), "audit: {:?}", audit.problems);
}

fn block(v: &Volume) -> Vec<u8> {
    std::thread::sleep(SETTLE);
    let mut got = vec![0u8; BLOCK];
    v.read(AT, &mut got).unwrap();
    got
}

/// An iteration-specific byte, never zero and never 0xee.
fn tag(i: u32, who: u8) -> u8 {
    ((i as u8).wrapping_mul(4).wrapping_add(who)) | 1
}

#[test]
fn disjoint_partial_writes_of_one_block_both_land() {
    let writer = |from: usize, len: usize, who: u8| {
        move |v: &Volume, i: u32| {
            v.write(AT + from as u64, &vec![tag(i, who); len], false)
                .unwrap();
            // Only this thread writes these bytes: they hold its last write.
            let got = block(v);
            assert!(
                got[from..from + len].iter().all(|&x| x == tag(i, who)),
                "iteration {i}: writer {who}'s bytes were undone by the other's read-modify-write"
            );
        }
    };
    race(writer(1, 700, 0), writer(2000, 1500, 2));
}

#[test]
fn a_whole_block_write_racing_a_partial_one_is_not_undone() {
    race(
        |v, i| v.write(AT, &[tag(i, 0); 10], false).unwrap(),
        |v, i| {
            v.write(AT, &vec![tag(i, 2); BLOCK], false).unwrap();
            // The partial writer touches bytes 0..10 only: the rest is this write's,
            // never an older block a read-modify-write read before it and wrote after.
            let got = block(v);
            assert!(
                got[10..].iter().all(|&x| x == tag(i, 2)),
                "iteration {i}: a whole-block write was undone by a read-modify-write"
            );
        },
    );
}

#[test]
fn a_partial_write_racing_a_trim_or_write_zeroes_of_its_block_ends_in_one_order() {
    for trim in [true, false] {
        race(
            |v, i| v.write(AT + 100, &[tag(i, 0); 100], false).unwrap(),
            move |v, i| {
                v.write(AT, &vec![0xee; BLOCK], false).unwrap();
                if trim {
                    v.trim(AT, BLOCK as u64, false).unwrap();
                } else {
                    v.write_zeroes(AT, BLOCK as u64, false).unwrap();
                }
                // After the range operation, only the partial writer may change the
                // block, and only from zeros: a 0xee byte means a read-modify-write
                // read the block before the range operation and wrote it back after.
                let got = block(v);
                assert!(
                    !got.contains(&0xee),
                    "iteration {i}: bytes the {} cleared came back",
                    if trim { "trim" } else { "write-zeroes" }
                );
            },
        );
    }
}

#[test]
fn a_partial_write_racing_a_partial_write_zeroes_keeps_both() {
    race(
        |v, i| {
            v.write(AT + 3, &[tag(i, 0); 50], false).unwrap();
            let got = block(v);
            assert!(
                got[3..53].iter().all(|&x| x == tag(i, 0)),
                "iteration {i}: write lost"
            );
        },
        |v, i| {
            v.write(AT + 1000, &[tag(i, 2); 3000], false).unwrap();
            v.write_zeroes(AT + 1000, 3000, false).unwrap();
            let got = block(v);
            assert!(
                got[1000..4000].iter().all(|&x| x == 0),
                "iteration {i}: zeroes lost"
            );
        },
    );
}

// Regression: a read of a block while another request overwrote it failed with
// `Corrupt` ("mapped but has no references", EIO over NBD): the writer dropped the
// object between the reader's map lookup and its read of the object's record.
#[test]
fn a_read_racing_overwrites_of_its_block_gets_one_of_the_contents() {
    race(
        |v, i| v.write(AT, &vec![tag(i, 0); BLOCK], false).unwrap(),
        |v, i| {
            let mut got = vec![0u8; BLOCK];
            v.read(AT, &mut got)
                .unwrap_or_else(|e| panic!("iteration {i}: a read racing a write failed: {e}"));
            assert!(
                got.iter().all(|&x| x == got[0]),
                "iteration {i}: the read mixed two writes' bytes"
            );
        },
    );
}
