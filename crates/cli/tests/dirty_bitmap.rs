//! Changed blocks over NBD: a volume exports the metadata context
//! `qemu:dirty-bitmap:SNAP` (the blocks changed since SNAP, a snapshot of it: a
//! clone taken earlier), as qemu-nbd's `-B` does, so a backup client reads only what
//! changed; `volume diff` lists the same ranges. Driven with libnbd's `block_status` (Debian's python3-libnbd), and an
//! incremental backup made from the dirty extents alone is checked against a full
//! copy with `qemu-img compare`.

mod common;

use common::libnbd::python_nbd;
use common::*;

const MIB: u64 = 1024 * 1024;

/// Asks for both contexts, says which were offered, walks the whole export's dirty
/// bitmap, and copies each dirty extent into BACKUP (which holds the snapshot).
const INCREMENTAL_PY: &str = r#"
import json, sys, nbd
uri, base, backup = sys.argv[1], sys.argv[2], sys.argv[3]
bitmap = "qemu:dirty-bitmap:" + base
h = nbd.NBD()
h.add_meta_context("base:allocation")
h.add_meta_context(bitmap)
h.connect_uri(uri)
offered = {c: bool(h.can_meta_context(c)) for c in ["base:allocation", bitmap]}
size = h.get_size()
seen = {}
def record(context, offset, entries, err):
    runs = seen.setdefault(context, [])
    pos = offset
    for i in range(0, len(entries), 2):
        runs.append([pos, entries[i], entries[i + 1]])
        pos += entries[i]
    return 0
copied = 0
if offered[bitmap]:
    pos = 0
    while pos < size:
        h.block_status(min(size - pos, 1 << 30), pos, record)
        last = seen[bitmap][-1]
        pos = last[0] + last[1]
    with open(backup, "r+b") as out:
        for start, length, flags in seen[bitmap]:
            if flags & 1:
                out.seek(start)
                out.write(h.pread(length, start))
                copied += length
print(json.dumps({"offered": offered, "runs": seen.get(bitmap, []),
                  "allocation_chunks": len(seen.get("base:allocation", [])),
                  "copied": copied}))
"#;

fn incremental(uri: &str, base: &str, backup: &std::path::Path) -> serde_json::Value {
    let ran = python_nbd(
        INCREMENTAL_PY,
        &[uri, base, backup.to_str().expect("utf-8 path")],
    );
    serde_json::from_str(ran.stdout.trim())
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", ran.report()))
}

fn raw_copy(uri: &str, to: &std::path::Path) {
    let ran = run_with_limit(
        std::process::Command::new(require_tool("qemu-img")).args([
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            uri,
            to.to_str().expect("utf-8 path"),
        ]),
        CLIENT_LIMIT,
    );
    assert!(ran.status.success(), "{}", ran.report());
}

#[test]
fn a_backup_client_reads_only_the_blocks_changed_since_a_snapshot() {
    let dir = TempDir::new("bitmap");
    let server = Server::start_new(dir.path(), &[("vm", "16M")], &[]);
    let uri = server.unix_uri("vm");
    qemu_io(&uri, &["write -P 0x11 0 8M".into()]);
    fewerbytes_ok(
        &server.pool,
        &["volume", "clone", "vm", "vm.monday", "--thin"],
    );
    // Since the snapshot: 1 MiB of new data, a block past the old data, a trim of
    // 1 MiB that held data, and a rewrite of the same bytes (it dedups to the block
    // it replaces: no change).
    qemu_io(
        &uri,
        &[
            "write -P 0x22 2M 1M".into(),
            "write -P 0x33 10M 4k".into(),
            "discard 5M 1M".into(),
            "write -P 0x11 7M 64k".into(),
        ],
    );

    // The snapshot as a full backup of Monday, then the increment on top of it.
    let backup = dir.path().join("backup.raw");
    raw_copy(&server.unix_uri("vm.monday"), &backup);
    let got = incremental(&uri, "vm.monday", &backup);
    assert_eq!(got["offered"]["qemu:dirty-bitmap:vm.monday"], true, "{got}");
    assert_eq!(got["offered"]["base:allocation"], true, "{got}");
    assert!(
        got["allocation_chunks"].as_u64() > Some(0),
        "block status answers both contexts: {got}"
    );
    let dirty: Vec<(u64, u64)> = got["runs"]
        .as_array()
        .expect("runs")
        .iter()
        .filter(|r| r[2].as_u64().expect("flags") & 1 == 1)
        .map(|r| (r[0].as_u64().expect("start"), r[1].as_u64().expect("len")))
        .collect();
    assert_eq!(
        dirty,
        [(2 * MIB, MIB), (5 * MIB, MIB), (10 * MIB, 4096)],
        "exactly the changed blocks: {got}"
    );
    assert_eq!(got["copied"], 2 * MIB + 4096, "{got}");
    // `volume diff` lists the same ranges, through the server.
    let diff = fewerbytes_ok(
        &server.pool,
        &["volume", "diff", "vm", "--from", "vm.monday", "--json"],
    );
    let listed: Vec<(u64, u64)> = serde_json::from_str::<serde_json::Value>(&diff.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", diff.report()))
        .as_array()
        .expect("a list")
        .iter()
        .map(|r| {
            (
                r["offset"].as_u64().expect("offset"),
                r["length"].as_u64().expect("length"),
            )
        })
        .collect();
    assert_eq!(listed, dirty, "{}", diff.report());
    let now = dir.path().join("now.raw");
    raw_copy(&uri, &now);
    let compare = run_with_limit(
        std::process::Command::new(require_tool("qemu-img")).args([
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            backup.to_str().expect("path"),
            now.to_str().expect("path"),
        ]),
        CLIENT_LIMIT,
    );
    assert!(
        compare.status.success(),
        "Monday's backup plus the dirty extents is today's disk:\n{}",
        compare.report()
    );

    // A base that does not exist, or the volume itself, is not offered.
    for base in ["vm.tuesday", "vm"] {
        let got = incremental(&uri, base, &backup);
        assert_eq!(
            got["offered"][format!("qemu:dirty-bitmap:{base}")],
            false,
            "{got}"
        );
        assert_eq!(got["offered"]["base:allocation"], true, "{got}");
    }
}

#[test]
fn a_bitmap_against_a_volume_the_client_may_not_open_is_not_offered() {
    // The bitmap says which of the base's blocks differ from the export's: against a
    // volume limited to TLS identities, a client in clear would learn about a volume
    // it may not read. Not offered, as an unknown base is not.
    let dir = TempDir::new("bitmap-access");
    let pool = create_pool(dir.path(), &[("vm", "16M"), ("hers", "16M")]);
    fewerbytes_ok(&pool, &["volume", "allow", "hers", "alice"]);
    let server = Server::start(dir.path(), &pool, &[]);
    let uri = server.unix_uri("vm");
    qemu_io(&uri, &["write -P 0x44 0 1M".into()]);
    let backup = dir.path().join("unused.raw");
    std::fs::write(&backup, []).expect("an empty file");
    let got = incremental(&uri, "hers", &backup);
    assert_eq!(got["offered"]["qemu:dirty-bitmap:hers"], false, "{got}");
    assert_eq!(got["copied"], 0, "{got}");
    // The same request against a volume it may open is offered.
    fewerbytes_ok(&pool, &["volume", "clone", "vm", "vm.snap", "--thin"]);
    let got = incremental(&uri, "vm.snap", &backup);
    assert_eq!(got["offered"]["qemu:dirty-bitmap:vm.snap"], true, "{got}");
}
