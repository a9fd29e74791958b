//! `Pool::repair` (`fewerbytes check --repair`): each kind of damage it rebuilds from
//! the block maps and object records is found by the audit, repaired and said, and
//! the pool then audits clean and reads back what the repair's rule says.
//!
//! The damage is made through the pool's test hooks (a count or a map entry set in
//! memory, then a checkpoint), so these tests hold whatever the page format is.

mod common;
use common::*;
use fewerbytes_engine::storage::{CrashMode, Storage};
use fewerbytes_engine::{EngineError, OpenOptions, Pool, RepairOptions, RepairPhase, RepairReport};
use rand::{rngs::StdRng, RngCore, SeedableRng};
use std::sync::Arc;

const REPAIR: RepairOptions = RepairOptions {
    apply: true,
    verify_data: false,
};
const DRY_RUN: RepairOptions = RepairOptions {
    apply: false,
    verify_data: false,
};

fn random_block(seed: u64) -> Vec<u8> {
    let mut block = vec![0u8; BLOCK];
    StdRng::seed_from_u64(seed).fill_bytes(&mut block);
    block
}

/// A pool with volume "a": blocks 0 and 1 hold one shared block (one object, two
/// references), block 2 a block of its own, all flushed and reopened.
fn pool_with_data() -> (TestPool, Vec<u8>, Vec<u8>) {
    let mut t = create(64 << 20, None);
    t.pool().create_volume("a", 4 << 20).unwrap();
    let shared = Mix::new(3).next_block();
    let own = random_block(4);
    let vol = t.pool().open_volume("a").unwrap();
    vol.write(0, &shared, false).unwrap();
    vol.write(BLOCK as u64, &shared, false).unwrap();
    vol.write(2 * BLOCK as u64, &own, false).unwrap();
    vol.flush().unwrap();
    drop(vol);
    t.reopen();
    (t, shared, own)
}

fn read_block(t: &TestPool, lbn: u64) -> Result<Vec<u8>, EngineError> {
    let vol = t.pool().open_volume("a").unwrap();
    let mut buf = vec![0u8; BLOCK];
    vol.read(lbn * BLOCK as u64, &mut buf).map(|()| buf)
}

/// The object block `lbn` of volume "a" names (it must name one).
fn stored_object(t: &TestPool, lbn: u64) -> u64 {
    t.pool()
        .object_of("a", lbn)
        .unwrap()
        .unwrap_or_else(|| panic!("block {lbn} is stored"))
}

fn repair(t: &TestPool, options: &RepairOptions) -> RepairReport {
    t.pool().repair(options, &|_, _, _| {}).expect("repair")
}

fn assert_audit_clean(t: &TestPool) {
    let audit = t.pool().audit();
    assert!(audit.problems.is_empty(), "{:?}", audit.problems);
}

fn assert_said(report: &RepairReport, words: &str) {
    assert!(
        report.repairs.iter().any(|r| r.contains(words)),
        "the repair did not say {words:?}: {:?}",
        report.repairs
    );
}

#[test]
fn a_clean_pool_needs_no_repair() {
    let (t, _, _) = pool_with_data();
    let report = repair(&t, &REPAIR);
    assert!(report.repairs.is_empty(), "{:?}", report.repairs);
    assert!(report.damage_left.is_empty(), "{:?}", report.damage_left);
    assert_eq!(report.map_entries_checked, 3);
    assert_eq!(report.objects_checked, 2);
}

#[test]
fn a_reference_count_too_high_is_set_to_the_references_found() {
    let (mut t, shared, own) = pool_with_data();
    let object = stored_object(&t, 0);
    t.pool().damage_reference_count(object, 5).unwrap();
    t.reopen();
    let audit = t.pool().audit();
    assert!(
        audit
            .problems
            .iter()
            .any(|p| p.contains(&format!("object {object}: stored count 5 but maps hold 2"))),
        "{:?}",
        audit.problems
    );

    let report = repair(&t, &REPAIR);
    assert_said(&report, &format!("object {object}: reference count 5 → 2"));
    assert_eq!(report.repairs.len(), 1, "{:?}", report.repairs);
    assert_audit_clean(&t);
    t.reopen();
    assert_audit_clean(&t);
    assert_eq!(read_block(&t, 0).unwrap(), shared);
    assert_eq!(read_block(&t, 1).unwrap(), shared);
    assert_eq!(read_block(&t, 2).unwrap(), own);
}

#[test]
fn a_reference_count_too_low_is_raised_so_an_overwrite_keeps_the_other_copy() {
    // Too low is the dangerous way: overwriting block 0 would free the object block
    // 1 still names. After the repair the overwrite leaves block 1 intact.
    let (mut t, shared, _) = pool_with_data();
    let object = stored_object(&t, 0);
    t.pool().damage_reference_count(object, 1).unwrap();
    t.reopen();
    let report = repair(&t, &REPAIR);
    assert_said(&report, &format!("object {object}: reference count 1 → 2"));

    let vol = t.pool().open_volume("a").unwrap();
    vol.write(0, &random_block(9), false).unwrap();
    vol.flush().unwrap();
    drop(vol);
    t.crash(CrashMode::KeepAll);
    assert_eq!(read_block(&t, 1).unwrap(), shared);
    assert_audit_clean(&t);
}

#[test]
fn a_leaked_object_is_freed_and_its_space_comes_back() {
    let (mut t, shared, _) = pool_with_data();
    let object = stored_object(&t, 2);
    // Block 2's entry goes; its object keeps its one reference: a leak.
    t.pool().damage_map_entry("a", 2, None).unwrap();
    t.reopen();
    let before = t.pool().stats();
    let audit = t.pool().audit();
    assert!(
        audit
            .problems
            .iter()
            .any(|p| p.contains(&format!("object {object}: stored count 1 but maps hold 0"))),
        "{:?}",
        audit.problems
    );

    let report = repair(&t, &REPAIR);
    assert_said(
        &report,
        &format!("object {object}: reference count 1 → 0, no map refers to it: freed"),
    );
    assert_audit_clean(&t);
    let after = t.pool().stats();
    assert_eq!(after.objects, before.objects - 1);
    assert_eq!(
        after.space.stored_bytes,
        before.space.stored_bytes - BLOCK as u64
    );
    t.reopen();
    assert_audit_clean(&t);
    assert_eq!(t.pool().stats().objects, before.objects - 1);
    assert_eq!(read_block(&t, 0).unwrap(), shared);
    assert_eq!(read_block(&t, 2).unwrap(), vec![0u8; BLOCK]);
}

#[test]
fn a_map_entry_naming_a_free_object_reads_as_zeros_after_the_repair_and_says_so() {
    let (mut t, shared, own) = pool_with_data();
    // The last object slot of slab 0 is never used in a pool this small.
    let free = u64::from(t.pool().info().objects_per_slab) - 1;
    t.pool().damage_map_entry("a", 5, Some(free)).unwrap();
    t.reopen();
    match read_block(&t, 5) {
        Err(EngineError::Corrupt { reason, .. }) => {
            assert!(reason.contains("no references"), "{reason}")
        }
        other => panic!("a dangling entry read as {other:?}"),
    }
    let audit = t.pool().audit();
    assert!(
        audit
            .problems
            .iter()
            .any(|p| p.contains(&format!("object {free}, which is free"))),
        "{:?}",
        audit.problems
    );

    let report = repair(&t, &REPAIR);
    assert_said(
        &report,
        &format!(
            "volume a: block 5 (bytes 20480-24575) referred to object {free}, which is not \
             stored: now reads as zeros (its data is lost)"
        ),
    );
    assert_eq!(report.lost_bytes, BLOCK as u64);
    assert_audit_clean(&t);
    assert_eq!(read_block(&t, 5).unwrap(), vec![0u8; BLOCK]);
    t.reopen();
    assert_audit_clean(&t);
    assert_eq!(read_block(&t, 5).unwrap(), vec![0u8; BLOCK]);
    assert_eq!(read_block(&t, 0).unwrap(), shared);
    assert_eq!(read_block(&t, 2).unwrap(), own);
}

#[test]
fn without_apply_a_repair_says_what_it_would_change_and_changes_nothing() {
    let (mut t, _, _) = pool_with_data();
    let object = stored_object(&t, 0);
    t.pool().damage_reference_count(object, 7).unwrap();
    t.reopen();
    let report = repair(&t, &DRY_RUN);
    assert_said(&report, &format!("object {object}: reference count 7 → 2"));
    let audit = t.pool().audit();
    assert_eq!(audit.problems.len(), 1, "{:?}", audit.problems);
    t.reopen();
    assert_eq!(t.pool().audit().problems.len(), 1);
}

#[test]
fn verifying_data_names_the_volume_bytes_of_a_block_that_fails_its_fingerprint() {
    let (mut t, shared, own) = pool_with_data();
    // The random block is stored whole: find its bytes on the device and flip one.
    t.pool().flush().unwrap();
    let image = t.dev.crash_image(CrashMode::KeepAll);
    let at = image
        .chunks(BLOCK)
        .position(|b| b == own.as_slice())
        .expect("the incompressible block is stored as it is")
        * BLOCK;
    t.dev.write_at(&[!own[100]], (at + 100) as u64).unwrap();
    t.reopen();

    let phases = std::sync::Mutex::new(Vec::new());
    let report = t
        .pool()
        .repair(
            &RepairOptions {
                apply: true,
                verify_data: true,
            },
            &|phase, _, _| phases.lock().unwrap().push(phase),
        )
        .unwrap();
    assert!(report.repairs.is_empty(), "{:?}", report.repairs);
    assert_eq!(report.damage_left.len(), 1, "{:?}", report.damage_left);
    let damage = &report.damage_left[0];
    assert!(
        damage.contains("does not match its fingerprint"),
        "{damage}"
    );
    // Named as a read, scrub and export name it: volume bytes, then the pool block.
    assert!(
        damage.starts_with(&format!(
            "volume 'a' bytes 8192..12287 (pool block {}): ",
            at / BLOCK
        )),
        "{damage}"
    );
    assert!(phases.lock().unwrap().contains(&RepairPhase::VerifyingData));
    // Left in place: the block still fails to read, the others read.
    assert!(read_block(&t, 2).is_err());
    assert_eq!(read_block(&t, 0).unwrap(), shared);
}

/// Close the pool and open it again for repair.
fn reopen_for_repair(t: &mut TestPool) -> Result<(), EngineError> {
    if let Some(p) = t.pool.take() {
        p.close().expect("close");
    }
    let pool = Pool::open_devices_for_repair(
        t.dev.clone() as Arc<dyn Storage>,
        None,
        &OpenOptions {
            threads: Some(2),
            index_memory_bytes: None,
            no_discard: false,
            hold_index_build: false,
            take_over: None,
            saved_index: fewerbytes_engine::SavedIndex::Off,
        },
    )?;
    t.pool = Some(pool);
    Ok(())
}

#[test]
fn a_count_of_zero_under_live_references_is_refused_at_open_and_restored_by_repair() {
    // A record with no references is freed by the open's rebuild, which would leave
    // both entries naming nothing. The record still holds the object's location and
    // fingerprint, so the data is not lost: a normal open refuses the pool, and an
    // open for repair restores the count once the data matches its fingerprint.
    let (mut t, shared, own) = pool_with_data();
    let object = stored_object(&t, 0);
    t.pool().damage_reference_count(object, 0).unwrap();
    t.pool.take().unwrap().close().unwrap();
    let refused = Pool::open_devices(
        t.dev.clone() as Arc<dyn Storage>,
        None,
        &OpenOptions {
            threads: Some(2),
            index_memory_bytes: None,
            no_discard: false,
            hold_index_build: false,
            take_over: None,
            saved_index: fewerbytes_engine::SavedIndex::Off,
        },
    );
    match refused {
        Err(e @ EngineError::Corrupt { .. }) => {
            let message = e.to_string();
            assert!(
                message.contains(&format!("object {object}: 2")),
                "{message}"
            );
            assert!(message.contains("check --repair"), "{message}");
        }
        Err(other) => panic!("expected a corruption error, got {other}"),
        Ok(_) => panic!("a pool whose maps name an object without references opened"),
    }

    reopen_for_repair(&mut t).expect("an open for repair");
    let report = repair(&t, &REPAIR);
    assert_said(
        &report,
        &format!("object {object}: reference count 0 → 2 (its data matches its fingerprint)"),
    );
    assert_eq!(report.lost_bytes, 0);
    assert_audit_clean(&t);
    t.reopen();
    assert_audit_clean(&t);
    assert_eq!(read_block(&t, 0).unwrap(), shared);
    assert_eq!(read_block(&t, 1).unwrap(), shared);
    assert_eq!(read_block(&t, 2).unwrap(), own);
}
