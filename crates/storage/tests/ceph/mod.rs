//! One throwaway Ceph cluster per test binary (scripts/ceph/cluster.sh), started on
//! first use and stopped when the binary exits; and images made with the `rbd` CLI.
//! Shared by the storage and engine tests (`#[path]`-included).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

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

/// A new image of `size_mib` MiB with a name of its own (Ceph's default features).
pub fn new_image(prefix: &str, size_mib: u64) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = format!("{prefix}-{}", NEXT.fetch_add(1, Ordering::Relaxed));
    rbd(&[
        "create",
        "--size",
        &format!("{size_mib}M"),
        &format!("{POOL}/{name}"),
    ]);
    name
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
