//! `fewerbytes serve` run the way a service manager runs it: a process nothing waits
//! for (the test decides what to wait for), and a fake service manager listening on the
//! datagram socket `NOTIFY_SOCKET` names. Used by `service.rs` and `packaging.rs`.

use super::{fewerbytes, fewerbytes_bin, greet_and_abort, run_with_limit, Ran, CLIENT_LIMIT};
use std::net::TcpStream;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to say it is ready (open, replay, listen).
pub const READY_LIMIT: Duration = Duration::from_secs(60);
/// How long a clean stop may take: far more than it needs, far less than forever.
pub const STOP_LIMIT: Duration = Duration::from_secs(60);

/// A `serve` process started the way a service manager starts it: nothing waits for
/// its sockets; the test decides what to wait for.
pub struct Serve {
    pub pool: PathBuf,
    pub socket: PathBuf,
    pub control: PathBuf,
    pub port: u16,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    pub child: Option<Child>,
}

impl Serve {
    /// `fewerbytes serve` on `pool`, with its unix socket and control socket in `dir`,
    /// `env` added to its environment and `extra` to its arguments.
    pub fn spawn(
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
    pub fn spawn_under(
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
                cmd.args(args).arg(fewerbytes_bin());
                cmd
            }
            None => Command::new(fewerbytes_bin()),
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

    pub fn pid(&self) -> libc::pid_t {
        let child = self.child.as_ref().expect("server running");
        libc::pid_t::try_from(child.id()).expect("pid fits pid_t")
    }

    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        let rc = unsafe { libc::kill(self.pid(), signal) };
        assert_eq!(rc, 0, "kill({}, {signal}) failed", self.pid());
    }

    /// Waits for the exit, at most `limit`; fails the test (after SIGKILL) past it.
    pub fn wait_exit(&mut self, limit: Duration, what: &str) -> ExitStatus {
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
    pub fn assert_running(&mut self) {
        let child = self.child.as_mut().expect("server running");
        if let Some(status) = child.try_wait().expect("poll server") {
            self.child = None;
            panic!("serve exited early with {status}\n{}", self.logs());
        }
    }

    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn stdout_text(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn logs(&self) -> String {
        format!(
            "--- serve stdout ---\n{}\n--- serve stderr ---\n{}",
            self.stdout_text(),
            self.stderr_text()
        )
    }

    /// Waits until the NBD unix socket, the TCP port and the control socket answer
    /// (for tests that do not watch readiness themselves).
    pub fn wait_listening(&mut self) {
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

    pub fn unix_uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket.display())
    }

    pub fn tcp_uri(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{export}", self.port)
    }

    /// The CLI, reaching this server through `--control-socket`.
    pub fn cli(&self, args: &[&str]) -> Ran {
        let mut cmd = Command::new(fewerbytes_bin());
        cmd.env_remove("FEWERBYTES_CONTROL_SOCKET")
            .arg("--pool")
            .arg(&self.pool)
            .arg("--control-socket")
            .arg(&self.control)
            .args(args);
        run_with_limit(&mut cmd, CLIENT_LIMIT)
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

pub fn nbd_greets_on_unix(socket: &Path) -> bool {
    UnixStream::connect(socket).is_ok_and(|s| greet_and_abort(s).is_ok())
}

pub fn nbd_greets_on_tcp(port: u16) -> bool {
    TcpStream::connect(("127.0.0.1", port)).is_ok_and(|s| greet_and_abort(s).is_ok())
}

/// A fake service manager: the datagram socket `NOTIFY_SOCKET` names.
pub struct Manager {
    pub socket: UnixDatagram,
    /// What to put in `NOTIFY_SOCKET`.
    pub address: String,
}

impl Manager {
    /// Listening on a path in `dir`.
    pub fn at_path(dir: &Path) -> Manager {
        let path = dir.join("notify");
        let socket = UnixDatagram::bind(&path).expect("bind the notify socket");
        Manager {
            socket,
            address: path.to_str().expect("utf-8 path").to_string(),
        }
    }

    /// Listening on an abstract name (`@name`, as systemd often passes it).
    pub fn abstract_named(label: &str) -> Manager {
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
    pub fn receive(&self, limit: Duration, serve: &mut Serve, waiting_for: &str) -> String {
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
pub fn assignments(message: &str) -> Vec<(String, String)> {
    message
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub fn value_of(message: &str, key: &str) -> Option<String> {
    assignments(message)
        .into_iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
}

/// `fewerbytes check` on a pool nobody serves: it reopens and its counts audit clean.
pub fn assert_pool_reopens_clean(pool: &Path) {
    let ran = fewerbytes(pool, &["check"]);
    assert!(
        ran.status.success(),
        "the pool did not reopen clean after the stop:\n{}",
        ran.report()
    );
}

/// Lines of a log at `level` (the word `DEBUG`, `INFO`, ...).
pub fn lines_at(stderr: &str, level: &str) -> usize {
    stderr
        .lines()
        .filter(|line| line.split_whitespace().any(|word| word == level))
        .count()
}
