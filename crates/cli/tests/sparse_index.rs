//! The sparse dedup index (`pool create --index sparse`): with the same memory as a
//! dense one it finds a template written again after fourteen times the dense
//! window of other data, which the dense index has forgotten; and the mode is a setting of
//! the pool (`pool set --index`, `--index-memory`), recorded in its super block and
//! shown by `pool info`.

mod common;

use common::data::{compressible_block, Rng};
use common::*;
use std::path::{Path, PathBuf};

const BLOCK: u64 = 4096;

/// The index memory of both pools: a dense window of a few tens of MiB.
const INDEX_MEMORY: &str = "32K";

fn json(pool: &Path, args: &[&str]) -> serde_json::Value {
    let ran = fewerbytes_ok(pool, args);
    serde_json::from_str(&ran.stdout).unwrap_or_else(|e| panic!("{e}:\n{}", ran.report()))
}

fn u64_of(v: &serde_json::Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("no {field} in {v}"))
}

fn pool_of(dir: &TempDir, mode: &str) -> PathBuf {
    let pool = dir.join(&format!("{mode}.pool"));
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(
        &pool,
        &[
            "pool",
            "create",
            pool_str,
            "--size",
            "1G",
            "--index-memory",
            INDEX_MEMORY,
            "--index",
            mode,
        ],
    );
    pool
}

/// A template image: runs of text-like blocks (stored compressed, packed several to a
/// block) and of random ones (stored whole), every block distinct.
fn template(blocks: u64) -> Vec<u8> {
    let mut rng = Rng::new(77);
    let mut image = Vec::with_capacity((blocks * BLOCK) as usize);
    for b in 0..blocks {
        if (b / 37) % 2 == 0 {
            image.extend_from_slice(&compressible_block(b ^ 0x5eed));
        } else {
            let mut block = vec![0u8; BLOCK as usize];
            rng.fill(&mut block);
            image.extend_from_slice(&block);
        }
    }
    image
}

/// Imports the template, then `other` (distinct data), then the template again into
/// a new volume; the share (per mille) of the second copy's blocks deduplicated.
fn template_again_permille(pool: &Path, template: &Path, other: &Path, blocks: u64) -> u64 {
    let template = template.to_str().expect("utf-8 temp path");
    fewerbytes_ok(pool, &["volume", "import", "template", template]);
    let other = other.to_str().expect("utf-8 temp path");
    fewerbytes_ok(pool, &["volume", "import", "other", other]);
    let before = u64_of(&json(pool, &["stats", "--json"]), "dedup_saved_blocks");
    fewerbytes_ok(pool, &["volume", "import", "clone", template]);
    let after = u64_of(&json(pool, &["stats", "--json"]), "dedup_saved_blocks");
    (after - before) * 1000 / blocks
}

#[test]
fn a_sparse_index_finds_a_template_again_far_past_the_dense_window() {
    let dir = TempDir::new("sparse");
    let dense = pool_of(&dir, "dense");
    let sparse = pool_of(&dir, "sparse");
    let dense_info = json(&dense, &["pool", "info", "--json"]);
    let sparse_info = json(&sparse, &["pool", "info", "--json"]);
    assert_eq!(dense_info["index_mode"]["mode"], "dense", "{dense_info}");
    assert_eq!(sparse_info["index_mode"]["mode"], "sparse", "{sparse_info}");
    assert_eq!(sparse_info["index_mode"]["shift"], 4, "{sparse_info}");
    // The same memory and table; sixteen times the window.
    let window = u64_of(&dense_info, "dedup_window_bytes") / BLOCK;
    assert_eq!(
        u64_of(&sparse_info, "index_memory_bytes"),
        u64_of(&dense_info, "index_memory_bytes")
    );
    assert_eq!(
        u64_of(&sparse_info, "dedup_window_bytes") / BLOCK,
        window * 16
    );

    let blocks = 1024;
    let template_file = dir.join("template.img");
    std::fs::write(&template_file, template(blocks)).expect("write the template");
    // Fourteen dense windows of random data: a dense index keeps a random sample of
    // what it was given past its window (each insert drops a random entry), and
    // after fourteen windows too little of the template to find the rest next to
    // it (after ten, a run of 256 blocks still kept one entry in two runs, rebuilt
    // at open in slab order); the sparse one holds the template's hooks and the
    // other data's (14/16 of its window).
    const WINDOWS: u64 = 14;
    let other_file = dir.join("other.img");
    let mut other = vec![0u8; (window * WINDOWS * BLOCK) as usize];
    Rng::new(78).fill(&mut other);
    std::fs::write(&other_file, &other).expect("write the other data");
    drop(other);

    let dense_permille = template_again_permille(&dense, &template_file, &other_file, blocks);
    let sparse_permille = template_again_permille(&sparse, &template_file, &other_file, blocks);
    eprintln!(
        "template of {blocks} blocks again after {} blocks of other data: dense {dense_permille}‰, \
         sparse {sparse_permille}‰ deduplicated",
        window * WINDOWS
    );
    assert!(
        dense_permille < 500,
        "the dense index still found {dense_permille}‰ of the template after {WINDOWS} \
         windows of other data: the test no longer shows what sparse adds"
    );
    assert!(
        sparse_permille >= 900,
        "the sparse index found {sparse_permille}‰ of the template after {WINDOWS} dense \
         windows"
    );
    assert_check_clean(&sparse);
    // Every volume reads back as written (advice found next to a hook is verified).
    let out = dir.join("clone.img");
    fewerbytes_ok(
        &sparse,
        &[
            "volume",
            "export",
            "clone",
            out.to_str().expect("utf-8 temp path"),
        ],
    );
    assert!(
        std::fs::read(&out).expect("read the export") == template(blocks),
        "the sparse pool's clone does not read back as the template"
    );
}

#[test]
fn pool_set_changes_the_index_mode_and_memory_and_pool_info_shows_them() {
    let dir = TempDir::new("sparseset");
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    // Default: dense.
    fewerbytes_ok(
        &pool,
        &[
            "pool",
            "create",
            pool_str,
            "--size",
            "1G",
            "--index-memory",
            "64K",
        ],
    );
    let info = json(&pool, &["pool", "info", "--json"]);
    assert_eq!(info["index_mode"]["mode"], "dense", "{info}");
    let entries = u64_of(&info, "index_entries");
    let window = u64_of(&info, "dedup_window_bytes");

    // Sparse, the same memory: recorded in the super block, used by the next open.
    let set = fewerbytes_ok(&pool, &["pool", "set", "--index", "sparse"]);
    assert!(
        set.stdout.contains("sparse") && set.stdout.contains("next open"),
        "{}",
        set.report()
    );
    let info = json(&pool, &["pool", "info", "--json"]);
    assert_eq!(info["index_mode"]["mode"], "sparse", "{info}");
    assert_eq!(u64_of(&info, "index_entries"), entries, "{info}");
    assert_eq!(u64_of(&info, "dedup_window_bytes"), window * 16, "{info}");
    assert!(info["index_recorded"].is_null(), "{info}");
    let text = fewerbytes_ok(&pool, &["pool", "info"]).stdout;
    assert!(
        text.contains("sparse (1 in 16 blocks sampled) index"),
        "{text}"
    );

    // More memory: more entries, the mode kept.
    fewerbytes_ok(&pool, &["pool", "set", "--index-memory", "256K"]);
    let info = json(&pool, &["pool", "info", "--json"]);
    assert_eq!(info["index_mode"]["mode"], "sparse", "{info}");
    assert!(u64_of(&info, "index_entries") > entries * 3, "{info}");
    assert!(u64_of(&info, "index_memory_bytes") <= 256 << 10, "{info}");

    // Back to dense; the pool still holds what was written and checks clean.
    let data = dir.join("data.img");
    std::fs::write(&data, template(256)).expect("write data");
    fewerbytes_ok(
        &pool,
        &["volume", "import", "a", data.to_str().expect("utf-8")],
    );
    fewerbytes_ok(&pool, &["pool", "set", "--index", "dense"]);
    let info = json(&pool, &["pool", "info", "--json"]);
    assert_eq!(info["index_mode"]["mode"], "dense", "{info}");
    assert_check_clean(&pool);

    // Served: recorded through the server, used from its next open; pool info shows
    // the index in use and the one recorded.
    let mut server = Server::start(dir.path(), &pool, &[]);
    let set = server.cli_ok(&["pool", "set", "--index", "sparse"]);
    assert!(set.stdout.contains("next open"), "{}", set.report());
    let served: serde_json::Value =
        serde_json::from_str(&server.cli_ok(&["pool", "info", "--json"]).stdout).expect("json");
    assert_eq!(served["index_mode"]["mode"], "dense", "{served}");
    assert_eq!(served["index_recorded"][0]["mode"], "sparse", "{served}");
    let text = server.cli_ok(&["pool", "info"]).stdout;
    assert!(
        text.contains("the pool records sparse (1 in 16 blocks sampled)")
            && text.contains("which an open without `serve --index-memory` builds"),
        "{text}"
    );
    let status = server.stop();
    assert!(status.success(), "{}", server.log_text());
    drop(server);
    let info = json(&pool, &["pool", "info", "--json"]);
    assert_eq!(info["index_mode"]["mode"], "sparse", "{info}");
    assert!(info["index_recorded"].is_null(), "{info}");
    fewerbytes_ok(&pool, &["pool", "set", "--index", "dense"]);

    // Bad input: a clear error, nothing changed.
    let bad = fewerbytes(&pool, &["pool", "set", "--index", "sparser"]);
    assert!(
        !bad.status.success() && bad.stderr.contains("unknown index mode 'sparser'"),
        "{}",
        bad.report()
    );
    let none = fewerbytes(&pool, &["pool", "set"]);
    assert!(!none.status.success(), "{}", none.report());
    let info = json(&pool, &["pool", "info", "--json"]);
    assert_eq!(info["index_mode"]["mode"], "dense", "{info}");
}
