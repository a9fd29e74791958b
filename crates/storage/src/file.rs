//! `FileStorage`: a regular file or a block device, with an exclusive lock.
//!
//! The lock is a POSIX record lock (`fcntl(F_SETLK)`) over the whole device, so a
//! second process gets the holder's PID from `F_GETLK` and can name it. POSIX locks
//! do not conflict inside one process, so a process-wide table of open devices
//! refuses a second opener in the same process too.
//!
//! The same bytes can be reached by more than one inode, and a second opener must be
//! refused whichever it takes:
//! - a block device is opened with `O_EXCL`, which the kernel refuses while the
//!   device is mounted or another program holds it exclusively (a second device node
//!   made with `mknod` has its own inode, but not its own device);
//! - a loop device (or a partition of one) is a second inode for its backing file:
//!   the backing file is opened and locked as well (see `loop_device`), so an opener
//!   of the file finds the lock of an opener of the loop device, and the other way
//!   round. A backing file that cannot be reached (unlinked, or replaced at its path)
//!   cannot be locked, and the loop device is refused.
//!
//! A discard is `fallocate(PUNCH_HOLE | KEEP_SIZE)` on a file (the file system frees
//! the blocks; the length stays) and the `BLKDISCARD` ioctl on a block device (the
//! drive, thin volume or loop device below frees them). A file system or device
//! that cannot discard says so once (`EOPNOTSUPP`), and later discards are not tried.
//!
//! Whole pages of data go past the page cache ([`Storage::write_pages`]): a second
//! descriptor on the same open file (reopened through `/proc/self/fd`, so the same
//! inode whatever became of the path, and without `O_EXCL`, which a block device
//! grants once) carries `O_DIRECT`. The kernel writes back and drops any cached page
//! of the range before such a write and drops them again after it, so a buffered
//! read afterwards reads the new bytes, and a page dirtied earlier by a buffered
//! write of the same range cannot be written back over them later; the one hazard,
//! a buffered write racing a direct one over the same range, the engine never makes
//! (a block is written by the one packer that holds it). `fdatasync` on the first
//! descriptor makes both kinds durable: it syncs the inode (its data, the extents a
//! direct write allocated) and flushes the drive's cache, whichever descriptor wrote.
//! A file system that refuses `O_DIRECT` (at the open, or `EINVAL` at the first
//! write) is said once in the log, and its pages are written through the cache as
//! every other write is. The direct descriptor is closed only with the storage:
//! closing any descriptor of a file drops the process's record locks on it.

use crate::loop_device::{backing_of, same_device};
use crate::{
    check_bounds, discard_pages, DiscardOutcome, IoCounters, IoOp, Storage, StorageError,
    PAGE_BYTES,
};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed};

/// Who holds a device's lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockHolder {
    /// The holder's process id, when the OS reports it.
    pub pid: Option<u32>,
    /// The holder's command line, when readable.
    pub command: Option<String>,
}

impl std::fmt::Display for LockHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.pid, &self.command) {
            (Some(pid), Some(cmd)) => write!(f, "process {pid} ({cmd})"),
            (Some(pid), None) => write!(f, "process {pid}"),
            (None, Some(what)) => f.write_str(what),
            (None, None) => f.write_str("another program"),
        }
    }
}

/// Devices open in this process, by (st_dev, st_ino) or (st_rdev) identity.
static OPEN_IN_PROCESS: Mutex<Option<HashSet<(u64, u64)>>> = Mutex::new(None);

/// Loop devices resolved to their backing files at most this deep (a loop device
/// over a loop device over …); the kernel refuses cycles, so this only bounds work.
const LOOP_DEPTH_MAX: usize = 8;

/// What `O_EXCL` on a busy block device means, for the error.
const EXCLUSIVE_HOLDER: &str =
    "another opener the kernel knows of (a mount, a device-mapper target, or a program that opened it exclusively)";

/// `BLKDISCARD` from `<linux/fs.h>`: `_IO(0x12, 119)`; its argument is a `[u64; 2]`
/// of (offset, length) in bytes.
const BLKDISCARD: libc::c_ulong = 0x1277;
/// `BLKGETSIZE64` from `<linux/fs.h>`: `_IOR(0x12, 114, size_t)`.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// Whether discards are tried on a device ([`FileStorage::discard`]).
const DISCARD_ON: u8 = 0;
/// Turned off by the caller.
const DISCARD_OFF: u8 = 1;
/// The device or file system said it cannot discard.
const DISCARD_UNSUPPORTED: u8 = 2;

/// A file or block device.
pub struct FileStorage {
    file: File,
    /// Files opened only to hold their locks (never read: the locks last while
    /// they are open): the backing file of a loop device, and its own backing file
    /// if that is a loop device again.
    #[expect(dead_code, reason = "held for its record locks, released on drop")]
    held: Vec<File>,
    name: String,
    /// Whether this is a block device (discarded with `BLKDISCARD`, sized with
    /// `BLKGETSIZE64`) rather than a regular file.
    is_block: bool,
    /// As last measured, at open or by [`Storage::refresh_len`].
    len_bytes: AtomicU64,
    /// `DISCARD_ON`, `DISCARD_OFF` or `DISCARD_UNSUPPORTED`.
    discard: AtomicU8,
    /// Every identity this storage took in the process-wide table.
    identities: Vec<(u64, u64)>,
    counters: IoCounters,
    /// Whether the kernel takes `RWF_NOWAIT` reads on this file (cleared if refused).
    nowait: AtomicBool,
    /// The same file opened again with `O_DIRECT`, for [`Storage::write_pages`]; `None`
    /// where the open was refused (or the storage was opened to read).
    direct: Option<File>,
    /// Whether whole pages go through `direct` (cleared, once, if a write is refused).
    direct_on: AtomicBool,
}

impl std::fmt::Debug for FileStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStorage")
            .field("name", &self.name)
            .finish()
    }
}

fn io_err(
    name: &str,
    op: IoOp,
    offset_bytes: u64,
    len_bytes: u64,
    source: std::io::Error,
) -> StorageError {
    StorageError::from_os(name, op, offset_bytes, len_bytes, source)
}

impl FileStorage {
    /// Whether `[offset, offset+len)` lies inside the device.
    fn check_bounds(&self, op: IoOp, offset_bytes: u64, len: usize) -> Result<(), StorageError> {
        check_bounds(
            &self.name,
            op,
            offset_bytes,
            len as u64,
            self.len_bytes.load(Relaxed),
        )
    }

    /// Open an existing file or block device, read-write, and lock it exclusively.
    pub fn open(path: &Path) -> Result<Self, StorageError> {
        Self::open_inner(path, None)
    }

    /// Open (creating if missing) a regular file of at least `len_bytes`, sparse.
    /// A block device is opened as it is; `len_bytes` is then ignored.
    pub fn create(path: &Path, len_bytes: u64) -> Result<Self, StorageError> {
        Self::open_inner(path, Some(len_bytes))
    }

    /// Open an existing file or block device to read only, without a lock, while
    /// another program may hold it (`open_device` with `read_only`): to read a
    /// pool's identity from its first blocks. Writes fail (`EBADF`).
    pub fn open_read_only(path: &Path) -> Result<Self, StorageError> {
        let name = path.display().to_string();
        let file = File::open(path).map_err(|e| io_err(&name, IoOp::Open, 0, 0, e))?;
        let meta = file
            .metadata()
            .map_err(|e| io_err(&name, IoOp::Open, 0, 0, e))?;
        let storage = FileStorage {
            file,
            held: Vec::new(),
            name,
            is_block: meta.file_type().is_block_device(),
            len_bytes: AtomicU64::new(0),
            // Nothing is given back through a device opened to read.
            discard: AtomicU8::new(DISCARD_OFF),
            identities: Vec::new(),
            counters: IoCounters::default(),
            nowait: AtomicBool::new(true),
            direct: None,
            direct_on: AtomicBool::new(false),
        };
        storage.refresh_len()?;
        Ok(storage)
    }

    fn open_inner(path: &Path, create_len: Option<u64>) -> Result<Self, StorageError> {
        let name = path.display().to_string();
        let (file, meta) = open_locked(path, &name, create_len.is_some())?;
        let is_block = meta.file_type().is_block_device();
        let mut identities = vec![identity_of(&meta)];
        let mut held = Vec::new();
        if is_block {
            if let Err(e) = lock_backing_files(&file, &meta, &name, &mut held, &mut identities) {
                release_identities(&identities);
                return Err(e);
            }
        }
        let direct = open_direct(&file, &name);
        let storage = FileStorage {
            file,
            held,
            name,
            is_block,
            len_bytes: AtomicU64::new(0),
            discard: AtomicU8::new(DISCARD_ON),
            identities,
            counters: IoCounters::default(),
            nowait: AtomicBool::new(true),
            direct_on: AtomicBool::new(direct.is_some()),
            direct,
        };
        if let (Some(want), false) = (create_len, is_block) {
            if meta.len() < want {
                storage
                    .file
                    .set_len(want)
                    .map_err(|e| io_err(&storage.name, IoOp::Open, 0, want, e))?;
            }
        }
        storage.refresh_len()?;
        Ok(storage)
    }

    /// Whether whole pages are written past the page cache (`O_DIRECT`): false where
    /// the file system refused it, and on a storage opened to read.
    pub fn writes_pages_direct(&self) -> bool {
        self.direct_on.load(Relaxed)
    }

    /// Write `buf` at `offset_bytes` through the `O_DIRECT` descriptor, if there is
    /// one and the write is of whole, aligned pages: `Ok(false)` when it was not
    /// tried, or was refused (`EINVAL`: from then on, never tried again).
    fn write_direct(&self, buf: &[u8], offset_bytes: u64) -> std::io::Result<bool> {
        let Some(direct) = self
            .direct
            .as_ref()
            .filter(|_| self.direct_on.load(Relaxed))
        else {
            return Ok(false);
        };
        if !is_page_aligned(buf, offset_bytes) {
            return Ok(false);
        }
        match direct.write_all_at(buf, offset_bytes) {
            Ok(()) => Ok(true),
            // Nothing is known of what landed: the caller writes all of it again.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                if self.direct_on.swap(false, Relaxed) {
                    tracing::warn!(
                        "{}: the file system refused a direct write ({e}); data is written through the page cache",
                        self.name
                    );
                }
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Punch a hole (a file) or issue `BLKDISCARD` (a block device) over
    /// `[offset_bytes, offset_bytes+len_bytes)`, page-aligned by the caller.
    fn discard_range(&self, offset_bytes: u64, len_bytes: u64) -> std::io::Result<()> {
        let fd = self.file.as_raw_fd();
        if self.is_block {
            let range: [u64; 2] = [offset_bytes, len_bytes];
            // SAFETY: BLKDISCARD reads two u64s (offset, length) through the pointer,
            // which points at `range`; the descriptor is owned by `self.file`.
            let rc = unsafe { libc::ioctl(fd, BLKDISCARD as _, &range as *const [u64; 2]) };
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
            return Ok(());
        }
        let (Ok(offset), Ok(len)) = (
            libc::off_t::try_from(offset_bytes),
            libc::off_t::try_from(len_bytes),
        ) else {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        };
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        // SAFETY: fallocate on a descriptor owned by `self.file`; no memory is passed.
        let rc = unsafe { libc::fallocate(fd, mode, offset, len) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

/// (st_dev, st_ino) of a file; (u64::MAX, st_rdev) of a block device, whatever node
/// names it.
fn identity_of(meta: &std::fs::Metadata) -> (u64, u64) {
    if meta.file_type().is_block_device() {
        (u64::MAX, meta.rdev())
    } else {
        (meta.dev(), meta.ino())
    }
}

/// Open `path` read-write (a block device with `O_EXCL`) and lock it, in the process
/// table and with a record lock.
fn open_locked(
    path: &Path,
    name: &str,
    create: bool,
) -> Result<(File, std::fs::Metadata), StorageError> {
    let is_block = std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
    let mut options = OpenOptions::new();
    options
        .read(true)
        .write(true)
        .create(create)
        .truncate(false);
    if is_block {
        // O_EXCL without O_CREAT is defined for block devices only: an exclusive
        // claim the kernel refuses while the device is mounted or claimed.
        options.custom_flags(libc::O_EXCL);
    }
    // A pool holds every volume's bytes: a file made for one is its owner's only from
    // its first moment (whatever the umask), so no other user opens it even empty.
    options.mode(0o600);
    let file = options.open(path).map_err(|e| {
        if is_block && e.raw_os_error() == Some(libc::EBUSY) {
            StorageError::Locked {
                device: name.to_string(),
                holder: LockHolder {
                    pid: None,
                    command: Some(EXCLUSIVE_HOLDER.into()),
                },
            }
        } else {
            io_err(name, IoOp::Open, 0, 0, e)
        }
    })?;
    let meta = file
        .metadata()
        .map_err(|e| io_err(name, IoOp::Open, 0, 0, e))?;
    lock_exclusive(&file, name, identity_of(&meta))?;
    if create && meta.file_type().is_file() && meta.mode() & 0o077 != 0 {
        // A file made before (`truncate`, `fallocate`) becomes a pool: its owner's only.
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| io_err(name, IoOp::Open, 0, 0, e))?;
    }
    Ok((file, meta))
}

/// `file` opened again with `O_DIRECT` (same access, no `O_EXCL`, no lock of its own),
/// or `None`, said once in the log, where the file system refuses it.
fn open_direct(file: &File, name: &str) -> Option<File> {
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path);
    match opened {
        Ok(direct) => Some(direct),
        Err(e) => {
            tracing::warn!("{name}: cannot open it for direct writes ({e}); data is written through the page cache");
            None
        }
    }
}

/// Whether a write of `buf` at `offset_bytes` is of whole pages from page-aligned
/// memory, as `O_DIRECT` wants it (on any logical block size up to 4 KiB).
fn is_page_aligned(buf: &[u8], offset_bytes: u64) -> bool {
    !buf.is_empty()
        && (buf.as_ptr() as usize).is_multiple_of(PAGE_BYTES)
        && buf.len().is_multiple_of(PAGE_BYTES)
        && offset_bytes.is_multiple_of(PAGE_BYTES as u64)
}

/// If `device` is a loop device (or a partition of one), open and lock its backing
/// file, and that file's backing file if it is a loop device again. Each file
/// locked is pushed on `held` and its identity on `identities`.
fn lock_backing_files(
    device: &File,
    meta: &std::fs::Metadata,
    name: &str,
    held: &mut Vec<File>,
    identities: &mut Vec<(u64, u64)>,
) -> Result<(), StorageError> {
    let mut current_rdev = meta.rdev();
    for _ in 0..LOOP_DEPTH_MAX {
        let current = held.last().unwrap_or(device);
        let backing =
            backing_of(current, current_rdev).map_err(|e| io_err(name, IoOp::Open, 0, 0, e))?;
        let Some(backing) = backing else {
            return Ok(());
        };
        let unreachable = |why: &str| StorageError::BackingUnreachable {
            device: name.to_string(),
            backing: backing.path.display().to_string(),
            why: why.to_string(),
        };
        let backing_name = format!("{name} (a loop device over {})", backing.path.display());
        let (file, backing_meta) = match open_locked(&backing.path, &backing_name, false) {
            Ok(opened) => opened,
            Err(StorageError::Io { source, .. }) => {
                return Err(unreachable(&source.to_string()));
            }
            Err(other) => return Err(other),
        };
        identities.push(identity_of(&backing_meta));
        let is_block = backing_meta.file_type().is_block_device();
        let is_the_file =
            same_device(backing_meta.dev(), backing.dev) && backing_meta.ino() == backing.ino;
        held.push(file);
        if !is_block {
            if is_the_file {
                return Ok(());
            }
            return Err(unreachable(
                "the file at that path is not the one the loop device reads (renamed or replaced)",
            ));
        }
        // A loop device over a block device: that device was opened with O_EXCL
        // above; if it is a loop device again, lock its backing file too.
        current_rdev = backing_meta.rdev();
    }
    Err(StorageError::BackingUnreachable {
        device: name.to_string(),
        backing: "(loop devices nested too deep)".into(),
        why: format!("more than {LOOP_DEPTH_MAX} loop devices deep"),
    })
}

fn device_len(file: &File, is_block: bool) -> std::io::Result<u64> {
    if !is_block {
        return Ok(file.metadata()?.len());
    }
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at `size`.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size)
}

fn lock_exclusive(file: &File, name: &str, identity: (u64, u64)) -> Result<(), StorageError> {
    {
        let mut open = OPEN_IN_PROCESS.lock();
        let set = open.get_or_insert_with(HashSet::new);
        if !set.insert(identity) {
            return Err(StorageError::Locked {
                device: name.to_string(),
                holder: LockHolder {
                    pid: Some(std::process::id()),
                    command: Some("this process".into()),
                },
            });
        }
    }
    // SAFETY: an all-zero flock is a valid value; every field we rely on is set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as _;
    fl.l_whence = libc::SEEK_SET as _;
    fl.l_start = 0;
    fl.l_len = 0;
    // SAFETY: fcntl with F_SETLK reads the flock struct we own.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLK, &fl) };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    release_identities(&[identity]);
    // SAFETY: F_GETLK fills the struct we own with the conflicting lock, if any.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETLK, &mut fl) };
    let pid = if rc == 0 && fl.l_type != libc::F_UNLCK as _ {
        Some(fl.l_pid as u32)
    } else {
        None
    };
    if pid.is_none() && !matches!(err.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) {
        return Err(io_err(name, IoOp::Open, 0, 0, err));
    }
    let command = pid
        .and_then(|p| std::fs::read(format!("/proc/{p}/cmdline")).ok())
        .map(|raw| {
            raw.split(|b| *b == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        });
    Err(StorageError::Locked {
        device: name.to_string(),
        holder: LockHolder { pid, command },
    })
}

fn release_identities(identities: &[(u64, u64)]) {
    if let Some(set) = OPEN_IN_PROCESS.lock().as_mut() {
        for identity in identities {
            set.remove(identity);
        }
    }
}

impl Drop for FileStorage {
    fn drop(&mut self) {
        release_identities(&self.identities);
    }
}

impl Storage for FileStorage {
    fn read_at(&self, buf: &mut [u8], offset_bytes: u64) -> Result<(), StorageError> {
        self.check_bounds(IoOp::Read, offset_bytes, buf.len())?;
        self.file
            .read_exact_at(buf, offset_bytes)
            .map_err(|e| io_err(&self.name, IoOp::Read, offset_bytes, buf.len() as u64, e))?;
        self.counters.count_read(buf.len());
        Ok(())
    }

    /// `preadv2(RWF_NOWAIT)`: the kernel reads only from the page cache, and says
    /// `EAGAIN` rather than wait for the device. Any refusal or short read is "would
    /// wait": the caller then reads the ordinary way, which reports real errors.
    fn read_at_cached(&self, buf: &mut [u8], offset_bytes: u64) -> Result<bool, StorageError> {
        self.check_bounds(IoOp::Read, offset_bytes, buf.len())?;
        if !self.nowait.load(Relaxed) {
            return Ok(false);
        }
        let Ok(offset) = libc::off_t::try_from(offset_bytes) else {
            return Ok(false);
        };
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: `iov` describes `buf`, which is valid for writes of its length and
        // outlives the call; the descriptor is owned by `self.file`.
        let n = unsafe { libc::preadv2(self.file.as_raw_fd(), &iov, 1, offset, libc::RWF_NOWAIT) };
        if n < 0 {
            let errno = std::io::Error::last_os_error().raw_os_error();
            if matches!(
                errno,
                Some(libc::EOPNOTSUPP) | Some(libc::EINVAL) | Some(libc::ENOSYS)
            ) {
                self.nowait.store(false, Relaxed);
            }
            return Ok(false);
        }
        if n as usize != buf.len() {
            return Ok(false);
        }
        self.counters.count_read(buf.len());
        Ok(true)
    }

    fn write_at(&self, buf: &[u8], offset_bytes: u64) -> Result<(), StorageError> {
        self.check_bounds(IoOp::Write, offset_bytes, buf.len())?;
        self.file
            .write_all_at(buf, offset_bytes)
            .map_err(|e| io_err(&self.name, IoOp::Write, offset_bytes, buf.len() as u64, e))?;
        self.counters.count_write(buf.len());
        Ok(())
    }

    /// Through the `O_DIRECT` descriptor when the write is of whole aligned pages and
    /// the file system takes it; otherwise as [`FileStorage::write_at`].
    fn write_pages(&self, buf: &[u8], offset_bytes: u64) -> Result<(), StorageError> {
        self.check_bounds(IoOp::Write, offset_bytes, buf.len())?;
        let direct = self
            .write_direct(buf, offset_bytes)
            .map_err(|e| io_err(&self.name, IoOp::Write, offset_bytes, buf.len() as u64, e))?;
        if !direct {
            self.file
                .write_all_at(buf, offset_bytes)
                .map_err(|e| io_err(&self.name, IoOp::Write, offset_bytes, buf.len() as u64, e))?;
        }
        self.counters.count_write(buf.len());
        Ok(())
    }

    /// `fdatasync` of the first descriptor: the inode's, so it covers direct writes too.
    fn flush(&self) -> Result<(), StorageError> {
        self.file
            .sync_data()
            .map_err(|e| io_err(&self.name, IoOp::Flush, 0, 0, e))?;
        if !self.is_block {
            // A regular file another program truncated: writes past its new end
            // grow it back with holes, so nothing else would ever notice.
            let len_bytes = self
                .file
                .metadata()
                .map_err(|e| io_err(&self.name, IoOp::Flush, 0, 0, e))?
                .len();
            let expected_bytes = self.len_bytes.load(Relaxed);
            if len_bytes < expected_bytes {
                return Err(StorageError::Shrunk {
                    device: self.name.clone(),
                    len_bytes,
                    expected_bytes,
                });
            }
        }
        self.counters.count_flush();
        Ok(())
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> Result<DiscardOutcome, StorageError> {
        check_bounds(
            &self.name,
            IoOp::Discard,
            offset_bytes,
            len_bytes,
            self.len_bytes.load(Relaxed),
        )?;
        match self.discard.load(Relaxed) {
            DISCARD_OFF => return Ok(DiscardOutcome::Disabled),
            DISCARD_UNSUPPORTED => return Ok(DiscardOutcome::Unsupported),
            _ => {}
        }
        let Some((offset, len)) = discard_pages(offset_bytes, len_bytes) else {
            return Ok(DiscardOutcome::Discarded);
        };
        match self.discard_range(offset, len) {
            Ok(()) => {
                self.counters.count_discard(len);
                Ok(DiscardOutcome::Discarded)
            }
            // EOPNOTSUPP: the file system has no hole punching, or the device no
            // discard. ENOTTY: a block device without the ioctl.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOTTY)) => {
                // Only ON becomes UNSUPPORTED: a caller's OFF stays off.
                let _ = self.discard.compare_exchange(
                    DISCARD_ON,
                    DISCARD_UNSUPPORTED,
                    Relaxed,
                    Relaxed,
                );
                Ok(DiscardOutcome::Unsupported)
            }
            Err(e) => Err(io_err(&self.name, IoOp::Discard, offset, len, e)),
        }
    }

    /// Off is remembered; on again tries the device again, even one that said it
    /// cannot discard (it may have been reconfigured).
    fn set_discard_enabled(&self, enabled: bool) {
        let state = if enabled { DISCARD_ON } else { DISCARD_OFF };
        self.discard.store(state, Relaxed);
    }

    fn len_bytes(&self) -> u64 {
        self.len_bytes.load(Relaxed)
    }

    fn refresh_len(&self) -> Result<u64, StorageError> {
        let len = device_len(&self.file, self.is_block)
            .map_err(|e| io_err(&self.name, IoOp::Open, 0, 0, e))?;
        self.len_bytes.store(len, Relaxed);
        Ok(len)
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn counters(&self) -> &IoCounters {
        &self.counters
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use std::os::unix::io::AsRawFd;

    /// A read that would wait for the disk is refused by `read_at_cached`, and the same
    /// bytes are read from the page cache once an ordinary read brought them in.
    // A file truncated under an open pool went unnoticed: writes past the new end grew
    // it back with holes and every flush succeeded.
    #[test]
    fn a_flush_reports_a_file_truncated_while_open() {
        let dir = std::env::temp_dir().join(format!("fewerbytes-shrunk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dev");
        let dev = FileStorage::create(&path, 1 << 20).unwrap();
        dev.flush().unwrap();
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4096)
            .unwrap();
        dev.write_at(&[7; 4096], 65536).unwrap();
        match dev.flush() {
            Err(StorageError::Shrunk {
                len_bytes,
                expected_bytes,
                ..
            }) => {
                assert_eq!(len_bytes, 65536 + 4096);
                assert_eq!(expected_bytes, 1 << 20);
            }
            other => panic!("flush of a truncated file: {other:?}"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cached_reads_come_only_from_the_page_cache() {
        // Under the build's target folder: on a disk (a tmpfs /tmp never evicts).
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../target")
            .join(format!("fewerbytes-storage-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("dev");
        let dev = FileStorage::create(&path, 1 << 20).expect("create");
        let data: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7 + i / 4096) as u8).collect();
        dev.write_at(&data, 0).expect("write");
        dev.flush().expect("flush");
        // Clean pages (after the fsync) leave the cache on request.
        // SAFETY: a valid descriptor; the call only advises the kernel.
        let rc =
            unsafe { libc::posix_fadvise(dev.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(rc, 0, "posix_fadvise");
        let mut buf = vec![0u8; 8192];
        assert!(
            !dev.read_at_cached(&mut buf, 65536).expect("cached read"),
            "bytes that are only on the disk were read without waiting"
        );
        dev.read_at(&mut buf, 65536).expect("read");
        let mut again = vec![0u8; 8192];
        assert!(
            dev.read_at_cached(&mut again, 65536).expect("cached read"),
            "bytes just read are in the page cache"
        );
        assert!(
            again == data[65536..65536 + 8192],
            "cached read returned other bytes"
        );
        drop(dev);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
