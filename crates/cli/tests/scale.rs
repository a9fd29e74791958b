//! Scale: what a pool costs follows what it stores, not the size of its device. An
//! empty 15 TiB pool file (sparse) is created, inspected, served, written at its
//! first and last blocks, served again and checked, and no process involved may grow
//! past a bound far below what the device's size would ask for: before slab state
//! followed what was written, `pool info` on it took 14 GB of memory and minutes,
//! and the default dedup index was sized for the whole device (14.14 GiB); before
//! slabs were made on first use, every command took ~180 MiB for their headers.

mod common;

use common::*;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};

/// The device: 15 TiB, what a large VM host's NVMe array holds (ext4 takes sparse
/// files up to 16 TiB).
const DEVICE: &str = "15T";
/// The thin volume written at both ends.
const VOLUME_BYTES: u64 = 14 << 40;
/// Peak resident memory any command or the server may reach, in KiB: the default
/// index budget (256 MiB) is allocated but untouched until written, and slabs are
/// made on first use, so what remains is the process, the pool's super block,
/// catalog and journal window, and the two slabs written. An index sized for the
/// device would be 14 GiB; a slab header for each of its 481,690 slabs, ~170 MiB.
const RSS_BOUND_KIB: u64 = 96 << 10;

/// Runs the CLI on `pool` with `args`; returns its output and its peak resident
/// memory (KiB), read from the kernel's accounting of the child (`wait4`).
#[expect(
    clippy::zombie_processes,
    reason = "the child is reaped by wait4, which std's Child cannot call with rusage"
)]
fn fewerbytes_rss(pool: &Path, args: &[&str]) -> (String, u64) {
    let mut cmd = Command::new(fewerbytes_bin());
    cmd.arg("--pool").arg(pool).args(args);
    let command = describe(&cmd);
    let out_path = pool.with_extension(format!("out{}", args.len()));
    let out = std::fs::File::create(&out_path).expect("create output capture");
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("clone capture"))
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start `{command}`: {e}"));
    let pid = child.id() as libc::pid_t;
    let mut status: libc::c_int = 0;
    // SAFETY: an all-zero rusage is a valid value of the plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our own child, not yet reaped (std's `Child` never waited
    // for it); `status` and `usage` are valid for writes for the call.
    let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(reaped, pid, "wait4 for `{command}`");
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    let _ = std::fs::remove_file(&out_path);
    assert!(
        ExitStatus::from_raw(status).success(),
        "`{command}` failed:\n{text}"
    );
    (text, usage.ru_maxrss as u64)
}

/// The server's peak resident memory so far, in KiB (`VmHWM`).
fn server_peak_rss_kib(server: &Server) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.pid()))
        .expect("read the server's /proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc status")
}

fn assert_bounded(what: &str, rss_kib: u64) {
    println!("{what}: {} MiB at its peak", rss_kib >> 10);
    assert!(
        rss_kib < RSS_BOUND_KIB,
        "{what} took {} MiB of memory at its peak on an empty {DEVICE} pool; \
         the bound is {} MiB (memory must follow what the pool stores)",
        rss_kib >> 10,
        RSS_BOUND_KIB >> 10
    );
}

#[test]
fn an_empty_15_tib_pool_costs_what_it_stores_not_its_size() {
    let dir = TempDir::new("scale");
    let pool = dir.join("big.pool");
    let (created, rss) = fewerbytes_rss(
        &pool,
        &[
            "pool",
            "create",
            pool.to_str().expect("utf-8 path"),
            "--size",
            DEVICE,
        ],
    );
    assert_bounded("pool create", rss);
    assert!(
        created.contains("index 256.00 MiB of memory"),
        "the default dedup index is bounded, not sized for the device:\n{created}"
    );
    fewerbytes_rss(
        &pool,
        &["volume", "create", "big", "--size", "14T", "--thin"],
    );
    for args in [
        &["pool", "info"][..],
        &["pool", "info", "--json"],
        &["stats"],
        &["volume", "list"],
        &["volume", "info", "big"],
    ] {
        let (_, rss) = fewerbytes_rss(&pool, args);
        assert_bounded(&format!("`{}`", args.join(" ")), rss);
    }

    let last = VOLUME_BYTES - (1 << 20);
    let mut server = Server::start(dir.path(), &pool, &[]);
    let uri = server.unix_uri("big");
    qemu_io(
        &uri,
        &[
            "write -P 0xa1 0 1M".to_string(),
            format!("write -P 0xb2 {last} 1M"),
            "flush".to_string(),
        ],
    );
    assert_bounded(
        "serve, after writes at both ends",
        server_peak_rss_kib(&server),
    );
    server.stop();

    // Reopened: the writes are there, and opening cost no more than the first time.
    server.spawn();
    qemu_io(
        &uri,
        &[
            "read -P 0xa1 0 1M".to_string(),
            format!("read -P 0xb2 {last} 1M"),
            format!("read -P 0 {} 1M", VOLUME_BYTES / 2),
        ],
    );
    assert_bounded("serve, reopened", server_peak_rss_kib(&server));
    server.stop();

    let (checked, rss) = fewerbytes_rss(&pool, &["check"]);
    assert!(checked.contains("No problems found"), "{checked}");
    assert_bounded("check", rss);
}
