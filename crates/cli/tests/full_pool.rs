//! A pool with no free data block left (all its blocks hold data): writes of new
//! data fail with ENOSPC over NBD, the pool is not latched (stats say normal),
//! reads and trims go on, and after a trim new data fits again, without a restart.

mod common;

use common::libnbd::python_nbd;
use common::*;

/// Fill the export with random bytes until a write fails; it must fail with ENOSPC.
/// Then what was written reads back, a trim of everything is taken, and new
/// random bytes are written, flushed and read back.
const FILL_PY: &str = r#"
import errno, os, sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
size = h.get_size()
chunk = 1 << 20
written = []
for off in range(0, size, chunk):
    data = os.urandom(chunk)
    try:
        h.pwrite(data, off)
    except nbd.Error as e:
        if e.errno not in (errno.ENOSPC, "ENOSPC"):
            sys.exit(f"the write at {off} failed with errno {e.errno}, not ENOSPC: {e}")
        break
    written.append(data)
else:
    sys.exit(f"{size} bytes of random data fit in a pool that should be full")
h.flush()
for i, data in enumerate(written):
    if h.pread(chunk, i * chunk) != data:
        sys.exit(f"MiB {i}, written before the pool was full, reads back other bytes")
print(f"full after {len(written)} MiB")
h.trim(size, 0)
h.flush()
data = os.urandom(chunk)
h.pwrite(data, 0)
h.flush()
if h.pread(chunk, 0) != data:
    sys.exit("the write after the trim reads back other bytes")
print("written again after the trim")
"#;

#[test]
fn a_full_pool_fails_writes_with_enospc_and_takes_them_again_after_a_trim() {
    let dir = TempDir::new("fullpool");
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "64M"]);
    fewerbytes_ok(
        &pool,
        &["volume", "create", "vm", "--size", "128M", "--thin"],
    );
    let mut server = Server::start(dir.path(), &pool, &[]);
    let ran = python_nbd(FILL_PY, &[&server.unix_uri("vm")]);
    assert!(
        ran.stdout.contains("written again after the trim"),
        "{}",
        ran.report()
    );
    assert_eq!(
        server.stats()["mode"],
        "normal",
        "a full pool is not latched:\n{}",
        server.log_text()
    );
    let status = server.stop();
    assert!(status.success(), "{}", server.log_text());
    drop(server);
    assert_check_clean(&pool);
}

/// Writes `argv[2]` MiB of random bytes from offset 0 and flushes; with `trim`,
/// trims the whole export and flushes instead.
const WRITE_OR_TRIM_PY: &str = r#"
import os, sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
if sys.argv[2] == "trim":
    h.trim(h.get_size(), 0)
else:
    for i in range(int(sys.argv[2])):
        h.pwrite(os.urandom(1 << 20), i << 20)
h.flush()
"#;

/// The warning `serve --warn-at 50` logs each time the pool reaches the mark.
const WARNING: &str = "past --warn-at 50%";

/// `stats` through the server: the JSON's `warn_at`, and the plain table's row.
fn warn_at(server: &Server) -> (serde_json::Value, String) {
    let json = server.stats()["warn_at"].clone();
    let table = server.cli_ok(&["stats"]).stdout;
    assert!(table.contains("Warn at"), "no Warn at column:\n{table}");
    (json, table)
}

#[test]
fn a_pool_whose_volumes_are_all_reserved_is_not_past_the_mark_until_one_is_thin() {
    // The default pool: one thick volume reserving all of it. Use% is 100 (nothing
    // is Available to writes no reservation covers), but no such write exists.
    let dir = TempDir::new("warnatthick");
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "64M"]);
    let info = fewerbytes_ok(&pool, &["pool", "info", "--json"]).stdout;
    let info: serde_json::Value = serde_json::from_str(&info).expect("pool info JSON");
    let reservable = info["reservable_bytes"]
        .as_u64()
        .expect("reservable_bytes in pool info");
    let size = format!("{}K", reservable / 1024 / 4 * 4);
    fewerbytes_ok(&pool, &["volume", "create", "vm", "--size", &size]);
    let server = Server::start(dir.path(), &pool, &["--warn-at", "90%"]);
    let (json, table) = warn_at(&server);
    assert_eq!(
        json["crossed"], false,
        "every volume is covered by its reservation: nothing can meet ENOSPC\n{table}"
    );
    assert!(
        !server.log_text().contains("past --warn-at 90%"),
        "{}",
        server.log_text()
    );
    // A thin volume can write only into what is Available, which is nothing.
    server.cli_ok(&["volume", "create", "thin", "--size", "16M", "--thin"]);
    let (json, table) = warn_at(&server);
    assert_eq!(json["crossed"], true, "{json}\n{table}");
    assert_eq!(
        server.log_text().matches("past --warn-at 90%").count(),
        1,
        "{}",
        server.log_text()
    );
}

#[test]
fn warn_at_warns_once_each_time_the_pool_reaches_the_mark_and_stats_show_it() {
    let dir = TempDir::new("warnat");
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "64M"]);
    fewerbytes_ok(
        &pool,
        &["volume", "create", "vm", "--size", "128M", "--thin"],
    );
    let server = Server::start(dir.path(), &pool, &["--warn-at", "50%"]);
    let uri = server.unix_uri("vm");
    let (json, table) = warn_at(&server);
    assert_eq!(json["percent"], 50, "{json}");
    assert_eq!(
        json["crossed"], false,
        "an empty pool is below the mark: {json}"
    );
    assert!(
        table.contains("50%") && !table.contains("crossed"),
        "{table}"
    );

    // 40 MiB of random data fills a 64 MiB pool past half.
    python_nbd(WRITE_OR_TRIM_PY, &[&uri, "40"]);
    let (json, table) = warn_at(&server);
    assert_eq!(json["crossed"], true, "{json}\n{table}");
    assert!(table.contains("50% (crossed)"), "{table}");
    // Looking again (and the watcher's own looks) do not warn again.
    warn_at(&server);
    assert_eq!(
        server.log_text().matches(WARNING).count(),
        1,
        "{}",
        server.log_text()
    );

    // Below the mark after a trim; reaching it again warns again.
    python_nbd(WRITE_OR_TRIM_PY, &[&uri, "trim"]);
    let (json, table) = warn_at(&server);
    assert_eq!(json["crossed"], false, "{json}\n{table}");
    assert!(
        server.log_text().contains("below --warn-at 50% again"),
        "{}",
        server.log_text()
    );
    python_nbd(WRITE_OR_TRIM_PY, &[&uri, "40"]);
    let (json, _) = warn_at(&server);
    assert_eq!(json["crossed"], true, "{json}");
    assert_eq!(
        server.log_text().matches(WARNING).count(),
        2,
        "{}",
        server.log_text()
    );

    // Without a server, stats show no mark (it is the server's).
    let mut server = server;
    assert!(server.stop().success(), "{}", server.log_text());
    drop(server);
    let table = fewerbytes_ok(&pool, &["stats"]).stdout;
    assert!(!table.contains("crossed"), "{table}");
}
