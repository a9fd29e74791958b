//! A snapshot's identity (its guid, which a send stream carries and a receive matches
//! an incremental base by) is keyed by a secret of its pool: no one who knows what
//! streams carry (the pool's id, the snapshot's small volume id) can compute it.

mod common;

use common::create;
use fewerbytes_engine::Pool;

/// The identity as it was computed before it was keyed: the low 64 bits of BLAKE3 of
/// the pool's id (the nonce every stream carries) and the snapshot's volume id.
fn unkeyed_guid(pool_id: u64, volume_id: u64) -> u64 {
    let mut input = [0u8; 16];
    input[..8].copy_from_slice(&pool_id.to_le_bytes());
    input[8..].copy_from_slice(&volume_id.to_le_bytes());
    let hash = blake3::hash(&input);
    let mut low = [0u8; 8];
    low.copy_from_slice(&hash.as_bytes()[..8]);
    u64::from_le_bytes(low).max(1)
}

/// Volume ids a forger would try: every id a pool of a few thousand volumes uses.
const GUESSED_IDS: u64 = 4096;

/// Two volumes, each with a snapshot `daily`; the snapshots' (volume id, guid).
fn tenants(pool: &Pool) -> Vec<(u64, u64)> {
    let mut found = Vec::new();
    for tenant in ["tenantA", "tenantB"] {
        pool.create_volume(tenant, 1 << 20).expect("create");
        let info = pool.snapshot_volume(tenant, "daily").expect("snapshot");
        let guid = info.guid.as_deref().expect("a snapshot has an identity");
        let guid = u64::from_str_radix(guid, 16).expect("a guid is hex");
        found.push((info.id, guid));
    }
    found
}

// Regression: a snapshot's guid was an unkeyed BLAKE3 of the pool id (in every
// stream the pool sends) and its small volume id: a forged 224-byte stream
// "incremental from tenantA@daily", received without --from, copied tenantA's
// snapshot on the third guess.
#[test]
fn a_snapshot_identity_cannot_be_computed_from_what_streams_carry() {
    let mut first = create(64 << 20, None);
    let second = create(64 << 20, None);
    let ours = tenants(first.pool());
    let theirs = tenants(second.pool());
    for (pool, snapshots) in [(first.pool(), &ours), (second.pool(), &theirs)] {
        let pool_id = pool.id();
        for &(volume_id, guid) in snapshots {
            let guessed = (0..GUESSED_IDS).find(|&id| unkeyed_guid(pool_id, id) == guid);
            assert_eq!(
                guessed, None,
                "the guid of snapshot id {volume_id} is computed from the pool id and a \
                 guessed volume id"
            );
        }
    }
    // The same volume ids in two pools: two identities.
    for (a, b) in ours.iter().zip(&theirs) {
        assert_eq!(a.0, b.0, "the two pools gave other volume ids");
        assert_ne!(a.1, b.1, "two pools gave snapshot id {} one identity", a.0);
    }
    // An identity is recorded, not recomputed: a reopen keeps it.
    first.reopen();
    for (tenant, &(volume_id, guid)) in ["tenantA", "tenantB"].iter().zip(&ours) {
        let kept = first
            .pool()
            .snapshots(tenant)
            .expect("snapshots")
            .into_iter()
            .find(|v| v.id == volume_id)
            .and_then(|v| v.guid)
            .expect("the snapshot after a reopen");
        assert_eq!(kept, format!("{guid:016x}"), "a reopen changed an identity");
    }
}
