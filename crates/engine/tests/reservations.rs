//! Reservations per volume (`reservation.rs`): thick volumes reserve their size and are
//! refused when the pool cannot hold it aside, thin ones are never refused, thin writes
//! fail with the no-space error while a thick volume still stores new data in every
//! block it reserved, and what each volume reserves survives a crash and a reopen.

mod common;

use common::*;
use fewerbytes_engine::storage::CrashMode;
use fewerbytes_engine::{EngineError, Provisioning, VolumeInfo};

const MIB: u64 = 1 << 20;

fn volume(t: &TestPool, name: &str) -> VolumeInfo {
    t.pool()
        .list_volumes()
        .into_iter()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

/// (reservation bytes, thin) of each named volume.
fn reservations(t: &TestPool, names: &[&str]) -> Vec<(u64, bool)> {
    names
        .iter()
        .map(|n| {
            let v = volume(t, n);
            (v.reserved_bytes, v.thin)
        })
        .collect()
}

#[test]
fn reservations_survive_crashes_and_reopens() {
    let mut t = create(64 * MIB, None);
    let pool = t.pool().clone();
    pool.create_volume("thick", 8 * MIB).unwrap();
    pool.create_volume_with("thin", 1 << 30, Provisioning::THIN)
        .unwrap();
    pool.create_volume_with("part", 16 * MIB, Provisioning::Reserve(4 * MIB))
        .unwrap();
    pool.clone_volume_with("thick", "clone", Provisioning::THIN)
        .unwrap();
    drop(pool);
    let expected = vec![(8 * MIB, false), (0, true), (4 * MIB, true), (0, true)];
    let names = ["thick", "thin", "part", "clone"];
    assert_eq!(reservations(&t, &names), expected);
    // Volume changes are durable on return: even a crash that keeps no unflushed
    // write keeps them.
    t.crash(CrashMode::DropAll);
    assert_eq!(reservations(&t, &names), expected);

    t.pool()
        .set_provisioning("thin", Provisioning::Reserve(2 * MIB))
        .unwrap();
    t.pool()
        .set_provisioning("thick", Provisioning::THIN)
        .unwrap();
    t.pool()
        .set_provisioning("clone", Provisioning::Thick)
        .unwrap();
    let expected = vec![
        (0, true),
        (2 * MIB, true),
        (4 * MIB, true),
        (8 * MIB, false),
    ];
    for mode in [CrashMode::DropAll, CrashMode::Random(3), CrashMode::KeepAll] {
        t.crash(mode);
        assert_eq!(reservations(&t, &names), expected, "after {mode:?}");
    }
    t.reopen();
    assert_eq!(reservations(&t, &names), expected);
    let info = t.pool().info();
    assert_eq!(info.space.reserved_bytes, 14 * MIB);
    assert_eq!(
        info.space.promised_bytes,
        8 * MIB + (1 << 30) + 16 * MIB + 8 * MIB
    );
    assert!(t.pool().audit().problems.is_empty());
}

#[test]
fn a_reservation_the_pool_cannot_hold_is_refused_and_changes_nothing() {
    let t = create(64 * MIB, None);
    let pool = t.pool();
    let data = pool.info().space.data_bytes;
    match pool.create_volume("big", data) {
        Err(EngineError::Refused(why)) => {
            assert!(why.contains("free for reservations"), "{why}");
            assert!(why.contains("--thin"), "{why}");
        }
        other => panic!("a thick volume as large as the data region: {other:?}"),
    }
    assert!(pool.list_volumes().is_empty());
    // Thin, it is never refused for space.
    pool.create_volume_with("big", data, Provisioning::THIN)
        .unwrap();
    pool.create_volume("half", data / 2 / BLOCK as u64 * BLOCK as u64)
        .unwrap();
    match pool.set_provisioning("big", Provisioning::Thick) {
        Err(EngineError::Refused(why)) => assert!(why.contains("reserve"), "{why}"),
        other => panic!("making the thin volume thick: {other:?}"),
    }
    assert_eq!(volume(&t, "big").reserved_bytes, 0);
    match pool.clone_volume("half", "copy") {
        Err(EngineError::Refused(_)) => {}
        other => panic!("a thick clone past what the pool holds: {other:?}"),
    }
    assert!(!pool.list_volumes().iter().any(|v| v.name == "copy"));
}

#[test]
fn thin_writes_fail_first_and_a_thick_volume_writes_its_whole_reservation() {
    let t = create(64 * MIB, None);
    let pool = t.pool();
    let thick_blocks = 2048u64; // 8 MiB
    pool.create_volume("thick", thick_blocks * BLOCK as u64)
        .unwrap();
    pool.create_volume_with("thin", 256 * MIB, Provisioning::THIN)
        .unwrap();
    let thin = pool.open_volume("thin").unwrap();
    let mut written = 0u64;
    let full = loop {
        match thin.write(written * BLOCK as u64, &random_block(written), false) {
            Ok(()) => written += 1,
            Err(e) => break e,
        }
        assert!(
            written < 256 * MIB / BLOCK as u64,
            "the thin volume never filled"
        );
    };
    assert!(full.is_no_space(), "{full}");
    assert!(
        full.to_string().contains("reservations hold back"),
        "{full}"
    );
    // Every block the thick volume reserved takes new data.
    let thick = pool.open_volume("thick").unwrap();
    for lbn in 0..thick_blocks {
        thick
            .write(lbn * BLOCK as u64, &random_block(1 << 40 | lbn), false)
            .unwrap_or_else(|e| panic!("block {lbn} of the thick volume: {e}"));
    }
    thick.flush().unwrap();
    let mut buf = vec![0u8; BLOCK];
    for lbn in [0, thick_blocks / 2, thick_blocks - 1] {
        thick.read(lbn * BLOCK as u64, &mut buf).unwrap();
        assert_eq!(buf, random_block(1 << 40 | lbn), "block {lbn}");
    }
    // Made thin, it gives its used space to no one, but nothing is withheld any more.
    assert_eq!(volume(&t, "thick").reserved_unused_bytes, 0);
    assert!(pool.audit().problems.is_empty());
}
