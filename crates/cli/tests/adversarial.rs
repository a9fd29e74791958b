//! The pool tried as a careless user and as an attacker would: a second
//! opener through another path, clients that stall to starve others, commands that
//! reach the wrong pool, damaged pool files, names that are not names.
//!
//! Each test is the regression test of one defect and says which in its first
//! comment; each asserts what a person would notice.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

const MIB: u64 = 1 << 20;

/// `fewerbytes --pool POOL ARGS…`, expected to fail; returns its error sentence.
fn fewerbytes_err(pool: &Path, args: &[&str]) -> String {
    fewerbytes_err_code(pool, args, 1)
}

/// Like [`fewerbytes_err`], expecting exit code `code` (`check` exits as fsck does:
/// 4 for damage, 8 when it could not check).
fn fewerbytes_err_code(pool: &Path, args: &[&str], code: i32) -> String {
    let ran = fewerbytes(pool, args);
    assert_eq!(ran.status.code(), Some(code), "{}", ran.report());
    ran.stderr
        .lines()
        .find(|l| l.starts_with("fewerbytes: error: "))
        .unwrap_or_else(|| panic!("no `fewerbytes: error:` line\n{}", ran.report()))
        .to_string()
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

/// A raw image of `bytes` with a seeded mix of data.
fn write_image(path: &Path, bytes: u64, seed: u64) -> Vec<u8> {
    let mut rng = common::data::Rng::new(seed);
    let mut image = vec![0u8; bytes as usize];
    for (i, block) in image.chunks_mut(4096).enumerate() {
        match i % 3 {
            0 => rng.fill(block),
            1 => block.copy_from_slice(&common::data::compressible_block(i as u64)),
            _ => {}
        }
    }
    std::fs::write(path, &image).expect("write image");
    image
}

/// `volume export NAME` to a file, read back.
fn export(pool: &Path, dir: &Path, name: &str) -> Vec<u8> {
    let out = dir.join(format!("{name}.export"));
    let _ = std::fs::remove_file(&out);
    fewerbytes_ok(pool, &["volume", "export", name, path_str(&out)]);
    std::fs::read(&out).expect("read export")
}

/// A loop device over a file, detached when dropped (even when the test fails).
struct LoopDevice {
    path: PathBuf,
}

impl LoopDevice {
    fn attach(file: &Path) -> LoopDevice {
        let ran = run_ok(tool("losetup").args(["-f", "--show"]).arg(file));
        LoopDevice {
            path: PathBuf::from(ran.stdout.trim()),
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new(require_tool("losetup"))
            .arg("-d")
            .arg(&self.path)
            .status();
    }
}

#[test]
fn a_loop_device_over_a_served_pool_file_is_refused_and_the_pool_stays_intact() {
    // Bug: the pool's lock was a record lock on the file's inode only; `losetup` over
    // a served pool file gives a second inode, `--pool /dev/loopN volume create` was
    // accepted, and the pool ended unopenable or with flushed writes gone.
    let dir = TempDir::new("loop");
    let pool = create_pool(dir.path(), &[("vm", "8M")]);
    let image_path = dir.join("image");
    let image = write_image(&image_path, 8 * MIB, 11);
    fewerbytes_ok(&pool, &["volume", "import", "vm", path_str(&image_path)]);

    let mut server = Server::start(dir.path(), &pool, &[]);
    let holder = server.pid();
    {
        let device = LoopDevice::attach(&pool);
        let device_str = path_str(&device.path).to_string();
        let refused = fewerbytes_err(&device.path, &["volume", "create", "x", "--size", "1G"]);
        assert!(
            refused.contains(&holder.to_string()),
            "the refusal must name the process holding the pool (pid {holder}): {refused}"
        );
        assert!(
            refused.contains(&device_str),
            "the refusal names the device: {refused}"
        );
        // Reading is refused too: a second opener's checkpoint at close would write.
        fewerbytes_err(&device.path, &["volume", "list"]);
    }
    assert!(
        server.stop().success(),
        "the server failed:\n{}",
        server.log_text()
    );

    // And the other way round: a pool served through the loop device locks its file.
    {
        let device = LoopDevice::attach(&pool);
        let mut server = Server::start(dir.path(), &device.path, &[]);
        let refused = fewerbytes_err(&pool, &["volume", "create", "y", "--size", "1M"]);
        assert!(
            refused.contains(&server.pid().to_string()),
            "the refusal names the process serving the loop device: {refused}"
        );
        assert!(
            server.stop().success(),
            "the server failed:\n{}",
            server.log_text()
        );
    }

    assert_eq!(volume_names(&pool), vec!["vm".to_string()]);
    assert!(
        export(&pool, dir.path(), "vm") == image,
        "data written before the second opener no longer reads back"
    );
    assert_check_clean(&pool);
}

#[test]
fn commands_for_a_new_pool_at_a_served_pool_s_old_path_reach_the_new_pool() {
    // Bug: after the served pool file was renamed and a new pool made at its old
    // path, commands for the new pool went through the old `<pool>.ctl` to the
    // served one: `volume delete` deleted a volume of the pool being served.
    let dir = TempDir::new("rename");
    let pool = create_pool(dir.path(), &[("served", "8M")]);
    let mut server = Server::start(dir.path(), &pool, &[]);
    let renamed = dir.join("renamed.pool");
    std::fs::rename(&pool, &renamed).expect("rename the served pool");
    fewerbytes_ok(
        &pool,
        &["pool", "create", path_str(&pool), "--size", "256M"],
    );
    fewerbytes_ok(&pool, &["volume", "create", "fresh", "--size", "4M"]);
    assert_eq!(
        volume_names(&pool),
        vec!["fresh".to_string()],
        "`volume list` for the new pool listed another pool's volumes"
    );
    let refused = fewerbytes_err(&pool, &["volume", "delete", "served"]);
    assert!(
        refused.contains("served"),
        "deleting a volume the new pool lacks must fail naming it: {refused}"
    );

    // A request that names another file is refused by the server itself, whatever
    // client sent it.
    let mut control = std::os::unix::net::UnixStream::connect(dir.join("test.pool.ctl"))
        .expect("the served pool's control socket");
    std::io::Write::write_all(
        &mut control,
        b"{\"pool\":{\"dev\":1,\"ino\":2},\"op\":\"delete-volume\",\"name\":\"served\",\"force\":true}\n",
    )
    .expect("send");
    let mut reply = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(control), &mut reply).expect("reply");
    let reply: serde_json::Value = serde_json::from_str(&reply).expect("json reply");
    assert_eq!(reply["ok"], false, "{reply}");
    assert_eq!(reply["wrong_pool"], true, "{reply}");

    // The served pool still has its volume.
    let listed = run_ok(tool("nbdinfo").args(["--list", "--json", &server.unix_uri("")]));
    assert!(
        listed.stdout.contains("\"served\""),
        "the served pool lost its volume:\n{}",
        listed.stdout
    );
    assert!(server.stop().success(), "{}", server.log_text());
    assert_eq!(volume_names(&renamed), vec!["served".to_string()]);
    assert_eq!(volume_names(&pool), vec!["fresh".to_string()]);
}

#[test]
fn a_truncated_pool_is_refused_at_open_and_check_fails() {
    // Bug: a pool file cut short passed `check` ("No problems found", exit 0) and
    // failed only at the first read past its new end.
    let dir = TempDir::new("trunc");
    let pool = create_pool(dir.path(), &[("vm", "8M")]);
    let image_path = dir.join("image");
    write_image(&image_path, 8 * MIB, 12);
    fewerbytes_ok(&pool, &["volume", "import", "vm", path_str(&image_path)]);
    let full_bytes = std::fs::metadata(&pool).expect("stat").len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&pool)
        .expect("open pool file");
    file.set_len(full_bytes - 64 * MIB).expect("truncate");
    drop(file);

    // A truncated pool is damage to `check` (exit 4), an error to the rest.
    for (args, code) in [(&["check"][..], 4), (&["volume", "list"][..], 1)] {
        let refused = fewerbytes_err_code(&pool, args, code);
        assert!(
            refused.contains("truncated"),
            "`{}` must say the pool is truncated: {refused}",
            args.join(" ")
        );
        assert!(
            refused.contains(&full_bytes.to_string()),
            "`{}` must say how long the pool must be ({full_bytes}): {refused}",
            args.join(" ")
        );
    }
}

/// Overwrite block `block` (4 KiB) of `file` with zeros, as a failed sector would.
fn zero_block(file: &Path, block: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .expect("open for zeroing");
    f.write_all_at(&[0u8; 4096], block * 4096).expect("zero");
    f.sync_all().expect("sync");
}

fn block_starts_with(file: &Path, block: u64, magic: &[u8]) -> bool {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(file).expect("open");
    let mut buf = vec![0u8; magic.len()];
    f.read_exact_at(&mut buf, block * 4096).expect("read");
    buf == magic
}

#[test]
fn losing_one_super_block_copy_or_label_copy_keeps_the_pool() {
    // Bug: with super block copy 0 zeroed the pool was "not a fewerbytes pool",
    // though copy 1 was intact; the same with the data device's label zeroed on a
    // pool with a metadata device.
    let dir = TempDir::new("sb");
    let pool = create_pool(dir.path(), &[("vm", "8M")]);
    let image_path = dir.join("image");
    let image = write_image(&image_path, 8 * MIB, 13);
    fewerbytes_ok(&pool, &["volume", "import", "vm", path_str(&image_path)]);
    zero_block(&pool, 0);
    let listed = fewerbytes_ok(&pool, &["volume", "list"]);
    assert!(
        listed.stderr.contains("copy 0"),
        "opening from copy 1 must say so in a warning:\n{}",
        listed.report()
    );
    assert!(
        !block_starts_with(&pool, 0, b"fewrbyts"),
        "`volume list` opens read-only and must write nothing"
    );
    // The next read-write open's checkpoint rewrites the damaged copy.
    fewerbytes_ok(&pool, &["volume", "create", "other", "--size", "4M"]);
    assert!(
        block_starts_with(&pool, 0, b"fewrbyts"),
        "the open's checkpoint did not rewrite super block copy 0"
    );
    assert!(export(&pool, dir.path(), "vm") == image, "the data is lost");
    let check = assert_check_clean(&pool);
    assert!(
        !check.stderr.contains("damaged"),
        "copy 0 is still damaged after it was rewritten:\n{}",
        check.report()
    );

    // A pool with a metadata device, its data device's label copy 0 zeroed.
    let data = dir.join("data.dev");
    let meta = dir.join("meta.dev");
    fewerbytes_ok(
        &data,
        &[
            "pool",
            "create",
            path_str(&data),
            "--size",
            "512M",
            "--metadata-device",
            path_str(&meta),
        ],
    );
    fewerbytes_ok(&data, &["volume", "import", "vm", path_str(&image_path)]);
    zero_block(&data, 0);
    let listed = fewerbytes_ok(&data, &["volume", "list"]);
    assert!(
        listed.stderr.contains("label copy 0"),
        "opening from label copy 1 must say so in a warning:\n{}",
        listed.report()
    );
    assert!(
        !block_starts_with(&data, 0, b"fbdatalb"),
        "`volume list` opens read-only and must write nothing"
    );
    fewerbytes_ok(&data, &["volume", "create", "other", "--size", "4M"]);
    assert!(
        block_starts_with(&data, 0, b"fbdatalb"),
        "label copy 0 was not rewritten"
    );
    assert!(export(&data, dir.path(), "vm") == image, "the data is lost");
    fewerbytes_ok(&data, &["check"]);
}

/// A file whose writes fail with EIO while `fail_when` exists: `nbdfuse` over
/// `nbdkit memory` with the `error` filter (a disk that starts failing). Unmounted
/// when dropped, when the test fails as well.
struct FailingFile {
    mount: PathBuf,
    file: PathBuf,
    fail_when: PathBuf,
    nbdfuse: Option<std::process::Child>,
}

impl FailingFile {
    fn start(dir: &Path, bytes: u64) -> FailingFile {
        let mount = dir.join("fuse");
        std::fs::create_dir_all(&mount).expect("mkdir fuse");
        let fail_when = dir.join("fail-writes");
        let log = std::fs::File::create(dir.join("nbdfuse.log")).expect("nbdfuse log");
        let nbdfuse = tool("nbdfuse")
            .arg(&mount)
            .args(["--command", "nbdkit", "-s", "memory"])
            .arg(bytes.to_string())
            .args([
                "--filter=error",
                "error-pwrite=EIO",
                "error-pwrite-rate=100%",
            ])
            .arg(format!("error-pwrite-file={}", fail_when.display()))
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start nbdfuse");
        let file = mount.join("nbd");
        let started = std::time::Instant::now();
        while std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) == 0 {
            assert!(
                started.elapsed() < CLIENT_LIMIT,
                "nbdfuse did not expose {}",
                file.display()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        FailingFile {
            mount,
            file,
            fail_when,
            nbdfuse: Some(nbdfuse),
        }
    }

    /// From now on every write fails with EIO.
    fn fail_writes(&self) {
        std::fs::write(&self.fail_when, b"").expect("create the error filter's file");
    }
}

impl Drop for FailingFile {
    fn drop(&mut self) {
        if let Some(mut child) = self.nbdfuse.take() {
            let ran = run_with_limit(tool("umount").arg(&self.mount), CLIENT_LIMIT);
            if !ran.status.success() {
                let _ = run_with_limit(tool("umount").arg("-l").arg(&self.mount), CLIENT_LIMIT);
            }
            let _ = child.wait();
        }
    }
}

#[test]
fn a_pool_latched_by_a_failed_write_says_so_in_check_and_at_close() {
    // Bug: a pool latched read-only by an I/O failure closed "cleanly" with exit 0,
    // and `check` through the live latched pool reported a leaked reference that
    // existed only in its memory. The failure here is real: the pool's file starts
    // failing every write with EIO (nbdkit's error filter under nbdfuse). (A full
    // file system is not a failure: it is ENOSPC and latches nothing,
    // `full_host_fs.rs`.)
    let dir = TempDir::new("latch");
    let failing = FailingFile::start(dir.path(), 256 * MIB);
    // Through a link, so that the control socket is made beside it, not in the mount.
    let pool = dir.join("p.pool");
    std::os::unix::fs::symlink(&failing.file, &pool).expect("link to the file");
    fewerbytes_ok(&pool, &["pool", "create", path_str(&pool)]);
    fewerbytes_ok(&pool, &["volume", "create", "vm", "--size", "128M"]);
    let mut server = Server::start(dir.path(), &pool, &[]);
    failing.fail_writes();
    let image = dir.join("random.img");
    let mut bytes = vec![0u8; 96 << 20];
    common::data::Rng::new(14).fill(&mut bytes);
    std::fs::write(&image, &bytes).expect("write image");
    drop(bytes);
    let copied = run_with_limit(
        tool("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&image)
            .arg(server.unix_uri("vm")),
        CLIENT_LIMIT,
    );
    assert!(
        !copied.status.success(),
        "96 MiB of random data written to a file that fails every write?\n{}",
        copied.report()
    );

    // Not checked (exit 8): the audit did not run.
    let refused = fewerbytes_err_code(&pool, &["check"], 8);
    assert!(
        refused.contains("latched"),
        "check on a latched pool must say it is latched: {refused}"
    );
    assert!(
        !refused.contains("leak"),
        "check on a latched pool must not audit its memory: {refused}"
    );
    let status = server.stop();
    assert!(
        !status.success(),
        "serve must exit non-zero when its pool did not close cleanly:\n{}",
        server.log_text()
    );
    assert!(
        server.log_text().contains("did not close cleanly"),
        "serve must say the pool did not close cleanly:\n{}",
        server.log_text()
    );
    drop(server);
    drop(failing);
}

#[test]
fn a_volume_exports_to_a_pipe_and_to_stdout() {
    // Bug: `volume export A /dev/stdout` failed with a bare "Illegal seek" when
    // stdout was a pipe; when it was a file, the summary line was written into it.
    let dir = TempDir::new("stdout");
    let pool = create_pool(dir.path(), &[("vm", "4M")]);
    let image_path = dir.join("image");
    let image = write_image(&image_path, 4 * MIB, 15);
    fewerbytes_ok(&pool, &["volume", "import", "vm", path_str(&image_path)]);

    for target in ["/dev/stdout", "-"] {
        // Into a pipe.
        let piped = Command::new(fewerbytes_bin())
            .arg("--pool")
            .arg(&pool)
            .args(["volume", "export", "vm", target])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run export");
        assert!(
            piped.status.success(),
            "export to {target} (a pipe) failed: {}",
            String::from_utf8_lossy(&piped.stderr)
        );
        assert!(
            piped.stdout == image,
            "export to {target} (a pipe) wrote {} bytes, not the volume's {}",
            piped.stdout.len(),
            image.len()
        );
        // Into a file that stdout is.
        let out_path = dir.join("stdout.img");
        let out = std::fs::File::create(&out_path).expect("create");
        let to_file = Command::new(fewerbytes_bin())
            .arg("--pool")
            .arg(&pool)
            .args(["volume", "export", "vm", target])
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .output()
            .expect("run export");
        assert!(
            to_file.status.success(),
            "export to {target} (a file) failed: {}",
            String::from_utf8_lossy(&to_file.stderr)
        );
        assert!(
            std::fs::read(&out_path).expect("read") == image,
            "export to {target} redirected to a file is not the volume"
        );
        assert!(
            String::from_utf8_lossy(&to_file.stderr).contains("Exported volume 'vm'"),
            "the summary goes to stderr when the image is stdout"
        );
    }
}

#[test]
fn volume_names_that_read_as_options_or_directories_are_refused() {
    // Bug: `volume create ..` and `volume create -- -x` were accepted.
    let dir = TempDir::new("names");
    let pool = create_pool(dir.path(), &[("vm", "4M")]);
    for bad in ["..", "-x", ".hidden"] {
        let refused = fewerbytes_err(&pool, &["volume", "create", "--size", "4M", "--", bad]);
        assert!(
            refused.contains("must start with a letter or a digit"),
            "creating '{bad}' must be refused with the rule: {refused}"
        );
        let refused = fewerbytes_err(&pool, &["volume", "clone", "vm", "--", bad]);
        assert!(
            refused.contains("must start with a letter or a digit"),
            "cloning to '{bad}' must be refused with the rule: {refused}"
        );
    }
    assert_eq!(volume_names(&pool), vec!["vm".to_string()]);
}
