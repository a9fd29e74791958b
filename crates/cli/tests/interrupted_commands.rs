//! Ctrl-C (SIGINT) and SIGTERM during the commands that hold a pool for long:
//! `volume import`, `export`, `send`, `receive` and `scrub` stop where they are,
//! close the pool (no later command warns that its opener did not close it), say in
//! one line what stopped and what it left, and exit 130 or 143. An import cut short
//! (by a signal or by kill -9) leaves its volume marked incomplete, which `serve`
//! refuses to export until `--resume` completes it or `--force` takes it as it is.
//!
//! Regression: Ctrl-C during an import exited 130 with no message, left
//! the pool marked open and half a disk written with nothing marking it.
//!
//! Each command is signalled once it is seen mid-way (the pool file or its output
//! has grown), on an image large enough that it is far from done then.

mod common;

use common::data::Rng;
use common::{create_pool, fewerbytes, fewerbytes_bin, fewerbytes_ok, tool, Ran, Server, TempDir};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// The image: data, a hole, data (256 MiB of data, unique so that every block is
/// hashed, compressed and stored: slow enough to be caught mid-way).
const IMAGE_PARTS_MIB: [(u64, bool); 3] = [(160, true), (64, false), (96, true)];
/// Growth that shows a command is under way: far below what it has to do.
const MIDWAY_BYTES: u64 = 16 * MIB;
/// How long a command may take to reach mid-way, and then to stop after a signal.
const LIMIT: Duration = Duration::from_secs(300);
/// What every later open must not say: the interrupted command closed the pool.
const NOT_CLOSED: &str = "did not close";

/// Writes the image to `path`; holes are left unwritten (a sparse file).
fn write_image(path: &Path, seed: u64) -> u64 {
    use std::os::unix::fs::FileExt;
    let file = std::fs::File::create(path).expect("create the image");
    let mut rng = Rng::new(seed);
    let mut chunk = vec![0u8; MIB as usize];
    let mut offset = 0;
    for (mib, data) in IMAGE_PARTS_MIB {
        if data {
            for i in 0..mib {
                rng.fill(&mut chunk);
                file.write_all_at(&chunk, offset + i * MIB)
                    .expect("write the image");
            }
        }
        offset += mib * MIB;
    }
    file.set_len(offset).expect("size the image");
    offset
}

/// Bytes the file system holds for `path` (a sparse pool file grows as it is written).
fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

/// Bytes held by the files in `dir`.
fn allocated_in(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .expect("list dir")
        .map(|e| allocated(&e.expect("dir entry").path()))
        .sum()
}

/// Whether process `pid` catches SIGINT (its handler is installed): `SigCgt` in
/// /proc/PID/status, a hex mask whose bit n - 1 is signal n.
fn catches_sigint(pid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (libc::SIGINT - 1)) != 0)
}

/// The CLI on `pool`, not yet waited for; stdin from `input` if given.
fn spawn(pool: &Path, args: &[&str], input: Option<&Path>, output: Option<&Path>) -> Child {
    let mut cmd = Command::new(fewerbytes_bin());
    cmd.arg("--pool").arg(pool).args(args);
    cmd.stdin(match input {
        Some(path) => Stdio::from(std::fs::File::open(path).expect("open the input")),
        None => Stdio::null(),
    });
    cmd.stdout(match output {
        Some(path) => Stdio::from(std::fs::File::create(path).expect("create the output")),
        None => Stdio::piped(),
    });
    cmd.stderr(Stdio::piped());
    cmd.spawn().expect("start the CLI")
}

/// Waits until `midway()` holds while `child` runs, sends `signal`, and returns what
/// the command said and how it exited.
fn signal_midway(mut child: Child, signal: libc::c_int, midway: impl Fn() -> bool) -> Ran {
    let started = Instant::now();
    while !midway() {
        if let Some(status) = child.try_wait().expect("poll the CLI") {
            let ran = collect(child, status);
            panic!(
                "the command ended before it was seen mid-way:\n{}",
                ran.report()
            );
        }
        assert!(started.elapsed() < LIMIT, "the command never got mid-way");
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
    // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
    assert_eq!(
        unsafe { libc::kill(pid, signal) },
        0,
        "kill({pid}, {signal})"
    );
    let stopped = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll the CLI") {
            break status;
        }
        if stopped.elapsed() > LIMIT {
            let _ = child.kill();
            panic!("the command did not stop within {LIMIT:?} of signal {signal}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    collect(child, status)
}

fn collect(mut child: Child, status: ExitStatus) -> Ran {
    use std::io::Read;
    let mut stdout = String::new();
    let mut stderr = String::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = out.read_to_string(&mut stdout);
    }
    if let Some(mut err) = child.stderr.take() {
        let _ = err.read_to_string(&mut stderr);
    }
    Ran {
        status,
        stdout,
        stderr,
        command: "fewerbytes (signalled)".into(),
    }
}

/// The command exited with 128 + `signal` and said, in one line, that `signal`
/// stopped it, what it left (`says`), and that the pool closed cleanly.
fn assert_stopped(ran: &Ran, signal: libc::c_int, says: &[&str]) {
    let (code, name) = match signal {
        libc::SIGINT => (130, "SIGINT"),
        _ => (143, "SIGTERM"),
    };
    assert_eq!(
        ran.status.code(),
        Some(code),
        "exit code after {name}:\n{}",
        ran.report()
    );
    let line = ran
        .stderr
        .lines()
        .find(|l| l.contains(&format!("interrupted by {name}")))
        .unwrap_or_else(|| panic!("no line says {name} stopped it:\n{}", ran.report()));
    for part in says.iter().chain(&["closed cleanly"]) {
        assert!(
            line.contains(part),
            "the line lacks {part:?}:\n{}",
            ran.report()
        );
    }
}

/// A later command opens the pool with no warning that its opener did not close it.
fn assert_closed(pool: &Path) {
    let list = fewerbytes_ok(pool, &["volume", "list"]);
    assert!(
        !list.stderr.contains(NOT_CLOSED),
        "the pool was left open:\n{}",
        list.report()
    );
}

/// Whether `volume list --json` marks `name` incomplete.
fn incomplete(pool: &Path, name: &str) -> bool {
    let list = fewerbytes_ok(pool, &["volume", "list", "--json"]);
    let volumes: serde_json::Value = serde_json::from_str(&list.stdout).expect("json");
    volumes
        .as_array()
        .expect("array")
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no volume '{name}':\n{}", list.report()))["incomplete"]
        .as_bool()
        .expect("incomplete is a bool")
}

/// `nbdinfo` on `name` through a server on `pool`; the server's log after it.
fn serve_and_probe(dir: &Path, pool: &Path, name: &str, check: impl FnOnce(&Server)) -> Ran {
    let mut server = Server::start(dir, pool, &[]);
    let mut probe = tool("nbdinfo");
    probe.arg(server.unix_uri(name));
    let ran = common::run_with_limit(&mut probe, LIMIT);
    check(&server);
    server.stop();
    ran
}

/// An import of a fresh image into `v`, sent `signal` mid-way: what it left, and how
/// it ended.
fn import_signalled(label: &str, signal: libc::c_int) -> (TempDir, PathBuf, PathBuf, Ran) {
    let dir = TempDir::new(label);
    let pool = create_pool(dir.path(), &[]);
    let image = dir.join("src.raw");
    write_image(&image, 37);
    let before = allocated(&pool);
    let child = spawn(
        &pool,
        &["volume", "import", "v", image.to_str().expect("utf-8")],
        None,
        None,
    );
    let ran = signal_midway(child, signal, || allocated(&pool) > before + MIDWAY_BYTES);
    (dir, pool, image, ran)
}

/// An import of a fresh image into `v`, stopped by `signal` mid-way.
fn import_stopped(label: &str, signal: libc::c_int) -> (TempDir, PathBuf, PathBuf) {
    let (dir, pool, image, ran) = import_signalled(label, signal);
    assert_stopped(
        &ran,
        signal,
        &["import of", "marked incomplete", "--resume"],
    );
    (dir, pool, image)
}

/// Serving `v` is refused while it is marked incomplete, and the log says why.
fn assert_served_refused(dir: &Path, pool: &Path) {
    let probe = serve_and_probe(dir, pool, "v", |server| {
        let log = server.log_text();
        assert!(
            log.contains("volume 'v' is not served: it is marked incomplete"),
            "the server does not say why it refuses 'v':\n{log}"
        );
        assert!(
            log.contains("Volume 'v': not served, marked incomplete"),
            "the banner offers the incomplete volume:\n{log}"
        );
    });
    assert!(
        !probe.status.success(),
        "a client opened the incomplete volume:\n{}",
        probe.report()
    );
}

#[test]
fn an_import_stopped_by_sigint_closes_the_pool_and_resumes_to_the_right_bytes() {
    let (dir, pool, image) = import_stopped("int-import", libc::SIGINT);
    assert_closed(&pool);
    assert!(incomplete(&pool, "v"), "the cut-short import is not marked");
    let table = fewerbytes_ok(&pool, &["volume", "list"]);
    assert!(table.stdout.contains("incomplete"), "{}", table.report());
    assert_served_refused(dir.path(), &pool);
    // A plain import again is refused: it would lose the mark's meaning.
    let again = fewerbytes(
        &pool,
        &["volume", "import", "v", image.to_str().expect("utf-8")],
    );
    assert!(!again.status.success(), "{}", again.report());
    assert!(again.stderr.contains("--resume"), "{}", again.report());

    let resumed = fewerbytes_ok(
        &pool,
        &[
            "volume",
            "import",
            "v",
            image.to_str().expect("utf-8"),
            "--resume",
        ],
    );
    assert!(
        resumed.stdout.contains("held already"),
        "{}",
        resumed.report()
    );
    assert!(
        !incomplete(&pool, "v"),
        "the resumed import is still marked"
    );
    let compare = serve_and_probe(dir.path(), &pool, "v", |server| {
        let mut compare = tool("qemu-img");
        compare
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&image)
            .arg(server.unix_uri("v"));
        common::run_ok(&mut compare);
    });
    assert!(compare.status.success(), "{}", compare.report());
}

#[test]
fn an_import_stopped_by_sigterm_is_taken_as_it_is_with_force() {
    let (dir, pool, _image) = import_stopped("term-import", libc::SIGTERM);
    assert_closed(&pool);
    assert!(incomplete(&pool, "v"));
    let taken = fewerbytes_ok(&pool, &["volume", "import", "v", "--force"]);
    assert!(
        taken.stdout.contains("taken as it is"),
        "{}",
        taken.report()
    );
    assert!(!incomplete(&pool, "v"));
    let probe = serve_and_probe(dir.path(), &pool, "v", |_| {});
    assert!(probe.status.success(), "{}", probe.report());
    // Taken once, there is nothing left to take.
    let twice = fewerbytes(&pool, &["volume", "import", "v", "--force"]);
    assert!(!twice.status.success(), "{}", twice.report());
}

#[test]
fn a_killed_import_leaves_its_volume_marked_incomplete() {
    let (dir, pool, _, ran) = import_signalled("kill-import", libc::SIGKILL);
    assert_eq!(ran.status.code(), None, "{}", ran.report());
    assert!(incomplete(&pool, "v"), "a killed import left no mark");
    assert_served_refused(dir.path(), &pool);
}

/// A pool holding `v`, imported from the image; the image's path.
fn pool_with_volume(dir: &TempDir) -> (PathBuf, PathBuf) {
    let pool = create_pool(dir.path(), &[]);
    let image = dir.join("src.raw");
    write_image(&image, 39);
    fewerbytes_ok(
        &pool,
        &["volume", "import", "v", image.to_str().expect("utf-8")],
    );
    (pool, image)
}

#[test]
fn an_export_stopped_by_a_signal_leaves_no_partial_file() {
    let dir = TempDir::new("term-export");
    let (pool, _) = pool_with_volume(&dir);
    let out_dir = dir.join("out");
    std::fs::create_dir(&out_dir).expect("mkdir");
    let target = out_dir.join("v.raw");
    let child = spawn(
        &pool,
        &["volume", "export", "v", target.to_str().expect("utf-8")],
        None,
        None,
    );
    let ran = signal_midway(child, libc::SIGTERM, || {
        allocated_in(&out_dir) > MIDWAY_BYTES
    });
    assert_stopped(
        &ran,
        libc::SIGTERM,
        &["export of volume 'v' stopped", "not made"],
    );
    let left: Vec<_> = std::fs::read_dir(&out_dir).expect("list").collect();
    assert!(left.is_empty(), "the export left {left:?}");
    assert_closed(&pool);
}

#[test]
fn a_send_stopped_by_a_signal_closes_cleanly() {
    let dir = TempDir::new("int-send");
    let (pool, _) = pool_with_volume(&dir);
    let stream = dir.join("v.stream");
    let child = spawn(&pool, &["volume", "send", "v"], None, Some(&stream));
    let ran = signal_midway(child, libc::SIGINT, || allocated(&stream) > MIDWAY_BYTES);
    assert_stopped(&ran, libc::SIGINT, &["send of volume 'v' stopped"]);
    assert_closed(&pool);
}

#[test]
fn a_receive_stopped_by_a_signal_keeps_what_it_applied_and_resumes() {
    let dir = TempDir::new("term-recv");
    let (source_pool, image) = pool_with_volume(&dir);
    let stream = dir.join("v.stream");
    let sent = spawn(&source_pool, &["volume", "send", "v"], None, Some(&stream))
        .wait()
        .expect("wait for the send");
    assert!(sent.success(), "the send failed: {sent}");

    let other = TempDir::new("term-recv-dst");
    let pool = create_pool(other.path(), &[]);
    let before = allocated(&pool);
    let child = spawn(&pool, &["volume", "receive", "r"], Some(&stream), None);
    let ran = signal_midway(child, libc::SIGTERM, || {
        allocated(&pool) > before + MIDWAY_BYTES
    });
    assert_stopped(&ran, libc::SIGTERM, &["receive of 'r' stopped", "--resume"]);
    assert_closed(&pool);

    let resumed = spawn(
        &pool,
        &["volume", "receive", "r", "--resume"],
        Some(&stream),
        None,
    );
    let output = resumed.wait_with_output().expect("wait for the resume");
    assert!(
        output.status.success(),
        "the resume failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let out = other.join("r.raw");
    fewerbytes_ok(
        &pool,
        &["volume", "export", "r", out.to_str().expect("utf-8")],
    );
    let mut compare = tool("qemu-img");
    compare
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&image)
        .arg(&out);
    common::run_ok(&mut compare);
}

#[test]
fn a_scrub_stopped_by_a_signal_closes_the_pool() {
    let dir = TempDir::new("int-scrub");
    let (pool, _) = pool_with_volume(&dir);
    // At 8 MiB/s the 256 MiB of data take half a minute: the signal lands mid-way.
    let child = spawn(&pool, &["scrub", "--rate", "8M"], None, None);
    let pid = child.id();
    let started = Instant::now();
    let ran = signal_midway(child, libc::SIGINT, || {
        catches_sigint(pid) && started.elapsed() > Duration::from_secs(2)
    });
    assert_stopped(&ran, libc::SIGINT, &["the scrub stopped at"]);
    assert_closed(&pool);
}

#[test]
fn a_repair_signalled_runs_to_its_end_then_says_so_and_closes_the_pool() {
    let dir = TempDir::new("int-repair");
    let (pool, _) = pool_with_volume(&dir);
    let child = spawn(&pool, &["check", "--repair", "--verify-data"], None, None);
    let pid = child.id();
    // Wherever it is then (opening the pool, or repairing), the stop is the same: a
    // repair is never stopped part-way.
    let ran = signal_midway(child, libc::SIGINT, || catches_sigint(pid));
    assert_stopped(&ran, libc::SIGINT, &["check --repair"]);
    assert_closed(&pool);
    common::assert_check_clean(&pool);
}

#[test]
fn the_man_pages_list_the_interrupted_exit_code() {
    let dir = TempDir::new("man-int");
    let pool = create_pool(dir.path(), &[]);
    let man_dir = dir.join("man1");
    fewerbytes_ok(&pool, &["man", man_dir.to_str().expect("utf-8 path")]);
    for command in [
        "volume-import",
        "volume-export",
        "volume-send",
        "volume-receive",
        "scrub",
        "check",
    ] {
        let page = std::fs::read_to_string(man_dir.join(format!("fewerbytes-{command}.1")))
            .expect("a man page");
        let exit_status = &page[page.find("EXIT STATUS").expect("EXIT STATUS")..];
        for code in ["\n130\n", "143 for SIGTERM"] {
            assert!(
                exit_status.contains(code),
                "{command}'s page lacks the interrupted exit code {code:?}:\n{page}"
            );
        }
    }
}
