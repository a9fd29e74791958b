//! A thin volume on a pool whose thick volume reserves everything (the pool `serve`
//! makes by default): every write to it fails with ENOSPC. The admin hears of it at
//! each step: `volume create --thin` warns with the numbers, the server logs the
//! refused write (naming the volume), `stats` counts it, and `--warn-at` fires
//! because what thin writes can use is gone, though the device is nearly empty.

mod common;

use common::*;

/// A pool laid out as the default one: disk0 thick, as large as the pool allows.
fn pool_with_thick_disk0(dir: &TempDir) -> std::path::PathBuf {
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "256M"]);
    let info = fewerbytes_ok(&pool, &["pool", "info", "--json"]).stdout;
    let info: serde_json::Value = serde_json::from_str(&info).expect("pool info --json");
    let addressable = info["addressable_bytes"]
        .as_u64()
        .expect("addressable_bytes");
    let disk0 = (addressable / (1 << 20) * (1 << 20)).to_string();
    fewerbytes_ok(&pool, &["volume", "create", "disk0", "--size", &disk0]);
    pool
}

#[test]
fn a_thin_volume_with_no_room_warns_at_create_logs_its_enospc_and_stats_count_it() {
    let dir = TempDir::new("thinfull");
    let pool = pool_with_thick_disk0(&dir);

    let created = fewerbytes_ok(
        &pool,
        &["volume", "create", "vm2", "--size", "1G", "--thin"],
    );
    let warning = &created.stderr;
    assert!(
        warning.contains("warning") && warning.contains("vm2"),
        "no warning for a thin volume that cannot write:\n{}",
        created.report()
    );
    assert!(
        warning.contains("1.00 GiB") && warning.contains("thin writes can use"),
        "the warning gives no numbers:\n{}",
        created.report()
    );
    assert!(
        warning.contains("volume set disk0 --thin") || warning.contains("--reserve"),
        "the warning says nothing of what to do:\n{}",
        created.report()
    );

    let server = Server::start(dir.path(), &pool, &["--warn-at", "90%"]);
    let mut write = tool("qemu-io");
    write
        .args(["-f", "raw", "-c", "write -P 0x5a 0 1M"])
        .arg(server.unix_uri("vm2"));
    let ran = run_with_limit(&mut write, CLIENT_LIMIT);
    assert!(
        ran.all_output().contains("No space left on device"),
        "the write to vm2 was not refused with ENOSPC:\n{}",
        ran.report()
    );

    let stats = server.stats();
    assert!(
        stats["no_space_refusals"].as_u64().unwrap_or(0) >= 1,
        "stats --json does not count the refused write: {}",
        stats["no_space_refusals"]
    );
    let vm2 = stats["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == "vm2"))
        .expect("vm2 in stats")
        .clone();
    assert!(
        vm2["no_space_refusals"].as_u64().unwrap_or(0) >= 1,
        "stats --json does not count vm2's refused write: {vm2}"
    );
    let list = server.cli_ok(&["volume", "list", "--json"]).stdout;
    let list: serde_json::Value = serde_json::from_str(&list).expect("volume list --json");
    let listed = list
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == "vm2"))
        .expect("vm2 in volume list");
    assert!(
        listed["no_space_refusals"].as_u64().unwrap_or(0) >= 1,
        "volume list --json does not count vm2's refused write: {listed}"
    );
    let table = server.cli_ok(&["stats"]).stdout;
    assert!(
        table.contains("ENOSPC"),
        "plain stats show no count:\n{table}"
    );
    // The watcher looks every 2 s; `stats` through the server looks now.
    assert_eq!(stats["warn_at"]["crossed"], true, "{}", stats["warn_at"]);

    let log = server.log_text();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("ENOSPC")
            && l.contains("'vm2'")
            && l.contains("thin writes can use")),
        "the server logs no ENOSPC naming vm2 and the numbers:\n{log}"
    );
    assert!(
        log.contains("past --warn-at 90%"),
        "the low-water warning did not fire:\n{log}"
    );
}

#[test]
fn volume_set_thin_and_clone_thin_warn_too_and_a_roomy_pool_does_not() {
    let dir = TempDir::new("thinwarn");
    let pool = pool_with_thick_disk0(&dir);
    // disk0 thin: everything is free for thin writes; a thin volume is no worry.
    fewerbytes_ok(&pool, &["volume", "set", "disk0", "--thin"]);
    let quiet = fewerbytes_ok(
        &pool,
        &["volume", "create", "vm2", "--size", "64M", "--thin"],
    );
    assert!(!quiet.stderr.contains("warning"), "{}", quiet.report());
    // Thick again (it fits: nothing is written); vm2 now has no room, nor a clone.
    fewerbytes_ok(&pool, &["volume", "set", "disk0", "--thick"]);
    let set = fewerbytes_ok(&pool, &["volume", "set", "vm2", "--thin"]);
    assert!(
        set.stderr.contains("warning") && set.stderr.contains("vm2"),
        "{}",
        set.report()
    );
    let clone = fewerbytes_ok(&pool, &["volume", "clone", "vm2", "vm3", "--thin"]);
    assert!(
        clone.stderr.contains("warning") && clone.stderr.contains("vm3"),
        "{}",
        clone.report()
    );
}
