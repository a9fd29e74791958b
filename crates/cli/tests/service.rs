//! `fewerbytes serve` as a service: readiness told to a service manager over a real
//! `NOTIFY_SOCKET` datagram socket (no earlier than every socket accepts), stops on
//! SIGTERM that flush and close (even with the socket files deleted), a second signal
//! that exits at once, a restart after SIGKILL serving the same data, log levels and
//! the journal's line format, the control socket at a path of its own, the systemd
//! unit checked by `systemd-analyze verify`, and `scripts/install.sh` into a DESTDIR.
//!
//! Each test runs the real binary on its own pool, sockets and port.

mod common;

use common::{create_pool, free_port, greet_and_abort, qemu_io, run_with_limit, TempDir};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to say it is ready (open, replay, listen).
const READY_LIMIT: Duration = Duration::from_secs(60);
/// How long a clean stop may take: far more than it needs, far less than forever.
const STOP_LIMIT: Duration = Duration::from_secs(60);

/// A `serve` process started the way a service manager starts it: nothing waits for
/// its sockets; the test decides what to wait for.
struct Serve {
    pool: PathBuf,
    socket: PathBuf,
    control: PathBuf,
    port: u16,
    stdout: PathBuf,
    stderr: PathBuf,
    child: Option<Child>,
}

impl Serve {
    /// `fewerbytes serve` on `pool`, with its unix socket and control socket in `dir`,
    /// `env` added to its environment and `extra` to its arguments.
    fn spawn(
        dir: &Path,
        pool: &Path,
        port: u16,
        env: &[(&str, &str)],
        extra: &[&str],
        label: &str,
    ) -> Serve {
        Serve::spawn_under(&[], dir, pool, port, env, extra, label)
    }

    /// Like [`Serve::spawn`], run through `wrapper` (a program and its arguments that
    /// end by exec'ing the command line after them), so the process is still serve.
    fn spawn_under(
        wrapper: &[&str],
        dir: &Path,
        pool: &Path,
        port: u16,
        env: &[(&str, &str)],
        extra: &[&str],
        label: &str,
    ) -> Serve {
        let socket = dir.join("nbd.sock");
        let control = dir.join("ctl.sock");
        let stdout = dir.join(format!("{label}.out"));
        let stderr = dir.join(format!("{label}.err"));
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(common::fewerbytes_bin());
                cmd
            }
            None => Command::new(common::fewerbytes_bin()),
        };
        cmd.env_remove("FEWERBYTES_LOG")
            .env_remove("RUST_LOG")
            .env_remove("NOTIFY_SOCKET")
            .env_remove("JOURNAL_STREAM")
            .env("NO_COLOR", "1")
            .envs(env.iter().copied())
            .arg("--pool")
            .arg(pool)
            .arg("--control-socket")
            .arg(&control)
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).expect("create stdout log"))
            .stderr(std::fs::File::create(&stderr).expect("create stderr log"));
        let child = cmd.spawn().expect("start fewerbytes serve");
        Serve {
            pool: pool.to_path_buf(),
            socket,
            control,
            port,
            stdout,
            stderr,
            child: Some(child),
        }
    }

    fn pid(&self) -> libc::pid_t {
        let child = self.child.as_ref().expect("server running");
        libc::pid_t::try_from(child.id()).expect("pid fits pid_t")
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        let rc = unsafe { libc::kill(self.pid(), signal) };
        assert_eq!(rc, 0, "kill({}, {signal}) failed", self.pid());
    }

    /// Waits for the exit, at most `limit`; fails the test (after SIGKILL) past it.
    fn wait_exit(&mut self, limit: Duration, what: &str) -> ExitStatus {
        let started = Instant::now();
        loop {
            let child = self.child.as_mut().expect("server running");
            if let Some(status) = child.try_wait().expect("poll server") {
                self.child = None;
                return status;
            }
            if started.elapsed() > limit {
                self.kill9();
                panic!(
                    "serve did not exit within {limit:?} of {what}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Fails the test if the process has exited (with its logs).
    fn assert_running(&mut self) {
        let child = self.child.as_mut().expect("server running");
        if let Some(status) = child.try_wait().expect("poll server") {
            self.child = None;
            panic!("serve exited early with {status}\n{}", self.logs());
        }
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn stdout_text(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn logs(&self) -> String {
        format!(
            "--- serve stdout ---\n{}\n--- serve stderr ---\n{}",
            self.stdout_text(),
            self.stderr_text()
        )
    }

    /// Waits until the NBD unix socket, the TCP port and the control socket answer
    /// (for tests that do not watch readiness themselves).
    fn wait_listening(&mut self) {
        let started = Instant::now();
        while !(nbd_greets_on_unix(&self.socket)
            && nbd_greets_on_tcp(self.port)
            && UnixStream::connect(&self.control).is_ok())
        {
            self.assert_running();
            assert!(
                started.elapsed() < READY_LIMIT,
                "serve did not listen within {READY_LIMIT:?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn unix_uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }

    fn tcp_uri(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{export}", self.port)
    }

    /// The CLI, reaching this server through `--control-socket`.
    fn cli(&self, args: &[&str]) -> common::Ran {
        let mut cmd = Command::new(common::fewerbytes_bin());
        cmd.env_remove("FEWERBYTES_CONTROL_SOCKET")
            .arg("--pool")
            .arg(&self.pool)
            .arg("--control-socket")
            .arg(&self.control)
            .args(args);
        run_with_limit(&mut cmd, common::CLIENT_LIMIT)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if self.child.is_some() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(self.pid(), libc::SIGTERM) };
            let started = Instant::now();
            while let Some(child) = self.child.as_mut() {
                if child.try_wait().ok().flatten().is_some() || started.elapsed() > STOP_LIMIT {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            self.kill9();
        }
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
    }
}

fn nbd_greets_on_unix(socket: &Path) -> bool {
    UnixStream::connect(socket).is_ok_and(|s| greet_and_abort(s).is_ok())
}

fn nbd_greets_on_tcp(port: u16) -> bool {
    TcpStream::connect(("127.0.0.1", port)).is_ok_and(|s| greet_and_abort(s).is_ok())
}

/// A fake service manager: the datagram socket `NOTIFY_SOCKET` names.
struct Manager {
    socket: UnixDatagram,
    /// What to put in `NOTIFY_SOCKET`.
    address: String,
}

impl Manager {
    /// Listening on a path in `dir`.
    fn at_path(dir: &Path) -> Manager {
        let path = dir.join("notify");
        let socket = UnixDatagram::bind(&path).expect("bind the notify socket");
        Manager {
            socket,
            address: path.to_str().expect("utf-8 path").to_string(),
        }
    }

    /// Listening on an abstract name (`@name`, as systemd often passes it).
    fn abstract_named(label: &str) -> Manager {
        use std::os::linux::net::SocketAddrExt;
        let name = format!("fb-notify-{label}-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .expect("abstract address");
        let socket = UnixDatagram::bind_addr(&addr).expect("bind the abstract notify socket");
        Manager {
            socket,
            address: format!("@{name}"),
        }
    }

    /// The next message, within `limit`; fails the test (with the server's logs) if
    /// none comes.
    fn receive(&self, limit: Duration, serve: &mut Serve, waiting_for: &str) -> String {
        let started = Instant::now();
        self.socket
            .set_read_timeout(Some(Duration::from_millis(200)))
            .expect("set timeout");
        let mut buf = vec![0u8; 4096];
        loop {
            match self.socket.recv(&mut buf) {
                Ok(n) => return String::from_utf8_lossy(&buf[..n]).into_owned(),
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(e) => panic!("notify socket: {e}"),
            }
            if serve.child.is_some() {
                serve.assert_running();
            }
            assert!(
                started.elapsed() < limit,
                "no {waiting_for} from serve within {limit:?}\n{}",
                serve.logs()
            );
        }
    }
}

/// The `KEY=VALUE` lines of a notification.
fn assignments(message: &str) -> Vec<(String, String)> {
    message
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn value_of(message: &str, key: &str) -> Option<String> {
    assignments(message)
        .into_iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
}

/// `fewerbytes check` on a pool nobody serves: it reopens and its counts audit clean.
fn assert_pool_reopens_clean(pool: &Path) {
    let ran = common::fewerbytes(pool, &["check"]);
    assert!(
        ran.status.success(),
        "the pool did not reopen clean after the stop:\n{}",
        ran.report()
    );
}

#[test]
fn ready_comes_once_every_socket_accepts_and_sigterm_stops_cleanly_keeping_the_data() {
    let dir = TempDir::new("ready");
    let pool = create_pool(dir.path(), &[("vm1", "64M")]);
    let manager = Manager::at_path(dir.path());
    let port = free_port();
    let mut serve = Serve::spawn(
        dir.path(),
        &pool,
        port,
        &[("NOTIFY_SOCKET", &manager.address)],
        &[],
        "first",
    );

    let ready = manager.receive(READY_LIMIT, &mut serve, "READY=1");
    assert_eq!(
        value_of(&ready, "READY").as_deref(),
        Some("1"),
        "the first notification must be READY=1, got {ready:?}"
    );
    // Not premature: at the moment READY=1 arrives, every socket accepts.
    assert!(
        nbd_greets_on_unix(&serve.socket),
        "READY=1 was sent before the unix socket {} accepted\n{}",
        serve.socket.display(),
        serve.logs()
    );
    assert!(
        nbd_greets_on_tcp(port),
        "READY=1 was sent before 127.0.0.1:{port} accepted\n{}",
        serve.logs()
    );
    assert!(
        UnixStream::connect(&serve.control).is_ok(),
        "READY=1 was sent before the control socket accepted"
    );
    let status = value_of(&ready, "STATUS").unwrap_or_default();
    assert!(
        status.contains(serve.socket.to_str().expect("utf-8"))
            && status.contains(&format!("127.0.0.1:{port}")),
        "STATUS= should say where the pool is served, got {status:?}"
    );
    serve.cli(&["volume", "list"]);

    // Data written (and flushed: qemu-io flushes as it closes) before the stop...
    qemu_io(&serve.unix_uri("vm1"), &["write -P 0x5a 1M 3M".into()]);
    qemu_io(&serve.tcp_uri("vm1"), &["write -P 0xa5 8M 64k".into()]);

    serve.signal(libc::SIGTERM);
    let stopping = manager.receive(STOP_LIMIT, &mut serve, "STOPPING=1");
    assert_eq!(
        value_of(&stopping, "STOPPING").as_deref(),
        Some("1"),
        "after SIGTERM the manager must hear STOPPING=1, got {stopping:?}"
    );
    let exit = serve.wait_exit(STOP_LIMIT, "SIGTERM");
    assert_eq!(
        exit.code(),
        Some(0),
        "a clean stop exits 0\n{}",
        serve.logs()
    );
    assert!(
        serve.stdout_text().contains("closed cleanly"),
        "{}",
        serve.logs()
    );
    assert!(
        !serve.socket.exists() && !serve.control.exists(),
        "a clean stop removes its socket files"
    );

    // ...is there after the pool reopens.
    assert_pool_reopens_clean(&pool);
    let mut again = Serve::spawn(dir.path(), &pool, free_port(), &[], &[], "second");
    again.wait_listening();
    qemu_io(
        &again.unix_uri("vm1"),
        &["read -P 0x5a 1M 3M".into(), "read -P 0xa5 8M 64k".into()],
    );
}

/// Regression: with `<pool>.ctl` deleted (a tmp cleaner, an admin), SIGTERM or SIGINT
/// left serve running forever, because its control thread was woken by connecting to
/// that path.
#[test]
fn sigterm_stops_cleanly_after_both_socket_files_were_deleted() {
    stop_cleanly_after_both_socket_files_were_deleted(libc::SIGTERM, "SIGTERM");
}

#[test]
fn sigint_stops_cleanly_after_both_socket_files_were_deleted() {
    stop_cleanly_after_both_socket_files_were_deleted(libc::SIGINT, "SIGINT");
}

fn stop_cleanly_after_both_socket_files_were_deleted(signal: libc::c_int, name: &str) {
    let dir = TempDir::new("deleted");
    let pool = create_pool(dir.path(), &[("vm1", "64M")]);
    let manager = Manager::abstract_named(&format!("deleted-{signal}"));
    let port = free_port();
    let mut serve = Serve::spawn(
        dir.path(),
        &pool,
        port,
        &[("NOTIFY_SOCKET", &manager.address)],
        &[],
        "serve",
    );
    manager.receive(READY_LIMIT, &mut serve, "READY=1");
    qemu_io(&serve.tcp_uri("vm1"), &["write -P 0x3c 0 2M".into()]);

    std::fs::remove_file(&serve.socket).expect("delete the NBD socket file");
    std::fs::remove_file(&serve.control).expect("delete the control socket file");
    serve.signal(signal);
    let stopping = manager.receive(STOP_LIMIT, &mut serve, "STOPPING=1");
    assert!(stopping.contains("STOPPING=1"), "got {stopping:?}");
    let exit = serve.wait_exit(STOP_LIMIT, &format!("{name} with the socket files deleted"));
    assert_eq!(
        exit.code(),
        Some(0),
        "a clean stop exits 0\n{}",
        serve.logs()
    );
    assert!(
        serve.stdout_text().contains("closed cleanly"),
        "{}",
        serve.logs()
    );

    assert_pool_reopens_clean(&pool);
    let mut again = Serve::spawn(dir.path(), &pool, free_port(), &[], &[], "again");
    again.wait_listening();
    qemu_io(&again.unix_uri("vm1"), &["read -P 0x3c 0 2M".into()]);
}

/// A stop removes its own socket files only: after they were deleted and another
/// server took the same paths, stopping the first must not take the second's away.
#[test]
fn a_stop_leaves_alone_socket_files_another_server_took_over() {
    let dir = TempDir::new("takeover");
    let first_pool = create_pool(dir.path(), &[("vm1", "16M")]);
    let mut first = Serve::spawn(dir.path(), &first_pool, free_port(), &[], &[], "first");
    first.wait_listening();
    std::fs::remove_file(&first.socket).expect("delete the NBD socket file");
    std::fs::remove_file(&first.control).expect("delete the control socket file");

    let second_dir = TempDir::new("takeover2");
    let second_pool = create_pool(second_dir.path(), &[("other", "16M")]);
    // The same socket paths (in `dir`), another pool and port.
    let mut second = Serve::spawn(dir.path(), &second_pool, free_port(), &[], &[], "second");
    second.wait_listening();

    first.signal(libc::SIGTERM);
    let exit = first.wait_exit(STOP_LIMIT, "SIGTERM");
    assert_eq!(exit.code(), Some(0), "{}", first.logs());
    assert!(
        nbd_greets_on_unix(&second.socket),
        "stopping the first server removed the second's NBD socket {}",
        second.socket.display()
    );
    let listed = second.cli(&["volume", "list"]);
    assert!(
        listed.status.success() && listed.stdout.contains("other"),
        "stopping the first server removed the second's control socket:\n{}",
        listed.report()
    );
}

/// A client that asks for 32 MiB and reads only the reply's header: its reply cannot
/// be written, so a clean stop waits for it (up to the server's grace period).
fn stall_a_reply(socket: &Path, export: &str) -> UnixStream {
    let mut stream = UnixStream::connect(socket).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).expect("greeting");
    assert_eq!(&greeting[..8], b"NBDMAGIC");
    // Client flags: FIXED_NEWSTYLE | NO_ZEROES; then NBD_OPT_EXPORT_NAME.
    stream.write_all(&3u32.to_be_bytes()).expect("flags");
    let mut option = b"IHAVEOPT".to_vec();
    option.extend_from_slice(&1u32.to_be_bytes());
    option.extend_from_slice(&u32::try_from(export.len()).expect("short").to_be_bytes());
    option.extend_from_slice(export.as_bytes());
    stream.write_all(&option).expect("option");
    let mut export_info = [0u8; 10]; // size (8) and transmission flags (2)
    stream.read_exact(&mut export_info).expect("export info");
    // NBD_CMD_READ of 32 MiB at offset 0.
    let mut request = Vec::with_capacity(28);
    request.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    request.extend_from_slice(&0u16.to_be_bytes());
    request.extend_from_slice(&0u16.to_be_bytes());
    request.extend_from_slice(&7u64.to_be_bytes());
    request.extend_from_slice(&0u64.to_be_bytes());
    request.extend_from_slice(&(32u32 << 20).to_be_bytes());
    stream.write_all(&request).expect("read request");
    let mut reply_header = [0u8; 16];
    stream.read_exact(&mut reply_header).expect("reply header");
    assert_eq!(
        &reply_header[..4],
        &0x6744_6698u32.to_be_bytes(),
        "simple reply"
    );
    stream
}

#[test]
fn a_second_signal_during_a_slow_stop_exits_at_once() {
    let dir = TempDir::new("second");
    let pool = create_pool(dir.path(), &[("vm1", "64M")]);
    let manager = Manager::at_path(dir.path());
    let mut serve = Serve::spawn(
        dir.path(),
        &pool,
        free_port(),
        &[("NOTIFY_SOCKET", &manager.address)],
        &[],
        "serve",
    );
    manager.receive(READY_LIMIT, &mut serve, "READY=1");
    qemu_io(&serve.unix_uri("vm1"), &["write -P 0x11 0 1M".into()]);
    let _stalled = stall_a_reply(&serve.socket, "vm1");

    serve.signal(libc::SIGTERM);
    manager.receive(STOP_LIMIT, &mut serve, "STOPPING=1");
    // The stop is under way and held by the stalled reply (the server's grace period
    // is 30 s); a second signal must not wait for it.
    serve.assert_running();
    serve.signal(libc::SIGTERM);
    let exit = serve.wait_exit(STOP_LIMIT, "a second SIGTERM");
    assert_eq!(
        exit.code(),
        Some(128 + libc::SIGTERM),
        "a second SIGTERM exits at once with 128 + 15 (a clean exit 0 means it waited for the stop)\n{}",
        serve.logs()
    );
    // What was flushed survives the forced exit, like any crash.
    assert_pool_reopens_clean(&pool);
    let mut again = Serve::spawn(dir.path(), &pool, free_port(), &[], &[], "again");
    again.wait_listening();
    qemu_io(&again.unix_uri("vm1"), &["read -P 0x11 0 1M".into()]);
}

#[test]
fn a_restart_after_kill_9_is_ready_again_and_serves_the_same_data() {
    let dir = TempDir::new("kill9");
    let pool = create_pool(dir.path(), &[("vm1", "64M")]);
    let manager = Manager::at_path(dir.path());
    let port = free_port();
    let mut serve = Serve::spawn(
        dir.path(),
        &pool,
        port,
        &[("NOTIFY_SOCKET", &manager.address)],
        &[],
        "first",
    );
    manager.receive(READY_LIMIT, &mut serve, "READY=1");
    qemu_io(
        &serve.unix_uri("vm1"),
        &["write -P 0x77 0 4M".into(), "write -z 1M 1M".into()],
    );
    serve.kill9();
    assert!(
        serve.socket.exists() && serve.control.exists(),
        "SIGKILL leaves the socket files behind: the restart must cope with them"
    );

    // What Restart=on-failure does: the same command line again.
    let mut restarted = Serve::spawn(
        dir.path(),
        &pool,
        port,
        &[("NOTIFY_SOCKET", &manager.address)],
        &[],
        "restarted",
    );
    let ready = manager.receive(READY_LIMIT, &mut restarted, "READY=1 after the restart");
    assert!(ready.contains("READY=1"), "got {ready:?}");
    qemu_io(
        &restarted.unix_uri("vm1"),
        &[
            "read -P 0x77 0 1M".into(),
            "read -P 0 1M 1M".into(),
            "read -P 0x77 2M 2M".into(),
        ],
    );
    restarted.signal(libc::SIGTERM);
    let exit = restarted.wait_exit(STOP_LIMIT, "SIGTERM");
    assert_eq!(exit.code(), Some(0), "{}", restarted.logs());
    assert_pool_reopens_clean(&pool);
}

/// Starts serve with `env` and `extra`, makes one NBD connection (logged at debug),
/// stops it, and returns its stderr.
fn stderr_of_a_short_serve(label: &str, env: &[(&str, &str)], extra: &[&str]) -> String {
    let dir = TempDir::new(label);
    let pool = create_pool(dir.path(), &[("vm1", "16M")]);
    let mut serve = Serve::spawn(dir.path(), &pool, free_port(), env, extra, "serve");
    serve.wait_listening();
    serve.signal(libc::SIGTERM);
    let exit = serve.wait_exit(STOP_LIMIT, "SIGTERM");
    assert_eq!(exit.code(), Some(0), "{}", serve.logs());
    serve.stderr_text()
}

fn lines_at(stderr: &str, level: &str) -> usize {
    stderr
        .lines()
        .filter(|line| line.split_whitespace().any(|word| word == level))
        .count()
}

#[test]
fn log_levels_follow_the_flag_then_the_environment() {
    let debug = stderr_of_a_short_serve("logdebug", &[], &["--log-level", "debug"]);
    assert!(
        lines_at(&debug, "DEBUG") > 0,
        "--log-level debug shows debug lines:\n{debug}"
    );

    let error = stderr_of_a_short_serve("logerror", &[], &["--log-level", "error"]);
    assert_eq!(
        lines_at(&error, "INFO"),
        0,
        "--log-level error hides info lines:\n{error}"
    );

    let default = stderr_of_a_short_serve("loginfo", &[], &[]);
    assert!(
        lines_at(&default, "INFO") > 0,
        "serve logs at info by default:\n{default}"
    );
    assert_eq!(lines_at(&default, "DEBUG"), 0, "{default}");

    let rust_log = stderr_of_a_short_serve("logenv", &[("RUST_LOG", "debug")], &[]);
    assert!(
        lines_at(&rust_log, "DEBUG") > 0,
        "RUST_LOG=debug is honoured:\n{rust_log}"
    );

    let flag_wins = stderr_of_a_short_serve(
        "logwins",
        &[("RUST_LOG", "debug"), ("FEWERBYTES_LOG", "debug")],
        &["--log-level", "warn"],
    );
    assert_eq!(
        lines_at(&flag_wins, "DEBUG") + lines_at(&flag_wins, "INFO"),
        0,
        "--log-level wins over RUST_LOG and FEWERBYTES_LOG:\n{flag_wins}"
    );
}

#[test]
fn under_the_journal_lines_carry_a_syslog_priority_and_no_timestamp() {
    let dir = TempDir::new("journal");
    let pool = create_pool(dir.path(), &[("vm1", "16M")]);
    // The stream systemd would name in JOURNAL_STREAM: here, the file stderr goes to.
    let stderr_path = dir.join("serve.err");
    std::fs::File::create(&stderr_path).expect("create");
    let meta = std::fs::metadata(&stderr_path).expect("stat");
    let journal_stream = format!("{}:{}", meta.dev(), meta.ino());
    let mut serve = Serve::spawn(
        dir.path(),
        &pool,
        free_port(),
        &[("JOURNAL_STREAM", &journal_stream)],
        &[],
        "serve",
    );
    assert_eq!(serve.stderr, stderr_path, "the same file");
    // Spawning created the file anew (truncate keeps the inode).
    assert_eq!(
        std::fs::metadata(&stderr_path).expect("stat").ino(),
        meta.ino()
    );
    serve.wait_listening();
    serve.signal(libc::SIGTERM);
    assert_eq!(
        serve.wait_exit(STOP_LIMIT, "SIGTERM").code(),
        Some(0),
        "{}",
        serve.logs()
    );
    let stderr = serve.stderr_text();
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(!lines.is_empty(), "serve logged nothing");
    for line in &lines {
        assert!(
            line.starts_with("<6>") || line.starts_with("<4>") || line.starts_with("<3>"),
            "each line starts with its syslog priority (info <6>): {line:?}"
        );
        assert!(
            !line.contains('\u{1b}'),
            "no colour codes in the journal: {line:?}"
        );
        // A timestamp would be the first word after the prefix: 2026-12-01T17:46:45.86Z.
        let first_word = line[3..].split_whitespace().next().unwrap_or_default();
        assert!(
            !first_word.contains('T') || !first_word.ends_with('Z'),
            "no timestamp (the journal adds its own): {line:?}"
        );
    }
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("<6>") && l.contains("INFO")),
        "{stderr}"
    );

    // A failed start's one-sentence error is an error in the journal too.
    let failed_path = dir.join("failed.err");
    let failed_file = std::fs::File::create(&failed_path).expect("create");
    let meta = failed_file.metadata().expect("stat");
    let status = Command::new(common::fewerbytes_bin())
        .env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino()))
        .arg("--pool")
        .arg(dir.join("missing.pool"))
        .arg("serve")
        .arg("--no-tcp")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(failed_file)
        .status()
        .expect("run serve");
    assert_eq!(status.code(), Some(1));
    let failed = std::fs::read_to_string(&failed_path).expect("read");
    assert!(
        failed.starts_with("<3>fewerbytes: error: there is no pool"),
        "the final error carries priority 3 (error): {failed:?}"
    );
}

#[test]
fn the_control_socket_can_live_apart_from_the_pool() {
    let dir = TempDir::new("ctlpath");
    let pool = create_pool(dir.path(), &[("vm1", "16M")]);
    let mut serve = Serve::spawn(dir.path(), &pool, free_port(), &[], &[], "serve");
    serve.wait_listening();
    assert!(
        !dir.join("test.pool.ctl").exists(),
        "with --control-socket there is no <pool>.ctl"
    );

    // The flag...
    let listed = serve.cli(&["volume", "create", "vm2", "--size", "16M"]);
    assert!(listed.status.success(), "{}", listed.report());
    // ...or the variable reaches the server.
    let mut cmd = Command::new(common::fewerbytes_bin());
    cmd.env("FEWERBYTES_CONTROL_SOCKET", &serve.control)
        .arg("--pool")
        .arg(&pool)
        .args(["volume", "list"]);
    let listed = run_with_limit(&mut cmd, common::CLIENT_LIMIT);
    assert!(listed.status.success(), "{}", listed.report());
    assert!(listed.stdout.contains("vm2"), "{}", listed.report());

    // Without either, the command cannot reach the server and says how to.
    let mut cmd = Command::new(common::fewerbytes_bin());
    cmd.env_remove("FEWERBYTES_CONTROL_SOCKET")
        .arg("--pool")
        .arg(&pool)
        .args(["volume", "list"]);
    let lost = run_with_limit(&mut cmd, common::CLIENT_LIMIT);
    assert!(!lost.status.success(), "{}", lost.report());
    assert!(
        lost.stderr.contains("--control-socket"),
        "the error names --control-socket:\n{}",
        lost.report()
    );
}

/// What the unit's sandbox takes away, approximated without systemd: a mount namespace
/// where everything but the test's directory (pool and sockets) is read-only, like
/// `ProtectSystem=strict` with the state and runtime directories writable, and no
/// capability at all with no_new_privs, like `CapabilityBoundingSet=` (empty) and
/// `NoNewPrivileges=yes`. The server must serve, take volume commands and stop clean.
#[test]
fn serve_needs_no_capability_and_writes_only_its_own_directory() {
    let dir = TempDir::new("sandbox");
    let pool = create_pool(dir.path(), &[("vm1", "16M")]);
    let unshare = common::require_tool("unshare");
    let setpriv = common::require_tool("setpriv");
    let script = format!(
        r#"set -e
mount --bind "$0" "$0"
mount -o remount,bind,ro /
parent=$(findmnt -n -o TARGET --target "$(dirname "$0")")
[ "$parent" = / ] || mount -o remount,bind,ro "$parent"
if touch "$(dirname "$0")/fb-sandbox-probe" 2>/dev/null; then
    echo "the sandbox leaves $(dirname "$0") writable" >&2; exit 97
fi
exec {setpriv} --bounding-set=-all --inh-caps=-all --no-new-privs -- "$@""#,
        setpriv = setpriv.display()
    );
    let dir_text = dir.path().to_str().expect("utf-8").to_string();
    let wrapper = [
        unshare.to_str().expect("utf-8"),
        "--mount",
        "sh",
        "-c",
        &script,
        &dir_text,
    ];
    let mut serve = Serve::spawn_under(&wrapper, dir.path(), &pool, free_port(), &[], &[], "serve");
    serve.wait_listening();
    let caps = std::fs::read_to_string(format!("/proc/{}/status", serve.pid())).expect("status");
    assert!(
        caps.lines().any(|l| l == "CapEff:\t0000000000000000"),
        "the server runs without capabilities:\n{caps}"
    );
    qemu_io(&serve.unix_uri("vm1"), &["write -P 0x66 0 4M".into()]);
    let cloned = serve.cli(&["volume", "clone", "vm1", "vm2"]);
    assert!(
        cloned.status.success(),
        "{}\n{}",
        cloned.report(),
        serve.logs()
    );
    serve.signal(libc::SIGTERM);
    let exit = serve.wait_exit(STOP_LIMIT, "SIGTERM");
    assert_eq!(exit.code(), Some(0), "{}", serve.logs());
    assert_pool_reopens_clean(&pool);
    let mut again = Serve::spawn(dir.path(), &pool, free_port(), &[], &[], "again");
    again.wait_listening();
    qemu_io(&again.unix_uri("vm2"), &["read -P 0x66 0 4M".into()]);
}

/// `KEY=value` lines of an EnvironmentFile, comments and blank lines left out.
fn environment_file(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The unit's `ExecStart=` as systemd expands it for instance `vms`: `%i` replaced,
/// `$VAR` (unbraced) split into words, with `/run/fewerbytes` moved to `run_dir` and the
/// binary to the one under test.
fn exec_start(unit_text: &str, run_dir: &Path, env: &[(String, String)]) -> Vec<String> {
    let line = unit_text
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("the unit has ExecStart=");
    let bin = common::fewerbytes_bin();
    let line = line
        .replace("%i", "vms")
        .replace("/run/fewerbytes", run_dir.to_str().expect("utf-8"))
        .replace("/usr/local/bin/fewerbytes", bin.to_str().expect("utf-8"));
    let mut words = Vec::new();
    for word in line.split_whitespace() {
        match word.strip_prefix('$') {
            Some(name) => {
                let value = env
                    .iter()
                    .rev()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default();
                words.extend(value.split_whitespace().map(str::to_string));
            }
            None => words.push(word.to_string()),
        }
    }
    words
}

/// The unit's command line and the example config, as systemd would combine them
/// (EXAMPLE.conf with its pool, address and extra options filled in): ready, serving,
/// reachable by the commands through the control socket, stopped clean.
#[test]
fn the_units_command_line_with_the_example_config_serves_the_pool() {
    let dir = TempDir::new("unitrun");
    let pool = create_pool(dir.path(), &[("vm1", "16M"), ("vm2", "16M")]);
    let run_dir = dir.join("run");
    std::fs::create_dir(&run_dir).expect("mkdir run");
    let unit_text =
        std::fs::read_to_string(repo_root().join("packaging/systemd/fewerbytes@.service"))
            .expect("read the unit");
    let example = std::fs::read_to_string(repo_root().join("packaging/systemd/EXAMPLE.conf"))
        .expect("read the example config");
    let port = free_port();
    // Environment= of the unit first, then the file, which overrides it.
    let mut env: Vec<(String, String)> = unit_text
        .lines()
        .filter_map(|l| l.strip_prefix("Environment="))
        .flat_map(|l| l.split_whitespace())
        .filter_map(|a| a.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for (key, value) in environment_file(&example) {
        let value = match key.as_str() {
            "FEWERBYTES_POOL" => pool.to_str().expect("utf-8").to_string(),
            "FEWERBYTES_LISTEN" => format!("127.0.0.1:{port}"),
            "FEWERBYTES_SERVE_ARGS" => "--default-volume vm2 --log-level debug".to_string(),
            _ => value,
        };
        env.push((key, value));
    }
    for key in [
        "FEWERBYTES_POOL",
        "FEWERBYTES_LISTEN",
        "FEWERBYTES_SERVE_ARGS",
    ] {
        assert!(env.iter().any(|(k, _)| k == key), "EXAMPLE.conf sets {key}");
    }
    let words = exec_start(&unit_text, &run_dir, &env);
    let manager = Manager::at_path(dir.path());
    let stdout = dir.join("unit.out");
    let stderr = dir.join("unit.err");
    let child = Command::new(&words[0])
        .args(&words[1..])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("NOTIFY_SOCKET", &manager.address)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout).expect("create"))
        .stderr(std::fs::File::create(&stderr).expect("create"))
        .spawn()
        .expect("start the unit's command");
    let mut serve = Serve {
        pool: pool.clone(),
        socket: run_dir.join("vms.sock"),
        control: run_dir.join("vms.ctl"),
        port,
        stdout,
        stderr,
        child: Some(child),
    };
    let ready = manager.receive(READY_LIMIT, &mut serve, "READY=1");
    assert!(ready.contains("READY=1"), "got {ready:?}");
    assert!(
        nbd_greets_on_unix(&serve.socket) && nbd_greets_on_tcp(port),
        "the unit's sockets: {} and 127.0.0.1:{port}\n{}",
        serve.socket.display(),
        serve.logs()
    );
    // The empty export name is the --default-volume from FEWERBYTES_SERVE_ARGS.
    qemu_io(
        &format!("nbd+unix:///?socket={}", serve.socket.display()),
        &["write -P 0x21 0 1M".into()],
    );
    qemu_io(&serve.tcp_uri("vm2"), &["read -P 0x21 0 1M".into()]);
    let listed = serve.cli(&["volume", "list"]);
    assert!(
        listed.status.success() && listed.stdout.contains("vm2"),
        "{}",
        listed.report()
    );
    assert!(
        lines_at(&serve.stderr_text(), "DEBUG") > 0,
        "--log-level debug from FEWERBYTES_SERVE_ARGS:\n{}",
        serve.logs()
    );
    serve.signal(libc::SIGTERM);
    manager.receive(STOP_LIMIT, &mut serve, "STOPPING=1");
    let exit = serve.wait_exit(STOP_LIMIT, "SIGTERM");
    assert_eq!(exit.code(), Some(0), "{}", serve.logs());
    assert!(
        !serve.socket.exists() && !serve.control.exists(),
        "the clean stop removed /run/fewerbytes/vms.sock and vms.ctl"
    );
}

/// The unit as shipped, checked by systemd's own parser.
#[test]
fn the_systemd_unit_passes_systemd_analyze_verify() {
    let analyze = common::require_tool("systemd-analyze");
    let unit_src = repo_root().join("packaging/systemd/fewerbytes@.service");
    let unit_text = std::fs::read_to_string(&unit_src).expect("read the unit");
    let dir = TempDir::new("unit");
    // verify checks that ExecStart's binary exists: point it at the one under test.
    let bin = common::fewerbytes_bin();
    let unit = dir.join("fewerbytes@.service");
    std::fs::write(
        &unit,
        unit_text.replace("/usr/local/bin/fewerbytes", bin.to_str().expect("utf-8")),
    )
    .expect("write the unit");
    // An instance of the template, as `systemctl start fewerbytes@vms` makes.
    let instance = dir.join("fewerbytes@vms.service");
    std::os::unix::fs::symlink(&unit, &instance).expect("symlink the instance");
    let mut cmd = Command::new(analyze);
    cmd.env("SYSTEMD_LOG_LEVEL", "notice")
        .arg("verify")
        .arg("--man=no")
        .arg(&instance);
    let ran = run_with_limit(&mut cmd, common::CLIENT_LIMIT);
    assert!(ran.status.success(), "{}", ran.report());
    let output = ran.all_output();
    let complaints: Vec<&str> = output
        .lines()
        .filter(|l| l.contains("fewerbytes@"))
        .collect();
    assert!(
        complaints.is_empty(),
        "systemd-analyze has something to say about the unit:\n{}",
        ran.report()
    );
    for required in [
        "Type=notify",
        "KillSignal=SIGTERM",
        "Restart=on-failure",
        "RuntimeDirectory=fewerbytes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "DevicePolicy=closed",
        "--socket /run/fewerbytes/%i.sock",
        "--control-socket /run/fewerbytes/%i.ctl",
        "EnvironmentFile=/etc/fewerbytes/%i.conf",
    ] {
        assert!(
            unit_text.lines().any(|l| l.contains(required)),
            "the unit lacks {required}"
        );
    }
}

#[test]
fn install_sh_puts_binary_unit_and_example_in_a_destdir_and_can_run_twice() {
    let dir = TempDir::new("install");
    let destdir = dir.join("root");
    let run_install = || {
        let mut cmd = Command::new("sh");
        cmd.arg(repo_root().join("scripts/install.sh"))
            .env("DESTDIR", &destdir)
            .env("FEWERBYTES_BIN", common::fewerbytes_bin());
        let ran = run_with_limit(&mut cmd, common::CLIENT_LIMIT);
        assert!(ran.status.success(), "{}", ran.report());
        ran
    };
    run_install();
    let bin = destdir.join("usr/local/bin/fewerbytes");
    let unit = destdir.join("etc/systemd/system/fewerbytes@.service");
    let example = destdir.join("etc/fewerbytes/EXAMPLE.conf");
    for path in [&bin, &unit, &example] {
        assert!(
            path.is_file(),
            "install.sh did not install {}",
            path.display()
        );
    }
    assert_eq!(std::fs::metadata(&bin).expect("stat").mode() & 0o777, 0o755);
    let version = run_with_limit(Command::new(&bin).arg("--version"), common::CLIENT_LIMIT);
    assert!(
        version.stdout.starts_with("fewerbytes "),
        "{}",
        version.report()
    );
    let unit_text = std::fs::read_to_string(&unit).expect("read unit");
    assert!(
        unit_text.contains("ExecStart=/usr/local/bin/fewerbytes serve"),
        "{unit_text}"
    );
    let example_text = std::fs::read_to_string(&example).expect("read example");
    assert!(example_text.contains("FEWERBYTES_POOL="), "{example_text}");

    // An admin's own config survives a second run, which changes nothing else.
    let own = destdir.join("etc/fewerbytes/vms.conf");
    std::fs::write(&own, "FEWERBYTES_POOL=/var/lib/fewerbytes/vms.pool\n").expect("write");
    let before = std::fs::read(&unit).expect("read");
    run_install();
    assert_eq!(std::fs::read(&unit).expect("read"), before);
    assert_eq!(
        std::fs::read_to_string(&own).expect("read"),
        "FEWERBYTES_POOL=/var/lib/fewerbytes/vms.pool\n"
    );
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repository root")
}
