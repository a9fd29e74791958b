//! The allow list is bound to its pool: the file records the pool's id, and a list
//! of another pool (copied over, or left by a pool made anew at the same path) or of
//! no pool (written before lists named their pool) opens no limited volume, with
//! nbdinfo over TLS-PSK as the client whose identity the list names.

mod common;

use common::tls::*;
use common::*;
use std::path::Path;
use std::time::Duration;

/// Whether the TLS-PSK identity `who` opens `export` of `server` (nbdinfo's answer).
fn opens(server: &Server, who: &str, export: &str, keys: &Path) -> bool {
    let uri = format!(
        "nbds://{who}@127.0.0.1:{}/{export}?tls-psk-file={}",
        server.port,
        keys.display()
    );
    run_with_limit(tool("nbdinfo").arg(uri), Duration::from_secs(60))
        .status
        .success()
}

/// The pool's id, as `pool info --json` gives it.
fn pool_id(pool: &Path) -> String {
    let info: serde_json::Value =
        serde_json::from_str(&fewerbytes_ok(pool, &["pool", "info", "--json"]).stdout)
            .expect("pool info JSON");
    let id = info["id"].as_str().expect("pool id").to_string();
    assert_eq!(id.len(), 16, "pool id {id}");
    id
}

/// A pool in `dir` with volume `open`, and volume `vm` limited to alice.
fn pool_with_vm_for_alice(dir: &Path) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).expect("pool dir");
    let pool = create_pool(dir, &[("open", "16M")]);
    fewerbytes_ok(
        &pool,
        &[
            "volume", "create", "vm", "--size", "16M", "--allow", "alice",
        ],
    );
    pool
}

// Regression: the allow file was found by path alone, so another pool's list copied
// beside this pool (or the list of a pool made anew at the same path) opened this
// pool's volumes to the identities it named.
#[test]
fn a_list_copied_from_another_pool_opens_nothing_and_the_pools_own_list_does() {
    let dir = TempDir::new("allow-pool-id");
    let keys = psk_file(&dir.join("keys.psk"), &["alice"]);
    let keys_arg = keys.to_str().expect("utf-8 path").to_string();
    let tls = ["--tls", "require", "--tls-psk", &keys_arg];
    let ours = pool_with_vm_for_alice(&dir.join("ours"));
    let theirs = pool_with_vm_for_alice(&dir.join("theirs"));
    let (our_id, their_id) = (pool_id(&ours), pool_id(&theirs));
    assert_ne!(our_id, their_id, "two pools drew the same id");
    let our_list = dir.join("ours/test.pool.allow.json");
    let their_list = dir.join("theirs/test.pool.allow.json");
    assert!(
        std::fs::read_to_string(&our_list)
            .expect("allow file")
            .contains(&our_id),
        "volume create --allow did not record the pool id"
    );

    // The pool's own list: alice opens her volume.
    let mut server = Server::start(&dir.join("ours"), &ours, &tls);
    assert!(
        opens(&server, "alice", "vm", &keys),
        "alice could not open her volume through the pool's own list:\n{}",
        server.log_text()
    );
    server.stop();

    // The other pool's list copied over ours (it names alice for 'vm' too).
    std::fs::copy(&their_list, &our_list).expect("copy the allow file");
    let copied = std::fs::read(&our_list).expect("allow file");
    let served = dir.join("ours/second");
    std::fs::create_dir_all(&served).expect("server dir");
    let server = Server::start(&served, &ours, &tls);
    assert!(
        !opens(&server, "alice", "vm", &keys),
        "alice opened 'vm' through another pool's allow list:\n{}",
        server.log_text()
    );
    assert!(opens(&server, "alice", "open", &keys));
    let log = server.log_text();
    let start = log
        .lines()
        .find(|line| line.contains("allow file") && line.contains(&their_id))
        .unwrap_or_else(|| panic!("serve did not say why the list is refused:\n{log}"));
    assert!(
        start.contains("WARN")
            && start.contains(&our_id)
            && start.contains(our_list.to_str().expect("utf-8 path"))
            && start.contains("'vm'"),
        "the start's warning does not name both ids, the file and the closed volume:\n{start}"
    );

    // A change refuses another pool's list, and leaves it as it was.
    let refused = server.cli(&["volume", "allow", "vm", "alice"]);
    assert!(!refused.status.success(), "{}", refused.report());
    assert!(
        refused.all_output().contains(&their_id),
        "{}",
        refused.report()
    );
    assert_eq!(
        std::fs::read(&our_list).expect("allow file"),
        copied,
        "a refused change wrote the file"
    );
}

// Regression (the choice for lists from before pool ids): a list that records no pool
// is refused, and `volume allow` records this pool's id in it, as the warning says.
#[test]
fn a_list_naming_no_pool_opens_nothing_until_volume_allow_records_the_pool() {
    let dir = TempDir::new("allow-no-id");
    let keys = psk_file(&dir.join("keys.psk"), &["alice"]);
    let keys_arg = keys.to_str().expect("utf-8 path").to_string();
    let pool = pool_with_vm_for_alice(dir.path());
    let list = dir.join("test.pool.allow.json");
    // What a fewerbytes before pool ids wrote: the entries alone.
    std::fs::remove_file(&list).expect("remove the allow file");
    std::fs::write(
        &list,
        "{\n  \"volumes\": {\n    \"vm\": [\n      \"alice\"\n    ]\n  }\n}\n",
    )
    .expect("old allow file");
    std::fs::set_permissions(&list, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod");
    let server = Server::start(
        dir.path(),
        &pool,
        &["--tls", "require", "--tls-psk", &keys_arg],
    );
    assert!(
        !opens(&server, "alice", "vm", &keys),
        "alice opened 'vm' through a list that names no pool:\n{}",
        server.log_text()
    );
    let log = server.log_text();
    assert!(
        log.contains("records no pool id")
            && log.contains(&pool_id(&pool))
            && log.contains("volume allow"),
        "serve did not say the list names no pool and what fixes it:\n{log}"
    );
    server.cli_ok(&["volume", "allow", "vm", "alice"]);
    assert!(
        opens(&server, "alice", "vm", &keys),
        "`volume allow` did not take up the list:\n{}",
        server.log_text()
    );
}

/// Whether a client in clear opens the export `uri` names (nbdinfo's
/// answer), running as uid and gid `as_uid` (root: as this test).
fn opens_in_clear(uri: &str, as_uid: u32) -> bool {
    let mut cmd = if as_uid == 0 {
        tool("nbdinfo")
    } else {
        let mut cmd = tool("setpriv");
        cmd.arg(format!("--reuid={as_uid}"))
            .arg(format!("--regid={as_uid}"))
            .arg("--clear-groups")
            .arg(common::require_tool("nbdinfo"));
        cmd
    };
    run_with_limit(cmd.arg(uri), Duration::from_secs(60))
        .status
        .success()
}

/// The exports `nbdinfo --list` shows the TLS-PSK identity `who`.
fn listed_for(server: &Server, who: &str, keys: &Path) -> Vec<String> {
    let uri = format!(
        "nbds://{who}@127.0.0.1:{}/?tls-psk-file={}",
        server.port,
        keys.display()
    );
    common::nbdinfo::listed_exports(&uri).into_keys().collect()
}

/// What `nbdinfo` says when the TLS-PSK identity `who` asks for `export`, with the
/// export's name taken out (to compare the refusal of a hidden name with the answer
/// for a name that does not exist).
fn refusal_for(server: &Server, who: &str, export: &str, keys: &Path) -> String {
    let uri = format!(
        "nbds://{who}@127.0.0.1:{}/{export}?tls-psk-file={}",
        server.port,
        keys.display()
    );
    let ran = run_with_limit(tool("nbdinfo").arg(uri), Duration::from_secs(60));
    assert!(!ran.status.success(), "{who} opened {export}");
    ran.all_output().replace(export, "NAME")
}

// Regression: a snapshot kept the limit its volume had when it was taken, so
// `volume snapshot secret s1` then `volume allow secret alice` left `secret@s1` open to
// a client in clear, to identity bob and to user nobody; and a snapshot taken after
// the limit opened for no one, alice included. A snapshot is limited as its volume
// is now, and a name a client may not open answers as one that does not exist.
#[test]
fn a_snapshot_is_limited_exactly_as_its_volume_is_now() {
    let dir = TempDir::new("allow-snap");
    let keys = psk_file(&dir.join("keys.psk"), &["alice", "bob"]);
    let keys_arg = keys.to_str().expect("utf-8 path").to_string();
    let pool = create_pool(dir.path(), &[("secret", "16M"), ("open", "16M")]);
    fewerbytes_ok(&pool, &["volume", "snapshot", "secret", "s1"]);
    fewerbytes_ok(&pool, &["volume", "allow", "secret", "alice"]);
    fewerbytes_ok(&pool, &["volume", "snapshot", "secret", "s2"]);
    // TLS required on TCP, the unix socket in clear (serve's default with a PSK file).
    let server = Server::start(dir.path(), &pool, &["--tls-psk", &keys_arg]);
    // The other user reaches the socket as a local client would.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod the directory");
    std::fs::set_permissions(
        &server.socket,
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .expect("chmod the socket");
    assert!(opens_in_clear(&server.unix_uri("open"), 0));
    for snapshot in ["secret@s1", "secret@s2"] {
        assert!(
            !opens_in_clear(&server.unix_uri(snapshot), 0),
            "a client in clear opened '{snapshot}':\n{}",
            server.log_text()
        );
        assert!(
            !opens(&server, "bob", snapshot, &keys),
            "bob opened '{snapshot}', limited to alice:\n{}",
            server.log_text()
        );
        assert!(
            opens(&server, "alice", snapshot, &keys),
            "alice could not open '{snapshot}':\n{}",
            server.log_text()
        );
        assert_eq!(
            refusal_for(&server, "bob", snapshot, &keys),
            refusal_for(&server, "bob", "nothing@here", &keys),
            "a hidden snapshot answers otherwise than a name that does not exist"
        );
    }
    // SAFETY: geteuid(2) reads the caller's id and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        assert!(opens_in_clear(&server.unix_uri("open"), 65534));
        assert!(
            !opens_in_clear(&server.unix_uri("secret@s1"), 65534),
            "user nobody opened 'secret@s1':\n{}",
            server.log_text()
        );
    }
    // Snapshots are not listed (they are reached by name); the volume is hidden from
    // whoever may not open it.
    let for_bob = listed_for(&server, "bob", &keys);
    assert_eq!(for_bob, ["open"], "bob's list shows what he may not open");
    assert_eq!(listed_for(&server, "alice", &keys), ["open", "secret"]);
    // A snapshot has no limit of its own to set.
    let refused = server.cli(&["volume", "allow", "secret@s1", "bob"]);
    assert!(!refused.status.success(), "{}", refused.report());
    assert!(
        refused.all_output().contains("volume allow secret"),
        "{}",
        refused.report()
    );
    assert!(!opens(&server, "bob", "secret@s1", &keys));
    let shown = server.cli_ok(&["volume", "allow", "secret@s1"]);
    assert!(shown.stdout.contains("alice"), "{}", shown.report());
    let listed = server.cli_ok(&["volume", "snapshot", "list", "secret", "--json"]);
    let snapshots: serde_json::Value = serde_json::from_str(&listed.stdout).expect("JSON");
    for snapshot in snapshots.as_array().expect("a list") {
        assert_eq!(snapshot["limited"], true, "{snapshot}");
    }
    // Lifting the volume's limit opens its snapshots too.
    server.cli_ok(&["volume", "allow", "secret", "--anyone"]);
    assert!(
        opens_in_clear(&server.unix_uri("secret@s1"), 0),
        "'secret@s1' stayed closed once its volume opened to anyone:\n{}",
        server.log_text()
    );
}
