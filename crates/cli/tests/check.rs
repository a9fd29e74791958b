//! `fewerbytes check` and `check --repair` as a person runs them after damage: the
//! exit codes fsck has (0 clean, 1 repaired, 4 damage left, 8 not checked), each
//! change said, and the volume reading back what docs/check.md promises.
//!
//! The damage is made through the engine's test hooks on the closed pool file (a
//! count or a map entry set in memory, then a checkpoint), so it holds whatever the
//! page format is; then only the binary touches the pool.

mod common;

use common::*;
use fewerbytes_engine::{OpenOptions, Pool};
use std::path::Path;

const BLOCK: usize = 4096;

/// A pool with volume "vm" (1 MiB): blocks 0 and 1 hold the same random block (one
/// object, two references), block 2 another; the rest zeros. Returns the pool and
/// the image imported.
fn pool_with_data(dir: &TempDir) -> (std::path::PathBuf, Vec<u8>) {
    let pool = create_pool(dir.path(), &[("vm", "1M")]);
    let mut image = vec![0u8; 1 << 20];
    let mut shared = vec![0u8; BLOCK];
    common::data::Rng::new(21).fill(&mut shared);
    image[..BLOCK].copy_from_slice(&shared);
    image[BLOCK..2 * BLOCK].copy_from_slice(&shared);
    common::data::Rng::new(22).fill(&mut image[2 * BLOCK..3 * BLOCK]);
    let image_path = dir.join("vm.img");
    std::fs::write(&image_path, &image).expect("write image");
    fewerbytes_ok(&pool, &["volume", "import", "vm", path_str(&image_path)]);
    (pool, image)
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

/// Open the (closed) pool file in this process, damage it, close it.
fn damage(pool: &Path, change: impl FnOnce(&Pool)) {
    let opened = Pool::open(
        pool,
        &OpenOptions {
            threads: Some(1),
            ..OpenOptions::default()
        },
    )
    .expect("open the pool");
    change(&opened);
    opened.close().expect("close the pool");
}

fn exported(pool: &Path, dir: &TempDir) -> Vec<u8> {
    let out = dir.join("out.img");
    fewerbytes_ok(pool, &["volume", "export", "vm", "--force", path_str(&out)]);
    std::fs::read(&out).expect("read the export")
}

/// Runs `check ARGS` and asserts its exit code; returns what it said.
fn check(pool: &Path, args: &[&str], code: i32) -> Ran {
    let mut all = vec!["check"];
    all.extend_from_slice(args);
    let ran = fewerbytes(pool, &all);
    assert_eq!(ran.status.code(), Some(code), "{}", ran.report());
    ran
}

/// `check` finds the damage (4), `check --repair` repairs it saying `said` (1), and
/// `check` is then clean (0).
fn found_repaired_clean(pool: &Path, problem: &str, said: &str) -> Ran {
    let found = check(pool, &[], 4);
    assert!(found.stdout.contains(problem), "{}", found.report());
    assert!(
        found.stderr.contains("check --repair"),
        "{}",
        found.report()
    );
    // The same audit for scripts: one JSON object, the same exit code.
    let found_json = check(pool, &["--json"], 4);
    let audit: serde_json::Value =
        serde_json::from_str(&found_json.stdout).expect("check --json prints JSON");
    let problems = audit["problems"].as_array().expect("a problems list");
    assert!(
        problems
            .iter()
            .any(|p| p.as_str().is_some_and(|p| p.contains(problem))),
        "{}",
        found_json.report()
    );
    let repaired = check(pool, &["--repair"], 1);
    assert!(
        repaired.stdout.contains(&format!("repaired: {said}")),
        "{}",
        repaired.report()
    );
    assert!(
        repaired.stdout.contains("Repaired 1 problem(s)"),
        "{}",
        repaired.report()
    );
    let clean = check(pool, &[], 0);
    assert!(
        clean.stdout.contains("No problems found"),
        "{}",
        clean.report()
    );
    let clean_json = check(pool, &["--json"], 0);
    let audit: serde_json::Value =
        serde_json::from_str(&clean_json.stdout).expect("check --json prints JSON");
    assert_eq!(
        audit["problems"],
        serde_json::json!([]),
        "{}",
        clean_json.report()
    );
    assert!(
        audit["objects_checked"].as_u64() > Some(0),
        "{}",
        clean_json.report()
    );
    check(pool, &["--repair"], 0);
    repaired
}

#[test]
fn a_corrupted_reference_count_is_found_repaired_and_then_clean() {
    let dir = TempDir::new("ck-count");
    let (pool, image) = pool_with_data(&dir);
    let mut object = 0;
    damage(&pool, |p| {
        object = p.object_of("vm", 0).unwrap().expect("block 0 is stored");
        p.damage_reference_count(object, 5).unwrap();
    });
    found_repaired_clean(
        &pool,
        &format!("object {object}: stored count 5 but maps hold 2"),
        &format!("object {object}: reference count 5 → 2"),
    );
    assert!(exported(&pool, &dir) == image, "the volume changed");
}

#[test]
fn a_leaked_object_is_found_freed_and_then_clean() {
    let dir = TempDir::new("ck-leak");
    let (pool, mut image) = pool_with_data(&dir);
    let mut object = 0;
    damage(&pool, |p| {
        object = p.object_of("vm", 2).unwrap().expect("block 2 is stored");
        p.damage_map_entry("vm", 2, None).unwrap();
    });
    let before = fewerbytes_ok(&pool, &["stats", "--json"]).stdout;
    let before: serde_json::Value = serde_json::from_str(&before).expect("stats JSON");
    found_repaired_clean(
        &pool,
        &format!("object {object}: stored count 1 but maps hold 0"),
        &format!("object {object}: reference count 1 → 0, no map refers to it: freed"),
    );
    let after = fewerbytes_ok(&pool, &["stats", "--json"]).stdout;
    let after: serde_json::Value = serde_json::from_str(&after).expect("stats JSON");
    assert_eq!(
        after["objects"].as_u64().unwrap() + 1,
        before["objects"].as_u64().unwrap(),
        "the leaked object still counts"
    );
    // The entry was gone before the repair: block 2 reads as zeros, as it did.
    image[2 * BLOCK..3 * BLOCK].fill(0);
    assert!(exported(&pool, &dir) == image, "the volume changed");
}

#[test]
fn a_dangling_map_entry_is_found_then_reads_as_zeros_and_is_listed_as_lost() {
    let dir = TempDir::new("ck-dangle");
    let (pool, mut image) = pool_with_data(&dir);
    let mut free = 0;
    damage(&pool, |p| {
        // The last object slot of slab 0 is never used in a pool this small.
        free = u64::from(p.info().objects_per_slab) - 1;
        p.damage_map_entry("vm", 77, Some(free)).unwrap();
    });
    // Before the repair the block cannot be read: an export fails, naming it.
    let export = fewerbytes(&pool, &["volume", "export", "vm", path_str(&dir.join("x"))]);
    assert!(!export.status.success(), "{}", export.report());
    let repaired = found_repaired_clean(
        &pool,
        &format!("object {free}, which is free"),
        &format!(
            "volume vm: block 77 (bytes 315392-319487) referred to object {free}, which is \
             not stored: now reads as zeros (its data is lost)"
        ),
    );
    assert!(
        repaired
            .stdout
            .contains("4.00 KiB of volume data was lost and now reads as zeros"),
        "{}",
        repaired.report()
    );
    image[77 * BLOCK..78 * BLOCK].fill(0);
    assert!(exported(&pool, &dir) == image, "the volume changed");
}

#[test]
fn check_without_repair_changes_nothing_and_verify_data_reports_what_repair_would_do() {
    let dir = TempDir::new("ck-dry");
    let (pool, _) = pool_with_data(&dir);
    let mut object = 0;
    damage(&pool, |p| {
        object = p.object_of("vm", 0).unwrap().expect("block 0 is stored");
        p.damage_reference_count(object, 9).unwrap();
    });
    check(&pool, &[], 4);
    let verified = check(&pool, &["--verify-data"], 4);
    assert!(
        verified
            .stdout
            .contains(&format!("problem: object {object}: reference count 9 → 2")),
        "{}",
        verified.report()
    );
    check(&pool, &[], 4);
    check(&pool, &["--repair", "--verify-data"], 1);
    check(&pool, &["--verify-data"], 0);
}

#[test]
fn repair_is_refused_on_a_served_pool_and_check_runs_through_it() {
    let dir = TempDir::new("ck-served");
    let pool = create_pool(dir.path(), &[("vm", "1M")]);
    let mut server = Server::start(dir.path(), &pool, &[]);
    let audited = check(&pool, &[], 0);
    assert!(
        audited.stdout.contains("No problems found"),
        "{}",
        audited.report()
    );
    for flag in ["--repair", "--verify-data"] {
        let refused = check(&pool, &[flag], 8);
        assert!(
            refused.stderr.contains("stop the server"),
            "{}",
            refused.report()
        );
        // What verifies data while serving is the scrub.
        assert_eq!(
            refused.stderr.contains("fewerbytes scrub --wait"),
            flag == "--verify-data",
            "{}",
            refused.report()
        );
    }
    assert!(server.stop().success(), "{}", server.log_text());
    check(&pool, &["--repair"], 0);
}

#[test]
fn a_pool_whose_metadata_does_not_load_cannot_be_repaired_and_says_so() {
    let dir = TempDir::new("ck-broken");
    let (pool, _) = pool_with_data(&dir);
    // Both super block copies damaged past their magic: they fail their checksums,
    // and nothing else says where the metadata is.
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&pool)
        .expect("open the pool file");
    for copy in 0..2u64 {
        std::os::unix::fs::FileExt::write_all_at(&file, &[0xa5u8; 256], copy * 4096 + 256)
            .expect("overwrite part of a super block");
    }
    drop(file);
    let refused = check(&pool, &["--repair"], 4);
    assert!(
        refused
            .stderr
            .contains("cannot be repaired by `check --repair`: its metadata does not load"),
        "{}",
        refused.report()
    );
    check(&pool, &[], 4);
    // No pool at all is not damage: the check did not run.
    check(&dir.join("none.pool"), &[], 8);
}

#[test]
fn a_count_of_zero_under_live_references_stops_the_open_and_repair_restores_it() {
    let dir = TempDir::new("ck-zero");
    let (pool, image) = pool_with_data(&dir);
    let mut object = 0;
    damage(&pool, |p| {
        // Block 2's object, stored at data block 1: a free record and one with no
        // references at data block 0 look alike on disk (format v1), see docs/check.md.
        object = p.object_of("vm", 2).unwrap().expect("block 2 is stored");
        p.damage_reference_count(object, 0).unwrap();
    });
    let found = check(&pool, &[], 4);
    assert!(
        found
            .stderr
            .contains("`fewerbytes check --repair` restores their counts"),
        "{}",
        found.report()
    );
    let refused = fewerbytes(&pool, &["volume", "list"]);
    assert_eq!(refused.status.code(), Some(1), "{}", refused.report());
    let repaired = check(&pool, &["--repair"], 1);
    assert!(
        repaired.stdout.contains(&format!(
            "repaired: object {object}: reference count 0 → 1 (its data matches its fingerprint)"
        )),
        "{}",
        repaired.report()
    );
    check(&pool, &[], 0);
    assert!(exported(&pool, &dir) == image, "the volume changed");
}
