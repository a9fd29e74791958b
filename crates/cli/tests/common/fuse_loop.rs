//! A volume as a block device without a kernel NBD driver: `nbdfuse` exposes it as a
//! file, `losetup` makes a loop device of that file; everything set up is undone on drop.

use super::{run_ok, run_with_limit, tool, CLIENT_LIMIT};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// How long nbdfuse may take to expose the volume as a file.
const EXPOSE_LIMIT: Duration = Duration::from_secs(30);

/// Everything mounted or attached for the ext4 test, undone in reverse on drop even
/// when the test fails half way.
pub struct FuseLoopStack {
    /// nbdfuse's mount point (the volume is the file `nbd` in it).
    pub fuse_dir: PathBuf,
    /// Where the file system on the loop device is mounted.
    pub mount_dir: PathBuf,
    /// The nbdfuse process, while it runs.
    pub nbdfuse: Option<Child>,
    /// The loop device, while attached.
    pub loop_dev: Option<String>,
    /// Whether the file system is mounted.
    pub mounted: bool,
}

impl FuseLoopStack {
    /// Exposes the export at `uri` as the file `fuse-LABEL/nbd` under `dir` (nbdfuse,
    /// logging to `nbdfuse-LABEL.log`), attaches a loop device to it, and makes
    /// `mnt-LABEL` ready to mount on; `read_only` for both nbdfuse and the loop
    /// device. The caller checks that nbdfuse, losetup and /dev/fuse are there.
    pub fn start(dir: &Path, label: &str, uri: &str, read_only: bool) -> FuseLoopStack {
        let fuse_dir = dir.join(format!("fuse-{label}"));
        let mount_dir = dir.join(format!("mnt-{label}"));
        std::fs::create_dir_all(&fuse_dir).expect("mkdir fuse");
        std::fs::create_dir_all(&mount_dir).expect("mkdir mnt");
        let log_path = dir.join(format!("nbdfuse-{label}.log"));
        let log = std::fs::File::create(&log_path).expect("nbdfuse log");
        let nbd_file = fuse_dir.join("nbd");
        let mut nbdfuse = tool("nbdfuse");
        if read_only {
            nbdfuse.arg("-r");
        }
        let nbdfuse = nbdfuse
            .arg(&nbd_file)
            .arg(uri)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start nbdfuse");
        let mut stack = FuseLoopStack {
            fuse_dir,
            mount_dir,
            nbdfuse: Some(nbdfuse),
            loop_dev: None,
            mounted: false,
        };
        let started = Instant::now();
        while std::fs::metadata(&nbd_file).map(|m| m.len()).unwrap_or(0) == 0 {
            assert!(
                started.elapsed() < EXPOSE_LIMIT,
                "nbdfuse did not expose {} within {EXPOSE_LIMIT:?}; its log:\n{}",
                nbd_file.display(),
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut losetup = tool("losetup");
        losetup.args(["-f", "--show"]);
        if read_only {
            losetup.arg("-r");
        }
        let ran = run_ok(losetup.arg(&nbd_file));
        let dev = ran.stdout.trim().to_string();
        assert!(
            dev.starts_with("/dev/loop"),
            "losetup printed no device:\n{}",
            ran.report()
        );
        stack.loop_dev = Some(dev);
        stack
    }

    /// The loop device (`/dev/loopN`).
    pub fn dev(&self) -> String {
        self.loop_dev.clone().expect("loop device attached")
    }

    /// Size of the volume as nbdfuse exposes it.
    pub fn exposed_bytes(&self) -> u64 {
        std::fs::metadata(self.fuse_dir.join("nbd"))
            .expect("nbdfuse's file")
            .len()
    }

    /// Unmounts the file system if mounted (lazily if it is busy).
    pub fn umount_fs(&mut self) {
        if self.mounted {
            let ran = run_with_limit(tool("umount").arg(&self.mount_dir), CLIENT_LIMIT);
            if !ran.status.success() {
                let _ = run_with_limit(tool("umount").arg("-l").arg(&self.mount_dir), CLIENT_LIMIT);
            }
            self.mounted = false;
        }
    }
}

impl Drop for FuseLoopStack {
    fn drop(&mut self) {
        self.umount_fs();
        if let Some(dev) = self.loop_dev.take() {
            let _ = run_with_limit(tool("losetup").args(["-d", &dev]), CLIENT_LIMIT);
        }
        if let Some(mut child) = self.nbdfuse.take() {
            let ran = run_with_limit(tool("umount").arg(&self.fuse_dir), CLIENT_LIMIT);
            if !ran.status.success() {
                let _ = run_with_limit(tool("umount").arg("-l").arg(&self.fuse_dir), CLIENT_LIMIT);
            }
            for _ in 0..100 {
                if child.try_wait().ok().flatten().is_some() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
