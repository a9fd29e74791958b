//! A pool named by a device URI, end to end through the `fewerbytes` binary: a pool
//! named `file:///…` created, served, written over NBD, served again and read back
//! whole, with its files beside it as for a path; clear errors for names that are
//! not devices and for an RBD pool whose Ceph config is missing; and a pool on an RBD
//! image of a real one-node Ceph cluster (scripts/ceph/cluster.sh): created on an
//! existing image (a larger --size refused, naming `rbd resize`), served with its
//! control socket in the run directory and its saved index in the state directory,
//! written with qemu-img, stopped, served again, every byte read back, managed through
//! the control socket, and checked clean; a pool whose metadata device is a second
//! image, found again through the data image's label; and a pool that takes the
//! space of its image grown with `rbd resize` (`pool grow`, served and offline).

mod common;

#[path = "../../storage/tests/ceph/mod.rs"]
mod ceph;

use common::{fewerbytes_bin, greet_and_abort, run_with_limit, tool, Ran, TempDir, CLIENT_LIMIT};
use std::ffi::OsString;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to listen, or to exit after SIGTERM (the RBD pool's
/// open and close cross the cluster on a loaded machine).
const SERVER_LIMIT: Duration = Duration::from_secs(120);

/// Environment given to every `fewerbytes` this test runs.
type Env = Vec<(&'static str, OsString)>;

/// `fewerbytes ARGS` with `env` (no pool from the test's own environment).
fn cli(env: &Env, args: &[&str]) -> Ran {
    let mut cmd = Command::new(fewerbytes_bin());
    cmd.env_remove("FEWERBYTES_POOL")
        .env_remove("CEPH_CONF")
        .env("NO_COLOR", "1");
    for (key, value) in env {
        cmd.env(key, value);
    }
    cmd.args(args);
    run_with_limit(&mut cmd, CLIENT_LIMIT)
}

fn cli_ok(env: &Env, args: &[&str]) -> Ran {
    let ran = cli(env, args);
    assert!(ran.status.success(), "fewerbytes failed:\n{}", ran.report());
    ran
}

fn cli_fails(env: &Env, args: &[&str]) -> Ran {
    let ran = cli(env, args);
    assert!(
        !ran.status.success(),
        "fewerbytes should have failed:\n{}",
        ran.report()
    );
    ran
}

/// A `fewerbytes serve` of one pool on a unix socket only.
struct Serving {
    child: Option<Child>,
    log: PathBuf,
}

impl Serving {
    /// Serve `pool` on `socket`, and wait until it greets there and answers on the
    /// control socket `control` (the home the test expects it to have).
    fn start(env: &Env, pool: &str, socket: &Path, control: &Path, log: &Path) -> Serving {
        let _ = std::fs::remove_file(socket);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("open the server log");
        let mut cmd = Command::new(fewerbytes_bin());
        cmd.env_remove("FEWERBYTES_POOL")
            .env_remove("CEPH_CONF")
            .env("NO_COLOR", "1");
        for (key, value) in env {
            cmd.env(key, value);
        }
        cmd.args(["--pool", pool, "serve", "--no-tcp", "--socket"])
            .arg(socket)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("clone the log handle"))
            .stderr(out);
        let child = cmd.spawn().expect("start fewerbytes serve");
        let mut serving = Serving {
            child: Some(child),
            log: log.to_path_buf(),
        };
        let started = Instant::now();
        loop {
            if let Some(status) = serving
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                serving.child = None;
                panic!(
                    "serve exited with {status} before listening:\n{}",
                    serving.log_text()
                );
            }
            let nbd_up = UnixStream::connect(socket).is_ok_and(|s| greet_and_abort(s).is_ok());
            let control_up = UnixStream::connect(control).is_ok();
            if nbd_up && control_up {
                return serving;
            }
            assert!(
                started.elapsed() < SERVER_LIMIT,
                "serve did not answer on {} and {} within {SERVER_LIMIT:?}:\n{}",
                socket.display(),
                control.display(),
                serving.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn log_text(&self) -> String {
        common::strip_ansi(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    /// SIGTERM, and the server's exit must be a clean one.
    fn stop(mut self) {
        let mut child = self.child.take().expect("server running");
        let pid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().expect("poll the server") {
                break status;
            }
            if started.elapsed() > SERVER_LIMIT {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "serve did not stop within {SERVER_LIMIT:?}:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
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
            let _ = child.kill();
            let _ = child.wait();
            eprintln!("--- server log ---\n{}", self.log_text());
        }
    }
}

/// `nbd+unix:///EXPORT?socket=PATH`.
fn unix_uri(socket: &Path, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", socket.display())
}

/// Write `image` over all of volume `export` with qemu-img (the NBD target's size is
/// the volume's, so the whole of it is written).
fn write_volume(socket: &Path, export: &str, image: &Path) {
    let mut cmd = tool("qemu-img");
    cmd.args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(image)
        .arg(unix_uri(socket, export));
    let ran = run_with_limit(&mut cmd, CLIENT_LIMIT);
    assert!(
        ran.status.success(),
        "qemu-img convert failed:\n{}",
        ran.report()
    );
}

/// Read every byte of volume `export` back and compare it with `image`.
fn assert_volume_is(socket: &Path, export: &str, image: &Path) {
    let mut cmd = tool("qemu-img");
    cmd.args(["compare", "-f", "raw", "-F", "raw"])
        .arg(image)
        .arg(unix_uri(socket, export));
    let ran = run_with_limit(&mut cmd, CLIENT_LIMIT);
    assert!(
        ran.status.success() && ran.stdout.contains("Images are identical"),
        "the volume does not read back as written:\n{}",
        ran.report()
    );
}

/// A 32 MiB image of mixed content (repeats, compressible and random blocks).
fn test_image(dir: &Path, seed: u64) -> PathBuf {
    let path = dir.join(format!("image-{seed}.raw"));
    std::fs::write(&path, common::data::mixed_image(8192, seed)).expect("write the test image");
    path
}

/// The names in `volume list --json`.
fn volume_names(env: &Env, pool: &str) -> Vec<String> {
    let ran = cli_ok(env, &["--pool", pool, "volume", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_str(&ran.stdout).expect("volume list is JSON");
    list.as_array()
        .expect("an array")
        .iter()
        .map(|v| v["name"].as_str().expect("a name").to_string())
        .collect()
}

#[test]
fn a_pool_named_by_a_file_uri_serves_and_reads_back() {
    let dir = TempDir::new("device-uri-file");
    let path = dir.join("vm.pool");
    let name = format!("file://{}", path.display());
    let env: Env = Vec::new();
    cli_ok(&env, &["pool", "create", &name, "--size", "1G"]);
    assert!(path.is_file(), "the file URI names {}", path.display());
    cli_ok(
        &env,
        &[
            "--pool", &name, "volume", "create", "disk0", "--size", "32M",
        ],
    );

    // Served by its URI, the pool keeps today's homes: beside the file.
    let socket = dir.join("nbd.sock");
    let control = dir.join("vm.pool.ctl");
    let log = dir.join("serve.log");
    let image = test_image(dir.path(), 1);
    let server = Serving::start(&env, &name, &socket, &control, &log);
    write_volume(&socket, "disk0", &image);
    // The pool is held by the server: this goes through its control socket.
    assert_eq!(volume_names(&env, &name), ["disk0"]);
    assert_eq!(volume_names(&env, path.to_str().expect("utf-8")), ["disk0"]);
    server.stop();
    assert!(
        dir.join("vm.pool.index").is_file(),
        "the clean stop saves the index beside the pool file"
    );

    let server = Serving::start(&env, &name, &socket, &control, &log);
    assert_volume_is(&socket, "disk0", &image);
    server.stop();
    let check = cli_ok(&env, &["--pool", &name, "check"]);
    assert!(
        check.stdout.contains("No problems found"),
        "{}",
        check.report()
    );
}

#[test]
fn names_that_are_not_devices_are_refused_clearly() {
    let env: Env = Vec::new();
    for (name, says) in [
        (
            "nbd://host/export",
            "the scheme nbd: is not one fewerbytes opens",
        ),
        ("rbd:vms/", "the image name is empty"),
        ("rbd:vms", "rbd:POOL/IMAGE[@CLUSTER]"),
        ("file:relative.pool", "absolute path"),
    ] {
        let ran = cli_fails(&env, &["--pool", name, "volume", "list"]);
        assert!(ran.stderr.contains(name), "names {name}:\n{}", ran.report());
        assert!(
            ran.stderr.contains(says),
            "says {says:?}:\n{}",
            ran.report()
        );
        let ran = cli_fails(&env, &["pool", "create", name]);
        assert!(
            ran.stderr.contains(says),
            "pool create says {says:?}:\n{}",
            ran.report()
        );
    }

    // An RBD pool whose config is missing: the message names both, and nothing is
    // looked for as a file named rbd:vms/pool0.
    let dir = TempDir::new("device-uri-noconf");
    let conf = dir.join("missing/ceph.conf");
    let env: Env = vec![
        ("CEPH_CONF", conf.clone().into_os_string()),
        ("FEWERBYTES_RUN_DIR", dir.join("run").into_os_string()),
        ("FEWERBYTES_STATE_DIR", dir.join("state").into_os_string()),
    ];
    for args in [
        &["--pool", "rbd:vms/pool0", "volume", "list"][..],
        &["--pool", "rbd:vms/pool0", "pool", "info"],
        &["pool", "create", "rbd:vms/pool0"],
    ] {
        let ran = cli_fails(&env, args);
        assert!(ran.stderr.contains("rbd:vms/pool0"), "{}", ran.report());
        assert!(
            ran.stderr.contains(&conf.display().to_string()),
            "names the missing config:\n{}",
            ran.report()
        );
        assert!(
            !ran.stderr.contains("there is no pool at"),
            "{}",
            ran.report()
        );
    }
}

#[test]
fn a_pool_on_an_rbd_image_serves_restarts_and_reads_back() {
    let cluster = ceph::cluster();
    let image = ceph::new_image("uri", 512);
    let name = format!("rbd:{}/{image}", ceph::POOL);
    let dir = TempDir::new("device-uri-rbd");
    let run_dir = dir.join("run");
    let state_dir = dir.join("state");
    let env: Env = vec![
        ("CEPH_CONF", cluster.conf.clone().into_os_string()),
        ("FEWERBYTES_RUN_DIR", run_dir.clone().into_os_string()),
        ("FEWERBYTES_STATE_DIR", state_dir.clone().into_os_string()),
    ];

    // The image is used at its size: a larger --size is refused, naming the fix.
    let ran = cli_fails(&env, &["pool", "create", &name, "--size", "1G"]);
    assert!(ran.stderr.contains("rbd resize"), "{}", ran.report());
    let missing = format!("rbd:{}/no-such-image", ceph::POOL);
    let ran = cli_fails(&env, &["pool", "create", &missing]);
    assert!(ran.stderr.contains(&missing), "{}", ran.report());

    let created = cli_ok(&env, &["pool", "create", &name]);
    assert!(created.stdout.contains(&name), "{}", created.report());
    cli_ok(
        &env,
        &[
            "--pool", &name, "volume", "create", "disk0", "--size", "32M",
        ],
    );
    let info = cli_ok(&env, &["--pool", &name, "pool", "info", "--json"]);
    let info: serde_json::Value = serde_json::from_str(&info.stdout).expect("pool info is JSON");
    let id = info["id"]
        .as_str()
        .expect("pool info has an id")
        .to_string();
    assert_eq!(
        info["data_device_bytes"].as_u64(),
        Some(512 << 20),
        "the image's size"
    );

    let socket = dir.join("nbd.sock");
    let control = run_dir.join(format!("{id}.ctl"));
    let log = dir.join("serve.log");
    let data = test_image(dir.path(), 2);
    let server = Serving::start(&env, &name, &socket, &control, &log);
    write_volume(&socket, "disk0", &data);
    // Held by the server: through the control socket in the run directory, found by
    // the pool's id, by the name and by the socket alone.
    assert_eq!(volume_names(&env, &name), ["disk0"]);
    let by_socket = cli_ok(
        &env,
        &[
            "--control-socket",
            control.to_str().expect("utf-8"),
            "volume",
            "list",
            "--json",
        ],
    );
    assert!(by_socket.stdout.contains("disk0"), "{}", by_socket.report());
    server.stop();
    assert!(
        state_dir.join(format!("{id}.index")).is_file(),
        "the clean stop saves the index in the state directory"
    );

    let server = Serving::start(&env, &name, &socket, &control, &log);
    assert_volume_is(&socket, "disk0", &data);
    server.stop();
    let check = cli_ok(&env, &["--pool", &name, "check"]);
    assert!(
        check.stdout.contains("No problems found"),
        "{}",
        check.report()
    );
}

/// A pool whose data and metadata devices are both RBD images: the data image's label
/// names the metadata image by its URI, and a later open (by the data image's name)
/// finds it there.
#[test]
fn a_pool_with_its_metadata_on_a_second_rbd_image_opens_by_its_label() {
    let cluster = ceph::cluster();
    let data = format!("rbd:{}/{}", ceph::POOL, ceph::new_image("uri-data", 256));
    let meta = format!("rbd:{}/{}", ceph::POOL, ceph::new_image("uri-meta", 64));
    let dir = TempDir::new("device-uri-rbd-meta");
    let env: Env = vec![
        ("CEPH_CONF", cluster.conf.clone().into_os_string()),
        ("FEWERBYTES_RUN_DIR", dir.join("run").into_os_string()),
        ("FEWERBYTES_STATE_DIR", dir.join("state").into_os_string()),
    ];
    cli_ok(&env, &["pool", "create", &data, "--metadata-device", &meta]);
    cli_ok(
        &env,
        &[
            "--pool", &data, "volume", "create", "disk0", "--size", "16M",
        ],
    );
    let info = cli_ok(&env, &["--pool", &data, "pool", "info", "--json"]);
    let info: serde_json::Value = serde_json::from_str(&info.stdout).expect("pool info is JSON");
    assert_eq!(
        info["metadata_path"].as_str(),
        Some(meta.as_str()),
        "{info}"
    );
    assert_eq!(volume_names(&env, &data), ["disk0"]);
    let check = cli_ok(&env, &["--pool", &data, "check"]);
    assert!(
        check.stdout.contains("No problems found"),
        "{}",
        check.report()
    );
}

/// `pool grow` of a pool on an RBD image after `rbd resize`: while served (through the
/// control socket) and offline. The new capacity shows in `stats` and `pool info`; a
/// volume the old data region could not hold is written while served, and what was
/// written before and after the grow reads back from the pool served again.
#[test]
fn a_pool_on_an_rbd_image_grows_after_rbd_resize_served_and_offline() {
    const MIB: u64 = 1 << 20;
    let cluster = ceph::cluster();
    let image = ceph::new_image("grow", 128);
    let name = format!("rbd:{}/{image}", ceph::POOL);
    let spec = format!("{}/{image}", ceph::POOL);
    let dir = TempDir::new("device-uri-rbd-grow");
    let run_dir = dir.join("run");
    let env: Env = vec![
        ("CEPH_CONF", cluster.conf.clone().into_os_string()),
        ("FEWERBYTES_RUN_DIR", run_dir.clone().into_os_string()),
        ("FEWERBYTES_STATE_DIR", dir.join("state").into_os_string()),
    ];
    let json = |args: &[&str]| -> serde_json::Value {
        let ran = cli_ok(&env, args);
        serde_json::from_str(&ran.stdout)
            .unwrap_or_else(|e| panic!("{args:?} is not JSON ({e}):\n{}", ran.report()))
    };
    let data_bytes = |v: &serde_json::Value| {
        v["data_bytes"]
            .as_u64()
            .unwrap_or_else(|| panic!("no data_bytes in {v}"))
    };

    cli_ok(&env, &["pool", "create", &name]);
    cli_ok(
        &env,
        &[
            "--pool", &name, "volume", "create", "disk0", "--size", "32M",
        ],
    );
    let id = json(&["--pool", &name, "pool", "info", "--json"])["id"]
        .as_str()
        .expect("pool info has an id")
        .to_string();
    let socket = dir.join("nbd.sock");
    let control = run_dir.join(format!("{id}.ctl"));
    let log = dir.join("serve.log");
    let early = test_image(dir.path(), 3);
    let server = Serving::start(&env, &name, &socket, &control, &log);
    write_volume(&socket, "disk0", &early);
    let before = json(&["--pool", &name, "stats", "--json"]);
    assert!(
        data_bytes(&before) < 128 * MIB,
        "the data region fits the image: {before}"
    );
    let big = ["--pool", &name, "volume", "create", "big", "--size", "160M"];
    let ran = cli_fails(&env, &big);
    assert!(ran.stderr.contains("big"), "{}", ran.report());

    // Served: the image grows under the server, which takes it on `pool grow`.
    ceph::rbd(&["resize", "--no-progress", "--size", "384M", &spec]);
    let grown = cli_ok(&env, &["--pool", &name, "pool", "grow"]);
    assert!(grown.stdout.contains("grown"), "{}", grown.report());
    let after = json(&["--pool", &name, "stats", "--json"]);
    assert!(
        data_bytes(&after) > data_bytes(&before) + 200 * MIB,
        "data region {} before, {} after",
        data_bytes(&before),
        data_bytes(&after)
    );
    // 160 MiB of random bytes, more than the whole old data region: some land in the
    // new space.
    cli_ok(&env, &big);
    let late = dir.join("late.raw");
    let mut bytes = vec![0u8; (160 * MIB) as usize];
    common::data::Rng::new(47).fill(&mut bytes);
    std::fs::write(&late, &bytes).expect("write late.raw");
    drop(bytes);
    write_volume(&socket, "big", &late);
    server.stop();

    // Offline: the image grows again, and `pool grow` opens the pool itself.
    ceph::rbd(&["resize", "--no-progress", "--size", "512M", &spec]);
    let report = json(&["--pool", &name, "pool", "grow", "--json"]);
    assert_eq!(
        report["old_data_bytes"].as_u64(),
        Some(data_bytes(&after)),
        "{report}"
    );
    assert!(
        data_bytes(&report) > data_bytes(&after) + 100 * MIB,
        "{report}"
    );
    assert_eq!(report["untaken_bytes"].as_u64(), Some(0), "{report}");
    let info = json(&["--pool", &name, "pool", "info", "--json"]);
    assert_eq!(
        info["data_device_bytes"].as_u64(),
        Some(512 * MIB),
        "{info}"
    );
    assert_eq!(data_bytes(&info), data_bytes(&report), "{info}");

    // Served again: both volumes read back whole, and the pool keeps its size.
    let server = Serving::start(&env, &name, &socket, &control, &log);
    assert_volume_is(&socket, "disk0", &early);
    assert_volume_is(&socket, "big", &late);
    let stats = json(&["--pool", &name, "stats", "--json"]);
    assert_eq!(data_bytes(&stats), data_bytes(&report), "{stats}");
    server.stop();
    let check = cli_ok(&env, &["--pool", &name, "check"]);
    assert!(
        check.stdout.contains("No problems found"),
        "{}",
        check.report()
    );
}
