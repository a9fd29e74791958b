//! `FileStorage`: a regular file or a block device, with an exclusive lock.
//!
//! The lock is a POSIX record lock (`fcntl(F_SETLK)`) over the whole device, so a
//! second process gets the holder's PID from `F_GETLK` and can name it. POSIX locks
//! do not conflict inside one process, so a process-wide table of open devices
//! refuses a second opener in the same process too.

use crate::{check_bounds, IoCounters, IoOp, Storage, StorageError};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

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
            _ => f.write_str("this process"),
        }
    }
}

/// Devices open in this process, by (st_dev, st_ino) or (st_rdev) identity.
static OPEN_IN_PROCESS: Mutex<Option<HashSet<(u64, u64)>>> = Mutex::new(None);

/// A file or block device.
pub struct FileStorage {
    file: File,
    name: String,
    len_bytes: u64,
    identity: (u64, u64),
    counters: IoCounters,
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
    StorageError::Io {
        device: name.to_string(),
        op,
        offset_bytes,
        len_bytes,
        source,
    }
}

impl FileStorage {
    /// Open an existing file or block device, read-write, and lock it exclusively.
    pub fn open(path: &Path) -> Result<Self, StorageError> {
        Self::open_inner(path, None)
    }

    /// Open (creating if missing) a regular file of at least `len_bytes`, sparse.
    /// A block device is opened as it is; `len_bytes` is then ignored.
    pub fn create(path: &Path, len_bytes: u64) -> Result<Self, StorageError> {
        Self::open_inner(path, Some(len_bytes))
    }

    fn open_inner(path: &Path, create_len: Option<u64>) -> Result<Self, StorageError> {
        let name = path.display().to_string();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create_len.is_some())
            .truncate(false)
            .open(path)
            .map_err(|e| io_err(&name, IoOp::Open, 0, 0, e))?;
        let meta = file
            .metadata()
            .map_err(|e| io_err(&name, IoOp::Open, 0, 0, e))?;
        let is_block = meta.file_type().is_block_device();
        let identity = if is_block {
            (u64::MAX, meta.rdev())
        } else {
            (meta.dev(), meta.ino())
        };
        lock_exclusive(&file, &name, identity)?;
        let mut storage = FileStorage {
            file,
            name,
            len_bytes: 0,
            identity,
            counters: IoCounters::default(),
        };
        if let (Some(want), false) = (create_len, is_block) {
            if meta.len() < want {
                storage
                    .file
                    .set_len(want)
                    .map_err(|e| io_err(&storage.name, IoOp::Open, 0, want, e))?;
            }
        }
        storage.len_bytes = device_len(&storage.file, is_block)
            .map_err(|e| io_err(&storage.name, IoOp::Open, 0, 0, e))?;
        Ok(storage)
    }
}

fn device_len(file: &File, is_block: bool) -> std::io::Result<u64> {
    if !is_block {
        return Ok(file.metadata()?.len());
    }
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at `size`.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), 0x8008_1272, &mut size as *mut u64) };
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
    release_identity(identity);
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

fn release_identity(identity: (u64, u64)) {
    if let Some(set) = OPEN_IN_PROCESS.lock().as_mut() {
        set.remove(&identity);
    }
}

impl Drop for FileStorage {
    fn drop(&mut self) {
        release_identity(self.identity);
    }
}

impl Storage for FileStorage {
    fn read_at(&self, buf: &mut [u8], offset_bytes: u64) -> Result<(), StorageError> {
        check_bounds(
            &self.name,
            IoOp::Read,
            offset_bytes,
            buf.len() as u64,
            self.len_bytes,
        )?;
        self.file
            .read_exact_at(buf, offset_bytes)
            .map_err(|e| io_err(&self.name, IoOp::Read, offset_bytes, buf.len() as u64, e))?;
        self.counters.count_read(buf.len());
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset_bytes: u64) -> Result<(), StorageError> {
        check_bounds(
            &self.name,
            IoOp::Write,
            offset_bytes,
            buf.len() as u64,
            self.len_bytes,
        )?;
        self.file
            .write_all_at(buf, offset_bytes)
            .map_err(|e| io_err(&self.name, IoOp::Write, offset_bytes, buf.len() as u64, e))?;
        self.counters.count_write(buf.len());
        Ok(())
    }

    fn flush(&self) -> Result<(), StorageError> {
        self.file
            .sync_data()
            .map_err(|e| io_err(&self.name, IoOp::Flush, 0, 0, e))?;
        self.counters.count_flush();
        Ok(())
    }

    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn counters(&self) -> &IoCounters {
        &self.counters
    }
}
