//! One throwaway Ceph cluster per test binary (scripts/ceph/cluster.sh), started on
//! first use and stopped when the binary exits; images made with the `rbd` CLI; Ceph
//! pools of a test's own (for a quota that must not reach other tests), and a
//! watchdog that fails the binary when a call hangs. Shared by the storage and engine
//! tests (`#[path]`-included).

#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::Duration;

/// The pool the cluster script makes.
pub const POOL: &str = "rbd";

/// A running cluster.
pub struct Cluster {
    pub dir: PathBuf,
    pub conf: PathBuf,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph/cluster.sh")
}

static CLUSTER: OnceLock<Cluster> = OnceLock::new();
static DIR: OnceLock<PathBuf> = OnceLock::new();

extern "C" fn stop_cluster() {
    if let Some(dir) = DIR.get() {
        let _ = Command::new(script()).arg("stop").arg(dir).status();
    }
}

/// The cluster of this test binary, started on first call (the daemons are those of
/// Debian's ceph-mon, ceph-mgr, ceph-osd; a missing one fails the test, naming them).
pub fn cluster() -> &'static Cluster {
    CLUSTER.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("fewerbytes-ceph-test-{}", std::process::id()));
        DIR.set(dir.clone()).expect("cluster dir set once");
        // SAFETY: registers a plain function to run at exit (the test harness
        // leaves through exit(), which runs it); it only spawns the stop script.
        unsafe { libc::atexit(stop_cluster) };
        let out = Command::new(script())
            .arg("start")
            .arg(&dir)
            .output()
            .expect("run scripts/ceph/cluster.sh");
        assert!(
            out.status.success(),
            "scripts/ceph/cluster.sh start failed (apt-get install ceph-mon ceph-mgr ceph-osd ceph-common):\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Cluster {
            conf: dir.join("ceph.conf"),
            dir,
        }
    })
}

/// Run Ceph's command-line `tool` (`rbd`, `ceph`) against the cluster; its stdout.
fn run_tool(tool: &str, args: &[&str]) -> String {
    let c = cluster();
    let out = Command::new(tool)
        .arg("-c")
        .arg(&c.conf)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {tool} (apt-get install ceph-common): {e}"));
    assert!(
        out.status.success(),
        "{tool} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Run the `rbd` CLI against the cluster; its stdout.
pub fn rbd(args: &[&str]) -> String {
    run_tool("rbd", args)
}

/// A name of its own: `prefix-N`.
fn unique(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("{prefix}-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// A new image of `size_mib` MiB with a name of its own (Ceph's default features).
pub fn new_image(prefix: &str, size_mib: u64) -> String {
    new_image_in(POOL, prefix, size_mib)
}

/// A new image of `size_mib` MiB in Ceph pool `pool`.
pub fn new_image_in(pool: &str, prefix: &str, size_mib: u64) -> String {
    let name = unique(prefix);
    rbd(&[
        "create",
        "--size",
        &format!("{size_mib}M"),
        &format!("{pool}/{name}"),
    ]);
    name
}

/// A new RBD pool of its own (8 placement groups, one copy as the cluster's default),
/// for a test that changes a pool's quota.
pub fn new_pool(prefix: &str) -> String {
    let name = unique(prefix);
    ceph(&["osd", "pool", "create", &name, "8", "8"]);
    rbd(&["pool", "init", &name]);
    name
}

/// Set Ceph pool `pool`'s byte quota (`ceph osd pool set-quota`); 0 lifts it.
pub fn set_quota_bytes(pool: &str, max_bytes: u64) {
    ceph(&[
        "osd",
        "pool",
        "set-quota",
        pool,
        "max_bytes",
        &max_bytes.to_string(),
    ]);
}

/// Whether the monitors flag Ceph pool `pool` full (over its quota, or an OSD full).
pub fn pool_flagged_full(pool: &str) -> bool {
    let out = ceph(&["osd", "pool", "ls", "detail", "--format", "json"]);
    let key = format!("\"pool_name\":\"{pool}\"");
    let at = out
        .find(&key)
        .unwrap_or_else(|| panic!("no pool {pool} in {out}"));
    let flags_key = "\"flags_names\":\"";
    let flags_at = out[at..]
        .find(flags_key)
        .unwrap_or_else(|| panic!("no flags_names for {pool} in {out}"))
        + at
        + flags_key.len();
    out[flags_at..]
        .chars()
        .take_while(|c| *c != '"')
        .collect::<String>()
        .split(',')
        .any(|flag| flag == "full")
}

/// Wait until the monitors flag `pool` full (`full` true) or no longer full. They
/// learn a pool's size from the OSDs' statistics every few seconds; a cluster that
/// has not done so in 120 s fails the test.
pub fn wait_pool_full(pool: &str, full: bool) {
    for _ in 0..600 {
        if pool_flagged_full(pool) == full {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("pool {pool} was not flagged full={full} within 120 s");
}

/// Fails the test binary (after stopping its cluster) if not dropped within its
/// limit: a hang detector for calls that must return, not a timing assertion.
pub struct Watchdog {
    done: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Watch `what` for `limit`: drop the guard once it has returned.
pub fn watchdog(what: &str, limit: Duration) -> Watchdog {
    let (done, wait) = mpsc::channel::<()>();
    let what = what.to_string();
    let thread = std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(limit) {
            // Past the test harness's capture of eprintln!, which _exit would drop.
            let _ = writeln!(
                std::io::stderr(),
                "HANG: {what} did not return within {limit:?}"
            );
            stop_cluster();
            // _exit, not exit: the hung call holds librados's locks, which its
            // static destructors would wait for.
            // SAFETY: ends the process at once; nothing of it is used after.
            unsafe { libc::_exit(1) };
        }
    });
    Watchdog {
        done: Some(done),
        thread: Some(thread),
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Bytes the image holds on the cluster, as `rbd du` counts them.
pub fn used_bytes(image: &str) -> u64 {
    let out = rbd(&["du", "--format", "json", &format!("{POOL}/{image}")]);
    let key = "\"used_size\":";
    let at = out
        .find(key)
        .unwrap_or_else(|| panic!("no used_size in {out}"))
        + key.len();
    out[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect::<String>()
        .parse()
        .unwrap_or_else(|_| panic!("bad used_size in {out}"))
}

/// Run the `ceph` CLI against the cluster; its stdout.
pub fn ceph(args: &[&str]) -> String {
    run_tool("ceph", args)
}

/// The client address that holds `image`'s exclusive lock, as `rbd lock ls` shows it.
pub fn lock_holder(image: &str) -> Option<String> {
    let out = rbd(&["lock", "ls", "--format", "json", &format!("{POOL}/{image}")]);
    let key = "\"address\":\"";
    let at = out.find(key)? + key.len();
    Some(out[at..].chars().take_while(|c| *c != '"').collect())
}

/// Whether `address` is on the cluster's blocklist.
pub fn blocklisted(address: &str) -> bool {
    ceph(&["osd", "blocklist", "ls"])
        .lines()
        .any(|line| line.split_whitespace().next() == Some(address))
}
