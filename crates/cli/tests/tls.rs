//! NBD over TLS with real clients: nbdinfo and nbdcopy (`nbds://…?tls-certificates=`
//! and `tls-psk-file=`), qemu-img and qemu-io (`--object tls-creds-x509` and
//! `tls-creds-psk`), fio's nbd engine (credentials from libnbd's default directory);
//! and the refusals: a client in clear where TLS is required, a wrong PSK key, a
//! certificate from another CA, an identity a volume does not allow, and clients
//! that stall or send garbage in the handshake while others are served.
//!
//! Credentials are made at test time with the `openssl` tool (`common::tls`).

mod common;

use common::nbdinfo::*;
use common::tls::*;
use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A client's view of a refusal: the command failed, and said something.
fn refused(ran: &Ran) -> String {
    assert!(
        !ran.status.success(),
        "expected a refusal:\n{}",
        ran.report()
    );
    ran.all_output()
}

fn nbdinfo(args: &[&str]) -> Ran {
    run_with_limit(tool("nbdinfo").args(args), Duration::from_secs(60))
}

/// `random` bytes written through `uri` with nbdcopy come back the same through it.
fn nbdcopy_round_trip(dir: &Path, uri: &str, bytes: usize, seed: u64) {
    let mut data = vec![0u8; bytes];
    common::data::Rng::new(seed).fill(&mut data);
    let input = dir.join(format!("in-{seed}.raw"));
    let output = dir.join(format!("out-{seed}.raw"));
    std::fs::write(&input, &data).expect("input image");
    run_ok(tool("nbdcopy").arg(&input).arg(uri));
    run_ok(tool("nbdcopy").arg(uri).arg(&output));
    let back = std::fs::read(&output).expect("output image");
    assert!(
        back.get(..bytes) == Some(&data[..]),
        "nbdcopy over TLS read back other bytes than it wrote"
    );
}

/// qemu-io with a TLS credentials object, on a volume over TCP; fails the test if a
/// command fails or a pattern does not match.
fn qemu_io_tls(server: &Server, object: &str, export: &str, commands: &[&str]) -> Ran {
    let mut cmd = tool("qemu-io");
    cmd.args(["--object", object, "--image-opts"]);
    for c in commands {
        cmd.arg("-c").arg(c);
    }
    cmd.arg(format!(
        "driver=raw,file.driver=nbd,file.server.type=inet,file.server.host=127.0.0.1,\
         file.server.port={},file.export={export},file.tls-creds=tls0",
        server.port
    ));
    let ran = run_ok(&mut cmd);
    let out = ran.all_output();
    assert!(
        !out.contains("failed") && !out.contains("verification"),
        "qemu-io over TLS:\n{}",
        ran.report()
    );
    ran
}

/// A server requiring x509 with client certificates, and the credentials around it.
struct X509Setup {
    server: Server,
    /// alice's client directory (CA A), for libnbd and qemu.
    alice: PathBuf,
    /// A client directory whose certificate (CN alice) another CA signed.
    impostor: PathBuf,
}

fn x509_setup(dir: &TempDir, extra: &[&str]) -> X509Setup {
    let ca = Ca::new(&dir.join("ca"), "fewerbytes test CA");
    let server_dir = ca.issue(&dir.join("server"), "localhost", "server");
    let alice = ca.issue(&dir.join("alice"), "alice", "client");
    let other_ca = Ca::new(&dir.join("other-ca"), "another CA");
    let impostor = other_ca.issue(&dir.join("impostor"), "alice", "client");
    let pool = create_pool(dir.path(), &[("open", "16M"), ("mine", "16M")]);
    // Created limited, before the server starts: the allow file beside the pool.
    fewerbytes_ok(
        &pool,
        &[
            "volume", "create", "hers", "--size", "16M", "--allow", "bob",
        ],
    );
    fewerbytes_ok(&pool, &["volume", "allow", "mine", "alice,carol"]);
    let certs = server_dir.to_str().expect("utf-8 path").to_string();
    let mut args = vec!["--tls-certificates", &certs, "--tls-verify-peer"];
    args.extend_from_slice(extra);
    let server = Server::start(dir.path(), &pool, &args);
    X509Setup {
        server,
        alice,
        impostor,
    }
}

fn nbds_uri(server: &Server, export: &str, query: &str) -> String {
    format!("nbds://127.0.0.1:{}/{export}?{query}", server.port)
}

#[test]
fn x509_clients_read_and_write_and_see_only_what_they_may_open() {
    let dir = TempDir::new("tls-x509");
    let X509Setup {
        server,
        alice,
        impostor,
    } = x509_setup(&dir, &["--tls", "require"]);
    let creds = format!("tls-certificates={}", alice.display());

    // The list shows alice what she may open: not bob's volume.
    let listed = listed_exports(&nbds_uri(&server, "", &creds));
    let names: Vec<&str> = listed.keys().map(String::as_str).collect();
    assert_eq!(names, ["mine", "open"], "exports listed to alice");
    let info = nbdinfo_json(&nbds_uri(&server, "mine", &creds));
    assert_eq!(info["TLS"], true, "{info}");

    nbdcopy_round_trip(dir.path(), &nbds_uri(&server, "mine", &creds), 4 << 20, 1);

    // qemu over TCP with its x509 object, and qemu-img reading what qemu-io wrote.
    let object = format!(
        "tls-creds-x509,id=tls0,endpoint=client,dir={}",
        alice.display()
    );
    qemu_io_tls(&server, &object, "open", &["write -P 0x5a 1M 256k"]);
    qemu_io_tls(&server, &object, "open", &["read -P 0x5a 1M 256k"]);
    let image = format!(
        "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={},export=open,\
         tls-creds=tls0",
        server.port
    );
    let qemu_info =
        run_ok(tool("qemu-img").args(["info", "--object", &object, "--image-opts", &image]));
    assert!(
        qemu_info.stdout.contains("16 MiB"),
        "{}",
        qemu_info.report()
    );

    // Refusals. bob's volume, to alice: the NBD option error, and nothing opened.
    let out = refused(&nbdinfo(&[&nbds_uri(&server, "hers", &creds)]));
    assert!(out.contains("hers"), "{out}");
    // A certificate (CN alice) from another CA: the handshake fails.
    let other = format!("tls-certificates={}", impostor.display());
    refused(&nbdinfo(&[&nbds_uri(&server, "open", &other)]));
    // A client in clear: told that TLS is required.
    let out = refused(&nbdinfo(&[&server.tcp_uri("open")]));
    assert!(out.contains("TLS"), "{out}");
    // qemu-img in clear says so too.
    let out = refused(&run_with_limit(
        tool("qemu-img").args(["info", &server.tcp_uri("open")]),
        Duration::from_secs(60),
    ));
    assert!(out.contains("TLS"), "{out}");

    // A limit changed while serving holds for the next client.
    server.cli_ok(&["volume", "allow", "hers", "alice"]);
    nbdinfo_json(&nbds_uri(&server, "hers", &creds));
    server.cli_ok(&["volume", "allow", "mine", "--anyone"]);
    server.cli_ok(&["volume", "rename", "hers", "renamed"]);
    let listed = listed_exports(&nbds_uri(&server, "", &creds));
    assert!(listed.contains_key("renamed"), "{listed:?}");
    // The rename kept the limit: bob's old volume is alice's only by the change above.
    let allowed = server.cli_ok(&["volume", "allow", "renamed"]);
    assert!(allowed.stdout.contains("alice"), "{}", allowed.report());
    assert!(
        server.log_text().contains("TLS as 'alice'"),
        "the log names the client's TLS identity:\n{}",
        server.log_text()
    );
}

#[test]
fn psk_clients_read_and_write_and_wrong_keys_are_refused() {
    let dir = TempDir::new("tls-psk");
    let keys_dir = dir.join("keys");
    std::fs::create_dir_all(&keys_dir).expect("keys dir");
    // qemu's tls-creds-psk reads DIR/keys.psk.
    let keys = psk_file(&keys_dir.join("keys.psk"), &["alice", "bob"]);
    let wrong = psk_file(&dir.join("wrong.psk"), &["alice"]);
    let pool = create_pool(dir.path(), &[("shared", "16M")]);
    fewerbytes_ok(
        &pool,
        &[
            "volume", "create", "alices", "--size", "16M", "--allow", "alice",
        ],
    );
    let keys_arg = keys.to_str().expect("utf-8 path").to_string();
    let server = Server::start(
        dir.path(),
        &pool,
        &["--tls", "require", "--tls-psk", &keys_arg],
    );
    let uri = |who: &str, export: &str, file: &Path| {
        format!(
            "nbds://{who}@127.0.0.1:{}/{export}?tls-psk-file={}",
            server.port,
            file.display()
        )
    };

    let listed = listed_exports(&uri("alice", "", &keys));
    assert_eq!(listed.keys().collect::<Vec<_>>(), ["alices", "shared"]);
    let listed = listed_exports(&uri("bob", "", &keys));
    assert_eq!(listed.keys().collect::<Vec<_>>(), ["shared"], "bob's list");
    nbdcopy_round_trip(dir.path(), &uri("alice", "alices", &keys), 2 << 20, 2);

    let object = format!(
        "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
        keys_dir.display()
    );
    qemu_io_tls(
        &server,
        &object,
        "shared",
        &["write -P 0x33 0 64k", "read -P 0x33 0 64k"],
    );

    refused(&nbdinfo(&[&uri("alice", "alices", &wrong)]));
    let out = refused(&nbdinfo(&[&uri("bob", "alices", &keys)]));
    assert!(out.contains("alices"), "{out}");
    let out = refused(&nbdinfo(&[&server.tcp_uri("shared")]));
    assert!(out.contains("TLS"), "{out}");
    // The unix socket requires TLS too when asked with --tls require.
    refused(&nbdinfo(&[&server.unix_uri("shared")]));
}

#[test]
fn tls_on_serves_clients_in_clear_except_limited_volumes() {
    let dir = TempDir::new("tls-on");
    let X509Setup { server, alice, .. } = x509_setup(&dir, &["--tls", "on"]);
    // In clear: the open volume, and a list without the limited ones.
    let info = nbdinfo_json(&server.tcp_uri("open"));
    assert_eq!(info["TLS"], false, "{info}");
    let listed = listed_exports(&server.tcp_uri(""));
    assert_eq!(listed.keys().collect::<Vec<_>>(), ["open"]);
    let out = refused(&nbdinfo(&[&server.tcp_uri("mine")]));
    assert!(out.contains("TLS"), "{out}");
    // With TLS, alice opens hers.
    let creds = format!("tls-certificates={}", alice.display());
    nbdinfo_json(&nbds_uri(&server, "mine", &creds));
}

/// The fixed-newstyle greeting, client flags, and NBD_OPT_STARTTLS; returns the reply
/// type the server sent.
fn start_tls_in_clear(stream: &mut TcpStream) -> u32 {
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).expect("greeting");
    stream.write_all(&3u32.to_be_bytes()).expect("client flags");
    let mut option = Vec::new();
    option.extend_from_slice(b"IHAVEOPT");
    option.extend_from_slice(&5u32.to_be_bytes()); // NBD_OPT_STARTTLS
    option.extend_from_slice(&0u32.to_be_bytes());
    stream.write_all(&option).expect("STARTTLS");
    let mut reply = [0u8; 20];
    stream.read_exact(&mut reply).expect("STARTTLS reply");
    u32::from_be_bytes(reply[12..16].try_into().expect("4 bytes"))
}

#[test]
fn clients_that_stall_or_send_garbage_in_the_handshake_do_not_stop_others() {
    let dir = TempDir::new("tls-stall");
    let X509Setup { server, alice, .. } = x509_setup(&dir, &["--tls", "require"]);
    let creds = format!("tls-certificates={}", alice.display());

    // An option in clear where TLS is required: NBD_REP_ERR_TLS_REQD (2^31 + 5).
    let mut clear = TcpStream::connect(("127.0.0.1", server.port)).expect("connect");
    let mut greeting = [0u8; 18];
    clear.read_exact(&mut greeting).expect("greeting");
    clear.write_all(&3u32.to_be_bytes()).expect("client flags");
    let mut option = Vec::new();
    option.extend_from_slice(b"IHAVEOPT");
    option.extend_from_slice(&3u32.to_be_bytes()); // NBD_OPT_LIST
    option.extend_from_slice(&0u32.to_be_bytes());
    clear.write_all(&option).expect("LIST");
    let mut reply = [0u8; 20];
    clear.read_exact(&mut reply).expect("LIST reply");
    let kind = u32::from_be_bytes(reply[12..16].try_into().expect("4 bytes"));
    assert_eq!(kind, (1 << 31) | 5, "NBD_OPT_LIST in clear");

    // Ten clients start TLS and then say nothing.
    let stalled: Vec<TcpStream> = (0..10)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", server.port)).expect("connect");
            assert_eq!(start_tls_in_clear(&mut s), 1, "NBD_REP_ACK to STARTTLS");
            s
        })
        .collect();
    // One sends garbage where its ClientHello should be: the server hangs up on it.
    let mut garbage = TcpStream::connect(("127.0.0.1", server.port)).expect("connect");
    assert_eq!(start_tls_in_clear(&mut garbage), 1);
    garbage.write_all(&[0x42u8; 4096]).expect("garbage");
    garbage
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let mut rest = Vec::new();
    // The server may first send a TLS alert; then it closes the connection.
    let ended = garbage.read_to_end(&mut rest);
    assert!(
        ended.is_ok()
            || ended
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "the server did not close a connection that sent garbage: {ended:?}"
    );
    // Meanwhile others are served, in full.
    nbdcopy_round_trip(dir.path(), &nbds_uri(&server, "mine", &creds), 1 << 20, 3);
    drop(stalled);
    nbdinfo_json(&nbds_uri(&server, "open", &creds));
}

#[test]
fn fio_writes_and_verifies_over_tls_with_libnbds_default_credentials() {
    // fio's nbd engine passes only a URI, and libnbd refuses the URI's
    // tls-certificates= or tls-psk-file= there (local file access is off by
    // default): fio gets x509 credentials from libnbd's default directory,
    // $HOME/.pki/libnbd for a user other than root (/etc/pki/libnbd for root, which a
    // test must not write). So fio runs as nobody, with HOME in the test directory.
    let dir = TempDir::new("tls-fio");
    let X509Setup { server, alice, .. } = x509_setup(&dir, &[]);
    let home = dir.join("home");
    let pki = home.join(".pki/libnbd");
    std::fs::create_dir_all(&pki).expect("pki dir");
    for name in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
        std::fs::copy(alice.join(name), pki.join(name)).expect("copy credentials");
    }
    let work = dir.join("fio");
    std::fs::create_dir_all(&work).expect("fio dir");
    for path in [dir.path(), &home, &home.join(".pki"), &pki, &work] {
        set_mode(path, 0o777);
    }
    for name in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
        set_mode(&pki.join(name), 0o644);
    }
    // Without --tls, credentials make TCP require TLS.
    let uri = format!("nbds://127.0.0.1:{}/mine", server.port);
    let mut cmd = if unsafe { libc::geteuid() } == 0 {
        let mut cmd = tool("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(require_tool("fio"));
        cmd
    } else {
        tool("fio")
    };
    cmd.current_dir(&work).env("HOME", &home).args([
        "--name=tls",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        "--size=4M",
        "--verify=crc32c",
        "--verify_fatal=1",
    ]);
    let ran = run_ok(&mut cmd);
    assert!(ran.stdout.contains("err= 0"), "{}", ran.report());
    assert!(
        server.log_text().contains("TLS as 'alice'"),
        "{}",
        server.log_text()
    );
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

#[test]
fn a_stop_closes_tls_clients_and_keeps_what_they_flushed() {
    let dir = TempDir::new("tls-stop");
    let X509Setup {
        mut server, alice, ..
    } = x509_setup(&dir, &["--tls", "require"]);
    let uri = nbds_uri(
        &server,
        "open",
        &format!("tls-certificates={}", alice.display()),
    );
    // A libnbd client that writes, flushes, and then holds its connection open.
    let script = r#"
import sys, time, nbd
h = nbd.NBD()
h.set_uri_allow_local_file(True)
h.connect_uri(sys.argv[1])
h.pwrite(b"\x7e" * 65536, 0)
h.flush()
print("flushed", flush=True)
time.sleep(120)
"#;
    let mut client = std::process::Command::new(common::libnbd::system_python())
        .args(["-c", script, &uri])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the libnbd client");
    let stdout = client.stdout.take().expect("client stdout");
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)
        .expect("read the client");
    assert_eq!(line.trim(), "flushed", "{}", server.log_text());
    let status = server.stop();
    let _ = client.kill();
    let _ = client.wait();
    assert!(
        status.success(),
        "serve exited with {status}:\n{}",
        server.log_text()
    );
    assert!(
        server.log_text().contains("NBD client detached"),
        "{}",
        server.log_text()
    );
    server.spawn();
    let object = format!(
        "tls-creds-x509,id=tls0,endpoint=client,dir={}",
        alice.display()
    );
    qemu_io_tls(&server, &object, "open", &["read -P 0x7e 0 64k"]);
}

/// Whether a plain client (no TLS, so no identity) may open `export`: nbdinfo's answer.
fn plain_client_opens(uri: &str) -> bool {
    nbdinfo(&[uri]).status.success()
}

// Regression: the allow list was found by path alone, so a pool served through a hard
// link (or a copy, or /dev/loopN) without --allow-file had no list, and a volume
// limited to one TLS identity opened for any plain client, with nothing logged.
#[test]
fn a_limited_volume_stays_closed_when_the_pool_is_served_by_another_name() {
    let dir = TempDir::new("allow-link");
    let pool = create_pool(dir.path(), &[("open", "16M")]);
    fewerbytes_ok(
        &pool,
        &[
            "volume", "create", "hers", "--size", "16M", "--allow", "bob",
        ],
    );
    // A clone holds the same bytes: the pool keeps it limited too.
    fewerbytes_ok(&pool, &["volume", "clone", "hers", "copy"]);
    let link = dir.join("link.pool");
    std::fs::hard_link(&pool, &link).expect("hard link the pool");
    let server = Server::start(dir.path(), &link, &[]);
    assert!(plain_client_opens(&server.unix_uri("open")));
    for limited in ["hers", "copy"] {
        assert!(
            !plain_client_opens(&server.unix_uri(limited)),
            "a plain client opened '{limited}', limited to bob:\n{}",
            server.log_text()
        );
    }
    let log = server.log_text();
    assert!(
        log.contains("hers") && log.contains("link.pool.allow.json"),
        "serve did not say at start that the limited volume stays closed:\n{log}"
    );
}

// Regression: the same, for a pool served through /dev/loopN without --allow-file.
#[test]
fn a_limited_volume_stays_closed_when_the_pool_is_served_through_a_loop_device() {
    let dir = TempDir::new("allow-loop");
    let pool = create_pool(dir.path(), &[("open", "16M")]);
    fewerbytes_ok(
        &pool,
        &[
            "volume", "create", "hers", "--size", "16M", "--allow", "bob",
        ],
    );
    let Some(device) = common::loop_device::LoopDevice::attach_or_skip(&pool) else {
        return;
    };
    let mut server = Server::start(dir.path(), &device.path, &[]);
    assert!(plain_client_opens(&server.unix_uri("open")));
    let opened = plain_client_opens(&server.unix_uri("hers"));
    let log = server.log_text();
    server.stop();
    assert!(!opened, "a plain client opened a limited volume:\n{log}");
    assert!(
        log.contains("hers") && log.contains(".allow.json"),
        "serve did not say the limited volume stays closed:\n{log}"
    );
}

// Regression: deleting the allow file while serving opened every limited volume to
// any client (a missing file read as an empty list), and nothing was logged.
#[test]
fn a_limited_volume_stays_closed_when_its_allow_file_is_deleted_while_serving() {
    let dir = TempDir::new("allow-deleted");
    let pool = create_pool(dir.path(), &[("open", "16M")]);
    fewerbytes_ok(
        &pool,
        &[
            "volume", "create", "hers", "--size", "16M", "--allow", "bob",
        ],
    );
    let server = Server::start(dir.path(), &pool, &[]);
    assert!(!plain_client_opens(&server.unix_uri("hers")));
    let allow_file = dir.join("test.pool.allow.json");
    std::fs::remove_file(&allow_file).expect("delete the allow file");
    assert!(
        !plain_client_opens(&server.unix_uri("hers")),
        "a plain client opened a limited volume once its allow file was gone:\n{}",
        server.log_text()
    );
    assert!(plain_client_opens(&server.unix_uri("open")));
    let log = server.log_text();
    assert!(
        log.contains("allow.json") && log.contains("hers"),
        "the missing allow file was not logged:\n{log}"
    );
    // `volume allow --anyone` is how a person opens it again, through the server.
    server.cli_ok(&["volume", "allow", "hers", "--anyone"]);
    assert!(plain_client_opens(&server.unix_uri("hers")));
}

// Regression: the allow file was written through the predictable
// `<pool>.allow.json.new`: a symbolic link placed there made `volume allow` overwrite
// the file it pointed to (and a file another user made there stayed theirs).
#[test]
fn volume_allow_writes_through_no_file_another_user_can_place() {
    let dir = TempDir::new("allow-staging");
    let pool = create_pool(dir.path(), &[("vm", "16M")]);
    let victim = dir.join("victim");
    std::fs::write(&victim, b"root's file\n").expect("victim");
    std::os::unix::fs::symlink(&victim, dir.join("test.pool.allow.json.new")).expect("symlink");
    fewerbytes_ok(&pool, &["volume", "allow", "vm", "alice"]);
    assert_eq!(
        std::fs::read(&victim).expect("victim"),
        b"root's file\n",
        "volume allow wrote through the symbolic link"
    );
    let allow_file = dir.join("test.pool.allow.json");
    let meta = std::fs::symlink_metadata(&allow_file).expect("allow file");
    assert!(
        meta.file_type().is_file(),
        "the allow file is not a plain file"
    );
    let text = std::fs::read_to_string(&allow_file).expect("allow file");
    assert!(text.contains("alice"), "{text}");
    let mode = std::os::unix::fs::PermissionsExt::mode(&meta.permissions());
    assert_eq!(mode & 0o777, 0o600, "allow file mode {:o}", mode & 0o777);
    // An allow file another user owns (made before ours, in a directory all may
    // write) decides nothing: it is refused, saying whose it is. Giving a file away
    // takes root.
    // SAFETY: geteuid(2) reads the caller's id and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped the foreign owner's allow file: not root");
        return;
    }
    std::os::unix::fs::chown(&allow_file, Some(65534), None).expect("chown");
    let refused = fewerbytes(&pool, &["volume", "allow", "vm", "bob"]);
    assert!(!refused.status.success(), "{}", refused.report());
    assert!(
        refused.all_output().contains("65534"),
        "{}",
        refused.report()
    );
}

/// Waits until the server's log, past its first `from` bytes, has a line containing
/// every one of `words`; returns that line.
fn logged_line(server: &Server, from: usize, words: &[&str]) -> String {
    let started = std::time::Instant::now();
    loop {
        let log = server.log_text();
        if let Some(line) = log
            .get(from..)
            .unwrap_or_default()
            .lines()
            .find(|l| words.iter().all(|w| l.contains(w)))
        {
            return line.to_string();
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no log line with {words:?} after the refusal:\n{}",
            log.get(from..).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

// What an admin sees at the default level (`serve` logs at info): a wrong PSK key, an
// identity a volume does not allow and a client in clear where TLS is required each
// leave a line saying so, and who it was where the server knows.
#[test]
fn refusals_leave_a_line_at_the_default_log_level() {
    let dir = TempDir::new("tls-refusal-log");
    let keys = psk_file(&dir.join("keys.psk"), &["alice", "bob"]);
    let wrong = psk_file(&dir.join("wrong.psk"), &["alice"]);
    let pool = create_pool(dir.path(), &[("shared", "16M")]);
    fewerbytes_ok(
        &pool,
        &[
            "volume", "create", "alices", "--size", "16M", "--allow", "alice",
        ],
    );
    let keys_arg = keys.to_str().expect("utf-8 path").to_string();
    // --log-level wins over the harness's FEWERBYTES_LOG (which adds debug).
    let server = Server::start(
        dir.path(),
        &pool,
        &[
            "--log-level",
            "info",
            "--tls",
            "require",
            "--tls-psk",
            &keys_arg,
        ],
    );
    let uri = |who: &str, export: &str, file: &Path| {
        format!(
            "nbds://{who}@127.0.0.1:{}/{export}?tls-psk-file={}",
            server.port,
            file.display()
        )
    };

    let from = server.log_text().len();
    refused(&nbdinfo(&[&uri("alice", "shared", &wrong)]));
    let line = logged_line(&server, from, &["refused", "TLS"]);
    assert!(line.contains("127.0.0.1"), "the peer is named: {line}");

    let from = server.log_text().len();
    refused(&nbdinfo(&[&uri("bob", "alices", &keys)]));
    let line = logged_line(&server, from, &["refused"]);
    assert!(
        line.contains("bob"),
        "the refused identity is named: {line}"
    );

    let from = server.log_text().len();
    refused(&nbdinfo(&[&server.tcp_uri("shared")]));
    let line = logged_line(&server, from, &["refused", "TLS"]);
    assert!(line.contains("127.0.0.1"), "the peer is named: {line}");
}
