//! A pool whose host file system is full: every command that only reads still works
//! (the data must be readable out without freeing space first).
//!
//! The pool file lives on a small tmpfs. A server takes writes and is killed before
//! it closes (as a server on a filling disk may die), so the pool needs its journal
//! replayed; then a filler file takes the file system's last byte. `stats`, `volume
//! list`, `check`, `volume export` and `serve --read-only` (read by `nbdinfo` and
//! `qemu-io`) must all work and show the data; once space is freed, the pool opens
//! read-write again. The tmpfs is unmounted on drop, when the test fails as well.

mod common;

use common::data::Rng;
use common::libnbd::python_nbd;
use common::nbdinfo::{first_export, nbdinfo_json};
use common::*;
use std::io::Write;
use std::path::{Path, PathBuf};

const MIB: u64 = 1 << 20;
/// The host file system: room for the pool's metadata and the data written, and
/// small enough to fill in a moment.
const HOST_FS_SIZE: &str = "96M";

/// A tmpfs mounted for the test, unmounted (lazily if busy) on drop.
struct SmallFs {
    at: PathBuf,
}

impl SmallFs {
    fn mount(at: &Path, size: &str) -> SmallFs {
        std::fs::create_dir_all(at).expect("mkdir mount point");
        run_ok(
            tool("mount")
                .args(["-t", "tmpfs", "-o"])
                .arg(format!("size={size}"))
                .arg("tmpfs")
                .arg(at),
        );
        SmallFs {
            at: at.to_path_buf(),
        }
    }

    /// Bytes an unprivileged writer could still allocate (`statvfs` f_bavail).
    fn free_bytes(&self) -> u64 {
        let path = std::ffi::CString::new(self.at.to_str().expect("utf-8")).expect("no NUL");
        // SAFETY: an all-zero statvfs is a valid value for statvfs(3) to fill.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `path` is NUL-terminated and `st` is ours to write.
        let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
        assert_eq!(rc, 0, "statvfs {}", self.at.display());
        st.f_bavail * st.f_frsize
    }

    /// Writes a file until the file system has no byte left; returns its path.
    fn fill(&self) -> PathBuf {
        let path = self.at.join("filler");
        let mut file = std::fs::File::create(&path).expect("create filler");
        for chunk in [MIB as usize, 4096, 1] {
            let bytes = vec![0x46u8; chunk];
            while file.write_all(&bytes).is_ok() {}
        }
        let _ = file.sync_all();
        assert_eq!(self.free_bytes(), 0, "the host file system still has room");
        path
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let ran = run_with_limit(tool("umount").arg(&self.at), CLIENT_LIMIT);
        if !ran.status.success() {
            let _ = run_with_limit(tool("umount").arg("-l").arg(&self.at), CLIENT_LIMIT);
        }
    }
}

/// Runs a read-only command on the pool and fails the test, naming the full file
/// system, unless it exits 0.
fn works_while_full(pool: &Path, args: &[&str]) -> Ran {
    let ran = fewerbytes(pool, args);
    assert!(
        ran.status.success(),
        "`fewerbytes {}` failed while the host file system is full:\n{}",
        args.join(" "),
        ran.report()
    );
    ran
}

#[test]
fn read_only_commands_work_on_a_full_host_file_system() {
    let dir = TempDir::new("fullfs");
    let fs = SmallFs::mount(&dir.join("host"), HOST_FS_SIZE);
    let pool = fs.at.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "1G"]);
    fewerbytes_ok(&pool, &["volume", "create", "vm", "--size", "64M"]);

    // Written and flushed through a server that then dies without closing.
    let mut server = Server::start(dir.path(), &pool, &[]);
    qemu_io(
        &server.unix_uri("vm"),
        &[
            "write -P 0x5a 0 8M".into(),
            "write -P 0x33 16M 4M".into(),
            "flush".into(),
        ],
    );
    server.kill9();
    drop(server);

    let filler = fs.fill();

    let stats = works_while_full(&pool, &["stats", "--json"]);
    let stats: serde_json::Value = serde_json::from_str(&stats.stdout)
        .unwrap_or_else(|e| panic!("stats --json is not JSON ({e}):\n{}", stats.stdout));
    assert!(stats.is_object(), "stats --json: {stats}");
    let list = works_while_full(&pool, &["volume", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_str(&list.stdout).expect("json");
    let vm = list
        .as_array()
        .expect("array")
        .iter()
        .find(|v| v["name"] == "vm")
        .unwrap_or_else(|| panic!("volume list has no 'vm': {list}"));
    assert_eq!(
        vm["logical_used_bytes"].as_u64(),
        Some(12 * MIB),
        "the flushed writes: {vm}"
    );
    works_while_full(&pool, &["check"]);

    // Exported to a file off the full file system, holding what was written.
    let out = dir.join("vm.img");
    works_while_full(
        &pool,
        &["volume", "export", "vm", out.to_str().expect("utf-8")],
    );
    let image = std::fs::read(&out).expect("read the export");
    assert_eq!(image.len() as u64, 64 * MIB);
    let filled = |from: u64, len: u64, byte: u8| {
        image[from as usize..(from + len) as usize]
            .iter()
            .all(|b| *b == byte)
    };
    assert!(filled(0, 8 * MIB, 0x5a), "the export lost the first write");
    assert!(filled(8 * MIB, 8 * MIB, 0), "the export's gap is not zeros");
    assert!(
        filled(16 * MIB, 4 * MIB, 0x33),
        "the export lost the second write"
    );

    // Served read-only: a client reads it; the other commands go through the server.
    let serve_dir = dir.join("ro");
    std::fs::create_dir_all(&serve_dir).expect("mkdir ro");
    let mut server = Server::start(&serve_dir, &pool, &["--read-only"]);
    let info = nbdinfo_json(&server.unix_uri("vm"));
    let export = first_export(&info);
    assert_eq!(export["export-size"].as_u64(), Some(64 * MIB), "{info}");
    assert_eq!(export["is_read_only"], true, "{info}");
    let read = run_ok(tool("qemu-io").args(["-r", "-f", "raw"]).args([
        "-c",
        "read -P 0x5a 0 8M",
        "-c",
        "read -P 0x33 16M 4M",
        &server.unix_uri("vm"),
    ]));
    let said = read.all_output();
    assert!(
        !said.contains("verification failed"),
        "qemu-io read other bytes through the read-only server:\n{}",
        read.report()
    );
    assert!(
        !said.contains("failed:"),
        "a qemu-io read failed through the read-only server:\n{}",
        read.report()
    );
    server.cli_ok(&["stats"]);
    server.cli_ok(&["volume", "list"]);
    let status = server.stop();
    assert!(
        status.success(),
        "the read-only server exited with {status}:\n{}",
        server.log_text()
    );
    drop(server);

    // Space freed on the host: the pool opens read-write and takes changes again.
    std::fs::remove_file(&filler).expect("remove the filler");
    fewerbytes_ok(&pool, &["volume", "create", "after", "--size", "1M"]);
    assert_check_clean(&pool);
}

/// While the host file system is full: a 4 MiB write of random bytes fails with
/// ENOSPC (`errno` as libnbd sees it, the message as qemu-io prints it), the
/// server stays up and read-write, reads and trims go on; once a file is deleted
/// on the host the next write succeeds, without a restart, and reads back.
const WHILE_FULL_PY: &str = r#"
import errno, os, sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
try:
    h.pwrite(os.urandom(4 << 20), 0)
    h.flush()
    sys.exit("a write of 4 MiB of random bytes succeeded on a full host file system")
except nbd.Error as e:
    if e.errno not in (errno.ENOSPC, "ENOSPC"):
        sys.exit(f"the write failed with errno {e.errno}, not ENOSPC: {e}")
if h.pread(1 << 20, 16 << 20) != b"\x5a" * (1 << 20):
    sys.exit("a read while full returned other bytes")
h.trim(1 << 20, 32 << 20)
print("ENOSPC, then a read and a trim")
"#;

const AFTER_SPACE_PY: &str = r#"
import os, sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
data = os.urandom(4 << 20)
h.pwrite(data, 0)
h.flush()
if h.pread(len(data), 0) != data:
    sys.exit("the write after space came back reads back other bytes")
if h.pread(1 << 20, 16 << 20) != b"\x5a" * (1 << 20):
    sys.exit("the write before the file system filled was lost")
print("written and read back")
"#;

#[test]
fn writes_on_a_full_host_file_system_fail_with_enospc_and_resume_when_space_is_freed() {
    let dir = TempDir::new("enospc");
    let fs = SmallFs::mount(&dir.join("host"), HOST_FS_SIZE);
    let pool = fs.at.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "1G"]);
    fewerbytes_ok(&pool, &["volume", "create", "vm", "--size", "64M"]);
    let mut server = Server::start(dir.path(), &pool, &[]);
    let uri = server.unix_uri("vm");
    qemu_io(&uri, &["write -P 0x5a 16M 1M".into(), "flush".into()]);

    let filler = fs.fill();
    // Random bytes: nothing to compress or deduplicate, so new blocks are needed.
    let random = dir.join("random.bin");
    let mut bytes = vec![0u8; 4 << 20];
    Rng::new(13).fill(&mut bytes);
    std::fs::write(&random, &bytes).expect("write random.bin");
    let write = run_with_limit(
        tool("qemu-io")
            .args(["-f", "raw", "-c"])
            .arg(format!("write -s {} 8M 4M", random.display()))
            .args(["-c", "flush"])
            .arg(&uri),
        CLIENT_LIMIT,
    );
    assert!(
        write.all_output().contains("No space left on device"),
        "qemu-io's write on a full host file system must fail with ENOSPC:\n{}",
        write.report()
    );
    python_nbd(WHILE_FULL_PY, &[&uri]);
    qemu_io(&uri, &["read -P 0x5a 16M 1M".into()]);
    assert_eq!(
        server.stats()["mode"],
        "normal",
        "a full host file system does not latch the pool:\n{}",
        server.log_text()
    );

    std::fs::remove_file(&filler).expect("remove the filler");
    python_nbd(AFTER_SPACE_PY, &[&uri]);
    let status = server.stop();
    assert!(
        status.success(),
        "the server exited with {status} after space came back:\n{}",
        server.log_text()
    );
    drop(server);
    assert_check_clean(&pool);
}
