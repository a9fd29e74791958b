//! `fewerbytes serve` as a service: readiness told to a service manager over a real
//! `NOTIFY_SOCKET` datagram socket (no earlier than every socket accepts), stops on
//! SIGTERM and SIGINT that flush and close (even with the socket files deleted or taken
//! over, or with 200 idle connections and a stalled write), a second signal that exits
//! at once, a restart after SIGKILL serving the same data, log levels and the
//! journal's line format, and the control socket at a path of its own. The unit file and the installer are `packaging.rs`'s.
//!
//! Each test runs the real binary on its own pool, sockets and port.

mod common;

use common::service::{
    assert_pool_reopens_clean, lines_at, nbd_greets_on_tcp, nbd_greets_on_unix, value_of, Manager,
    Serve, READY_LIMIT, STOP_LIMIT,
};
use common::{create_pool, free_port, qemu_io, run_with_limit, TempDir};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

/// `serve` on `pool` telling `manager` its state, as systemd runs it.
fn spawn_managed(dir: &Path, pool: &Path, port: u16, manager: &Manager, label: &str) -> Serve {
    Serve::spawn(
        dir,
        pool,
        port,
        &[("NOTIFY_SOCKET", &manager.address)],
        &[],
        label,
    )
}

/// A clean stop: exit 0, saying the pool closed cleanly.
fn assert_clean_exit(serve: &Serve, exit: ExitStatus) {
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
}

/// After a stop: the pool passes `check`, and a new serve on it (logs labelled
/// `label`) reads back what `reads` (qemu-io commands) expect.
fn reopen_and_read(dir: &Path, pool: &Path, label: &str, reads: &[&str]) {
    assert_pool_reopens_clean(pool);
    let mut again = Serve::spawn(dir, pool, free_port(), &[], &[], label);
    again.wait_listening();
    let reads: Vec<String> = reads.iter().map(|r| r.to_string()).collect();
    qemu_io(&again.unix_uri("vm1"), &reads);
}

#[test]
fn ready_comes_once_every_socket_accepts_and_sigterm_stops_cleanly_keeping_the_data() {
    let dir = TempDir::new("ready");
    let pool = create_pool(dir.path(), &[("vm1", "64M")]);
    let manager = Manager::at_path(dir.path());
    let port = free_port();
    let mut serve = spawn_managed(dir.path(), &pool, port, &manager, "first");

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
    assert_clean_exit(&serve, exit);
    assert!(
        !serve.socket.exists() && !serve.control.exists(),
        "a clean stop removes its socket files"
    );

    // ...is there after the pool reopens.
    reopen_and_read(
        dir.path(),
        &pool,
        "second",
        &["read -P 0x5a 1M 3M", "read -P 0xa5 8M 64k"],
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
    let mut serve = spawn_managed(dir.path(), &pool, port, &manager, "serve");
    manager.receive(READY_LIMIT, &mut serve, "READY=1");
    qemu_io(&serve.tcp_uri("vm1"), &["write -P 0x3c 0 2M".into()]);

    std::fs::remove_file(&serve.socket).expect("delete the NBD socket file");
    std::fs::remove_file(&serve.control).expect("delete the control socket file");
    serve.signal(signal);
    let stopping = manager.receive(STOP_LIMIT, &mut serve, "STOPPING=1");
    assert!(stopping.contains("STOPPING=1"), "got {stopping:?}");
    let exit = serve.wait_exit(STOP_LIMIT, &format!("{name} with the socket files deleted"));
    assert_clean_exit(&serve, exit);
    reopen_and_read(dir.path(), &pool, "again", &["read -P 0x3c 0 2M"]);
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

/// A session on `export` opened with NBD_OPT_EXPORT_NAME, as the oldest clients do.
fn open_session(socket: &Path, export: &str) -> UnixStream {
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
    stream
}

/// An NBD request header: `kind` (0 read, 1 write) of `len` bytes at offset 0.
fn request_header(kind: u16, len: u32) -> Vec<u8> {
    let mut request = Vec::with_capacity(28);
    request.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    request.extend_from_slice(&0u16.to_be_bytes());
    request.extend_from_slice(&kind.to_be_bytes());
    request.extend_from_slice(&7u64.to_be_bytes());
    request.extend_from_slice(&0u64.to_be_bytes());
    request.extend_from_slice(&len.to_be_bytes());
    request
}

/// A client that asks for 32 MiB and reads only the reply's header: its reply cannot
/// be written, so a clean stop waits for it (up to the server's grace period).
fn stall_a_reply(socket: &Path, export: &str) -> UnixStream {
    let mut stream = open_session(socket, export);
    stream
        .write_all(&request_header(0, 32 << 20))
        .expect("read request");
    let mut reply_header = [0u8; 16];
    stream.read_exact(&mut reply_header).expect("reply header");
    assert_eq!(
        &reply_header[..4],
        &0x6744_6698u32.to_be_bytes(),
        "simple reply"
    );
    stream
}

/// Idle connections the next test holds open (a socket on each end and a server
/// thread each; far below the server's 512 and any descriptor limit).
const IDLE_CONNECTIONS: usize = 200;

#[test]
fn idle_connections_and_a_stalled_write_neither_starve_a_client_nor_hold_a_stop() {
    // 200 idle connections (half still negotiating) and a client
    // that sent half a write's payload and stopped must neither keep a good client
    // waiting nor make SIGTERM wait out the server's grace period.
    let dir = TempDir::new("idle");
    let pool = create_pool(dir.path(), &[("vm1", "64M")]);
    let mut serve = Serve::spawn(dir.path(), &pool, free_port(), &[], &[], "serve");
    serve.wait_listening();
    let mut idle = Vec::new();
    for i in 0..IDLE_CONNECTIONS {
        if i % 2 == 0 {
            idle.push(open_session(&serve.socket, "vm1"));
        } else {
            let mut greeted = UnixStream::connect(&serve.socket).expect("connect");
            let mut greeting = [0u8; 18];
            greeted.read_exact(&mut greeting).expect("greeting");
            idle.push(greeted);
        }
    }
    let mut stalled = open_session(&serve.socket, "vm1");
    stalled
        .write_all(&request_header(1, 1 << 20))
        .expect("write request");
    stalled
        .write_all(&[0x99; 512 << 10])
        .expect("half the payload");

    qemu_io(
        &serve.unix_uri("vm1"),
        &["write -P 0x22 4M 1M".into(), "read -P 0x22 4M 1M".into()],
    );
    let ran = serve.cli(&["stats", "--json"]);
    assert!(
        ran.status.success(),
        "stats while held
{}",
        ran.report()
    );

    serve.signal(libc::SIGTERM);
    let exit = serve.wait_exit(fewerbytes_nbd::SHUTDOWN_GRACE, "SIGTERM");
    assert_clean_exit(&serve, exit);
    drop(idle);
    drop(stalled);
    reopen_and_read(
        dir.path(),
        &pool,
        "again",
        &["read -P 0x22 4M 1M", "read -P 0 0 1M"],
    );
}

#[test]
fn a_second_signal_during_a_slow_stop_exits_at_once() {
    let dir = TempDir::new("second");
    let pool = create_pool(dir.path(), &[("vm1", "64M")]);
    let manager = Manager::at_path(dir.path());
    let mut serve = spawn_managed(dir.path(), &pool, free_port(), &manager, "serve");
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
    reopen_and_read(dir.path(), &pool, "again", &["read -P 0x11 0 1M"]);
}

#[test]
fn a_restart_after_kill_9_is_ready_again_and_serves_the_same_data() {
    let dir = TempDir::new("kill9");
    let pool = create_pool(dir.path(), &[("vm1", "64M")]);
    let manager = Manager::at_path(dir.path());
    let port = free_port();
    let mut serve = spawn_managed(dir.path(), &pool, port, &manager, "first");
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
    let mut restarted = spawn_managed(dir.path(), &pool, port, &manager, "restarted");
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

/// `--control-socket` alone (as README and docs/service.md show it) reaches the served
/// pool from any directory: the server tells the command which pool it holds. A socket
/// nobody answers on is named in the error. On main the command looked for
/// ./fewerbytes.pool instead and failed with "there is no pool at ./fewerbytes.pool".
#[test]
fn the_control_socket_alone_reaches_the_served_pool() {
    let dir = TempDir::new("ctlalone");
    let elsewhere = TempDir::new("ctlalone-cwd");
    let pool = create_pool(dir.path(), &[("vm1", "16M")]);
    let mut serve = Serve::spawn(dir.path(), &pool, free_port(), &[], &[], "serve");
    serve.wait_listening();
    let only_socket = |socket: &Path, args: &[&str]| {
        let mut cmd = Command::new(common::fewerbytes_bin());
        cmd.current_dir(elsewhere.path())
            .env_remove("FEWERBYTES_POOL")
            .env_remove("FEWERBYTES_CONTROL_SOCKET")
            .arg("--control-socket")
            .arg(socket)
            .args(args);
        run_with_limit(&mut cmd, common::CLIENT_LIMIT)
    };

    let created = only_socket(
        &serve.control,
        &["volume", "create", "vm2", "--size", "16M"],
    );
    assert!(created.status.success(), "{}", created.report());
    let listed = only_socket(&serve.control, &["volume", "list"]);
    assert!(listed.status.success(), "{}", listed.report());
    assert!(
        listed.stdout.contains("vm1") && listed.stdout.contains("vm2"),
        "the served pool's volumes are listed:\n{}",
        listed.report()
    );
    let info = only_socket(&serve.control, &["pool", "info"]);
    assert!(info.status.success(), "{}", info.report());
    // The variable counts as naming the socket too.
    let mut cmd = Command::new(common::fewerbytes_bin());
    cmd.current_dir(elsewhere.path())
        .env_remove("FEWERBYTES_POOL")
        .env("FEWERBYTES_CONTROL_SOCKET", &serve.control)
        .args(["stats"]);
    let stats = run_with_limit(&mut cmd, common::CLIENT_LIMIT);
    assert!(stats.status.success(), "{}", stats.report());
    assert!(
        !elsewhere.join("fewerbytes.pool").exists(),
        "no pool was made in the working directory"
    );

    // A socket nobody answers on: the error names it.
    let silent = dir.join("nobody.ctl");
    let lost = only_socket(&silent, &["volume", "list"]);
    assert!(!lost.status.success(), "{}", lost.report());
    assert!(
        lost.stderr.contains(&format!(
            "no fewerbytes server answers on the control socket {}",
            silent.display()
        )),
        "the error names the socket:\n{}",
        lost.report()
    );
    assert!(
        !lost.stderr.contains("there is no pool"),
        "{}",
        lost.report()
    );
}
