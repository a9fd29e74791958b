//! `fewerbytes scrub` on a served pool: bytes written into the pool file under the
//! running server (one block-map page, one stored data block) are found by
//! `scrub --wait`, which rewrites the page from the server's memory, names the
//! volume and range that map the damaged block, and exits non-zero for it; a
//! second scrub finds only the block; `check` after the server stops is clean.
//! Pause and resume show in `scrub status`.

mod common;

use common::data::Rng;
use common::*;
use std::os::unix::fs::FileExt;

const BLOCK: usize = 4096;
/// The page header's magic ("FBPG", little-endian u32 0x4750_4246) and the byte
/// offsets of its kind, generation and owner (docs/format.md, "Pages").
const PAGE_MAGIC: [u8; 4] = [0x46, 0x42, 0x50, 0x47];
const KIND_MAP: u8 = 1;

fn u64_at(block: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(block[at..at + 8].try_into().expect("8 bytes"))
}

/// Byte offset in the pool file of the newest block-map page of volume `owner`.
fn newest_map_page(file: &[u8], owner: u64) -> usize {
    file.chunks(BLOCK)
        .enumerate()
        .filter(|(_, b)| b.len() == BLOCK && b[..4] == PAGE_MAGIC && b[9] == KIND_MAP)
        .filter(|(_, b)| u64_at(b, 40) == owner)
        .max_by_key(|(_, b)| u64_at(b, 32))
        .map(|(i, _)| i * BLOCK)
        .expect("a block-map page of the volume in the pool file")
}

fn volume_id(pool: &std::path::Path, name: &str) -> u64 {
    let ran = fewerbytes_ok(pool, &["volume", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_str(&ran.stdout).expect("json");
    list.as_array()
        .expect("array")
        .iter()
        .find(|v| v["name"] == name)
        .and_then(|v| v["id"].as_u64())
        .expect("the volume's id")
}

fn scrub_json(pool: &std::path::Path, args: &[&str]) -> (Ran, serde_json::Value) {
    let mut all = vec!["scrub"];
    all.extend_from_slice(args);
    all.push("--json");
    let ran = fewerbytes(pool, &all);
    let value = serde_json::from_str(&ran.stdout)
        .unwrap_or_else(|e| panic!("scrub --json: {e}\n{}", ran.report()));
    (ran, value)
}

#[test]
fn scrub_of_a_served_pool_repairs_a_damaged_page_and_names_a_damaged_block() {
    let dir = TempDir::new("scrub");
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "256M"]);
    // Two volumes of noise (stored whole, so a block is found by its bytes).
    let mut images = Vec::new();
    for (name, seed) in [("a", 1u64), ("b", 2)] {
        fewerbytes_ok(&pool, &["volume", "create", name, "--size", "8M"]);
        let mut image = vec![0u8; 2 << 20];
        Rng::new(seed).fill(&mut image);
        let path = dir.join(&format!("{name}.raw"));
        std::fs::write(&path, &image).expect("write the image");
        fewerbytes_ok(
            &pool,
            &["volume", "import", name, path.to_str().expect("utf-8")],
        );
        images.push(image);
    }
    let mut server = Server::start(dir.path(), &pool, &[]);
    let a = volume_id(&pool, "a");

    // Damage the newest map page of volume a and block 3 of volume b, in the
    // pool file, under the running server.
    let bytes = std::fs::read(&pool).expect("read the pool file");
    let map_at = newest_map_page(&bytes, a);
    let block_3 = &images[1][3 * BLOCK..4 * BLOCK];
    let data_at = bytes
        .chunks(BLOCK)
        .position(|c| c == block_3)
        .expect("volume b's block 3 stored whole")
        * BLOCK;
    drop(bytes);
    // Named one way in every report of damage: volume bytes, then the pool block.
    let block_3_named = format!(
        "volume 'b' bytes 12288..16383 (pool block {})",
        data_at / BLOCK
    );
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&pool)
        .expect("open the pool file");
    file.write_all_at(&[0xa5; 64], (map_at + 1000) as u64)
        .expect("damage the map page");
    file.write_all_at(&[0x5a; 16], (data_at + 100) as u64)
        .expect("damage the data block");
    file.sync_all().expect("sync");

    let ran = fewerbytes(&pool, &["scrub", "--wait"]);
    assert_eq!(ran.status.code(), Some(1), "{}", ran.report());
    assert!(
        ran.stdout.contains("2 errors found, 1 repaired"),
        "{}",
        ran.report()
    );
    // 2 MiB of data spans two map pages (504 blocks each): either may be newest.
    assert!(
        ran.stdout.contains("map (repaired): block-map page"),
        "{}",
        ran.report()
    );
    assert!(ran.stdout.contains("of volume 'a'"), "{}", ran.report());
    assert!(
        ran.stdout.contains(&format!("mapped by {block_3_named}")),
        "{}",
        ran.report()
    );

    // Again: the page reads back good now; only the block is damaged.
    let (ran, second) = scrub_json(&pool, &["--wait"]);
    assert_eq!(ran.status.code(), Some(1), "{}", ran.report());
    assert_eq!(second["state"], "done", "{}", ran.report());
    assert_eq!(second["errors_found"], 1, "{}", ran.report());
    assert_eq!(second["findings"][0]["region"], "data", "{}", ran.report());
    assert_eq!(
        second["findings"][0]["volumes"][0],
        block_3_named.as_str(),
        "{}",
        ran.report()
    );
    assert!(second["started"].as_str().is_some_and(|t| t.ends_with('Z')));

    // The report is in stats and pool info.
    let stats: serde_json::Value =
        serde_json::from_str(&fewerbytes_ok(&pool, &["stats", "--json"]).stdout).expect("json");
    assert_eq!(stats["scrub"]["state"], "done");
    assert_eq!(stats["scrub"]["errors_found"], 1);
    let info = fewerbytes_ok(&pool, &["pool", "info"]);
    assert!(info.stdout.contains("Scrub:"), "{}", info.report());
    assert!(info.stdout.contains("1 errors found"), "{}", info.report());

    // Pause and resume, as `scrub status` shows them (4 KiB/s: minutes to go).
    let (ran, started) = scrub_json(&pool, &["start", "--rate", "4K"]);
    assert!(ran.status.success(), "{}", ran.report());
    assert_eq!(started["state"], "running");
    fewerbytes_ok(&pool, &["scrub", "pause"]);
    let (_, paused) = scrub_json(&pool, &["status"]);
    assert_eq!(paused["state"], "paused");
    let refused = fewerbytes(&pool, &["scrub", "start"]);
    assert!(!refused.status.success(), "{}", refused.report());
    assert!(
        refused.stderr.contains("already paused"),
        "{}",
        refused.report()
    );
    fewerbytes_ok(&pool, &["scrub", "resume"]);
    let (_, resumed) = scrub_json(&pool, &["status"]);
    assert_eq!(resumed["state"], "running");
    assert_eq!(resumed["rate_bytes_per_s"], 4096);

    // Stopping the server ends the scrub; the reopened pool checks clean (its
    // rewritten map page loads).
    assert!(server.stop().success(), "{}", server.log_text());
    assert_check_clean(&pool);

    // Not served: the command opens the pool, scrubs it to the end, and closes it.
    let ran = fewerbytes(&pool, &["scrub"]);
    assert_eq!(ran.status.code(), Some(1), "{}", ran.report());
    assert!(
        ran.stdout.contains("1 errors found, 0 repaired"),
        "{}",
        ran.report()
    );
    assert!(
        ran.stdout.contains(&format!("mapped by {block_3_named}")),
        "{}",
        ran.report()
    );
    let refused = fewerbytes(&pool, &["scrub", "pause"]);
    assert!(!refused.status.success(), "{}", refused.report());
    assert!(
        refused.stderr.contains("no server holds the pool"),
        "{}",
        refused.report()
    );
}

/// `fewerbytes --pool FROM volume send ARGS… | fewerbytes --pool TO volume receive NAME`.
fn send_receive(from: &std::path::Path, args: &[&str], to: &std::path::Path, name: &str) {
    let bin = fewerbytes_bin();
    let (bin, from, to) = (
        bin.to_str().expect("utf-8"),
        from.to_str().expect("utf-8"),
        to.to_str().expect("utf-8"),
    );
    let line = format!(
        "set -o pipefail; '{bin}' --pool '{from}' volume send {} | '{bin}' --pool '{to}' \
         volume receive {name}",
        args.join(" ")
    );
    let mut cmd = std::process::Command::new("bash");
    cmd.args(["-c", &line]);
    let ran = run_with_limit(&mut cmd, CLIENT_LIMIT);
    assert!(ran.status.success(), "{}", ran.report());
}

/// The scrub of `pool` (not served) finds nothing and exits 0, and `check` agrees.
fn assert_scrubs_clean(pool: &std::path::Path) {
    let ran = fewerbytes(pool, &["scrub"]);
    assert_eq!(ran.status.code(), Some(0), "{}", ran.report());
    assert!(
        ran.stdout.contains("0 errors found, 0 repaired"),
        "{}",
        ran.report()
    );
    assert_check_clean(pool);
}

/// Regression: `volume clone src c1` on a clean pool, then `scrub`: "133
/// errors found", exit 1, "the page names owner 1 … expected owner 2", and advice to
/// trim the ranges, while reads and `check --verify-data` were clean. A clone's,
/// snapshot's and rollback's map pages are their source's, named by its lineage.
#[test]
fn a_pool_with_clones_snapshots_rollbacks_and_received_snapshots_scrubs_clean() {
    let dir = TempDir::new("scrub-lineage");
    let pool = dir.join("a.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "256M"]);
    fewerbytes_ok(&pool, &["volume", "create", "vm", "--size", "8M"]);
    // 3 MiB of noise: map pages 0 and 1.
    let mut image = vec![0u8; 3 << 20];
    Rng::new(37).fill(&mut image);
    let raw = dir.join("vm.raw");
    std::fs::write(&raw, &image).expect("write the image");
    fewerbytes_ok(
        &pool,
        &["volume", "import", "vm", raw.to_str().expect("utf-8")],
    );
    fewerbytes_ok(&pool, &["volume", "snapshot", "vm", "s1"]);
    fewerbytes_ok(&pool, &["volume", "clone", "vm", "c1"]);
    fewerbytes_ok(&pool, &["volume", "clone", "c1", "c2"]);
    fewerbytes_ok(&pool, &["volume", "clone", "vm@s1", "c3"]);
    // Writes after the clones: vm and c2 make a page each their own.
    let mut server = Server::start(dir.path(), &pool, &[]);
    for volume in ["vm", "c2"] {
        qemu_io(
            &server.unix_uri(volume),
            &["write -P 7 4096 8192".into(), "flush".into()],
        );
    }
    assert!(server.stop().success(), "{}", server.log_text());
    fewerbytes_ok(&pool, &["volume", "snapshot", "vm", "s2"]);
    fewerbytes_ok(&pool, &["volume", "rollback", "vm", "s1"]);
    fewerbytes_ok(&pool, &["volume", "delete", "c1"]);
    assert_scrubs_clean(&pool);

    // Served: the scrub finds nothing, so it rewrites nothing.
    let mut server = Server::start(dir.path(), &pool, &[]);
    let ran = fewerbytes(&pool, &["scrub", "--wait"]);
    assert_eq!(ran.status.code(), Some(0), "{}", ran.report());
    assert!(
        ran.stdout.contains("0 errors found, 0 repaired"),
        "{}",
        ran.report()
    );
    assert!(server.stop().success(), "{}", server.log_text());

    // Received snapshots, a full stream and an incremental one, and a clone of one.
    let other = dir.join("b.pool");
    let other_str = other.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&other, &["pool", "create", other_str, "--size", "256M"]);
    send_receive(&pool, &["vm@s1"], &other, "vm");
    send_receive(&pool, &["vm@s2", "--from", "s1"], &other, "vm");
    fewerbytes_ok(&other, &["volume", "clone", "vm@s1", "r1"]);
    assert_scrubs_clean(&other);
}

/// One map page a snapshot shares with its volume, damaged under the server: one
/// error, naming both the volume and the snapshot (each loses the 2 MiB it maps),
/// rewritten from memory for both, so both check clean after.
#[test]
fn a_damaged_page_a_snapshot_shares_is_named_for_both_and_rewritten() {
    let dir = TempDir::new("scrub-shared");
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "256M"]);
    fewerbytes_ok(&pool, &["volume", "create", "sv", "--size", "8M"]);
    let mut image = vec![0u8; 2 << 20];
    Rng::new(38).fill(&mut image);
    let raw = dir.join("sv.raw");
    std::fs::write(&raw, &image).expect("write the image");
    fewerbytes_ok(
        &pool,
        &["volume", "import", "sv", raw.to_str().expect("utf-8")],
    );
    fewerbytes_ok(&pool, &["volume", "snapshot", "sv", "s"]);
    let mut server = Server::start(dir.path(), &pool, &[]);
    let sv = volume_id(&pool, "sv");
    let bytes = std::fs::read(&pool).expect("read the pool file");
    // The newest page of the line: page 0 or 1 (2 MiB spans both), shared by both.
    let page_at = newest_map_page(&bytes, sv);
    let index = u64_at(&bytes[page_at..page_at + BLOCK], 48);
    drop(bytes);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&pool)
        .expect("open the pool file");
    file.write_all_at(&[0xa5; 64], (page_at + 1000) as u64)
        .expect("damage the map page");
    file.sync_all().expect("sync");

    let (ran, report) = scrub_json(&pool, &["--wait"]);
    assert_eq!(ran.status.code(), Some(0), "{}", ran.report());
    assert_eq!(report["errors_found"], 1, "one page, one error: {report}");
    assert_eq!(report["repaired"], 1, "{report}");
    let per_page = 504 * BLOCK as u64;
    let range = format!("bytes {}..{}", index * per_page, (index + 1) * per_page - 1);
    assert_eq!(
        report["findings"][0]["volumes"],
        serde_json::json!([
            format!("volume 'sv' {range}"),
            format!("volume 'sv@s' {range}")
        ]),
        "{report}"
    );
    let (_, again) = scrub_json(&pool, &["--wait"]);
    assert_eq!(again["errors_found"], 0, "{again}");
    assert!(server.stop().success(), "{}", server.log_text());
    assert_check_clean(&pool);
    for volume in ["sv", "sv@s"] {
        let out = dir.join(&format!("{volume}.out.raw"));
        fewerbytes_ok(
            &pool,
            &["volume", "export", volume, out.to_str().expect("utf-8")],
        );
        let got = std::fs::read(&out).expect("read the export");
        assert!(got[..image.len()] == image[..], "{volume} differs");
    }
}
