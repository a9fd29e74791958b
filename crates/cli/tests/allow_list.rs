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
