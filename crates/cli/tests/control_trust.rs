//! The CLI talks only to a server run by root or the pool's owner: with the pool in a
//! sticky directory every user may write (`/tmp`), another user (`nobody`) binds the
//! pool's socket names while no server runs, and neither root's commands nor root's
//! `serve` trust what they find there.

mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The unprivileged user that plays the other user.
const NOBODY_UID: u32 = 65534;

/// As uid `argv[3]`, binds the unix socket `argv[1]`. Mode `stale`: closes it at once
/// (the file stays, as a killed server's does). Mode `serve`: answers as a fewerbytes
/// server would (a ping with done; a send with a stream of its own bytes; a receive
/// by reading the stream), appending every byte it is sent to the file `argv[2]`.
const FAKE_SERVER: &str = r#"
import os, socket, struct, sys
path, caught, uid, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
os.chmod(path, 0o777)
if mode == "stale":
    listener.close()
    print("ready", flush=True)
    sys.stdin.read()
    sys.exit(0)
listener.listen(16)
out = open(caught, "ab", buffering=0)
print("ready", flush=True)
def frame(kind, payload):
    return struct.pack("<BI", kind, len(payload)) + payload
streamed = b'{"ok":true,"value":{"kind":"streamed","data":"done"}}'
def answer(conn):
    reader = conn.makefile("rb")
    line = reader.readline()
    out.write(line)
    if not line:
        return
    if b'"op":"send-volume"' in line:
        conn.sendall(b'{"ok":true,"value":{"kind":"streaming"}}\n')
        conn.sendall(frame(1, b"BYTES OF THE OTHER USER") + frame(2, streamed))
    elif b'"op":"receive-volume"' in line:
        conn.sendall(b'{"ok":true,"value":{"kind":"streaming"}}\n')
        out.write(reader.read())
        conn.sendall(frame(2, streamed))
    else:
        conn.sendall(b'{"ok":true,"value":{"kind":"done"}}\n')
while True:
    conn, _ = listener.accept()
    try:
        answer(conn)
    except OSError:
        pass
    conn.close()
"#;

/// The other user's socket at `path`, in `mode` (see [`FAKE_SERVER`]), once bound.
fn fake_server(path: &Path, caught: &Path, mode: &str) -> Child {
    let mut child = Command::new(default_python3())
        .args(["-c", FAKE_SERVER])
        .arg(path)
        .arg(caught)
        .arg(NOBODY_UID.to_string())
        .arg(mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the other user's socket");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the fake server's start");
    assert_eq!(line.trim(), "ready", "the fake server did not start");
    child
}

fn stop(mut child: Child) {
    drop(child.stdin.take());
    let _ = child.kill();
    let _ = child.wait();
}

/// A pool of root's in a fresh directory that every user may write, sticky (as `/tmp`).
fn pool_in_sticky_dir(dir: &TempDir) -> PathBuf {
    // SAFETY: geteuid(2) reads the caller's id and cannot fail.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test plays another user: run it as root"
    );
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777))
        .expect("chmod 1777");
    create_pool(dir.path(), &[("vm", "16M")])
}

/// `fewerbytes --pool POOL ARGS`, stdin from `input`, stdout to `output`.
/// (through the shell: `run_with_limit` owns the command's own streams).
fn piped(pool: &Path, args: &[&str], input: &Path, output: &Path) -> Ran {
    let mut cmd = Command::new("sh");
    cmd.args(["-c", r#"exec "$@" < "$FB_IN" > "$FB_OUT""#, "sh"])
        .arg(fewerbytes_bin())
        .arg("--pool")
        .arg(pool)
        .args(args)
        .env("FB_IN", input)
        .env("FB_OUT", output);
    run_with_limit(&mut cmd, Duration::from_secs(60))
}

// Regression: with the pool in a sticky world-writable directory and no server
// running, another user bound `<pool>.ctl`; root's `volume receive` sent that user
// the stream, and root's `volume send` wrote that user's bytes, both exit 0. The
// CLI never checked who answered.
#[test]
fn commands_send_nothing_to_a_control_socket_another_user_made() {
    let dir = TempDir::new("ctl-trust");
    let pool = pool_in_sticky_dir(&dir);
    // A real stream of root's, from another pool.
    let other = TempDir::new("ctl-trust-src");
    let source = create_pool(other.path(), &[("src", "16M")]);
    let stream = dir.join("secret.stream");
    let sent = piped(
        &source,
        &["volume", "send", "src"],
        Path::new("/dev/null"),
        &stream,
    );
    assert!(sent.status.success(), "{}", sent.report());
    let stream_bytes = std::fs::metadata(&stream).expect("stream").len();
    assert!(stream_bytes > 0, "the stream is empty");

    let caught = dir.join("caught");
    let fake = fake_server(&dir.join("test.pool.ctl"), &caught, "serve");
    let received = piped(
        &pool,
        &["volume", "receive", "copy"],
        &stream,
        &dir.join("out"),
    );
    let out = dir.join("sent.stream");
    let sent = piped(
        &pool,
        &["volume", "send", "vm"],
        Path::new("/dev/null"),
        &out,
    );
    stop(fake);
    let caught_bytes = std::fs::read(&caught).unwrap_or_default();
    assert!(
        caught_bytes.is_empty(),
        "the other user's socket was sent {} bytes (the stream has {stream_bytes})",
        caught_bytes.len()
    );
    for (what, ran) in [("volume receive", &received), ("volume send", &sent)] {
        assert!(
            !ran.status.success(),
            "{what} went through another user's socket:\n{}",
            ran.report()
        );
        assert!(
            ran.all_output().contains(&format!("uid {NOBODY_UID}")),
            "{what} did not name the socket's uid:\n{}",
            ran.report()
        );
    }
    assert_eq!(
        std::fs::metadata(&out).expect("send's output").len(),
        0,
        "volume send wrote the other user's bytes"
    );
}

/// `serve` of `pool` (unix socket `socket` only), as far as it gets in 20 s.
fn serve(pool: &Path, socket: &Path) -> Ran {
    let mut cmd = Command::new(fewerbytes_bin());
    cmd.arg("--pool")
        .arg(pool)
        .args(["serve", "--no-tcp", "--socket"])
        .arg(socket);
    run_with_limit(&mut cmd, Duration::from_secs(20))
}

// Regression: `serve` removed a socket file another user had left at the pool's
// control socket or NBD socket, and started there: the names are shared in a sticky
// directory, so a file there that root did not make is refused, naming its owner.
#[test]
fn serve_neither_removes_nor_starts_beside_another_users_socket() {
    let dir = TempDir::new("ctl-stale");
    let pool = pool_in_sticky_dir(&dir);
    let caught = dir.join("caught");
    let nbd_socket = dir.join("nbd.sock");
    for planted in [dir.join("test.pool.ctl"), nbd_socket.clone()] {
        let fake = fake_server(&planted, &caught, "stale");
        let ran = serve(&pool, &nbd_socket);
        stop(fake);
        assert!(!ran.status.success(), "serve started:\n{}", ran.report());
        assert!(
            ran.all_output().contains(&format!("uid {NOBODY_UID}")),
            "serve did not name the owner of {}:\n{}",
            planted.display(),
            ran.report()
        );
        let owner = std::fs::symlink_metadata(&planted)
            .expect("the other user's socket is gone")
            .uid();
        assert_eq!(owner, NOBODY_UID, "serve replaced {}", planted.display());
        std::fs::remove_file(&planted).expect("remove the planted socket");
    }
}
