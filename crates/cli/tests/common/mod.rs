//! Test harness for driving `fewerbytes serve` with real NBD clients: a temporary
//! directory per test, a server process with its own pool, unix socket and TCP port,
//! and helpers that run client tools with a time limit and fail loudly.
//!
//! A missing client tool is a test failure naming the Debian package that provides
//! it, never a silent skip: `scripts/test.sh` and `.ci/run` install every one.

#![allow(
    dead_code,
    reason = "each test binary uses a different subset of the harness"
)]

pub mod data;
pub mod fuse_loop;
pub mod libnbd;
pub mod loop_device;
pub mod nbdinfo;
pub mod send_stream;
pub mod service;
pub mod tls;

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The binary under test.
pub const FEWERBYTES: &str = env!("CARGO_BIN_EXE_fewerbytes");

/// The binary the tests run: `FEWERBYTES_TEST_BIN` if set (an installed build, say),
/// else the one cargo just built.
pub fn fewerbytes_bin() -> PathBuf {
    std::env::var_os("FEWERBYTES_TEST_BIN").map_or_else(|| PathBuf::from(FEWERBYTES), PathBuf::from)
}

/// Size of the pool file each test creates (sparse), big enough for every volume a
/// test makes (the engine refuses volume sizes that add up past what it addresses);
/// the soak runs' larger volumes need a larger pool.
pub fn pool_size() -> &'static str {
    if soak() {
        "12G"
    } else {
        "4G"
    }
}

/// How long a server may take to start listening.
const SERVER_START_LIMIT: Duration = Duration::from_secs(60);
/// How long a server may take to exit after SIGTERM (it flushes first).
const SERVER_STOP_LIMIT: Duration = Duration::from_secs(60);
/// Default limit for one client command; long enough for the slowest client step on
/// a loaded 2-core machine, short enough that a hang fails the test instead of CI.
pub const CLIENT_LIMIT: Duration = Duration::from_secs(300);

/// `FEWERBYTES_SOAK=1` makes the workload tests larger and longer.
pub fn soak() -> bool {
    std::env::var("FEWERBYTES_SOAK").is_ok_and(|v| v == "1")
}

/// Where a client tool comes from, for the failure message.
fn package_of(tool: &str) -> &'static str {
    match tool {
        "nbdinfo" | "nbdcopy" | "nbdfuse" => "libnbd-bin",
        "nbdsh" => "python3-libnbd",
        "nbd-client" => "nbd-client",
        "fio" => "fio",
        "qemu-img" | "qemu-io" | "qemu-nbd" => "qemu-utils",
        "mkfs.ext4" | "fsck.ext4" => "e2fsprogs",
        "losetup" | "fstrim" | "unshare" | "setpriv" => "util-linux",
        "mount" | "umount" => "mount",
        "systemd-analyze" => "systemd",
        "prove" | "perl" => "perl (with libtest-mockmodule-perl and libjson-perl)",
        "openssl" => "openssl",
        _ => "(unknown package)",
    }
}

/// The system's python3 (`command -v -p`: the default PATH, not a user's).
pub fn default_python3() -> PathBuf {
    let out = Command::new("sh")
        .args(["-c", "command -v -p python3"])
        .output()
        .expect("run sh");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        !path.is_empty(),
        "no python3 on the default PATH; .ci/run installs it"
    );
    PathBuf::from(path)
}

/// Panics (fails the test) unless `tool` is on PATH or is an absolute path that exists.
pub fn require_tool(tool: &str) -> PathBuf {
    if tool.starts_with('/') {
        let path = PathBuf::from(tool);
        assert!(
            path.exists(),
            "required client `{tool}` is missing; run scripts/test.sh, which installs it"
        );
        return path;
    }
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path_var).collect();
    // Root's tools live in sbin, which a non-login PATH may lack.
    for extra in ["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        dirs.push(PathBuf::from(extra));
    }
    for dir in dirs {
        let candidate = dir.join(tool);
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!(
        "required client tool `{tool}` was not found (Debian package `{}`); \
         run scripts/test.sh, which installs every client the NBD tests use",
        package_of(tool)
    );
}

/// A directory removed when dropped.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// A fresh directory under the system temp dir, named after the test.
    pub fn new(label: &str) -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        // Short names: a unix socket path must fit in 108 bytes.
        let path =
            std::env::temp_dir().join(format!("fb-{label}-{}-{n}-{nanos:x}", std::process::id()));
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A path inside it.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("FEWERBYTES_KEEP_TEMP").is_some() {
            eprintln!("keeping {}", self.path.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local addr").port()
}

/// A command line as a person would type it, for failure messages.
pub fn describe(cmd: &Command) -> String {
    let mut parts = vec![cmd.get_program().to_string_lossy().into_owned()];
    parts.extend(cmd.get_args().map(shell_quote));
    parts.join(" ")
}

fn shell_quote(arg: &OsStr) -> String {
    let s = arg.to_string_lossy();
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
    {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// What a finished command said.
pub struct Ran {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub command: String,
}

impl Ran {
    /// Both streams, for assertions that do not care which one a tool used.
    pub fn all_output(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }

    /// Everything a person needs to see when a step failed.
    pub fn report(&self) -> String {
        format!(
            "command: {}\nstatus: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.command, self.status, self.stdout, self.stderr
        )
    }
}

/// Runs `cmd` to completion within `limit`, killing it past that.
pub fn run_with_limit(cmd: &mut Command, limit: Duration) -> Ran {
    let command = describe(cmd);
    let stdout_path = std::env::temp_dir().join(format!(
        "fb-out-{}-{}",
        std::process::id(),
        OUT_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let stderr_path = stdout_path.with_extension("err");
    let stdout_file = std::fs::File::create(&stdout_path).expect("create stdout capture");
    let stderr_file = std::fs::File::create(&stderr_path).expect("create stderr capture");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(stdout_file)
        .stderr(stderr_file)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start `{command}`: {e}"));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for client") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let stdout = std::fs::read_to_string(&stdout_path).unwrap_or_default();
            let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
            let _ = std::fs::remove_file(&stdout_path);
            let _ = std::fs::remove_file(&stderr_path);
            panic!("`{command}` did not finish within {limit:?}; killed it.\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout =
        String::from_utf8_lossy(&std::fs::read(&stdout_path).unwrap_or_default()).into_owned();
    let stderr =
        String::from_utf8_lossy(&std::fs::read(&stderr_path).unwrap_or_default()).into_owned();
    let _ = std::fs::remove_file(&stdout_path);
    let _ = std::fs::remove_file(&stderr_path);
    Ran {
        status,
        stdout,
        stderr,
        command,
    }
}

static OUT_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Runs `cmd` and fails the test, with everything it printed, unless it exits 0.
pub fn run_ok(cmd: &mut Command) -> Ran {
    let ran = run_with_limit(cmd, CLIENT_LIMIT);
    assert!(
        ran.status.success(),
        "a client step failed:\n{}",
        ran.report()
    );
    ran
}

/// A command for a client tool, checked to exist first.
pub fn tool(name: &str) -> Command {
    Command::new(require_tool(name))
}

/// `qemu-io` on a raw NBD URI, running each of `commands` in order; fails the test
/// if any command fails (qemu-io exits 1) or a pattern does not match.
pub fn qemu_io(uri: &str, commands: &[String]) -> Ran {
    let mut cmd = tool("qemu-io");
    cmd.args(["-f", "raw"]);
    for c in commands {
        cmd.arg("-c").arg(c);
    }
    cmd.arg(uri);
    let ran = run_with_limit(&mut cmd, CLIENT_LIMIT);
    assert!(ran.status.success(), "qemu-io failed:\n{}", ran.report());
    let out = ran.all_output();
    assert!(
        !out.contains("verification failed"),
        "qemu-io read back the wrong data:\n{}",
        ran.report()
    );
    assert!(
        !out.contains("failed:"),
        "a qemu-io command failed:\n{}",
        ran.report()
    );
    ran
}

/// A running `fewerbytes serve` and the pool it serves.
pub struct Server {
    pub dir: PathBuf,
    pub pool: PathBuf,
    pub socket: PathBuf,
    pub port: u16,
    pub log: PathBuf,
    extra_args: Vec<String>,
    child: Option<Child>,
}

/// Runs the `fewerbytes` CLI against `pool`; returns what it said, exit status included.
pub fn fewerbytes(pool: &Path, args: &[&str]) -> Ran {
    let mut cmd = Command::new(fewerbytes_bin());
    cmd.env("FEWERBYTES_POOL", pool)
        .arg("--pool")
        .arg(pool)
        .args(args);
    run_with_limit(&mut cmd, CLIENT_LIMIT)
}

/// Like [`fewerbytes`], failing the test on a non-zero exit.
pub fn fewerbytes_ok(pool: &Path, args: &[&str]) -> Ran {
    let ran = fewerbytes(pool, args);
    assert!(
        ran.status.success(),
        "fewerbytes CLI failed:\n{}",
        ran.report()
    );
    ran
}

/// Runs `check` on the pool and fails the test unless it found no problem; returns the
/// run for further assertions.
pub fn assert_check_clean(pool: &Path) -> Ran {
    let check = fewerbytes_ok(pool, &["check"]);
    assert!(
        check.stdout.contains("No problems found"),
        "{}",
        check.report()
    );
    check
}

/// The pool's volume names (`volume list --json`).
pub fn volume_names(pool: &Path) -> Vec<String> {
    let ran = fewerbytes_ok(pool, &["volume", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_str(&ran.stdout).expect("json");
    list.as_array()
        .expect("array")
        .iter()
        .map(|v| v["name"].as_str().expect("name").to_string())
        .collect()
}

/// Creates a pool at `dir/test.pool` with the given volumes (name, size as the CLI
/// takes it, e.g. "256M"); returns the pool path.
pub fn create_pool(dir: &Path, volumes: &[(&str, &str)]) -> PathBuf {
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", pool_size()]);
    for (name, size) in volumes {
        fewerbytes_ok(&pool, &["volume", "create", name, "--size", size]);
    }
    pool
}

impl Server {
    /// Creates a pool with `volumes` in `dir` and serves it with `extra_args` added to
    /// `serve` (e.g. `--read-only`, `--default-volume NAME`).
    pub fn start_new(dir: &Path, volumes: &[(&str, &str)], extra_args: &[&str]) -> Server {
        let pool = create_pool(dir, volumes);
        Server::start(dir, &pool, extra_args)
    }

    /// Serves an existing pool.
    pub fn start(dir: &Path, pool: &Path, extra_args: &[&str]) -> Server {
        let mut server = Server {
            dir: dir.to_path_buf(),
            pool: pool.to_path_buf(),
            socket: dir.join("nbd.sock"),
            port: free_port(),
            log: dir.join("serve.log"),
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            child: None,
        };
        server.spawn();
        server
    }

    /// (Re)starts the server process on the same pool, socket and port.
    pub fn spawn(&mut self) {
        assert!(self.child.is_none(), "server already running");
        let _ = std::fs::remove_file(&self.socket);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open server log");
        let mut cmd = Command::new(fewerbytes_bin());
        cmd.env("FEWERBYTES_POOL", &self.pool)
            // Connections and negotiation outcomes are logged at debug: the
            // kernel-handshake test reads them, and a failing test shows them.
            .env(
                "FEWERBYTES_LOG",
                std::env::var("FEWERBYTES_LOG")
                    .unwrap_or_else(|_| "info,fewerbytes_nbd=debug".into()),
            )
            .env("NO_COLOR", "1")
            .arg("serve")
            .arg("--pool")
            .arg(&self.pool)
            .arg("--socket")
            .arg(&self.socket)
            .arg("--listen")
            .arg(format!("127.0.0.1:{}", self.port))
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone log handle"))
            .stderr(log);
        let command = describe(&cmd);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start `{command}`: {e}"));
        self.child = Some(child);
        self.wait_ready(&command);
    }

    /// Waits until both listeners answer an NBD greeting and the control socket exists.
    fn wait_ready(&mut self, command: &str) {
        let started = Instant::now();
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait().expect("poll server") {
                    self.child = None;
                    panic!("`{command}` exited with {status} before listening.\n--- server log ---\n{}", self.log_text());
                }
            }
            let unix_ok = UnixStream::connect(&self.socket)
                .map(|s| greet_and_abort(s).is_ok())
                .unwrap_or(false);
            let tcp_ok = TcpStream::connect(("127.0.0.1", self.port))
                .map(|s| greet_and_abort(s).is_ok())
                .unwrap_or(false);
            // The control socket too: the tests manage volumes while serving.
            let mut control = self.pool.clone().into_os_string();
            control.push(".ctl");
            // Connecting, not just existing: a SIGKILLed server leaves a stale file.
            let control_ok = UnixStream::connect(Path::new(&control)).is_ok();
            if unix_ok && tcp_ok && control_ok {
                return;
            }
            if started.elapsed() > SERVER_START_LIMIT {
                panic!(
                    "`{command}` did not answer on {} and 127.0.0.1:{} within {SERVER_START_LIMIT:?}.\n--- server log ---\n{}",
                    self.socket.display(),
                    self.port,
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's output so far, without terminal colour codes.
    pub fn log_text(&self) -> String {
        strip_ansi(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    /// `nbd+unix:///NAME?socket=PATH`.
    pub fn unix_uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }

    /// `nbd://127.0.0.1:PORT/NAME`.
    pub fn tcp_uri(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{export}", self.port)
    }

    /// The CLI against the served pool (through its control socket).
    pub fn cli(&self, args: &[&str]) -> Ran {
        fewerbytes(&self.pool, args)
    }

    /// The CLI, failing the test on a non-zero exit.
    pub fn cli_ok(&self, args: &[&str]) -> Ran {
        let ran = self.cli(args);
        assert!(
            ran.status.success(),
            "fewerbytes CLI failed while serving:\n{}\n--- server log ---\n{}",
            ran.report(),
            self.log_text()
        );
        ran
    }

    /// `stats --json`, parsed.
    pub fn stats(&self) -> serde_json::Value {
        let ran = self.cli_ok(&["stats", "--json"]);
        serde_json::from_str(&ran.stdout)
            .unwrap_or_else(|e| panic!("stats --json is not JSON ({e}):\n{}", ran.report()))
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server running").id()
    }

    /// Sends a signal to the server.
    pub fn signal(&self, sig: libc::c_int) {
        let child = self.child.as_ref().expect("server running");
        let pid = libc::pid_t::try_from(child.id()).expect("pid fits pid_t");
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        let rc = unsafe { libc::kill(pid, sig) };
        assert_eq!(rc, 0, "kill({pid}, {sig}) failed");
    }

    /// SIGTERM, then waits for the exit (SIGKILL past the limit); returns the status.
    pub fn stop(&mut self) -> ExitStatus {
        self.stop_with(libc::SIGTERM)
    }

    /// Sends `sig` (SIGTERM or SIGINT), then waits for the exit (SIGKILL past the
    /// limit); returns the status.
    pub fn stop_with(&mut self, sig: libc::c_int) -> ExitStatus {
        self.signal(sig);
        let status = self.wait_exit(SERVER_STOP_LIMIT);
        status.unwrap_or_else(|| {
            let mut child = self.child.take().expect("server running");
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "server did not exit within {SERVER_STOP_LIMIT:?} of signal {sig}.\n--- server log ---\n{}",
                self.log_text()
            )
        })
    }

    /// SIGKILL and reap: a crash, as far as the pool can tell.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let started = Instant::now();
        loop {
            let child = self.child.as_mut()?;
            if let Some(status) = child.try_wait().expect("poll server") {
                self.child = None;
                return Some(status);
            }
            if started.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(child) => child.try_wait().expect("poll server").is_none(),
            None => false,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.is_some() {
            // A clean stop if it will take one, so the pool file is not left mid-write.
            let _ = self.child.as_ref().map(|c| {
                let pid = libc::pid_t::try_from(c.id()).unwrap_or(0);
                // SAFETY: kill(2) on our own child's pid.
                unsafe { libc::kill(pid, libc::SIGTERM) }
            });
            if self.wait_exit(Duration::from_secs(10)).is_none() {
                self.kill9();
            }
        }
        if std::thread::panicking() {
            let log = self.log_text();
            let tail: String = log
                .lines()
                .rev()
                .take(80)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n");
            eprintln!(
                "--- server log ({}), last 80 lines ---\n{tail}",
                self.log.display()
            );
        }
    }
}

/// The fixed-newstyle greeting, then client flags and `NBD_OPT_ABORT`: a polite
/// client that leaves, used to tell that a listener is up.
pub fn greet_and_abort<S: Read + Write>(mut stream: S) -> std::io::Result<()> {
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting)?;
    if &greeting[0..8] != b"NBDMAGIC" || &greeting[8..16] != b"IHAVEOPT" {
        return Err(std::io::Error::other("not an NBD newstyle greeting"));
    }
    // Client flags: FIXED_NEWSTYLE | NO_ZEROES.
    stream.write_all(&3u32.to_be_bytes())?;
    let mut option = Vec::with_capacity(16);
    option.extend_from_slice(b"IHAVEOPT");
    option.extend_from_slice(&2u32.to_be_bytes()); // NBD_OPT_ABORT
    option.extend_from_slice(&0u32.to_be_bytes());
    stream.write_all(&option)?;
    // The server may answer ACK or just close; either is fine.
    let mut reply = [0u8; 20];
    let _ = stream.read(&mut reply);
    Ok(())
}

/// `text` without ANSI escape sequences (`ESC [ ... letter`).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
