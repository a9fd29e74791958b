//! A loop device over a file for tests that need a block device: attached with
//! `losetup -f`, detached when dropped (on every path, a failing test's too).

use std::path::{Path, PathBuf};
use std::process::Command;

/// A loop device over a file, detached when dropped, on every path (a failing
/// test's too).
pub struct LoopDevice {
    /// The device, `/dev/loopN`.
    pub path: PathBuf,
    losetup: PathBuf,
}

impl LoopDevice {
    /// Attach `file` to a free loop device, or say why loop devices are not available
    /// here (not root, no `losetup`, no loop driver, no free device).
    pub fn attach(file: &Path) -> Result<LoopDevice, String> {
        // SAFETY: geteuid(2) reads the caller's id and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: losetup needs root".into());
        }
        let losetup = [
            "/usr/sbin/losetup",
            "/sbin/losetup",
            "/usr/bin/losetup",
            "/bin/losetup",
        ]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or("losetup (util-linux) is not installed")?;
        if !Path::new("/dev/loop-control").exists() {
            return Err("/dev/loop-control is missing: no loop driver".into());
        }
        let out = Command::new(&losetup)
            .args(["-f", "--show"])
            .arg(file)
            .output()
            .map_err(|e| format!("losetup did not run: {e}"))?;
        let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() || path.is_empty() {
            return Err(format!(
                "losetup -f could not attach a loop device: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(LoopDevice {
            path: PathBuf::from(path),
            losetup,
        })
    }

    /// [`LoopDevice::attach`], or `None` after printing why the test is skipped.
    pub fn attach_or_skip(file: &Path) -> Option<LoopDevice> {
        LoopDevice::attach(file)
            .map_err(|why| eprintln!("skipped: loop devices are not available here: {why}"))
            .ok()
    }

    /// The device's path as a string.
    pub fn path_str(&self) -> &str {
        self.path.to_str().expect("utf-8 device path")
    }

    /// Size in bytes the kernel reports for the device now.
    pub fn size_bytes(&self) -> u64 {
        let sectors = std::fs::read_to_string(self.sysfs().join("size"))
            .expect("sysfs size of the loop device");
        sectors.trim().parse::<u64>().expect("sectors") * 512
    }

    /// Discard requests the device has completed and the sectors they covered
    /// (fields 12 and 14 of `/sys/block/loopN/stat`; counted since the device was
    /// made, so a test compares two readings).
    pub fn discards(&self) -> (u64, u64) {
        let stat = std::fs::read_to_string(self.sysfs().join("stat"))
            .expect("sysfs stat of the loop device");
        let fields: Vec<u64> = stat
            .split_whitespace()
            .map(|f| f.parse().expect("a number"))
            .collect();
        assert!(fields.len() >= 15, "no discard fields in {stat:?}");
        (fields[11], fields[13])
    }

    fn sysfs(&self) -> PathBuf {
        Path::new("/sys/block").join(self.path.file_name().expect("device name"))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new(&self.losetup)
            .arg("-d")
            .arg(&self.path)
            .status();
    }
}
