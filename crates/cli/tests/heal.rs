//! Damage heals, with the real binary and real clients: a stored block
//! damaged in the pool file fails its reads over NBD; once the server has found it
//! (a read, or `scrub`), writing the good data back (`nbdcopy` of the good image,
//! or a corrective `volume receive` of a good stream) makes every volume naming the
//! block read good, across a restart, and the scrub and `check --verify-data` find
//! nothing. Before, the good data deduplicated onto the damaged block: `nbdcopy`
//! exited 0 and every read still failed.

mod common;

use common::data::Rng;
use common::*;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const BLOCK: usize = 4096;
/// The damaged block of the volumes (block 3: bytes 12288..16383).
const DAMAGED: usize = 3;

/// A pool with volumes `vm` and `copy` holding the same 2 MiB of noise (stored
/// once: `copy` deduplicates onto `vm`); the image and its file.
fn pool_with_two_copies(dir: &TempDir) -> (PathBuf, Vec<u8>, PathBuf) {
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "256M"]);
    let mut image = vec![0u8; 2 << 20];
    Rng::new(37).fill(&mut image);
    let path = dir.join("good.raw");
    std::fs::write(&path, &image).expect("write the image");
    for name in ["vm", "copy"] {
        fewerbytes_ok(&pool, &["volume", "create", name, "--size", "2M"]);
        fewerbytes_ok(
            &pool,
            &["volume", "import", name, path.to_str().expect("utf-8")],
        );
    }
    (pool, image, path)
}

/// Flip one bit of the block [`DAMAGED`] of `image` where the pool file stores it
/// (noise is stored whole, so it is found by its bytes); its pool block.
fn damage_block(pool: &Path, image: &[u8]) -> usize {
    let bytes = std::fs::read(pool).expect("read the pool file");
    let wanted = &image[DAMAGED * BLOCK..(DAMAGED + 1) * BLOCK];
    let pool_block = bytes
        .chunks(BLOCK)
        .position(|c| c == wanted)
        .expect("the block stored whole");
    let at = pool_block * BLOCK + 2000;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(pool)
        .expect("open the pool file");
    file.write_all_at(&[bytes[at] ^ 0x04], at as u64)
        .expect("damage the data block");
    file.sync_all().expect("sync");
    pool_block
}

/// Read the damaged block over NBD with qemu-io: it must fail.
fn assert_read_fails(server: &Server, volume: &str) {
    let mut cmd = tool("qemu-io");
    cmd.args(["-f", "raw", "-c"])
        .arg(format!("read {} {BLOCK}", DAMAGED * BLOCK))
        .arg(server.unix_uri(volume));
    let ran = run_with_limit(&mut cmd, CLIENT_LIMIT);
    assert!(
        ran.all_output().contains("Input/output error"),
        "a read of the damaged block of '{volume}' did not fail:\n{}",
        ran.report()
    );
}

/// Every byte of `volume` over NBD (nbdcopy to a file).
fn volume_bytes(server: &Server, dir: &TempDir, volume: &str) -> Vec<u8> {
    let out = dir.join(&format!("{volume}.out"));
    let _ = std::fs::remove_file(&out);
    run_ok(tool("nbdcopy").arg(server.unix_uri(volume)).arg(&out));
    std::fs::read(&out).expect("read the copy")
}

fn assert_volumes_read(server: &Server, dir: &TempDir, image: &[u8], when: &str) {
    for volume in ["vm", "copy"] {
        let got = volume_bytes(server, dir, volume);
        assert!(
            got == image,
            "'{volume}' does not read its good data {when}"
        );
    }
}

#[test]
fn nbdcopy_of_the_good_image_heals_a_damaged_block_in_every_volume_across_a_restart() {
    require_tool("nbdcopy");
    require_tool("qemu-io");
    let dir = TempDir::new("heal-nbdcopy");
    let (pool, image, good) = pool_with_two_copies(&dir);
    let mut server = Server::start(dir.path(), &pool, &[]);
    damage_block(&pool, &image);
    assert_read_fails(&server, "vm");

    // The good image written back over the volume whose read failed.
    run_ok(tool("nbdcopy").arg(&good).arg(server.unix_uri("vm")));
    assert_volumes_read(&server, &dir, &image, "after nbdcopy of the good image");
    let stats = server.stats();
    assert_eq!(stats["damaged_objects_healed"], 1, "{stats:#}");
    assert_eq!(stats["damaged_objects_known"], 0, "{stats:#}");
    let text = server.cli_ok(&["stats"]);
    assert!(
        text.stdout.contains("Damaged blocks: 0 known damaged")
            && text.stdout.contains("1 healed since open"),
        "{}",
        text.report()
    );

    // Durable: a restart reads the good data, and the scrub finds nothing.
    assert!(server.stop().success(), "{}", server.log_text());
    server.spawn();
    assert_volumes_read(&server, &dir, &image, "after a restart");
    let ran = server.cli(&["scrub", "--wait"]);
    assert_eq!(ran.status.code(), Some(0), "{}", ran.report());
    assert!(server.stop().success(), "{}", server.log_text());
    let ran = fewerbytes(&pool, &["check", "--verify-data"]);
    assert_eq!(ran.status.code(), Some(0), "{}", ran.report());
}

#[test]
fn a_block_the_scrub_found_after_a_restart_heals_by_a_write_over_nbd_and_the_advice_says_so() {
    require_tool("qemu-io");
    let dir = TempDir::new("heal-scrub");
    let (pool, image, _) = pool_with_two_copies(&dir);
    // Damaged while no server runs: the server that opens it knows nothing of it.
    let pool_block = damage_block(&pool, &image);
    let mut server = Server::start(dir.path(), &pool, &[]);
    let ran = server.cli(&["scrub", "--wait"]);
    assert_eq!(ran.status.code(), Some(1), "{}", ran.report());
    assert!(
        ran.stdout.contains(&format!(
            "volume 'vm' bytes 12288..16383 (pool block {pool_block})"
        )),
        "{}",
        ran.report()
    );
    assert!(
        ran.stdout
            .contains("writing the good data back over NBD heals"),
        "the scrub does not say what heals the block:\n{}",
        ran.report()
    );

    // Just the block's good bytes, written with qemu-io into the other volume.
    let block = dir.join("block.raw");
    std::fs::write(&block, &image[DAMAGED * BLOCK..(DAMAGED + 1) * BLOCK]).expect("block");
    qemu_io(
        &server.unix_uri("copy"),
        &[format!(
            "write -s {} {} {BLOCK}",
            block.display(),
            DAMAGED * BLOCK
        )],
    );
    assert_volumes_read(&server, &dir, &image, "after the block was written back");
    let ran = server.cli(&["scrub", "--wait"]);
    assert_eq!(ran.status.code(), Some(0), "{}", ran.report());
    assert!(server.stop().success(), "{}", server.log_text());
}

/// `fewerbytes --pool POOL ARGS` with stdin from `input` and stdout to `output`.
fn piped(pool: &Path, args: &[&str], input: Option<&Path>, output: Option<&Path>) -> Ran {
    let mut cmd = Command::new(fewerbytes_bin());
    cmd.arg("--pool").arg(pool).args(args);
    let stdin = match input {
        Some(path) => Stdio::from(std::fs::File::open(path).expect("open the stream")),
        None => Stdio::null(),
    };
    let stdout = match output {
        Some(path) => Stdio::from(std::fs::File::create(path).expect("create the stream")),
        None => Stdio::piped(),
    };
    let command = describe(&cmd);
    let out = cmd
        .stdin(stdin)
        .stdout(stdout)
        .stderr(Stdio::piped())
        .output()
        .expect("run fewerbytes");
    Ran {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        command,
    }
}

#[test]
fn a_corrective_receive_of_a_good_stream_heals_a_damaged_block() {
    require_tool("qemu-io");
    let dir = TempDir::new("heal-receive");
    let (pool, image, _) = pool_with_two_copies(&dir);
    // A good stream of the volume, sent before the damage (a backup elsewhere).
    let stream = dir.join("vm.stream");
    let ran = piped(&pool, &["volume", "send", "vm"], None, Some(&stream));
    assert!(ran.status.success(), "{}", ran.report());
    damage_block(&pool, &image);
    let mut server = Server::start(dir.path(), &pool, &[]);
    assert_read_fails(&server, "copy");

    let ran = piped(
        &pool,
        &["volume", "receive", "restored"],
        Some(&stream),
        None,
    );
    assert!(ran.status.success(), "{}", ran.report());
    assert_volumes_read(&server, &dir, &image, "after a receive of a good stream");
    assert_eq!(server.stats()["damaged_objects_healed"], 1);
    assert!(server.stop().success(), "{}", server.log_text());
    let ran = fewerbytes(&pool, &["check", "--verify-data"]);
    assert_eq!(ran.status.code(), Some(0), "{}", ran.report());
}

/// The damaged blocks a server knew, carried over a restart: `nbdcopy` of the good
/// image after the restart heals, with no read of the block in between. Before, the
/// restarted server knew nothing, and the good data deduplicated onto the damaged
/// block: every read still failed.
#[test]
fn nbdcopy_of_the_good_image_after_a_restart_heals_a_block_a_read_found_damaged_before_it() {
    require_tool("nbdcopy");
    require_tool("qemu-io");
    let dir = TempDir::new("heal-restart");
    let (pool, image, good) = pool_with_two_copies(&dir);
    let mut server = Server::start(dir.path(), &pool, &[]);
    damage_block(&pool, &image);
    assert_read_fails(&server, "vm");
    assert!(server.stop().success(), "{}", server.log_text());

    server.spawn();
    let stats = server.stats();
    assert_eq!(stats["damaged_objects_carried_over"], 1, "{stats:#}");
    assert_eq!(stats["damaged_objects_known"], 1, "{stats:#}");
    run_ok(tool("nbdcopy").arg(&good).arg(server.unix_uri("vm")));
    assert_volumes_read(&server, &dir, &image, "after nbdcopy after a restart");
    assert_eq!(server.stats()["damaged_objects_healed"], 1);
    let ran = server.cli(&["scrub", "--wait"]);
    assert_eq!(ran.status.code(), Some(0), "{}", ran.report());
    assert!(server.stop().success(), "{}", server.log_text());
}

/// `check --verify-data` with no server running finds the damaged block; the server
/// started after it knows it, and `nbdcopy` of the good image heals it.
#[test]
fn an_offline_check_verify_data_s_finding_heals_when_the_good_image_is_written_over_nbd() {
    require_tool("nbdcopy");
    let dir = TempDir::new("heal-offline-check");
    let (pool, image, good) = pool_with_two_copies(&dir);
    damage_block(&pool, &image);
    let ran = fewerbytes(&pool, &["check", "--verify-data"]);
    assert_ne!(ran.status.code(), Some(0), "{}", ran.report());
    let info = fewerbytes_ok(&pool, &["pool", "info"]);
    assert!(info.stdout.contains("Damaged blocks"), "{}", info.report());

    let mut server = Server::start(dir.path(), &pool, &[]);
    let text = server.cli_ok(&["stats"]);
    assert!(
        text.stdout
            .contains("1 of them carried over from the last open"),
        "{}",
        text.report()
    );
    run_ok(tool("nbdcopy").arg(&good).arg(server.unix_uri("vm")));
    assert_volumes_read(
        &server,
        &dir,
        &image,
        "after nbdcopy after check --verify-data",
    );
    let ran = server.cli(&["scrub", "--wait"]);
    assert_eq!(ran.status.code(), Some(0), "{}", ran.report());
    assert!(server.stop().success(), "{}", server.log_text());
    let ran = fewerbytes(&pool, &["check", "--verify-data"]);
    assert_eq!(ran.status.code(), Some(0), "{}", ran.report());
}
