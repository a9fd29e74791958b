//! The dedup window a pool reports holds what it says: a file of random
//! data up to 90% of the window, imported twice with `volume import`, dedups ≥ 99%
//! the second time; past the window dedup degrades gracefully (the index keeps a
//! sample and tries a hit's neighbours: a second copy of twice the window in order
//! is still found nearly whole, shuffled a share of it); and
//! `serve --index-memory` sizes the index for that open. Small windows, set with
//! `--index-memory`, keep the files a few tens of MiB.

mod common;

use common::data::Rng;
use common::*;
use std::path::{Path, PathBuf};

const BLOCK: u64 = 4096;

fn json(pool: &Path, args: &[&str]) -> serde_json::Value {
    let ran = fewerbytes_ok(pool, args);
    serde_json::from_str(&ran.stdout).unwrap_or_else(|e| panic!("{e}:\n{}", ran.report()))
}

fn u64_of(v: &serde_json::Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("no {field} in {v}"))
}

/// A pool of `size` whose index takes `index_memory`; its window in blocks.
fn pool_with_index(dir: &TempDir, size: &str, index_memory: u64) -> (PathBuf, u64) {
    let budget = index_memory.to_string();
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(
        &pool,
        &[
            "pool",
            "create",
            pool_str,
            "--size",
            size,
            "--index-memory",
            &budget,
        ],
    );
    let info = json(&pool, &["pool", "info", "--json"]);
    let window = u64_of(&info, "dedup_window_bytes") / BLOCK;
    let memory = u64_of(&info, "index_memory_bytes");
    // Within the budget, and about 4 bytes per 4 KiB block of window (1 GiB per
    // TiB; a little more in tables this small, whose shards' shares vary more).
    assert!(
        memory <= index_memory && memory <= window * 9 / 2,
        "{memory} bytes for a window of {window} blocks"
    );
    (pool, window)
}

/// Imports `blocks` blocks of random data twice (the second time with its blocks
/// shuffled, if asked); the share (per mille) of the second copy's blocks that
/// deduplicated, checked against the data the second copy added.
fn second_copy_dedup_permille(
    dir: &TempDir,
    pool: &Path,
    blocks: u64,
    seed: u64,
    shuffled: bool,
) -> u64 {
    let file = dir.join(&format!("random-{seed}.img"));
    let mut bytes = vec![0u8; (blocks * BLOCK) as usize];
    let mut rng = Rng::new(seed);
    rng.fill(&mut bytes);
    std::fs::write(&file, &bytes).expect("write the random file");
    let file_str = file.to_str().expect("utf-8 temp path");
    fewerbytes_ok(pool, &["volume", "import", "first", file_str]);
    let first = json(pool, &["stats", "--json"]);
    if shuffled {
        let mut order: Vec<usize> = (0..blocks as usize).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let b = BLOCK as usize;
        let out: Vec<u8> = order
            .iter()
            .flat_map(|&i| bytes[i * b..(i + 1) * b].iter().copied())
            .collect();
        std::fs::write(&file, &out).expect("write the shuffled file");
    }
    drop(bytes);
    fewerbytes_ok(pool, &["volume", "import", "second", file_str]);
    let second = json(pool, &["stats", "--json"]);
    std::fs::remove_file(&file).expect("remove the random file");
    let saved = u64_of(&second, "dedup_saved_blocks") - u64_of(&first, "dedup_saved_blocks");
    let added = u64_of(&second, "stored_bytes") - u64_of(&first, "stored_bytes");
    // Random data: every block not deduplicated is stored whole.
    assert_eq!(
        added,
        (blocks - saved) * BLOCK,
        "the second copy added {added} bytes but deduplicated {saved} of {blocks} blocks"
    );
    eprintln!("{blocks} blocks imported twice: the second copy deduplicated {saved}");
    saved * 1000 / blocks
}

#[test]
fn a_second_copy_within_the_reported_window_dedups() {
    let dir = TempDir::new("dwin");
    let (pool, window) = pool_with_index(&dir, "1G", 64 << 10);
    assert!(
        window >= 8192,
        "a 64 KiB index gives a window of {window} blocks"
    );
    // 90% of the window, each import a separate open: the second copy is found in
    // an index rebuilt from the object records.
    let permille = second_copy_dedup_permille(&dir, &pool, window * 9 / 10, 1, false);
    assert!(
        permille >= 990,
        "a second copy of 90% of the window deduplicated {permille}‰"
    );
    assert_check_clean(&pool);
}

#[test]
fn past_the_window_dedup_degrades_gracefully() {
    // Twice the window. The index keeps a sample as large as its slots (each new
    // block replaces a random older entry), and once lossy a miss also tries the
    // objects stored after the thread's last hit: a second copy in the same order
    // is found from its sampled blocks onwards, nearly whole.
    let dir = TempDir::new("dpast");
    let (pool, window) = pool_with_index(&dir, "1G", 64 << 10);
    let permille = second_copy_dedup_permille(&dir, &pool, window * 2, 2, false);
    assert!(
        permille >= 950,
        "a second copy of twice the window, in order, deduplicated {permille}‰"
    );
    let verbose = fewerbytes_ok(&pool, &["stats", "--verbose"]).stdout;
    assert!(
        verbose.contains("index entries dropped since open"),
        "stats --verbose does not show the index's dropped entries:\n{verbose}"
    );
    assert_check_clean(&pool);
    // Shuffled, only the sample is found (less the entries the second copy's own
    // misses displace before they are looked up): a share, not nothing.
    let dir = TempDir::new("dshuf");
    let (pool, window) = pool_with_index(&dir, "1G", 64 << 10);
    let permille = second_copy_dedup_permille(&dir, &pool, window * 2, 3, true);
    assert!(
        permille >= 250,
        "a second copy of twice the window, shuffled, deduplicated {permille}‰"
    );
    assert_check_clean(&pool);
}

#[test]
fn serve_sizes_the_index_for_its_open() {
    let dir = TempDir::new("dserve");
    let (pool, recorded) = pool_with_index(&dir, "1G", 1 << 20);
    let mut server = Server::start(dir.path(), &pool, &["--index-memory", "64K"]);
    let served: serde_json::Value =
        serde_json::from_str(&server.cli_ok(&["pool", "info", "--json"]).stdout).expect("json");
    let window = u64_of(&served, "dedup_window_bytes") / BLOCK;
    assert!(
        u64_of(&served, "index_memory_bytes") <= 64 << 10 && window * 8 < recorded,
        "served with --index-memory 64K: {served}"
    );
    let status = server.stop();
    assert!(status.success(), "{}", server.log_text());
    drop(server);
    // The budget was for that open only: the pool keeps the window it records.
    let info = json(&pool, &["pool", "info", "--json"]);
    assert_eq!(u64_of(&info, "dedup_window_bytes") / BLOCK, recorded);
}

/// `stats --json` of the served pool, once its index is no longer rebuilding (the
/// server rebuilds it in the background after its open).
fn stats_once_index_built(server: &Server) -> serde_json::Value {
    for _ in 0..6000 {
        let stats = server.stats();
        if stats["index"]["state"] != "rebuilding" {
            return stats;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("the index was still rebuilding after 6,000 polls of stats");
}

#[test]
fn a_served_pool_reports_its_index_and_read_only_commands_never_build_it() {
    let dir = TempDir::new("dindex");
    let (pool, _) = pool_with_index(&dir, "1G", 1 << 20);
    let file = dir.join("random.img");
    let mut bytes = vec![0u8; 2048 * BLOCK as usize];
    Rng::new(11).fill(&mut bytes);
    std::fs::write(&file, &bytes).expect("write the random file");
    fewerbytes_ok(
        &pool,
        &["volume", "import", "first", file.to_str().expect("utf-8")],
    );
    // Not served: `pool info` opens the pool read-only and never builds the index.
    let info = json(&pool, &["pool", "info", "--json"]);
    assert_eq!(info["index"]["state"], "not-built", "{info}");
    let text = fewerbytes_ok(&pool, &["pool", "info"]).stdout;
    assert!(
        text.contains("not built (opened read-only)"),
        "pool info of an unserved pool:\n{text}"
    );
    // `volume import`'s close saved the index beside the pool: the server loads it,
    // and its stop saves it again. Without the file, the next open rebuilds it, and
    // says so until it is ready.
    let saved = {
        let mut name = std::fs::canonicalize(&pool)
            .expect("pool path")
            .into_os_string();
        name.push(".index");
        std::path::PathBuf::from(name)
    };
    assert!(saved.exists(), "volume import's close saved no index");
    let mut server = Server::start(dir.path(), &pool, &[]);
    for round in 0..2 {
        let stats = stats_once_index_built(&server);
        assert_eq!(stats["index"]["state"], "ready", "round {round}: {stats}");
        assert_eq!(stats["index"]["percent"], 100, "round {round}: {stats}");
        assert_eq!(
            stats["index"]["loaded"],
            round == 0,
            "round {round}: {stats}"
        );
        let text = server.cli_ok(&["stats"]).stdout;
        assert!(
            text.contains("Index: ready"),
            "round {round}: stats:\n{text}"
        );
        let text = server.cli_ok(&["pool", "info"]).stdout;
        let ends = if round == 0 {
            "ready (loaded from the index saved at the last close)"
        } else {
            "ready"
        };
        assert!(
            text.lines()
                .any(|l| l.starts_with("Index") && l.trim_end().ends_with(ends)),
            "round {round}: pool info:\n{text}"
        );
        assert!(!saved.exists(), "round {round}: the loaded file stayed");
        let status = server.stop();
        assert!(status.success(), "{}", server.log_text());
        assert!(saved.exists(), "round {round}: the stop saved no index");
        if round == 0 {
            std::fs::remove_file(&saved).expect("remove the saved index");
            server.spawn();
        }
    }
    // The server's log says where the index came from each time.
    let log = server.log_text();
    assert!(log.contains("dedup index loaded from"), "{log}");
    assert!(
        log.contains("dedup index rebuilt from 2048 stored objects"),
        "{log}"
    );
}
