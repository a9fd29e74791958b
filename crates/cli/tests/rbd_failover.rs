//! One owner at a time, and a fenced takeover, for a pool on RBD images of a real
//! one-node Ceph cluster (scripts/ceph/cluster.sh), through the `fewerbytes` binary
//! as two hosts would run it (each with its own Ceph client id and its own run and
//! state directories).
//!
//! Server A serves the pool and a client writes a volume and flushes. A second server
//! without `--take-over` is refused while A holds the pool, naming A's client. A is
//! frozen (SIGSTOP, as a paused or partitioned host would be); server B takes over
//! (`--take-over`: A blocklisted, its lock broken, the journal replayed), the client
//! reads every flushed byte from B, and B stops cleanly. A is resumed (SIGCONT) and a
//! client tries to write through it: the write fails (A finds itself fenced as it
//! wakes, by its watch on the image or by the write's refusal, whichever comes
//! first), A exits 3 (not this server's pool) saying why, and the images hold the same bytes as before
//! A woke. `check` is clean, and B serves again without a take-over (its clean stop
//! released the pool). The same for a pool whose metadata device is a second image.
//! A read-only server taken over stops as well; `--take-over` on a pool file is
//! refused (its lock is the kernel's).

mod common;

#[path = "../../storage/tests/ceph/mod.rs"]
mod ceph;

use common::{fewerbytes_bin, greet_and_abort, run_with_limit, tool, Ran, TempDir, CLIENT_LIMIT};
use std::ffi::OsString;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to listen, or to exit (the open of an RBD pool and its
/// take-over cross the cluster on a loaded machine).
const SERVER_LIMIT: Duration = Duration::from_secs(120);
/// The volume served, and its size in MiB.
const VOLUME: &str = "disk0";
const VOLUME_MIB: u64 = 32;
/// `serve`'s exit code when the pool is another server's (refused, or taken over):
/// the unit does not restart it (`RestartPreventExitStatus=3`).
const NOT_OWNER: i32 = 3;

/// One "host": a Ceph client id and directories of its own.
struct Host {
    env: Vec<(&'static str, OsString)>,
    socket: PathBuf,
    log: PathBuf,
}

impl Host {
    fn new(dir: &TempDir, name: &str) -> Host {
        let home = dir.join(name);
        std::fs::create_dir_all(&home).expect("make the host's directory");
        Host {
            env: vec![
                ("CEPH_CONF", ceph::cluster().conf.clone().into_os_string()),
                ("CEPH_ID", OsString::from(name)),
                ("FEWERBYTES_RUN_DIR", home.join("run").into_os_string()),
                ("FEWERBYTES_STATE_DIR", home.join("state").into_os_string()),
            ],
            socket: home.join("nbd.sock"),
            log: home.join("serve.log"),
        }
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(fewerbytes_bin());
        cmd.env_remove("FEWERBYTES_POOL")
            .env_remove("CEPH_CONF")
            .env("NO_COLOR", "1");
        for (key, value) in &self.env {
            cmd.env(key, value);
        }
        cmd
    }

    fn cli(&self, args: &[&str]) -> Ran {
        run_with_limit(self.command().args(args), CLIENT_LIMIT)
    }

    fn cli_ok(&self, args: &[&str]) -> Ran {
        let ran = self.cli(args);
        assert!(ran.status.success(), "fewerbytes failed:\n{}", ran.report());
        ran
    }

    fn serve_args<'a>(&self, pool: &'a str, extra: &[&'a str]) -> Vec<OsString> {
        let mut args: Vec<OsString> = ["--pool", pool, "serve", "--no-tcp", "--socket"]
            .iter()
            .map(OsString::from)
            .collect();
        args.push(self.socket.clone().into_os_string());
        args.extend(extra.iter().map(OsString::from));
        args
    }

    /// `serve` the pool, once it greets on its socket.
    fn serve(&self, pool: &str, extra: &[&str]) -> Serving {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open the server log");
        let child = self
            .command()
            .args(self.serve_args(pool, extra))
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("clone the log handle"))
            .stderr(out)
            .spawn()
            .expect("start fewerbytes serve");
        let mut serving = Serving {
            child: Some(child),
            log: self.log.clone(),
        };
        let started = Instant::now();
        while !greets(&self.socket) {
            if let Some(status) = serving.exited() {
                panic!(
                    "serve exited with {status} before listening:\n{}",
                    serving.log_text()
                );
            }
            assert!(
                started.elapsed() < SERVER_LIMIT,
                "serve did not listen within {SERVER_LIMIT:?}:\n{}",
                serving.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        serving
    }

    /// `serve` the pool, which must be refused.
    fn serve_refused(&self, pool: &str) -> Ran {
        let ran = run_with_limit(
            self.command().args(self.serve_args(pool, &[])),
            SERVER_LIMIT,
        );
        assert!(
            !ran.status.success(),
            "a second server was let in:\n{}",
            ran.report()
        );
        assert_eq!(ran.status.code(), Some(NOT_OWNER), "{}", ran.report());
        ran
    }
}

fn greets(socket: &Path) -> bool {
    UnixStream::connect(socket).is_ok_and(|s| greet_and_abort(s).is_ok())
}

/// A running `fewerbytes serve`.
struct Serving {
    child: Option<Child>,
    log: PathBuf,
}

impl Serving {
    fn log_text(&self) -> String {
        common::strip_ansi(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().expect("poll the server")?;
        self.child = None;
        Some(status)
    }

    fn signal(&self, signal: libc::c_int) {
        let child = self.child.as_ref().expect("server running");
        let pid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
        // SAFETY: kill(2) on our own child's pid, not yet reaped.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    }

    /// Its exit status, waiting up to `SERVER_LIMIT`.
    fn wait_exit(&mut self) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.exited() {
                return status;
            }
            assert!(
                started.elapsed() < SERVER_LIMIT,
                "serve did not exit within {SERVER_LIMIT:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM; the exit must be clean.
    fn stop(mut self) {
        self.signal(libc::SIGTERM);
        let status = self.wait_exit();
        assert!(
            status.success(),
            "serve exited with {status}:\n{}",
            self.log_text()
        );
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // A frozen server must be thawed to die of SIGKILL's cleanup promptly.
            let _ = child.kill();
            let pid = libc::pid_t::try_from(child.id()).unwrap_or(0);
            // SAFETY: kill(2) on our own child, killed above and not yet reaped.
            unsafe { libc::kill(pid, libc::SIGCONT) };
            let _ = child.wait();
            eprintln!("--- server log ---\n{}", self.log_text());
        }
    }
}

fn unix_uri(socket: &Path) -> String {
    format!("nbd+unix:///{VOLUME}?socket={}", socket.display())
}

/// Write `image` over the whole volume with qemu-img, then flush it (qemu-io).
fn write_and_flush(socket: &Path, image: &Path) {
    let mut cmd = tool("qemu-img");
    cmd.args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(image)
        .arg(unix_uri(socket));
    let ran = run_with_limit(&mut cmd, CLIENT_LIMIT);
    assert!(
        ran.status.success(),
        "qemu-img convert failed:\n{}",
        ran.report()
    );
    common::qemu_io(&unix_uri(socket), &["flush".to_string()]);
}

/// Every byte of the volume compared with `image`.
fn assert_volume_is(socket: &Path, image: &Path) {
    let mut cmd = tool("qemu-img");
    cmd.args(["compare", "-f", "raw", "-F", "raw"])
        .arg(image)
        .arg(unix_uri(socket));
    let ran = run_with_limit(&mut cmd, CLIENT_LIMIT);
    assert!(
        ran.status.success() && ran.stdout.contains("Images are identical"),
        "the volume does not read back as written and flushed:\n{}",
        ran.report()
    );
}

/// Every image's bytes, exported to files in `dir` under `label`.
fn export(images: &[String], dir: &TempDir, label: &str) -> Vec<PathBuf> {
    images
        .iter()
        .map(|image| {
            let path = dir.join(&format!("{image}.{label}"));
            ceph::rbd(&[
                "export",
                "--no-progress",
                &format!("{}/{image}", ceph::POOL),
                path.to_str().expect("utf-8"),
            ]);
            path
        })
        .collect()
}

fn assert_same_bytes(before: &[PathBuf], after: &[PathBuf]) {
    for (b, a) in before.iter().zip(after) {
        let ran = run_with_limit(tool("cmp").arg(b).arg(a), CLIENT_LIMIT);
        assert!(
            ran.status.success(),
            "the fenced server changed the image ({} and {} differ):\n{}",
            b.display(),
            a.display(),
            ran.report()
        );
    }
}

fn failover(separate_metadata: bool) {
    let dir = TempDir::new("rbd-failover");
    let data_image = ceph::new_image("failover-data", 256);
    let mut images = vec![data_image.clone()];
    let pool = format!("rbd:{}/{data_image}", ceph::POOL);
    let a = Host::new(&dir, "host-a");
    let b = Host::new(&dir, "host-b");
    let mut create = vec!["pool", "create", pool.as_str()];
    let meta;
    if separate_metadata {
        let meta_image = ceph::new_image("failover-meta", 64);
        meta = format!("rbd:{}/{meta_image}", ceph::POOL);
        create.extend(["--metadata-device", meta.as_str()]);
        images.push(meta_image);
    }
    a.cli_ok(&create);
    let size = format!("{VOLUME_MIB}M");
    a.cli_ok(&["--pool", &pool, "volume", "create", VOLUME, "--size", &size]);
    let data = dir.join("data.raw");
    std::fs::write(&data, common::data::mixed_image(VOLUME_MIB * 256, 7))
        .expect("write the test data");

    let mut server_a = a.serve(&pool, &[]);
    write_and_flush(&a.socket, &data);
    // Each image is opened by a client of its own, which holds its lock.
    let owners_a: Vec<String> = images
        .iter()
        .map(|image| {
            ceph::lock_holder(image).unwrap_or_else(|| panic!("A holds no lock on {image}"))
        })
        .collect();
    let owner_a = owners_a[0].clone();

    // While A lives, another server is refused, naming A's client and the way out.
    let refused = b.serve_refused(&pool);
    let said = refused.stderr.clone();
    assert!(
        said.contains(&owner_a),
        "the refusal does not name A:\n{said}"
    );
    assert!(
        said.contains("--take-over"),
        "the refusal does not say how:\n{said}"
    );
    assert!(greets(&a.socket), "A stopped serving after B was refused");

    // A freezes; B takes over.
    server_a.signal(libc::SIGSTOP);
    let server_b = b.serve(&pool, &["--take-over", "--blocklist-expire", "3600"]);
    for (image, owner) in images.iter().zip(&owners_a) {
        assert!(
            ceph::blocklisted(owner),
            "A's client {owner} of {image} is not blocklisted"
        );
        let holder = ceph::lock_holder(image);
        assert!(holder.is_some_and(|h| h != *owner), "{image} is not B's");
    }
    assert_volume_is(&b.socket, &data);
    server_b.stop();

    // A wakes. Whatever it does, nothing of it reaches the images.
    let before = export(&images, &dir, "before");
    server_a.signal(libc::SIGCONT);
    let mut write = tool("qemu-io");
    write
        .args(["-f", "raw", "-c", "write -P 0x5a 0 1M", "-c", "flush"])
        .arg(unix_uri(&a.socket));
    let wrote = run_with_limit(&mut write, CLIENT_LIMIT);
    assert!(
        !wrote.status.success(),
        "a write through the fenced server succeeded:\n{}",
        wrote.report()
    );
    let status = server_a.wait_exit();
    assert_eq!(
        status.code(),
        Some(NOT_OWNER),
        "the fenced server's exit:\n{}",
        server_a.log_text()
    );
    assert!(
        server_a.log_text().contains("no longer this server's"),
        "the fenced server did not say why it stopped:\n{}",
        server_a.log_text()
    );
    let after = export(&images, &dir, "after");
    assert_same_bytes(&before, &after);

    let check = b.cli_ok(&["--pool", &pool, "check"]);
    assert!(
        check.stdout.contains("No problems found"),
        "{}",
        check.report()
    );
    // B's clean stop released the pool: it serves again without a take-over.
    let server_b = b.serve(&pool, &[]);
    assert_volume_is(&b.socket, &data);
    server_b.stop();
}

#[test]
fn a_frozen_server_is_fenced_and_its_pool_taken_over() {
    failover(false);
}

#[test]
fn a_pool_with_its_metadata_on_a_second_image_is_taken_over_whole() {
    failover(true);
}

/// A read-only server holds the pool too (the engine's read-only mode relies on
/// nobody writing), and stops when another server takes it over, rather than serve
/// reads of a pool that another server now changes.
#[test]
fn a_read_only_server_taken_over_stops() {
    let dir = TempDir::new("rbd-failover-ro");
    let image = ceph::new_image("failover-ro", 128);
    let pool = format!("rbd:{}/{image}", ceph::POOL);
    let a = Host::new(&dir, "host-a");
    let b = Host::new(&dir, "host-b");
    a.cli_ok(&["pool", "create", &pool]);
    let mut server_a = a.serve(&pool, &["--read-only"]);
    let owner_a = ceph::lock_holder(&image).expect("a read-only server holds the lock");
    server_a.signal(libc::SIGSTOP);
    let server_b = b.serve(&pool, &["--take-over"]);
    assert!(ceph::blocklisted(&owner_a), "A's client is not blocklisted");
    server_a.signal(libc::SIGCONT);
    let status = server_a.wait_exit();
    assert_eq!(
        status.code(),
        Some(NOT_OWNER),
        "the fenced server's exit:\n{}",
        server_a.log_text()
    );
    assert!(
        server_a.log_text().contains("no longer this server's"),
        "the fenced server did not say why it stopped:\n{}",
        server_a.log_text()
    );
    server_b.stop();
}

#[test]
fn take_over_is_refused_for_a_pool_file() {
    let dir = TempDir::new("rbd-failover-file");
    let host = Host::new(&dir, "host-a");
    let file = dir.join("vms.pool");
    let file = file.to_str().expect("utf-8");
    host.cli_ok(&["pool", "create", file, "--size", "64M"]);
    let ran = host.cli(&["--pool", file, "serve", "--no-tcp", "--take-over"]);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(
        ran.stderr
            .contains("--take-over is for a pool on RBD images"),
        "{}",
        ran.report()
    );
}
