//! `volume send` / `volume receive` between two pools, with the real binary: a full
//! stream makes an identical volume and carries each distinct block once; an
//! incremental stream from a clone carries only the blocks written since (through
//! NBD by qemu-io); a cut-short stream fails and `--resume` completes it (fed the
//! same stream again, or a send resumed from the printed token); a flipped byte and
//! a missing or different base are refused, and no volume appears under the name.

mod common;

use common::data::{compressible_block, Rng};
use common::send_stream::{count_before, resume_token};
use common::*;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BLOCK: usize = 4096;
/// Bytes of a stream's header, and of a record's head (docs/stream.md).
const HEADER_BYTES: u64 = 192;
const RECORD_HEAD_BYTES: u64 = 32;

/// `fewerbytes --pool POOL ARGS` with stdin from `input` and stdout to `output`.
fn piped(pool: &Path, args: &[&str], input: Option<&Path>, output: Option<&Path>) -> Ran {
    let mut cmd = Command::new(fewerbytes_bin());
    cmd.arg("--pool").arg(pool).args(args);
    cmd.stdin(match input {
        Some(path) => Stdio::from(File::open(path).expect("open the stream")),
        None => Stdio::null(),
    });
    cmd.stdout(match output {
        Some(path) => Stdio::from(File::create(path).expect("create the stream file")),
        None => Stdio::piped(),
    });
    cmd.stderr(Stdio::piped());
    let command = describe(&cmd);
    let child = cmd.spawn().expect("start fewerbytes");
    let pid = child.id();
    let started = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = loop {
        if let Ok(out) = rx.recv_timeout(Duration::from_millis(100)) {
            break out.expect("wait for fewerbytes");
        }
        if started.elapsed() > CLIENT_LIMIT {
            // SAFETY: a signal to the child this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("`{command}` did not finish within {CLIENT_LIMIT:?}");
        }
    };
    Ran {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        command,
    }
}

fn send(pool: &Path, args: &[&str], stream: &Path) -> Ran {
    let mut all = vec!["volume", "send"];
    all.extend_from_slice(args);
    let ran = piped(pool, &all, None, Some(stream));
    assert!(ran.status.success(), "send failed:\n{}", ran.report());
    ran
}

fn receive(pool: &Path, args: &[&str], stream: &Path) -> Ran {
    let mut all = vec!["volume", "receive"];
    all.extend_from_slice(args);
    piped(pool, &all, Some(stream), None)
}

fn new_pool(dir: &TempDir, name: &str) -> PathBuf {
    let pool = dir.join(name);
    let path = pool.to_str().expect("utf-8 path");
    fewerbytes_ok(&pool, &["pool", "create", path, "--size", "1G"]);
    pool
}

/// The volume's bytes, by `volume export` to a file.
fn exported(pool: &Path, volume: &str, dir: &TempDir) -> Vec<u8> {
    let file = dir.join(&format!("{volume}.export.raw"));
    let _ = std::fs::remove_file(&file);
    fewerbytes_ok(
        pool,
        &["volume", "export", volume, file.to_str().expect("utf-8")],
    );
    std::fs::read(&file).expect("read the export")
}

fn write_image(dir: &TempDir, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write the image");
    path
}

fn random_block(rng: &mut Rng) -> Vec<u8> {
    let mut block = vec![0u8; BLOCK];
    rng.fill(&mut block);
    block
}

/// 2,048 blocks: 64 random blocks each written 24 times, 256 distinct compressible
/// blocks, and 256 zero blocks. Distinct non-zero blocks: 320.
fn image_with_duplicates(seed: u64) -> (Vec<u8>, u64) {
    let mut rng = Rng::new(seed);
    let templates: Vec<Vec<u8>> = (0..64).map(|_| random_block(&mut rng)).collect();
    let mut image = Vec::new();
    for copy in 0..24 {
        for t in &templates {
            image.extend_from_slice(t);
        }
        if copy == 11 {
            image.extend_from_slice(&vec![0u8; 256 * BLOCK]);
        }
    }
    for i in 0..256 {
        image.extend_from_slice(&compressible_block(seed * 1000 + i));
    }
    (image, 64 + 256)
}

/// The number in "N blocks of data" of a send's summary.
fn data_blocks_sent(ran: &Ran) -> u64 {
    count_before(ran, " blocks of data")
}

#[test]
fn a_full_stream_makes_the_same_volume_and_carries_each_distinct_block_once() {
    let dir = TempDir::new("sendfull");
    let a = new_pool(&dir, "a.pool");
    let b = new_pool(&dir, "b.pool");
    let (image, distinct) = image_with_duplicates(7);
    let raw = write_image(&dir, "vm.raw", &image);
    fewerbytes_ok(
        &a,
        &["volume", "import", "vm", raw.to_str().expect("utf-8")],
    );

    let stream = dir.join("vm.fbs");
    let sent = send(&a, &["vm"], &stream);
    assert_eq!(data_blocks_sent(&sent), distinct, "{}", sent.report());
    let stream_bytes = std::fs::metadata(&stream).expect("stream").len();
    // Each distinct block once: the 64 random ones cannot compress, so the stream
    // holds at least their bytes, and at most every distinct block whole with its
    // record head, plus the header and the few zero and reference runs.
    let random_bytes = 64 * BLOCK as u64;
    let distinct_bound = distinct * (BLOCK as u64 + RECORD_HEAD_BYTES) + HEADER_BYTES;
    assert!(stream_bytes >= random_bytes, "{stream_bytes} bytes");
    assert!(
        stream_bytes < distinct_bound + 200 * (RECORD_HEAD_BYTES + 8),
        "the stream ({stream_bytes} bytes) carries more than each of the {distinct} distinct blocks once"
    );
    assert!(
        stream_bytes * 4 < image.len() as u64,
        "the stream ({stream_bytes} bytes) is not much smaller than the image ({} bytes)",
        image.len()
    );

    let received = receive(&b, &["vm"], &stream);
    assert!(received.status.success(), "{}", received.report());
    assert_eq!(volume_names(&b), vec!["vm".to_string()]);
    let copy = exported(&b, "vm", &dir);
    assert!(copy == image, "the received volume differs from the image");
    // And qemu-img agrees, on the two exports.
    let original = write_image(&dir, "a-export.raw", &exported(&a, "vm", &dir));
    let copy_file = write_image(&dir, "b-export.raw", &copy);
    run_ok(
        tool("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&original)
            .arg(&copy_file),
    );
    assert_check_clean(&b);
}

/// Pools A and B both hold `vm` (sent in full) and its clone `base`; A's `vm` is
/// then written through NBD: `changed` new blocks and 16 zeroed ones.
struct Replicas {
    dir: TempDir,
    a: PathBuf,
    b: PathBuf,
    image: Vec<u8>,
    changed: u64,
}

fn replicas(label: &str) -> Replicas {
    let dir = TempDir::new(label);
    let a = new_pool(&dir, "a.pool");
    let b = new_pool(&dir, "b.pool");
    let (mut image, _) = image_with_duplicates(11);
    let raw = write_image(&dir, "vm.raw", &image);
    fewerbytes_ok(
        &a,
        &["volume", "import", "vm", raw.to_str().expect("utf-8")],
    );
    let stream = dir.join("full.fbs");
    send(&a, &["vm"], &stream);
    let ran = receive(&b, &["vm"], &stream);
    assert!(ran.status.success(), "{}", ran.report());
    fewerbytes_ok(&a, &["volume", "clone", "vm", "base"]);
    fewerbytes_ok(&b, &["volume", "clone", "vm", "base"]);

    let mut server = Server::start(dir.path(), &a, &[]);
    let mut rng = Rng::new(99);
    let changed_lbns = [3u64, 700, 701, 1500, 2047];
    let mut commands = Vec::new();
    for (i, lbn) in changed_lbns.iter().enumerate() {
        let block = random_block(&mut rng);
        let file = write_image(&dir, &format!("block{i}"), &block);
        let offset = *lbn as usize * BLOCK;
        image[offset..offset + BLOCK].copy_from_slice(&block);
        commands.push(format!(
            "write -s {} {offset} {BLOCK}",
            file.to_str().expect("utf-8")
        ));
    }
    // A block the base holds elsewhere (a file copied in the guest): sent as a
    // reference to the base, not as data.
    let copied = image[70 * BLOCK..71 * BLOCK].to_vec();
    let file = write_image(&dir, "copied", &copied);
    image[1800 * BLOCK..1801 * BLOCK].copy_from_slice(&copied);
    commands.push(format!(
        "write -s {} {} {BLOCK}",
        file.to_str().expect("utf-8"),
        1800 * BLOCK
    ));
    let zeroed = 100 * BLOCK..116 * BLOCK;
    image[zeroed.clone()].fill(0);
    commands.push(format!("write -z {} {}", zeroed.start, zeroed.len()));
    qemu_io(&server.unix_uri("vm"), &commands);
    server.stop();
    Replicas {
        dir,
        a,
        b,
        image,
        changed: changed_lbns.len() as u64,
    }
}

#[test]
fn an_incremental_stream_from_a_clone_carries_only_the_changed_blocks() {
    let r = replicas("sendinc");
    let stream = r.dir.join("inc.fbs");
    let sent = send(&r.a, &["vm", "--from", "base"], &stream);
    assert_eq!(data_blocks_sent(&sent), r.changed, "{}", sent.report());
    assert!(
        sent.stderr.contains("1 by reference to the base"),
        "{}",
        sent.report()
    );
    let stream_bytes = std::fs::metadata(&stream).expect("stream").len();
    let bound = HEADER_BYTES + r.changed * (BLOCK as u64 + RECORD_HEAD_BYTES) + 4 * 64;
    assert!(
        stream_bytes <= bound,
        "{stream_bytes} bytes for {} changed blocks",
        r.changed
    );

    let ran = receive(&r.b, &["vm2"], &stream);
    assert!(ran.status.success(), "{}", ran.report());
    assert!(
        exported(&r.b, "vm2", &r.dir) == r.image,
        "vm2 differs from the source"
    );
    // The base is untouched, and still what the sender's base is.
    assert!(exported(&r.b, "base", &r.dir) == exported(&r.a, "base", &r.dir));
    assert_check_clean(&r.b);
}

#[test]
fn a_missing_or_different_base_is_refused_and_leaves_nothing() {
    let r = replicas("sendbase");
    let stream = r.dir.join("inc.fbs");
    send(&r.a, &["vm", "--from", "base"], &stream);

    // A pool without the base.
    let c = new_pool(&r.dir, "c.pool");
    let ran = receive(&c, &["vm2"], &stream);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(
        ran.stderr.contains("incremental from volume 'base'")
            && ran.stderr.contains("does not hold"),
        "{}",
        ran.report()
    );
    assert!(volume_names(&c).is_empty());
    assert!(!r.dir.join("c.pool.receive.vm2.json").exists());

    // A base of the same name and size whose bytes differ.
    let (mut other, _) = image_with_duplicates(11);
    other[BLOCK * 5] ^= 1;
    let raw = write_image(&r.dir, "other.raw", &other);
    fewerbytes_ok(
        &c,
        &["volume", "import", "base", raw.to_str().expect("utf-8")],
    );
    let ran = receive(&c, &["vm2"], &stream);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(
        ran.stderr.contains("differs from the sender's base"),
        "{}",
        ran.report()
    );
    assert_eq!(volume_names(&c), vec!["base".to_string()]);
    // Named another way, the right base is taken.
    fewerbytes_ok(&r.b, &["volume", "rename", "base", "golden"]);
    let ran = receive(&r.b, &["vm2", "--from", "golden"], &stream);
    assert!(ran.status.success(), "{}", ran.report());
    assert!(exported(&r.b, "vm2", &r.dir) == r.image);
}

#[test]
fn a_cut_stream_fails_and_resume_completes_it() {
    let dir = TempDir::new("sendcut");
    let a = new_pool(&dir, "a.pool");
    let b = new_pool(&dir, "b.pool");
    let (image, _) = image_with_duplicates(5);
    let raw = write_image(&dir, "vm.raw", &image);
    fewerbytes_ok(
        &a,
        &["volume", "import", "vm", raw.to_str().expect("utf-8")],
    );
    let stream = dir.join("vm.fbs");
    send(&a, &["vm"], &stream);
    let bytes = std::fs::read(&stream).expect("stream");

    // Cut at a third: refused, nothing under the name, the partial kept.
    let cut = write_image(&dir, "cut.fbs", &bytes[..bytes.len() / 3]);
    let ran = receive(&b, &["vm"], &cut);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(ran.stderr.contains("truncated"), "{}", ran.report());
    // The partial volume is internal: no listing shows it.
    assert!(volume_names(&b).is_empty(), "{:?}", volume_names(&b));
    // A new receive is refused while one waits.
    let ran = receive(&b, &["vm"], &stream);
    assert!(!ran.status.success());
    assert!(ran.stderr.contains("--resume"), "{}", ran.report());

    // Resumed with the same stream from its start: the held records are skipped.
    let ran = receive(&b, &["vm", "--resume"], &stream);
    assert!(ran.status.success(), "{}", ran.report());
    assert_eq!(volume_names(&b), vec!["vm".to_string()]);
    assert!(exported(&b, "vm", &dir) == image);
    assert!(!dir.join("b.pool.receive.vm.json").exists());

    // Cut again, and resumed by a send that starts at the token's record: it sends
    // less than the whole stream, and the volume is complete.
    let ran = receive(&b, &["vm3"], &cut);
    assert!(!ran.status.success(), "{}", ran.report());
    let token = resume_token(&ran);
    let rest = dir.join("rest.fbs");
    send(&a, &["vm", "--resume-token", &token], &rest);
    let rest_bytes = std::fs::metadata(&rest).expect("rest").len();
    assert!(
        rest_bytes < bytes.len() as u64 * 3 / 4,
        "the resumed send ({rest_bytes} bytes) resent what the receiver held ({} in all)",
        bytes.len()
    );
    assert_eq!(
        &std::fs::read(&rest).expect("rest")[..HEADER_BYTES as usize],
        &bytes[..HEADER_BYTES as usize]
    );
    let ran = receive(&b, &["vm3", "--resume"], &rest);
    assert!(ran.status.success(), "{}", ran.report());
    assert!(exported(&b, "vm3", &dir) == image);

    // A source written between the cut and the resumed send makes another stream,
    // which the waiting receive refuses rather than finish with a mix of the two.
    let ran = receive(&b, &["vm4"], &cut);
    assert!(!ran.status.success(), "{}", ran.report());
    let token = resume_token(&ran);
    let (other, _) = image_with_duplicates(6);
    let raw = write_image(&dir, "other.raw", &other);
    fewerbytes_ok(
        &a,
        &[
            "volume",
            "import",
            "vm",
            raw.to_str().expect("utf-8"),
            "--force",
        ],
    );
    send(&a, &["vm", "--resume-token", &token], &rest);
    let ran = receive(&b, &["vm4", "--resume"], &rest);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(
        ran.stderr.contains("not the one the interrupted receive"),
        "{}",
        ran.report()
    );
    assert!(!volume_names(&b).contains(&"vm4".to_string()));
    assert_check_clean(&b);
}

#[test]
fn a_flipped_byte_is_refused_and_abandon_discards_the_partial_volume() {
    let dir = TempDir::new("sendflip");
    let a = new_pool(&dir, "a.pool");
    let b = new_pool(&dir, "b.pool");
    let (image, _) = image_with_duplicates(3);
    let raw = write_image(&dir, "vm.raw", &image);
    fewerbytes_ok(
        &a,
        &["volume", "import", "vm", raw.to_str().expect("utf-8")],
    );
    let stream = dir.join("vm.fbs");
    send(&a, &["vm"], &stream);
    let mut bytes = std::fs::read(&stream).expect("stream");
    for at in [bytes.len() / 2, 40, HEADER_BYTES as usize + 5] {
        let mut damaged = bytes.clone();
        damaged[at] ^= 0x20;
        let file = write_image(&dir, "flipped.fbs", &damaged);
        let ran = receive(&b, &["vm"], &file);
        assert!(!ran.status.success(), "byte {at}:\n{}", ran.report());
        assert!(
            ran.stderr.contains("checksum mismatch") || ran.stderr.contains("damaged"),
            "byte {at}:\n{}",
            ran.report()
        );
        assert!(
            !volume_names(&b).contains(&"vm".to_string()),
            "byte {at}: a volume appeared under the name"
        );
        fewerbytes_ok(&b, &["volume", "receive", "vm", "--abandon"]);
        assert!(volume_names(&b).is_empty());
    }
    // Trailing bytes after the end record are refused too.
    bytes.extend_from_slice(b"junk");
    let file = write_image(&dir, "trailing.fbs", &bytes);
    let ran = receive(&b, &["vm"], &file);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(
        ran.stderr.contains("follow its end record"),
        "{}",
        ran.report()
    );
    assert!(!volume_names(&b).contains(&"vm".to_string()));
}

// Base references read a frozen copy of the base taken when the receive began: a
// base rewritten between a cut and the resume changes nothing of what is received
// (before, the resume read the live base again).
#[test]
fn an_incremental_receive_resumes_from_the_base_as_it_was_when_it_began() {
    let r = replicas("sendincres");
    let stream = r.dir.join("inc.fbs");
    send(&r.a, &["vm", "--from", "base"], &stream);
    let bytes = std::fs::read(&stream).expect("stream");
    let cut = write_image(&r.dir, "cut.fbs", &bytes[..bytes.len() / 2]);

    // Cut; the base rewritten whole before the resume.
    let ran = receive(&r.b, &["vm2"], &cut);
    assert!(!ran.status.success(), "{}", ran.report());
    let (mut other, _) = image_with_duplicates(11);
    other[BLOCK * 9] ^= 1;
    let raw = write_image(&r.dir, "other.raw", &other);
    fewerbytes_ok(
        &r.b,
        &[
            "volume",
            "import",
            "base",
            raw.to_str().expect("utf-8"),
            "--force",
        ],
    );
    let ran = receive(&r.b, &["vm2", "--resume"], &stream);
    assert!(ran.status.success(), "{}", ran.report());
    assert!(
        exported(&r.b, "vm2", &r.dir) == r.image,
        "vm2 differs from the source"
    );
    assert!(exported(&r.b, "base", &r.dir) == other);
    assert_eq!(volume_names(&r.b), ["vm", "base", "vm2"]);
    assert_check_clean(&r.b);
}

#[test]
fn a_two_way_send_sends_only_the_blocks_the_receiver_lacks() {
    let dir = TempDir::new("send2way");
    let a = new_pool(&dir, "a.pool");
    let b = new_pool(&dir, "b.pool");
    let (image, distinct) = image_with_duplicates(13);
    let raw = write_image(&dir, "template.raw", &image);
    fewerbytes_ok(
        &a,
        &["volume", "import", "template", raw.to_str().expect("utf-8")],
    );
    let stream = dir.join("template.fbs");
    send(&a, &["template"], &stream);
    let ran = receive(&b, &["template"], &stream);
    assert!(ran.status.success(), "{}", ran.report());

    // vm: the template's bytes with 3 new blocks, a volume of its own (no base).
    let mut vm = image.clone();
    let mut rng = Rng::new(77);
    for lbn in [10usize, 900, 2000] {
        vm[lbn * BLOCK..(lbn + 1) * BLOCK].copy_from_slice(&random_block(&mut rng));
    }
    let raw = write_image(&dir, "vm.raw", &vm);
    fewerbytes_ok(
        &a,
        &["volume", "import", "vm", raw.to_str().expect("utf-8")],
    );
    let one_way = dir.join("vm.fbs");
    send(&a, &["vm"], &one_way);
    let one_way_bytes = std::fs::metadata(&one_way).expect("stream").len();

    let receiver = format!(
        "{} --pool {} volume receive vm --negotiate-with template",
        fewerbytes_bin().display(),
        b.display()
    );
    let ran = piped(&a, &["volume", "send", "vm", "--to", &receiver], None, None);
    assert!(ran.status.success(), "{}", ran.report());
    assert_eq!(data_blocks_sent(&ran), 3, "{}", ran.report());
    // Every other distinct block of vm is the template's: held, not sent (319: the
    // unique block at 2000 is gone from vm; those at 10 and 900 repeat elsewhere).
    assert_eq!(
        count_before(&ran, " the receiver held"),
        distinct - 1,
        "{}",
        ran.report()
    );
    assert!(exported(&b, "vm", &dir) == vm, "vm differs from the source");
    assert_check_clean(&b);
    // The one-way stream carried every distinct block (at least the 64 random ones
    // whole); the two-way one, 3 blocks and a digest and a reference for each other.
    assert!(
        one_way_bytes > 64 * BLOCK as u64,
        "one way: {one_way_bytes} bytes"
    );

    // A receiver that fails is named, and leaves nothing.
    let receiver = format!(
        "{} --pool {} volume receive vm2 --negotiate-with nosuch",
        fewerbytes_bin().display(),
        b.display()
    );
    let ran = piped(&a, &["volume", "send", "vm", "--to", &receiver], None, None);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(
        ran.stderr.contains("the receiver failed"),
        "{}",
        ran.report()
    );
    assert!(ran.stderr.contains("'nosuch'"), "{}", ran.report());
    assert_eq!(
        volume_names(&b),
        vec!["template".to_string(), "vm".to_string()]
    );
}

// The progress file was written through `<pool>.receive.NAME.json.new` with a plain
// create: a symlink planted there overwrote the file it pointed to.
#[test]
fn a_link_planted_beside_the_pool_is_never_written_or_read_through() {
    let dir = TempDir::new("sendlink");
    let a = new_pool(&dir, "a.pool");
    let b = new_pool(&dir, "b.pool");
    let (image, _) = image_with_duplicates(13);
    let raw = write_image(&dir, "vm.raw", &image);
    fewerbytes_ok(
        &a,
        &["volume", "import", "vm", raw.to_str().expect("utf-8")],
    );
    let stream = dir.join("vm.fbs");
    send(&a, &["vm"], &stream);
    let bytes = std::fs::read(&stream).expect("stream");
    let cut = write_image(&dir, "cut.fbs", &bytes[..bytes.len() / 2]);
    let victim = write_image(&dir, "victim", b"precious");
    std::os::unix::fs::symlink(&victim, dir.join("b.pool.receive.vm.json.new")).expect("link");

    let ran = receive(&b, &["vm"], &cut);
    assert!(ran.stderr.contains("truncated"), "{}", ran.report());
    assert_eq!(std::fs::read(&victim).expect("victim"), b"precious");
    let progress = std::fs::metadata(dir.join("b.pool.receive.vm.json")).expect("progress");
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&progress.permissions()) & 0o777,
        0o600
    );
    let ran = receive(&b, &["vm", "--resume"], &stream);
    assert!(ran.status.success(), "{}", ran.report());
    assert!(exported(&b, "vm", &dir) == image);

    // A link in the progress file's place is refused, not followed.
    std::os::unix::fs::symlink(&victim, dir.join("b.pool.receive.vm5.json")).expect("link");
    let ran = piped(&b, &["volume", "receive", "vm5", "--abandon"], None, None);
    assert!(!ran.status.success(), "{}", ran.report());
    assert_eq!(std::fs::read(&victim).expect("victim"), b"precious");
}

// A stream "incremental from tenantA@daily", received into a new name without
// --from, was taken by the identity it carries (a guess away): a copy of another
// volume's snapshot.
#[test]
fn a_snapshot_base_found_only_by_its_identity_is_refused_until_named() {
    let dir = TempDir::new("sendguid");
    let a = new_pool(&dir, "a.pool");
    let b = new_pool(&dir, "b.pool");
    let (image, _) = image_with_duplicates(17);
    let raw = write_image(&dir, "vm.raw", &image);
    fewerbytes_ok(
        &a,
        &["volume", "import", "tenant", raw.to_str().expect("utf-8")],
    );
    fewerbytes_ok(&a, &["volume", "snapshot", "tenant", "daily"]);
    let full = dir.join("full.fbs");
    send(&a, &["tenant@daily"], &full);
    let ran = receive(&b, &["tenant"], &full);
    assert!(ran.status.success(), "{}", ran.report());
    let (other, _) = image_with_duplicates(19);
    let raw = write_image(&dir, "other.raw", &other);
    fewerbytes_ok(
        &a,
        &[
            "volume",
            "import",
            "tenant",
            raw.to_str().expect("utf-8"),
            "--force",
        ],
    );
    fewerbytes_ok(&a, &["volume", "snapshot", "tenant", "s2"]);
    let stream = dir.join("inc.fbs");
    send(&a, &["tenant@s2", "--from", "daily"], &stream);

    let ran = receive(&b, &["copy"], &stream);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(
        ran.stderr.contains("--from tenant@daily"),
        "{}",
        ran.report()
    );
    assert_eq!(volume_names(&b), ["tenant"]);
    let ran = receive(&b, &["copy", "--from", "tenant@daily"], &stream);
    assert!(ran.status.success(), "{}", ran.report());
    assert!(exported(&b, "copy", &dir) == other);
}

// A two-way receive kept every offer: 1 GiB of offers took a server to 1.19 GB.
#[test]
fn offers_past_the_volume_s_blocks_are_refused() {
    use fewerbytes_format::stream::{Record, RecordBody, StreamHeader, OFFER_DIGESTS_MAX};
    let dir = TempDir::new("sendoffers");
    let b = new_pool(&dir, "b.pool");
    fewerbytes_ok(&b, &["volume", "create", "cand", "--size", "1M"]);
    let header = StreamHeader {
        volume_size_bytes: 1 << 20,
        source_pool_id: 1,
        stream_key: [7; 32],
        base: None,
        negotiated: true,
        source_map_digest: 0,
        snapshot: false,
    };
    let mut bytes = header.encode().to_vec();
    // 256 blocks: two full offer records are 512 digests.
    for position in 0..2u64 {
        let digests = (0..OFFER_DIGESTS_MAX)
            .map(|i| {
                let mut d = [0u8; 16];
                d[..8].copy_from_slice(&((position << 32) + i as u64).to_le_bytes());
                d
            })
            .collect::<Vec<_>>();
        let record = Record {
            position,
            lbn: 0,
            count: digests.len() as u32,
            body: RecordBody::Offer { digests },
        };
        record.encode(&header.stream_key, &mut bytes);
    }
    let stream = write_image(&dir, "offers.fbs", &bytes);
    let ran = receive(&b, &["vm", "--negotiate-with", "cand"], &stream);
    assert!(!ran.status.success(), "{}", ran.report());
    assert!(
        ran.stderr.contains("offers more than 256"),
        "{}",
        ran.report()
    );
    assert_eq!(volume_names(&b), ["cand"]);
}
