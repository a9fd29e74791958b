//! A volume as a block device without a kernel NBD driver: `nbdfuse` exposes it as a
//! file, `losetup` makes a loop device of that file; everything set up is undone on drop.

use super::{run_with_limit, tool, CLIENT_LIMIT};
use std::path::PathBuf;
use std::process::Child;
use std::time::Duration;

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
