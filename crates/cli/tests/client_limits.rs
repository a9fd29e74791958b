//! No local user locks others out of `serve`, and what a client sends cannot forge
//! the server's log or find the volumes its export list hides: another user's
//! connections against root's client, an export name holding a newline, a probe
//! for a limited volume. Each test is the regression test of one defect and says
//! which in its first comment.

mod common;

use common::nbdinfo::nbdinfo_json;
use common::*;
use fewerbytes_nbd::DEFAULT_MAX_CONNECTIONS_PER_SOURCE;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};

/// The unprivileged user the attacking connections run as.
const NOBODY_UID: u32 = 65534;
/// Connections the other user opens: more than the server's 512 slots.
const ATTACK_CONNECTIONS: usize = 520;

/// Opens `count` connections to `tcp:PORT` (on 127.0.0.1) or `unix:PATH` as uid and
/// gid `uid`, reads the greeting (or the close) on each, prints how many the server
/// kept, and holds them until its stdin closes.
const ATTACKER: &str = r#"
import os, socket, sys
target, count, uid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
assert os.getuid() == uid
kind, where = target.split(":", 1)
held = []
for _ in range(count):
    if kind == "tcp":
        held.append(socket.create_connection(("127.0.0.1", int(where))))
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(where)
        held.append(s)
kept = 0
for s in held:
    s.settimeout(60)
    try:
        if s.recv(18):
            kept += 1
    except OSError:
        pass
print(kept, flush=True)
sys.stdin.read()
"#;

/// Starts [`ATTACKER`] against `target` as [`NOBODY_UID`]: the process (holding its
/// connections) and how many of them the server kept.
fn attack(server: &Server, target: &str) -> (std::process::Child, usize) {
    let mut attacker = Command::new(default_python3())
        .args(["-c", ATTACKER, target])
        .arg(ATTACK_CONNECTIONS.to_string())
        .arg(NOBODY_UID.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the attacking process");
    let mut line = String::new();
    BufReader::new(attacker.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the attacker's count");
    let kept: usize = line.trim().parse().unwrap_or_else(|_| {
        panic!(
            "the attacker on {target} printed {line:?}\n--- server log ---\n{}",
            server.log_text()
        )
    });
    eprintln!("the server kept {kept} of {ATTACK_CONNECTIONS} connections on {target} from uid {NOBODY_UID}");
    (attacker, kept)
}

#[test]
fn connections_from_another_user_do_not_lock_root_out() {
    // Bug: 520 TCP connections to 127.0.0.1 from `nobody` took all 512 connection
    // slots, shared with the unix socket: root's clients were refused on both. Now
    // the same user's 520 more on the unix socket are refused too (one source).
    // SAFETY: getuid(2) has no preconditions.
    let uid = unsafe { libc::getuid() };
    assert_eq!(
        uid, 0,
        "this test opens connections as another user: run it as root"
    );
    let dir = TempDir::new("client-limits-users");
    let server = Server::start_new(dir.path(), &[("disk0", "16M")], &[]);
    let (mut on_tcp, kept_tcp) = attack(&server, &format!("tcp:{}", server.port));
    // The unix socket too, once the other user may connect to it.
    std::fs::set_permissions(&server.socket, std::fs::Permissions::from_mode(0o777))
        .expect("chmod the socket");
    let (mut on_unix, kept_unix) = attack(&server, &format!("unix:{}", server.socket.display()));
    assert_eq!(
        kept_tcp + kept_unix,
        DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
        "one user's connections over TCP and the unix socket count as one source"
    );

    // Root is still served, on the unix socket and on TCP.
    for uri in [server.unix_uri("disk0"), server.tcp_uri("disk0")] {
        let info = nbdinfo_json(&uri);
        assert_eq!(
            info["exports"][0]["export-size"],
            16 << 20,
            "{uri}: {info}\n--- server log ---\n{}",
            server.log_text()
        );
    }
    let log = server.log_text();
    assert!(
        log.contains("its source is at its connection limit"),
        "the refusals are logged:\n{log}"
    );
    for attacker in [&mut on_tcp, &mut on_unix] {
        drop(attacker.stdin.take());
        let _ = attacker.kill();
        let _ = attacker.wait();
    }
}

/// The fixed-newstyle greeting and client flags, then `NBD_OPT_GO` for `name`;
/// returns the first reply's type and its message.
fn go_in_clear(port: u16, name: &[u8]) -> (u32, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    s.write_all(&3u32.to_be_bytes()).expect("client flags");
    let mut data = Vec::new();
    data.extend_from_slice(&(name.len() as u32).to_be_bytes());
    data.extend_from_slice(name);
    data.extend_from_slice(&0u16.to_be_bytes());
    let mut option = Vec::new();
    option.extend_from_slice(b"IHAVEOPT");
    option.extend_from_slice(&7u32.to_be_bytes()); // NBD_OPT_GO
    option.extend_from_slice(&(data.len() as u32).to_be_bytes());
    option.extend_from_slice(&data);
    s.write_all(&option).expect("GO");
    let mut reply = [0u8; 20];
    s.read_exact(&mut reply).expect("GO reply");
    let kind = u32::from_be_bytes(reply[12..16].try_into().expect("4 bytes"));
    let len = u32::from_be_bytes(reply[16..20].try_into().expect("4 bytes"));
    let mut message = vec![0u8; len as usize];
    s.read_exact(&mut message).expect("GO reply data");
    (kind, String::from_utf8_lossy(&message).into_owned())
}

#[test]
fn an_export_name_holding_a_newline_cannot_forge_a_log_line() {
    // Bug: an export name holding a newline went raw into the server's log (at debug
    // level), where what followed it read as a line of its own.
    let dir = TempDir::new("client-limits-log");
    let server = Server::start_new(dir.path(), &[("disk0", "16M")], &[]);
    let (kind, _) = go_in_clear(server.port, b"nosuch\nFORGED NBD client attached");
    assert_eq!(kind, (1 << 31) | 6, "NBD_REP_ERR_UNKNOWN");
    let log = server.log_text();
    assert!(
        !log.lines().any(|l| l.starts_with("FORGED")),
        "a client's export name forged a log line:\n{log}"
    );
    assert!(
        log.contains(r"nosuch\nFORGED"),
        "the refused name is logged, escaped:\n{log}"
    );
}

#[test]
fn probing_a_limited_volume_answers_as_an_unknown_name_and_logs_the_refusal() {
    // Bug: a volume limited to TLS identities, which NBD_OPT_LIST hides from others,
    // answered NBD_REP_ERR_TLS_REQD to a client in clear where an unknown name
    // answers ERR_UNKNOWN, so probing found it; and the refusal was logged at debug
    // only, though `--log-level info` is said to show refusals.
    let dir = TempDir::new("client-limits-probe");
    let pool = create_pool(dir.path(), &[("open", "16M"), ("hers", "16M")]);
    fewerbytes_ok(&pool, &["volume", "allow", "hers", "alice"]);
    let server = Server::start(dir.path(), &pool, &[]);
    let hidden = go_in_clear(server.port, b"hers");
    let unknown = go_in_clear(server.port, b"hern");
    assert_eq!(hidden.0, (1 << 31) | 6, "NBD_REP_ERR_UNKNOWN: {}", hidden.1);
    assert_eq!(
        (hidden.0, hidden.1.replace("'hers'", "'?'")),
        (unknown.0, unknown.1.replace("'hern'", "'?'")),
        "a limited volume and an unknown name answer alike"
    );
    let log = server.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("INFO") && l.contains("refused by policy") && l.contains("hers")),
        "the refusal is logged at info:\n{log}"
    );
}
