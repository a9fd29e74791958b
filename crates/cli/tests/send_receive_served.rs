//! `volume send` / `volume receive` on pools that servers hold: the stream goes
//! through each server's control socket, the servers read and write the volumes,
//! and the command only carries bytes. With a served pool on each side: a full
//! stream piped from one command into the other makes a volume `qemu-img compare`
//! finds identical over NBD; an incremental one from a clone carries only the blocks
//! qemu-io wrote since; a two-way send carries only the blocks the receiver lacks; a
//! cut stream, and a receive whose command is killed, leave a partial volume that a
//! resumed send completes; a stream whose base the receiver lacks is refused.

mod common;

use common::data::{compressible_block, Rng};
use common::send_stream::{count_before, resume_token};
use common::*;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BLOCK: usize = 4096;

/// A served pool in its own directory (its NBD socket, control socket and log).
fn served_pool(dir: &TempDir, name: &str, images: &[(&str, &[u8])]) -> Server {
    let home = dir.join(name);
    std::fs::create_dir_all(&home).expect("pool directory");
    let pool = home.join(format!("{name}.pool"));
    let path = pool.to_str().expect("utf-8 path");
    fewerbytes_ok(&pool, &["pool", "create", path, "--size", "1G"]);
    for (volume, bytes) in images {
        let raw = home.join(format!("{volume}.raw"));
        std::fs::write(&raw, bytes).expect("write the image");
        fewerbytes_ok(
            &pool,
            &["volume", "import", volume, raw.to_str().expect("utf-8")],
        );
    }
    Server::start(&home, &pool, &[])
}

/// `sh -c SCRIPT`, for pipelines of the real binary.
fn shell(script: &str) -> Ran {
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(script);
    run_with_limit(&mut cmd, CLIENT_LIMIT)
}

fn bin() -> String {
    fewerbytes_bin().display().to_string()
}

/// `fewerbytes --pool POOL volume send ARGS > stream`.
fn send_to_file(pool: &Path, args: &str, stream: &Path) -> Ran {
    let ran = shell(&format!(
        "{} --pool {} volume send {args} > {}",
        bin(),
        pool.display(),
        stream.display()
    ));
    assert!(ran.status.success(), "{}", ran.report());
    ran
}

/// `fewerbytes --pool POOL volume receive ARGS < stream`.
fn receive_from_file(pool: &Path, args: &str, stream: &Path) -> Ran {
    shell(&format!(
        "{} --pool {} volume receive {args} < {}",
        bin(),
        pool.display(),
        stream.display()
    ))
}

/// `qemu-img compare` of two NBD exports: they read the same bytes.
fn assert_same(left: &str, right: &str) {
    let mut cmd = tool("qemu-img");
    cmd.args(["compare", "-f", "raw", "-F", "raw", left, right]);
    let ran = run_with_limit(&mut cmd, CLIENT_LIMIT);
    assert!(ran.status.success(), "{}", ran.report());
    assert!(
        ran.stdout.contains("Images are identical"),
        "{}",
        ran.report()
    );
}

/// 1,024 blocks: 32 random blocks each written 16 times, 256 compressible blocks,
/// 256 zero blocks.
fn image(seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let templates: Vec<Vec<u8>> = (0..32)
        .map(|_| {
            let mut block = vec![0u8; BLOCK];
            rng.fill(&mut block);
            block
        })
        .collect();
    let mut image = Vec::new();
    for _ in 0..16 {
        for t in &templates {
            image.extend_from_slice(t);
        }
    }
    image.extend_from_slice(&vec![0u8; 256 * BLOCK]);
    for i in 0..256 {
        image.extend_from_slice(&compressible_block(seed * 1000 + i));
    }
    image
}

#[test]
fn full_and_incremental_streams_between_served_pools_make_identical_volumes() {
    let dir = TempDir::new("servedsend");
    let bytes = image(3);
    let a = served_pool(&dir, "a", &[("vm", &bytes)]);
    let b = served_pool(&dir, "b", &[]);

    // Full, piped from one command into the other, both through their servers.
    let ran = shell(&format!(
        "{0} --pool {1} volume send vm | {0} --pool {2} volume receive vm",
        bin(),
        a.pool.display(),
        b.pool.display()
    ));
    assert!(ran.status.success(), "{}", ran.report());
    assert!(ran.stderr.contains("Sent volume 'vm'"), "{}", ran.report());
    assert!(
        ran.stderr.contains("Received volume 'vm'"),
        "{}",
        ran.report()
    );
    // Each distinct block once: 32 random, 256 compressible.
    assert_eq!(count_before(&ran, " blocks of data"), 32 + 256);
    assert_same(&a.unix_uri("vm"), &b.unix_uri("vm"));
    // The servers logged the streams they ran.
    assert!(
        a.log_text().contains("send volume 'vm'"),
        "{}",
        a.log_text()
    );
    assert!(
        b.log_text().contains("receive volume 'vm'"),
        "{}",
        b.log_text()
    );

    // A base on both sides, then 5 blocks written over NBD on the sender.
    a.cli_ok(&["volume", "clone", "vm", "base"]);
    b.cli_ok(&["volume", "clone", "vm", "base"]);
    for (i, lbn) in [7usize, 300, 301, 700, 1000].iter().enumerate() {
        let ran = qemu_io(
            &a.unix_uri("vm"),
            &[format!("write -P {} {} 4096", i + 1, lbn * BLOCK)],
        );
        assert!(ran.status.success(), "{}", ran.report());
    }
    let stream = dir.join("inc.fbs");
    let sent = send_to_file(&a.pool, "vm --from base", &stream);
    assert_eq!(
        count_before(&sent, " blocks of data"),
        5,
        "{}",
        sent.report()
    );
    let ran = receive_from_file(&b.pool, "vm2", &stream);
    assert!(ran.status.success(), "{}", ran.report());
    assert_same(&a.unix_uri("vm"), &b.unix_uri("vm2"));
    assert_check_clean(&b.pool);
}

#[test]
fn a_two_way_send_between_served_pools_sends_only_what_the_receiver_lacks() {
    let dir = TempDir::new("served2way");
    let template = image(5);
    let mut vm = template.clone();
    let mut rng = Rng::new(17);
    for lbn in [10usize, 600, 1000] {
        rng.fill(&mut vm[lbn * BLOCK..(lbn + 1) * BLOCK]);
    }
    let a = served_pool(&dir, "a", &[("template", &template), ("vm", &vm)]);
    let b = served_pool(&dir, "b", &[("template", &template)]);
    let ran = shell(&format!(
        "{0} --pool {1} volume send vm --to '{0} --pool {2} volume receive vm \
         --negotiate-with template'",
        bin(),
        a.pool.display(),
        b.pool.display()
    ));
    assert!(ran.status.success(), "{}", ran.report());
    assert_eq!(count_before(&ran, " blocks of data"), 3, "{}", ran.report());
    assert!(
        count_before(&ran, " the receiver held") > 200,
        "{}",
        ran.report()
    );
    assert_same(&a.unix_uri("vm"), &b.unix_uri("vm"));
}

/// `volume receive ARGS` fed `stream`, again while the server still applies a cut
/// receive into the same name (it refuses a second one until that one stopped).
fn receive_when_free(pool: &Path, args: &str, stream: &Path) -> Ran {
    let started = Instant::now();
    loop {
        let ran = receive_from_file(pool, args, stream);
        if !ran.stderr.contains("is running on this server") {
            return ran;
        }
        assert!(
            started.elapsed() < CLIENT_LIMIT,
            "the cut receive never stopped:\n{}",
            ran.report()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_cut_or_killed_receive_into_a_served_pool_resumes_from_a_served_sender() {
    let dir = TempDir::new("servedcut");
    let bytes = image(7);
    let a = served_pool(&dir, "a", &[("vm", &bytes)]);
    let b = served_pool(&dir, "b", &[]);
    let stream = dir.join("vm.fbs");
    send_to_file(&a.pool, "vm", &stream);
    let whole = std::fs::read(&stream).expect("stream");
    let cut: PathBuf = dir.join("cut.fbs");
    std::fs::write(&cut, &whole[..whole.len() / 3]).expect("cut");

    // Cut: refused, the partial kept on the server's pool, nothing under the name.
    let ran = receive_from_file(&b.pool, "vm", &cut);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(ran.stderr.contains("truncated"), "{}", ran.report());
    // The partial volume is internal: no listing shows it.
    assert!(volume_names(&b.pool).is_empty());
    // Resumed by a send from the served sender that starts at the token's record.
    let token = resume_token(&ran);
    let rest = dir.join("rest.fbs");
    send_to_file(&a.pool, &format!("vm --resume-token {token}"), &rest);
    let rest_len = std::fs::metadata(&rest).expect("rest").len();
    assert!(
        rest_len < whole.len() as u64 * 3 / 4,
        "{rest_len} of {}",
        whole.len()
    );
    let ran = receive_from_file(&b.pool, "vm --resume", &rest);
    assert!(ran.status.success(), "{}", ran.report());
    assert_same(&a.unix_uri("vm"), &b.unix_uri("vm"));

    // The receiving command killed half-way: the server sees the connection end,
    // keeps what it applied, and the same stream fed again completes it.
    let mut cmd = Command::new(fewerbytes_bin());
    cmd.arg("--pool")
        .arg(&b.pool)
        .args(["volume", "receive", "vm3"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().expect("start the receive");
    let mut input = child.stdin.take().expect("stdin");
    input
        .write_all(&whole[..whole.len() / 2])
        .expect("feed half");
    input.flush().expect("flush");
    child.kill().expect("kill the receive");
    let _ = child.wait();
    drop(input);
    let ran = receive_when_free(&b.pool, "vm3 --resume", &stream);
    assert!(ran.status.success(), "{}", ran.report());
    assert_same(&a.unix_uri("vm"), &b.unix_uri("vm3"));
    assert_check_clean(&b.pool);
}

#[test]
fn a_served_receive_refuses_a_stream_whose_base_it_lacks() {
    let dir = TempDir::new("servedbase");
    let bytes = image(9);
    let a = served_pool(&dir, "a", &[("vm", &bytes)]);
    let c = served_pool(&dir, "c", &[]);
    a.cli_ok(&["volume", "clone", "vm", "base"]);
    let stream = dir.join("inc.fbs");
    send_to_file(&a.pool, "vm --from base", &stream);
    let ran = receive_from_file(&c.pool, "vm", &stream);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(
        ran.stderr
            .contains("volume 'base', which this pool does not hold"),
        "{}",
        ran.report()
    );
    assert!(volume_names(&c.pool).is_empty());
    // The sender's base missing is refused by the sending server.
    let ran = shell(&format!(
        "{} --pool {} volume send vm --from nosuch > {}",
        bin(),
        a.pool.display(),
        dir.join("x.fbs").display()
    ));
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(ran.stderr.contains("nosuch"), "{}", ran.report());
}

/// `volume snapshot list VOL --json` on a served pool: (full name, identity) of
/// each snapshot, oldest first.
fn snapshot_ids(server: &Server, volume: &str) -> Vec<(String, String)> {
    let ran = server.cli_ok(&["volume", "snapshot", "list", volume, "--json"]);
    let list: serde_json::Value = serde_json::from_str(&ran.stdout).expect("snapshot list JSON");
    list.as_array()
        .expect("a list")
        .iter()
        .map(|s| {
            (
                s["name"].as_str().expect("name").to_string(),
                s["guid"].as_str().expect("guid").to_string(),
            )
        })
        .collect()
}

/// `SEND | RECEIVE` between two served pools.
fn pipe(from: &Server, send: &str, to: &Server, receive: &str) -> Ran {
    shell(&format!(
        "{0} --pool {1} volume send {send} | {0} --pool {2} volume receive {receive}",
        bin(),
        from.pool.display(),
        to.pool.display()
    ))
}

/// qemu-io writes a block of its own bytes (`pattern` * 16 + its index) at each
/// block of `lbns` over NBD.
fn write_blocks(uri: &str, pattern: usize, lbns: &[usize]) {
    for (i, lbn) in lbns.iter().enumerate() {
        let byte = pattern * 16 + i;
        let ran = qemu_io(uri, &[format!("write -P {byte} {} 4096", lbn * BLOCK)]);
        assert!(ran.status.success(), "{}", ran.report());
    }
}

#[test]
fn snapshots_cross_with_their_identity_and_increments_apply_in_place() {
    let dir = TempDir::new("servedsnaps");
    let a = served_pool(&dir, "a", &[("vm", &image(21))]);
    let b = served_pool(&dir, "b", &[]);
    let vm = a.unix_uri("vm");
    a.cli_ok(&["volume", "snapshot", "vm", "s1"]);
    write_blocks(&vm, 1, &[3, 400, 900]);
    a.cli_ok(&["volume", "snapshot", "vm", "s2"]);
    // Written after s2: never part of what is sent below.
    write_blocks(&vm, 2, &[5]);

    // The older snapshot in full: b gets vm, and vm@s1 with a's identity.
    let ran = pipe(&a, "vm@s1", &b, "vm");
    assert!(ran.status.success(), "{}", ran.report());
    assert!(ran.stderr.contains("snapshot 'vm@s1'"), "{}", ran.report());
    assert_same(&a.unix_uri("vm@s1"), &b.unix_uri("vm@s1"));
    // The newer one from it: only the 3 blocks written between, and b's vm is
    // updated in place (the same volume, its snapshots kept).
    let ran = pipe(&a, "vm@s2 --from s1", &b, "vm");
    assert!(ran.status.success(), "{}", ran.report());
    assert_eq!(count_before(&ran, " blocks of data"), 3, "{}", ran.report());
    assert!(ran.stderr.contains("updated in place"), "{}", ran.report());
    assert_same(&a.unix_uri("vm@s2"), &b.unix_uri("vm"));
    assert_same(&a.unix_uri("vm@s2"), &b.unix_uri("vm@s2"));
    assert_same(&a.unix_uri("vm@s1"), &b.unix_uri("vm@s1"));
    assert_eq!(snapshot_ids(&a, "vm"), snapshot_ids(&b, "vm"));
    assert_eq!(snapshot_ids(&b, "vm").len(), 2);

    // An increment from the newer one.
    write_blocks(&vm, 3, &[6, 7]);
    a.cli_ok(&["volume", "snapshot", "vm", "s3"]);
    let ran = pipe(&a, "vm@s3 --from s2", &b, "vm");
    assert!(ran.status.success(), "{}", ran.report());
    // Block 5 (written after s2) and blocks 6 and 7.
    assert_eq!(count_before(&ran, " blocks of data"), 3, "{}", ran.report());
    assert_same(&a.unix_uri("vm@s3"), &b.unix_uri("vm"));
    assert_eq!(snapshot_ids(&a, "vm"), snapshot_ids(&b, "vm"));
    assert_check_clean(&b.pool);

    // A base the receiver lacks is refused by its identity, nothing made.
    a.cli_ok(&["volume", "snapshot", "vm", "s4"]);
    let stream = dir.join("s4.fbs");
    send_to_file(&a.pool, "vm@s4 --from s3", &stream);
    b.cli_ok(&["volume", "snapshot", "delete", "vm", "s3"]);
    let ran = receive_from_file(&b.pool, "vm", &stream);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(
        ran.stderr.contains("snapshot 'vm@s3' (identity"),
        "{}",
        ran.report()
    );
    // A snapshot of the same name is not the base: its identity differs.
    b.cli_ok(&["volume", "snapshot", "vm", "s3"]);
    let ran = receive_from_file(&b.pool, "vm", &stream);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(
        ran.stderr.contains("another snapshot of the same name"),
        "{}",
        ran.report()
    );
    assert_eq!(snapshot_ids(&b, "vm").len(), 3);
    assert_eq!(volume_names(&b.pool), ["vm"]);
}

#[test]
fn an_increment_into_a_volume_written_since_its_base_is_refused_unless_forced() {
    let dir = TempDir::new("servedforce");
    let a = served_pool(&dir, "a", &[("vm", &image(23))]);
    let b = served_pool(&dir, "b", &[]);
    a.cli_ok(&["volume", "snapshot", "vm", "s1"]);
    assert!(pipe(&a, "vm@s1", &b, "vm").status.success());
    write_blocks(&a.unix_uri("vm"), 1, &[10]);
    a.cli_ok(&["volume", "snapshot", "vm", "s2"]);
    let stream = dir.join("s2.fbs");
    send_to_file(&a.pool, "vm@s2 --from s1", &stream);
    // b's vm written after s1: the increment would lose that write.
    write_blocks(&b.unix_uri("vm"), 9, &[20]);
    let ran = receive_from_file(&b.pool, "vm", &stream);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(ran.stderr.contains("--force"), "{}", ran.report());
    let ran = receive_from_file(&b.pool, "vm --force", &stream);
    assert!(ran.status.success(), "{}", ran.report());
    assert_same(&a.unix_uri("vm@s2"), &b.unix_uri("vm"));
    assert_eq!(snapshot_ids(&a, "vm"), snapshot_ids(&b, "vm"));
}

/// `volume receive ARGS` fed `stream` in two parts: its header, then (once the
/// receive's progress file `progress` exists: the receive began) `between` runs,
/// then the rest. What a client does while a receive runs, at a point it has surely
/// reached.
fn receive_around(
    pool: &Path,
    args: &[&str],
    stream: &Path,
    progress: &Path,
    between: impl FnOnce(),
) -> Ran {
    let bytes = std::fs::read(stream).expect("stream");
    let header = fewerbytes_format::stream::HEADER_BYTES;
    let mut cmd = Command::new(fewerbytes_bin());
    cmd.arg("--pool")
        .arg(pool)
        .args(["volume", "receive"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start the receive");
    let mut input = child.stdin.take().expect("stdin");
    input.write_all(&bytes[..header]).expect("feed the header");
    input.flush().expect("flush");
    let started = Instant::now();
    while !progress.exists() {
        assert!(started.elapsed() < CLIENT_LIMIT, "the receive never began");
        std::thread::sleep(Duration::from_millis(20));
    }
    between();
    // The receive may have stopped already (refused); what it says is below.
    let _ = input.write_all(&bytes[header..]);
    drop(input);
    let out = child.wait_with_output().expect("wait for the receive");
    Ran {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        command: format!("volume receive {}", args.join(" ")),
    }
}

/// qemu-io reads `byte` in every byte of block `lbn` over NBD.
fn assert_block(uri: &str, lbn: usize, byte: usize) {
    qemu_io(uri, &[format!("read -P {byte} {} 4096", lbn * BLOCK)]);
}

/// b holds vm and vm@s1 as a's; `s2.fbs` is a's increment vm@s2 --from s1.
fn in_place_pair(dir: &TempDir, seed: u64) -> (Server, Server, PathBuf) {
    let a = served_pool(dir, "a", &[("vm", &image(seed))]);
    let b = served_pool(dir, "b", &[]);
    a.cli_ok(&["volume", "snapshot", "vm", "s1"]);
    assert!(pipe(&a, "vm@s1", &b, "vm").status.success());
    write_blocks(&a.unix_uri("vm"), 1, &[10]);
    a.cli_ok(&["volume", "snapshot", "vm", "s2"]);
    let stream = dir.join("s2.fbs");
    send_to_file(&a.pool, "vm@s2 --from s1", &stream);
    (a, b, stream)
}

// An in-place receive checked "written since its base" only when it began: a
// client's write (4 KiB, flushed, disconnected) while it ran, or between a cut
// and --resume, was discarded by the final rollback, which reported success.
#[test]
fn an_in_place_receive_refuses_a_target_written_while_it_runs_or_before_its_resume() {
    let dir = TempDir::new("servedracing");
    let (a, b, stream) = in_place_pair(&dir, 25);
    let progress = dir.join("b").join("b.pool.receive.vm.json");
    let vm = b.unix_uri("vm");
    let ran = receive_around(&b.pool, &["vm"], &stream, &progress, || {
        write_blocks(&vm, 9, &[20]);
    });
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(ran.stderr.contains("was written since"), "{}", ran.report());
    assert_block(&vm, 20, 9 * 16);
    fewerbytes_ok(&b.pool, &["volume", "receive", "vm", "--abandon"]);
    assert_block(&vm, 20, 9 * 16);
    assert_eq!(volume_names(&b.pool), ["vm"]);

    // Cut, then written, then resumed: refused again.
    b.cli_ok(&["volume", "rollback", "vm", "s1"]);
    let bytes = std::fs::read(&stream).expect("stream");
    let cut = dir.join("cut.fbs");
    // Inside the end record (its head and 40-byte payload): every block applied.
    std::fs::write(&cut, &bytes[..bytes.len() - 36]).expect("cut");
    let ran = receive_from_file(&b.pool, "vm", &cut);
    assert!(ran.stderr.contains("truncated"), "{}", ran.report());
    write_blocks(&vm, 8, &[30]);
    let ran = receive_from_file(&b.pool, "vm --resume", &stream);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(ran.stderr.contains("was written since"), "{}", ran.report());
    assert_block(&vm, 30, 8 * 16);
    // Forced, the resume applies the stream over what was written.
    let ran = receive_from_file(&b.pool, "vm --resume --force", &stream);
    assert!(ran.status.success(), "{}", ran.report());
    assert_same(&a.unix_uri("vm@s2"), &vm);
    assert_check_clean(&b.pool);
}

// Base references read the live base: a client rewriting the base while a receive
// ran put its bytes into the received volume, and the receive said it checked out.
#[test]
fn base_references_read_the_base_as_it_was_when_the_receive_began() {
    let dir = TempDir::new("servedfrozen");
    let template = image(27);
    let mut vm = template.clone();
    // Block 900 of vm holds what block 3 of the base holds: a base reference.
    vm.copy_within(3 * BLOCK..4 * BLOCK, 900 * BLOCK);
    let a = served_pool(&dir, "a", &[("base", &template), ("vm", &vm)]);
    let b = served_pool(&dir, "b", &[("base", &template)]);
    let stream = dir.join("inc.fbs");
    send_to_file(&a.pool, "vm --from base", &stream);
    let progress = dir.join("b").join("b.pool.receive.x.json");
    let base = b.unix_uri("base");
    let ran = receive_around(
        &b.pool,
        &["x", "--from", "base"],
        &stream,
        &progress,
        || {
            // Every copy of that block in the base (image() repeats it every 32).
            write_blocks(&base, 7, &(0..16).map(|k| 3 + 32 * k).collect::<Vec<_>>());
        },
    );
    assert_block(&base, 3, 7 * 16);
    if ran.status.success() {
        assert!(
            count_before(&ran, " by reference to the base") > 0,
            "{}",
            ran.report()
        );
        assert_same(&a.unix_uri("vm"), &b.unix_uri("x"));
    } else {
        // The write landed before the frozen copy was taken: the base is not the
        // sender's, and nothing was made.
        assert!(
            ran.stderr.contains("differs from the sender's base"),
            "{}",
            ran.report()
        );
        assert_eq!(volume_names(&b.pool), ["base"]);
    }
    assert_check_clean(&b.pool);
}

// The partial volume was an export: listed by `nbdinfo --list`, writable, and a
// user's own volume named `x:receiving` was taken for an interrupted receive and
// deleted by --abandon.
#[test]
fn the_partial_volume_is_no_export_and_no_user_name_is_taken_for_it() {
    let dir = TempDir::new("servedhidden");
    let bytes = image(29);
    let a = served_pool(&dir, "a", &[("vm", &bytes)]);
    let b = served_pool(&dir, "b", &[("vm:receiving", &image(31))]);
    let stream = dir.join("vm.fbs");
    send_to_file(&a.pool, "vm", &stream);
    let whole = std::fs::read(&stream).expect("stream");
    let cut = dir.join("cut.fbs");
    std::fs::write(&cut, &whole[..whole.len() / 2]).expect("cut");
    let ran = receive_from_file(&b.pool, "vm", &cut);
    assert!(!ran.status.success(), "{}", ran.report());
    let listed = common::nbdinfo::listed_exports(&b.unix_uri(""));
    assert_eq!(
        listed.keys().collect::<Vec<_>>(),
        ["vm:receiving"],
        "{listed:?}"
    );
    assert!(
        !tool("nbdinfo")
            .arg(b.unix_uri("%25receive.vm"))
            .output()
            .expect("nbdinfo")
            .status
            .success(),
        "the partial volume opened as an export"
    );
    let ran = receive_from_file(&b.pool, "vm --resume", &stream);
    assert!(ran.status.success(), "{}", ran.report());
    assert_same(&a.unix_uri("vm"), &b.unix_uri("vm"));
    // No receive waits: --abandon deletes nothing, the user's volume stays.
    fewerbytes_ok(&b.pool, &["volume", "receive", "vm", "--abandon"]);
    assert_eq!(volume_names(&b.pool), ["vm:receiving", "vm"]);
    let ran = receive_from_file(&b.pool, "vm2", &stream);
    assert!(ran.status.success(), "{}", ran.report());
}
