//! The README's commands run as written: the quick start, the capacity section and the
//! TLS section, extracted from README.md and run in a scratch directory with the
//! binary under test first on `PATH` as `fewerbytes` (where `scripts/install.sh` puts
//! it), so a doc that no longer matches the program fails here.
//!
//! A block runs when an HTML comment right before its fence marks it (the rendered
//! README shows nothing of it):
//!
//! - `<!-- docs-test: SECTION -->`: run with `bash -e`; it must exit 0.
//! - `<!-- docs-test: SECTION fails -->`: a refusal the README shows: it must exit 1
//!   with fewerbytes' own `fewerbytes: error:` (not 127 for a missing command).
//! - `<!-- docs-test: SECTION serve -->`: one command that serves until stopped. It is
//!   exec'd in the background with `NOTIFY_SOCKET` set, the next block runs once it
//!   sent `READY=1`, and at the end of the section it gets SIGTERM and must exit 0,
//!   with no ERROR line in its log (the README's examples are the happy path).
//!
//! Not run here: the quick start's first block (apt-get, rustup, `scripts/install.sh`:
//! `packaging.rs` runs the install into a `DESTDIR`) and its guest boot (`guest.rs`
//! runs the same `scripts/guest/` steps), and "Install as a service" (systemd).
//!
//! Blocks of a section run in the order of the README, each in a fresh `bash` in the
//! section's scratch directory (the repository root of the README's reader). Nothing of
//! the blocks' text is changed; no output is compared (the README's figures change with
//! the code, its commands must not). Each section runs in a network namespace of its
//! own, so the README's fixed ports (10809, 10810) are free whatever else this machine
//! serves; this needs root, as the quick start's loop devices and mounts do.

mod common;

use common::*;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long one block may run: the quick start's fio and mkfs on a loaded machine take
/// a few minutes at most.
const BLOCK_LIMIT: Duration = Duration::from_secs(900);
/// How long a serving block may take to say READY=1.
const READY_LIMIT: Duration = Duration::from_secs(120);
/// How long a server may take to stop after SIGTERM.
const STOP_LIMIT: Duration = Duration::from_secs(120);

const MARKER: &str = "<!-- docs-test:";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Role {
    Run,
    Fails,
    Serve,
}

#[derive(Debug)]
struct Block {
    role: Role,
    /// The line of its opening fence in the file, for messages.
    line: usize,
    text: String,
}

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every marked block of `section` in `file` (relative to the repository), in order.
fn marked_blocks(file: &str, section: &str) -> Vec<Block> {
    let path = repository().join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let lines: Vec<&str> = text.lines().collect();
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        i += 1;
        let Some(rest) = line.strip_prefix(MARKER) else {
            continue;
        };
        let words: Vec<&str> = rest
            .strip_suffix("-->")
            .unwrap_or_else(|| panic!("{file}:{i}: a docs-test marker ends with -->"))
            .split_whitespace()
            .collect();
        let (name, role) = match words.as_slice() {
            [name] => (*name, Role::Run),
            [name, "fails"] => (*name, Role::Fails),
            [name, "serve"] => (*name, Role::Serve),
            _ => panic!("{file}:{i}: a docs-test marker is `SECTION [fails|serve]`: {line}"),
        };
        // The fence follows the marker at once: the marker belongs to that block.
        let fence = lines.get(i).map(|l| l.trim()).unwrap_or_default();
        assert!(
            fence == "```sh",
            "{file}:{}: a docs-test marker must be followed by a ```sh fence, found {fence:?}",
            i + 1
        );
        let start = i + 1;
        let end = (start..lines.len())
            .find(|&j| lines[j].trim() == "```")
            .unwrap_or_else(|| panic!("{file}:{start}: the block never closes"));
        if name == section {
            blocks.push(Block {
                role,
                line: start,
                text: lines[start..end].join("\n") + "\n",
            });
        }
        i = end + 1;
    }
    assert!(
        !blocks.is_empty(),
        "{file} has no block marked `{MARKER} {section} -->`: the test would check nothing"
    );
    blocks
}

/// The block's commands, comments and blank lines left out, continuation lines joined.
fn commands(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let line = line.trim();
        if current.is_empty() && (line.is_empty() || line.starts_with('#')) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(head) => current.push_str(head),
            None => {
                current.push_str(line);
                out.push(std::mem::take(&mut current));
            }
        }
    }
    out
}

/// Moves this thread (and every process it starts from now on) into a network
/// namespace of its own with loopback up.
fn own_network_namespace() {
    // SAFETY: unshare affects only the calling thread's namespaces; no pointers.
    let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    assert_eq!(
        rc,
        0,
        "unshare(CLONE_NEWNET) failed (the docs test runs as root): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a plain socket for the interface ioctls, closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: ifreq is plain data; all zeros is a valid value.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request.ifr_name.iter_mut().zip(b"lo\0") {
        *slot = *byte as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS and SIOCSIFFLAGS read and write `request`, which lives
    // across both calls.
    unsafe {
        assert_eq!(
            libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut request),
            0,
            "SIOCGIFFLAGS lo: {}",
            std::io::Error::last_os_error()
        );
        request.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        assert_eq!(
            libc::ioctl(fd, libc::SIOCSIFFLAGS, &request),
            0,
            "SIOCSIFFLAGS lo up: {}",
            std::io::Error::last_os_error()
        );
        libc::close(fd);
    }
}

/// A server a serving block started.
struct Served {
    child: Child,
    log: String,
    /// Its NOTIFY_SOCKET, kept open so that its STOPPING=1 finds a listener.
    _notify: UnixDatagram,
}

/// A section's scratch directory, with `fewerbytes` first on `PATH`.
struct Scratch {
    dir: TempDir,
    path_var: String,
    servers: Vec<Served>,
    /// How many blocks ran, for the names of their files.
    blocks_run: usize,
}

impl Scratch {
    fn new(section: &str) -> Scratch {
        let dir = TempDir::new(&format!("docs-{section}"));
        let bin = dir.join(".bin");
        std::fs::create_dir_all(&bin).expect("bin dir");
        std::os::unix::fs::symlink(fewerbytes_bin(), bin.join("fewerbytes"))
            .expect("link fewerbytes into the scratch bin");
        let path_var = format!(
            "{}:{}:/usr/sbin:/sbin",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        Scratch {
            dir,
            path_var,
            servers: Vec::new(),
            blocks_run: 0,
        }
    }

    /// `bash -e FILE` for the block, in the scratch directory, with a clean environment
    /// for fewerbytes (no pool, socket, address or log level from the caller's).
    fn bash(&mut self, script: &str) -> (Command, PathBuf) {
        self.blocks_run += 1;
        let file = self.dir.join(&format!(".block-{}.sh", self.blocks_run));
        std::fs::write(&file, script).expect("write the block");
        let mut cmd = Command::new("bash");
        cmd.arg("-e")
            .arg(&file)
            .current_dir(self.dir.path())
            .env("PATH", &self.path_var)
            .env("NO_COLOR", "1")
            .env_remove("FEWERBYTES_POOL")
            .env_remove("FEWERBYTES_CONTROL_SOCKET")
            .env_remove("FEWERBYTES_ALLOW_FILE")
            .env_remove("FEWERBYTES_LISTEN")
            .env_remove("FEWERBYTES_LOG")
            .env_remove("FEWERBYTES_LOG_FORMAT")
            .env_remove("RUST_LOG")
            .env_remove("NOTIFY_SOCKET")
            .stdin(Stdio::null());
        (cmd, file)
    }

    fn run(&mut self, file: &str, block: &Block) {
        let where_ = format!("{file}:{}", block.line);
        match block.role {
            Role::Run | Role::Fails => {
                let (mut cmd, _) = self.bash(&block.text);
                let ran = run_with_limit(&mut cmd, BLOCK_LIMIT);
                let expected = block.role == Role::Run;
                // A refusal is fewerbytes' own error (exit 1, "fewerbytes: error: ..."),
                // not a missing command (127) or a usage error (2).
                let as_shown = if expected {
                    ran.status.success()
                } else {
                    ran.status.code() == Some(1) && ran.stderr.contains("fewerbytes: error:")
                };
                assert!(
                    as_shown,
                    "the block at {where_} {}:\n{}\n{}{}",
                    if expected {
                        "failed"
                    } else {
                        "did not fail as the README shows (exit 1, fewerbytes: error:)"
                    },
                    block.text,
                    ran.report(),
                    self.server_logs()
                );
            }
            Role::Serve => self.serve(&where_, block),
        }
    }

    /// Starts a serving block in the background and waits for its READY=1.
    fn serve(&mut self, where_: &str, block: &Block) {
        let commands = commands(&block.text);
        assert!(
            commands.len() == 1,
            "the serving block at {where_} must be one command (it runs until stopped), \
             found {commands:?}"
        );
        let index = self.servers.len();
        let notify_path = self.dir.join(&format!(".notify-{index}"));
        let notify = UnixDatagram::bind(&notify_path).expect("bind the notify socket");
        notify
            .set_read_timeout(Some(Duration::from_millis(200)))
            .expect("notify timeout");
        // exec: the server is the process the test signals and waits for.
        let (mut cmd, _) = self.bash(&format!("exec {}\n", commands[0]));
        let log_path = self.dir.join(&format!(".server-{index}.log"));
        let log = std::fs::File::create(&log_path).expect("server log");
        cmd.env("NOTIFY_SOCKET", &notify_path)
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .process_group(0);
        let mut child = cmd.spawn().expect("start the serving block");
        let started = Instant::now();
        let mut buf = [0u8; 4096];
        loop {
            if let Ok(n) = notify.recv(&mut buf) {
                if String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .any(|l| l == "READY=1")
                {
                    break;
                }
            }
            if let Some(status) = child.try_wait().expect("poll the server") {
                panic!(
                    "the serving block at {where_} exited ({status}) before it was ready:\n{}\n{}",
                    block.text,
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
            }
            if started.elapsed() > READY_LIMIT {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "the serving block at {where_} did not say READY=1 within {READY_LIMIT:?}:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
            }
        }
        self.servers.push(Served {
            child,
            log: log_path.to_string_lossy().into_owned(),
            _notify: notify,
        });
    }

    fn server_logs(&self) -> String {
        let mut out = String::new();
        for Served { log, .. } in &self.servers {
            out.push_str(&format!(
                "\n--- {log} ---\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            ));
        }
        out
    }

    /// SIGTERM to every server the section started, newest first; each must exit 0.
    fn stop_servers(&mut self) {
        while let Some(Served { mut child, log, .. }) = self.servers.pop() {
            let pid = i32::try_from(child.id()).expect("pid");
            // SAFETY: kill(2) on a child this test started and has not reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let started = Instant::now();
            let status = loop {
                if let Some(status) = child.try_wait().expect("wait for the server") {
                    break status;
                }
                if started.elapsed() > STOP_LIMIT {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "a server did not stop within {STOP_LIMIT:?} of SIGTERM:\n{}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            assert!(
                status.success(),
                "a server the README starts exited with {status} after SIGTERM:\n{text}"
            );
            // The README's examples are the happy path: an error in the log there is
            // one a reader would see and worry about.
            assert!(
                !text.lines().any(|l| l.contains(" ERROR ")),
                "a server the README starts logged an error:\n{text}"
            );
        }
    }

    /// Mounts and loop devices a failed block left under the scratch directory.
    fn undo_mounts(&self) {
        let root = self.dir.path().to_string_lossy().into_owned();
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let mut points: Vec<&str> = mounts
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter(|p| p.starts_with(&root))
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for point in points {
            if let Ok(out) = Command::new("findmnt")
                .args(["-n", "-o", "SOURCE", point])
                .output()
            {
                let source = String::from_utf8_lossy(&out.stdout).trim().to_string();
                let _ = Command::new("umount").args(["-l", point]).status();
                if source.starts_with("/dev/loop") {
                    let _ = Command::new("losetup").args(["-d", &source]).status();
                }
            }
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for Served { child, .. } in &mut self.servers {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.undo_mounts();
    }
}

/// Runs every block of `section` in README.md, in order, then `and_then` while its
/// servers still serve, then stops them.
fn run_section_then(section: &str, and_then: impl FnOnce(&Scratch)) {
    let blocks = marked_blocks("README.md", section);
    for tool in ["nbdinfo", "qemu-img", "fio", "nbdfuse", "openssl"] {
        require_tool(tool);
    }
    own_network_namespace();
    let mut scratch = Scratch::new(section);
    for block in &blocks {
        scratch.run("README.md", block);
    }
    and_then(&scratch);
    scratch.stop_servers();
}

fn run_section(section: &str) {
    run_section_then(section, |_| {});
}

/// The TCP URIs the first server's banner printed (lines that are a URI alone).
fn banner_uris(scratch: &Scratch) -> Vec<String> {
    let log = &scratch.servers.first().expect("a server").log;
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("nbd://") || l.starts_with("nbds://"))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_quick_start_runs_as_written() {
    run_section("quick-start");
}

#[test]
fn the_capacity_examples_run_as_written() {
    run_section("capacity");
}

// The server listens on 0.0.0.0: the URIs it prints must still be ones a client can
// use as printed (with its credentials), not nbds://0.0.0.0:…, which no certificate
// names.
#[test]
fn the_tls_x509_example_serves_a_client_on_this_host() {
    run_section_then("tls-x509", |scratch| {
        let uris = banner_uris(scratch);
        assert!(!uris.is_empty(), "serve printed no TCP URI");
        for uri in uris {
            let mut nbdinfo = tool("nbdinfo");
            nbdinfo
                .arg(format!("{uri}?tls-certificates=pki/alice"))
                .current_dir(scratch.dir.path());
            let ran = run_with_limit(&mut nbdinfo, BLOCK_LIMIT);
            assert!(
                ran.status.success(),
                "a URI serve printed does not work as printed:\n{}",
                ran.report()
            );
        }
    });
}

#[test]
fn the_tls_psk_example_serves_a_client_on_this_host() {
    run_section("tls-psk");
}

#[test]
fn a_serving_block_is_one_command_and_comments_are_not_commands() {
    assert_eq!(
        commands("# a comment\nfewerbytes serve   # serves\n\nnbdinfo a \\\n  b\n"),
        ["fewerbytes serve   # serves", "nbdinfo a b"]
    );
}
