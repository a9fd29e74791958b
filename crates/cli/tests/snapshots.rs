//! `volume snapshot` on a served pool, driven by real clients: a snapshot is taken
//! while the server runs, served read-only as `VOLUME@SNAPSHOT` (nbdinfo sees the
//! read-only flag, qemu-io's write is refused, qemu-img reads the old bytes), its
//! changed blocks are the dirty bitmap `qemu:dirty-bitmap:SNAPSHOT` by its short
//! name, and `volume rollback` and `volume snapshot delete` finish the cycle with
//! `check` clean.

mod common;

use common::libnbd::python_nbd;
use common::nbdinfo::{first_export, json, listed_exports, nbdinfo_json};
use common::*;

/// Asks for the dirty bitmap against BASE and prints the dirty runs as JSON.
const DIRTY_PY: &str = r#"
import json, sys, nbd
uri, base = sys.argv[1], sys.argv[2]
bitmap = "qemu:dirty-bitmap:" + base
h = nbd.NBD()
h.add_meta_context(bitmap)
h.connect_uri(uri)
runs, end = [], [0]
def record(context, offset, entries, err):
    pos = offset
    for i in range(0, len(entries), 2):
        if context == bitmap and entries[i + 1] & 1:
            runs.append([pos, entries[i]])
        pos += entries[i]
    end[0] = pos
    return 0
offered = bool(h.can_meta_context(bitmap))
if offered:
    size, pos = h.get_size(), 0
    while pos < size:
        h.block_status(size - pos, pos, record)
        pos = end[0]
print(json.dumps({"offered": offered, "dirty": runs}))
"#;

#[test]
fn a_snapshot_taken_while_served_is_read_only_over_nbd_and_rolls_back() {
    let dir = TempDir::new("snapshots");
    let server = Server::start_new(dir.path(), &[("vm", "16M")], &[]);
    let uri = server.unix_uri("vm");
    qemu_io(&uri, &["write -P 0x11 0 8M".into()]);

    let taken = fewerbytes_ok(&server.pool, &["volume", "snapshot", "vm", "monday"]);
    assert!(taken.stdout.contains("vm@monday"), "{}", taken.report());
    qemu_io(
        &uri,
        &["write -P 0x22 2M 1M".into(), "discard 6M 1M".into()],
    );

    // Served read-only, under its full name, with Monday's bytes.
    let snap_uri = server.unix_uri("vm@monday");
    let info = nbdinfo_json(&snap_uri);
    assert_eq!(first_export(&info)["is_read_only"], true, "{info}");
    let read = run_with_limit(
        tool("qemu-io").args([
            "-r",
            "-f",
            "raw",
            "-c",
            "read -P 0x11 0 8M",
            "-c",
            "read -P 0 8M 8M",
            &snap_uri,
        ]),
        CLIENT_LIMIT,
    );
    assert!(
        read.status.success() && !read.all_output().contains("failed"),
        "{}",
        read.report()
    );
    // qemu-io cannot open it for writing: the server says read-only.
    let refused = run_with_limit(
        tool("qemu-io").args(["-f", "raw", "-c", "write -P 0x33 0 4k", &snap_uri]),
        CLIENT_LIMIT,
    );
    assert!(
        !refused.status.success() && refused.all_output().contains("Permission denied"),
        "a write to a snapshot was let through:\n{}",
        refused.report()
    );
    // The volume list leaves it out; the snapshot list has it.
    assert!(!listed_exports(&uri).contains_key("vm@monday"));
    let list = json(&fewerbytes_ok(
        &server.pool,
        &["volume", "snapshot", "list", "vm", "--json"],
    ));
    assert_eq!(list[0]["name"], "vm@monday", "{list}");
    assert_eq!(list[0]["snapshot_of"], "vm", "{list}");
    let info = json(&fewerbytes_ok(
        &server.pool,
        &["volume", "info", "vm@monday", "--json"],
    ));
    assert_eq!(info["logical_used_bytes"], 8 << 20, "{info}");

    // What changed since Monday, by the snapshot's short name.
    let ran = python_nbd(DIRTY_PY, &[&uri, "monday"]);
    let got: serde_json::Value = serde_json::from_str(ran.stdout.trim())
        .unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", ran.report()));
    assert_eq!(got["offered"], true, "{got}");
    assert_eq!(
        got["dirty"],
        serde_json::json!([[2 << 20, 1 << 20], [6 << 20, 1 << 20]]),
        "{got}"
    );
    let diff = fewerbytes_ok(&server.pool, &["volume", "diff", "vm", "--from", "monday"]);
    assert_eq!(
        diff.stdout.lines().collect::<Vec<_>>(),
        [
            format!("{} {}", 2 << 20, 1 << 20),
            format!("{} {}", 6 << 20, 1 << 20)
        ]
    );

    // A volume with snapshots is not deleted; rollback takes Monday back.
    let refused = fewerbytes(&server.pool, &["volume", "delete", "vm"]);
    assert!(!refused.status.success(), "{}", refused.report());
    assert!(refused.stderr.contains("snapshot"), "{}", refused.report());
    fewerbytes_ok(&server.pool, &["volume", "rollback", "vm", "monday"]);
    qemu_io(
        &uri,
        &["read -P 0x11 0 8M".into(), "read -P 0 8M 8M".into()],
    );
    fewerbytes_ok(
        &server.pool,
        &["volume", "snapshot", "delete", "vm", "monday"],
    );
    let list = json(&fewerbytes_ok(
        &server.pool,
        &["volume", "snapshot", "list", "vm", "--json"],
    ));
    assert_eq!(list, serde_json::json!([]));
    assert_check_clean(&server.pool);
    let log = std::fs::read_to_string(&server.log).expect("server log");
    assert!(
        log.contains("control: take snapshot 'monday' of volume 'vm': done in"),
        "{log}"
    );
}
