//! Which file a loop device reads and writes.
//!
//! A pool's lock is a record lock on the inode it was opened by. `losetup` over a
//! pool file gives the same bytes a second inode (the device node), so a lock on one
//! is invisible to an opener of the other. To refuse a second opener whatever path
//! it takes, opening a loop device (or a partition of one) also opens and locks the
//! file behind it; [`backing_of`] says which file that is.
//!
//! The kernel reports the backing file twice: its path now (sysfs
//! `loop/backing_file`, which follows renames and ends in " (deleted)" once the file
//! is unlinked) and its device and inode numbers (`LOOP_GET_STATUS64`). The caller
//! opens the path and checks the numbers, so a path that names another file by now
//! is never locked in its place.

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;

/// `LOOP_GET_STATUS64` from `<linux/loop.h>`.
const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;
/// `LO_NAME_SIZE` and `LO_KEY_SIZE` from `<linux/loop.h>`.
const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;

/// `struct loop_info64` from `<linux/loop.h>` (232 bytes).
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);

/// The file behind a loop device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Backing {
    /// Its path as the kernel reports it now.
    pub path: PathBuf,
    /// `st_dev` of the file, as the kernel encodes it in `loop_info64`.
    pub dev: u64,
    /// `st_ino` of the file.
    pub ino: u64,
}

/// The backing file of the block device `device` (device number `rdev`), if it is a
/// loop device or a partition of one; `None` for any other block device.
pub(crate) fn backing_of(device: &File, rdev: u64) -> io::Result<Option<Backing>> {
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    let mut sys = match std::fs::canonicalize(format!("/sys/dev/block/{major}:{minor}")) {
        Ok(path) => path,
        // No sysfs entry: not a device this kernel knows as a disk.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    // A partition's sysfs directory sits inside its disk's.
    if sys.join("partition").exists() {
        if let Some(parent) = sys.parent() {
            sys = parent.to_path_buf();
        }
    }
    let path = match std::fs::read_to_string(sys.join("loop/backing_file")) {
        Ok(text) => PathBuf::from(text.trim_end_matches('\n')),
        // Not a loop device, or a loop device bound to nothing.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    // SAFETY: an all-zero loop_info64 is a valid value of this plain-data struct.
    let mut info: LoopInfo64 = unsafe { std::mem::zeroed() };
    // SAFETY: LOOP_GET_STATUS64 writes one loop_info64 through the pointer, which
    // points at `info` (of that layout and size, checked above); the descriptor is
    // owned by `device` for the call.
    let rc = unsafe {
        libc::ioctl(
            device.as_raw_fd(),
            LOOP_GET_STATUS64 as _,
            &mut info as *mut LoopInfo64,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Some(Backing {
        path,
        dev: info.lo_device,
        ino: info.lo_inode,
    }))
}

/// Whether `st_dev` of a file equals the kernel's `lo_device` for it. The kernel
/// writes `huge_encode_dev` there, which equals glibc's `st_dev` encoding for every
/// major number below 4,096; above, the two differ and only the major and minor
/// numbers are compared.
pub(crate) fn same_device(st_dev: u64, lo_device: u64) -> bool {
    if st_dev == lo_device {
        return true;
    }
    // huge_encode_dev: minor bits 0-7, major bits 8-19, minor bits 20-31.
    let lo_major = (lo_device >> 8) & 0xfff;
    let lo_minor = (lo_device & 0xff) | ((lo_device >> 12) & !0xff);
    u64::from(libc::major(st_dev)) == lo_major && u64::from(libc::minor(st_dev)) == lo_minor
}
