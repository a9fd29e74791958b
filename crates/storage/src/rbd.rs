//! `RbdStorage`: an image of a Ceph RBD pool, through librbd (loaded at run time,
//! see `rbd_lib`).
//!
//! How the [`Storage`] contract maps onto librbd:
//! - `read_at`/`write_at` are `rbd_read2`/`rbd_write2` (synchronous). librbd's
//!   cache may acknowledge a write it has not sent to the OSDs; such a write is
//!   visible to this handle's later reads, like an unflushed write to a file.
//!   With the cache on (librbd's default), a synchronous write returns once in the
//!   cache, which writes back with many requests in flight: the engine's threads
//!   need no deeper queue (docs/benchmarks.md, "RBD: queue depth").
//! - `write_batch` is `rbd_aio_write2`, up to [`AIO_IN_FLIGHT_MAX`] in flight
//!   (`rbd_aio.rs`): what a checkpoint writes, which with the cache off would
//!   otherwise wait one round trip per page.
//! - `flush` is `rbd_flush`: its result, and only its result, says the writes that
//!   returned before it are on the OSDs. A client cut off from the cluster (its lock
//!   broken, its address blocklisted) can have writes acknowledged by the cache that
//!   never land; its flush fails, and the engine latches on a failed flush.
//! - `discard` is `rbd_discard` of the whole 4 KiB pages of the range (librbd frees
//!   whole objects, and zeroes or skips partial ones: both are allowed).
//! - `len_bytes` is the image's size at open or at the last `refresh_len`
//!   (`rbd_get_size`); a flush that finds the image shrunk fails
//!   ([`StorageError::Shrunk`]), as for a file.
//! - errors are librbd's negative errno values: `ENOSPC`/`EDQUOT` on a write or a
//!   discard are [`StorageError::NoSpace`], everything else [`StorageError::Io`].
//!
//! A full pool fails writes instead of holding them. By default a librados client
//! holds every write to a pool flagged full (an OSD past `mon_osd_full_ratio`, or the
//! pool past a quota, `ceph osd pool set-quota`) until the flag is cleared: each
//! librbd call waits, with no timeout, and so does an open (it writes the image's
//! header). This handle's I/O context is made *full-try*
//! (`rados_set_pool_full_try`, which librbd 16 carries into the contexts it makes for
//! the image): its writes are sent to a full pool all the same, and the OSD answers
//! one that would add bytes or objects with `EDQUOT` (a quota) or `ENOSPC` (a full
//! OSD); overwrites within an object's size, reads, discards and flushes go on. Who
//! hears the refusal depends on librbd's cache:
//! - on (librbd's default, and what fewerbytes leaves it at): the write was
//!   acknowledged by the cache, and the refusal comes back from the next flush, which
//!   fails: the engine latches the pool read-only (every write flushed before stays;
//!   those since are lost, as in a crash), and a restart once there is room serves
//!   again;
//! - off (`rbd cache = false` in ceph.conf, or [`DeviceOptions::write_through`]): the
//!   write itself fails with [`StorageError::NoSpace`], the pool stays writable and
//!   takes the write once there is room, at a large price in write speed (each write
//!   waits for the OSDs: docs/benchmarks.md, "RBD: fewerbytes with librbd's cache off
//!   and on").
//!
//! Either way nothing is held. Not covered: an OSD that really runs out of space
//! (past `osd_failsafe_full_ratio`, which the mon's full flag is there to keep it
//! from) drops writes or stops, and its clients wait for it as for any OSD that is
//! down; librados has only a timeout for that (`rados_osd_op_timeout`), left unset,
//! since it would fail the I/O of a briefly slow cluster too.
//!
//! Threads: the engine reads and writes from several threads on one handle. librbd
//! serves concurrent calls on one `rbd_image_t` (its `ImageCtx` takes its own locks;
//! QEMU and rbd-nbd share one handle among their I/O threads); what it forbids is
//! closing the handle while a call is in flight, which `Drop` (by `&mut self`)
//! rules out.
//!
//! One owner per image. A read-write open takes the image's exclusive lock
//! (`rbd_lock_acquire`) and keeps it until close: a lock taken that way is
//! *managed*, and librbd then answers another client's request for it with a
//! refusal instead of handing it over (which is what its transparent locking does
//! for a plain writer). An image whose lock another client holds is refused,
//! naming the holder ([`StorageError::Owned`]), unless the open is a take-over
//! ([`crate::TakeOver`]): then the holder's client address is blocklisted on the
//! cluster (`rados_blocklist_add`, which returns once the OSD map carrying it is
//! out) and its lock broken (`rbd_lock_break`) before the lock is taken. A
//! blocklisted client's writes are refused by the OSDs (`ESHUTDOWN`, Ceph's
//! `EBLOCKLISTED`): its writes and flushes fail with [`StorageError::Fenced`], and
//! its watch on the image (`rbd_watch.rs`) tells [`Storage::on_fenced`] even while
//! nothing is written. An image without the `exclusive-lock` feature cannot
//! be owned and is refused for read-write ([`StorageError::NotLockable`]). Within
//! this process a second read-write open of the same image (same cluster fsid,
//! pool and name) is refused with [`StorageError::Locked`].

use crate::rbd_aio::{InFlight, AIO_IN_FLIGHT_MAX};
use crate::rbd_lib::{self, errno_error, Image, Ioctx, Lib, Rados};
use crate::rbd_lock::Owning;
use crate::rbd_watch::OwnerWatch;
use crate::{
    check_batch_bounds, check_bounds, discard_pages, DeviceOptions, DiscardOutcome, FencedListener,
    IoCounters, IoOp, LockHolder, Storage, StorageError,
};
use parking_lot::Mutex;
use std::collections::{HashSet, VecDeque};
use std::ffi::{c_char, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// librbd takes at most `INT_MAX` bytes per call (its results are `int`); larger
/// requests are cut into pieces of this size.
const CALL_BYTES_MAX: usize = 1 << 30;

/// `EBLOCKLISTED` in Ceph's headers is `ESHUTDOWN`: what the OSDs answer a client
/// whose address is blocklisted.
const EBLOCKLISTED: i32 = libc::ESHUTDOWN;

/// RBD image feature bits (`RBD_FEATURE_*` in `rbd/features.h`) and their names as
/// `rbd info` prints them.
const FEATURES: [(u64, &str); 11] = [
    (1 << 0, "layering"),
    (1 << 1, "striping"),
    (1 << 2, "exclusive-lock"),
    (1 << 3, "object-map"),
    (1 << 4, "fast-diff"),
    (1 << 5, "deep-flatten"),
    (1 << 6, "journaling"),
    (1 << 7, "data-pool"),
    (1 << 8, "operations"),
    (1 << 9, "migrating"),
    (1 << 10, "non-primary"),
];

/// Images open in this process, by (cluster fsid, pool, image).
static OPEN_IN_PROCESS: Mutex<Option<HashSet<(String, String, String)>>> = Mutex::new(None);

/// Open `pool/image` on a Ceph cluster as a [`Storage`].
///
/// `cluster` is the cluster's name (default `ceph`: the conf file searched is
/// `/etc/ceph/$cluster.conf`), `id` the client's id (default `admin`, i.e.
/// `client.admin`), `conf` a ceph.conf to read instead of the default search
/// (`$CEPH_CONF`, `/etc/ceph/$cluster.conf`, `~/.ceph/config`, `./ceph.conf`).
/// `CEPH_ARGS` is honoured. The image must exist (`rbd create`).
pub fn open_rbd(
    pool: &str,
    image: &str,
    cluster: Option<&str>,
    id: Option<&str>,
    conf: Option<&Path>,
) -> Result<Box<dyn Storage>, StorageError> {
    Ok(Box::new(RbdStorage::open(pool, image, cluster, id, conf)?))
}

/// An open RBD image.
pub struct RbdStorage {
    lib: &'static Lib,
    rados: Rados,
    ioctx: Ioctx,
    image: Image,
    /// `rbd:POOL/IMAGE[@CLUSTER]`.
    name: String,
    /// The key in `OPEN_IN_PROCESS`.
    key: (String, String, String),
    /// Whether `key` was taken there (a read-write open), and is released on drop.
    registered: bool,
    /// Whether this handle took the image's exclusive lock (a read-write open).
    owner: bool,
    /// The watch that finds the image taken over while idle (`rbd_watch.rs`).
    watch: Option<OwnerWatch>,
    len: AtomicU64,
    features: u64,
    discard_enabled: AtomicBool,
    counters: IoCounters,
}

// SAFETY: the handles are pointers to librados/librbd objects that are not tied to
// the thread that made them; librbd serves concurrent calls on one image handle and
// librados on one cluster handle (see the module's comment). They are released only
// in `Drop`, which no other reference can race.
unsafe impl Send for RbdStorage {}
// SAFETY: as for Send: every `&self` method is a librbd call that is safe to make
// from several threads at once on one handle.
unsafe impl Sync for RbdStorage {}

/// Handles made so far while opening, released in reverse on an error.
struct Opening {
    lib: &'static Lib,
    rados: Rados,
    ioctx: Ioctx,
}

impl Drop for Opening {
    fn drop(&mut self) {
        // SAFETY: each handle is non-NULL only if its create call succeeded, and is
        // released once, here (an `RbdStorage` takes them and nulls these first).
        unsafe {
            if !self.ioctx.is_null() {
                (self.lib.rados_ioctx_destroy)(self.ioctx);
            }
            if !self.rados.is_null() {
                (self.lib.rados_shutdown)(self.rados);
            }
        }
    }
}

/// The error of a failed write, flush or discard on an image: [`StorageError::Fenced`]
/// when this client owned the image and the cluster now refuses it (blocklisted:
/// `ESHUTDOWN`; or its lock lost: `EROFS`, librbd's answer to a write without the
/// lock it cannot take back), else as [`StorageError::from_os`].
fn write_error(
    device: &str,
    owner: bool,
    op: IoOp,
    offset_bytes: u64,
    len_bytes: u64,
    r: i64,
) -> StorageError {
    let source = errno_error(r);
    let fenced = matches!(source.raw_os_error(), Some(EBLOCKLISTED | libc::EROFS));
    if owner && fenced {
        return StorageError::Fenced {
            device: device.to_string(),
            op,
            source,
        };
    }
    StorageError::from_os(device, op, offset_bytes, len_bytes, source)
}

fn c_string(what: &str, value: &[u8], device: &str) -> Result<CString, StorageError> {
    CString::new(value).map_err(|_| StorageError::Io {
        device: device.to_string(),
        op: IoOp::Open,
        offset_bytes: 0,
        len_bytes: 0,
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("the {what} contains a NUL byte"),
        ),
    })
}

/// Set a config option on a configuring cluster handle; the negative errno.
fn set_conf(lib: &Lib, rados: Rados, option: &str, value: &str) -> Result<(), i64> {
    let option = CString::new(option).map_err(|_| -i64::from(libc::EINVAL))?;
    let value = CString::new(value).map_err(|_| -i64::from(libc::EINVAL))?;
    // SAFETY: a created, not yet connected handle (librbd reads its options from the
    // handle's context when an image is opened); both strings are NUL-terminated and
    // only read during the call.
    let r = unsafe { (lib.rados_conf_set)(rados, option.as_ptr(), value.as_ptr()) };
    if r < 0 {
        return Err(r.into());
    }
    Ok(())
}

impl RbdStorage {
    /// Open `pool/image` (see [`open_rbd`]).
    pub fn open(
        pool: &str,
        image: &str,
        cluster: Option<&str>,
        id: Option<&str>,
        conf: Option<&Path>,
    ) -> Result<RbdStorage, StorageError> {
        Self::open_with(pool, image, cluster, id, conf, &DeviceOptions::default())
    }

    /// Open `pool/image` as [`RbdStorage::open`] does (read-write, taking the image's
    /// exclusive lock), as a take-over of a dead holder's lock
    /// ([`DeviceOptions::take_over`]), or with `read_only` by `rbd_open_read_only`:
    /// to read while another client writes (librbd then refuses every write with
    /// `EROFS`); such an opener takes no lock and is not counted as this process's
    /// one opener of the image.
    pub fn open_with(
        pool: &str,
        image: &str,
        cluster: Option<&str>,
        id: Option<&str>,
        conf: Option<&Path>,
        options: &DeviceOptions,
    ) -> Result<RbdStorage, StorageError> {
        let read_only = options.read_only;
        let name = match cluster {
            Some(c) => format!("rbd:{pool}/{image}@{c}"),
            None => format!("rbd:{pool}/{image}"),
        };
        let open_error = |what: String, r: i64| StorageError::Io {
            device: name.clone(),
            op: IoOp::Open,
            offset_bytes: 0,
            len_bytes: 0,
            source: std::io::Error::new(
                errno_error(r).kind(),
                format!("{what}: {}", errno_error(r)),
            ),
        };
        let lib = rbd_lib::lib().map_err(|why| StorageError::Io {
            device: name.clone(),
            op: IoOp::Open,
            offset_bytes: 0,
            len_bytes: 0,
            source: std::io::Error::new(std::io::ErrorKind::NotFound, why),
        })?;
        let cluster_c = c_string("cluster name", cluster.unwrap_or("ceph").as_bytes(), &name)?;
        let client_c = c_string(
            "client id",
            format!("client.{}", id.unwrap_or("admin")).as_bytes(),
            &name,
        )?;
        let pool_c = c_string("pool name", pool.as_bytes(), &name)?;
        let image_c = c_string("image name", image.as_bytes(), &name)?;
        let conf_c = conf
            .map(|p| c_string("conf path", p.as_os_str().as_bytes(), &name))
            .transpose()?;

        let mut h = Opening {
            lib,
            rados: std::ptr::null_mut(),
            ioctx: std::ptr::null_mut(),
        };
        // SAFETY: the out-pointer is valid; both names are NUL-terminated and only
        // read during the call. On success `h.rados` is a handle to shut down once.
        let r =
            unsafe { (lib.rados_create2)(&mut h.rados, cluster_c.as_ptr(), client_c.as_ptr(), 0) };
        if r < 0 {
            h.rados = std::ptr::null_mut();
            return Err(open_error("rados_create2".into(), r.into()));
        }
        let conf_ptr = conf_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
        // SAFETY: a configuring (not yet connected) handle; NULL asks librados to
        // search the default paths, otherwise a NUL-terminated path.
        let r = unsafe { (lib.rados_conf_read_file)(h.rados, conf_ptr) };
        if r < 0 {
            let what = match conf {
                Some(p) => format!("cannot read {}", p.display()),
                None => "no ceph.conf found ($CEPH_CONF, /etc/ceph/$cluster.conf)".into(),
            };
            return Err(open_error(what, r.into()));
        }
        // SAFETY: a configuring handle; NULL means the `CEPH_ARGS` variable.
        let r = unsafe { (lib.rados_conf_parse_env)(h.rados, std::ptr::null()) };
        if r < 0 {
            return Err(open_error("bad CEPH_ARGS".into(), r.into()));
        }
        if options.write_through {
            // Each write's own result says whether it landed (the module's
            // comment), whatever ceph.conf or CEPH_ARGS say.
            set_conf(lib, h.rados, "rbd_cache", "false")
                .map_err(|r| open_error("rbd_cache".into(), r))?;
        }
        if options.take_over.is_some() && !read_only {
            // A take-over blocklists the old holder itself (`Owning::take`), with the
            // expiry asked for: librbd's own blocklist on a lock break sends an
            // expiry the Ceph 16.2 monitor refuses (EINVAL, see docs/ceph.md), so
            // it is turned off for this client.
            set_conf(lib, h.rados, "rbd_blocklist_on_break_lock", "false")
                .map_err(|r| open_error("rbd_blocklist_on_break_lock".into(), r))?;
        }
        // SAFETY: a configured handle, connected once.
        let r = unsafe { (lib.rados_connect)(h.rados) };
        if r < 0 {
            return Err(open_error("cannot connect to the cluster".into(), r.into()));
        }
        let mut fsid = [0u8; 64];
        // SAFETY: a connected handle; the buffer is valid for its length, and
        // librados writes a NUL-terminated fsid of at most 37 bytes into it.
        let r = unsafe {
            (lib.rados_cluster_fsid)(h.rados, fsid.as_mut_ptr().cast::<c_char>(), fsid.len())
        };
        if r < 0 {
            return Err(open_error("rados_cluster_fsid".into(), r.into()));
        }
        let fsid_end = fsid.iter().position(|&b| b == 0).unwrap_or(fsid.len());
        let fsid = String::from_utf8_lossy(fsid.get(..fsid_end).unwrap_or_default()).into_owned();
        // SAFETY: a connected handle, a NUL-terminated pool name, a valid
        // out-pointer. On success `h.ioctx` is destroyed once, before shutdown.
        let r = unsafe { (lib.rados_ioctx_create)(h.rados, pool_c.as_ptr(), &mut h.ioctx) };
        if r < 0 {
            h.ioctx = std::ptr::null_mut();
            return Err(open_error(format!("no pool {pool}"), r.into()));
        }
        // SAFETY: a valid ioctx, made above and not yet shared. A full pool then
        // answers this handle's writes with ENOSPC/EDQUOT instead of holding them
        // (the module's comment); librbd copies the flag into the I/O contexts it
        // makes from this one at `rbd_open`.
        unsafe { (lib.rados_set_pool_full_try)(h.ioctx) };

        let key = (fsid, pool.to_string(), image.to_string());
        if !read_only {
            let mut open = OPEN_IN_PROCESS.lock();
            let open = open.get_or_insert_with(HashSet::new);
            if !open.insert(key.clone()) {
                return Err(StorageError::Locked {
                    device: name,
                    holder: LockHolder {
                        pid: Some(std::process::id()),
                        command: Some("this process".to_string()),
                    },
                });
            }
        }
        let forget = |key: &(String, String, String)| {
            if read_only {
                return;
            }
            if let Some(open) = OPEN_IN_PROCESS.lock().as_mut() {
                open.remove(key);
            }
        };

        let mut handle: Image = std::ptr::null_mut();
        let open_fn = if read_only {
            lib.rbd_open_read_only
        } else {
            lib.rbd_open
        };
        // SAFETY: a valid ioctx, a NUL-terminated image name, a valid out-pointer,
        // NULL for no snapshot (the image itself; writable unless read-only).
        let r = unsafe { open_fn(h.ioctx, image_c.as_ptr(), &mut handle, std::ptr::null()) };
        if r < 0 {
            forget(&key);
            return Err(open_error(
                format!("no image {image} in pool {pool}"),
                r.into(),
            ));
        }
        let mut len = 0u64;
        let mut features = 0u64;
        // SAFETY: an open image and valid out-pointers.
        let r = unsafe { (lib.rbd_get_size)(handle, &mut len) };
        // SAFETY: as above.
        let r2 = if r >= 0 {
            unsafe { (lib.rbd_get_features)(handle, &mut features) }
        } else {
            r
        };
        if r2 < 0 {
            // SAFETY: the image was opened above and is closed once, here.
            unsafe { (lib.rbd_close)(handle) };
            forget(&key);
            return Err(open_error("cannot size the image".into(), r2.into()));
        }
        if !read_only {
            let owned = Owning {
                lib,
                rados: h.rados,
                image: handle,
                name: &name,
                spec: match cluster {
                    Some(c) => format!("--cluster {c} {pool}/{image}"),
                    None => format!("{pool}/{image}"),
                },
            }
            .take(features, options);
            if let Err(e) = owned {
                // SAFETY: the image was opened above and is closed once, here.
                unsafe { (lib.rbd_close)(handle) };
                forget(&key);
                return Err(e);
            }
        }
        let watch = if read_only {
            None
        } else {
            OwnerWatch::start(lib, handle, &name)
        };
        let storage = RbdStorage {
            lib,
            rados: h.rados,
            ioctx: h.ioctx,
            image: handle,
            name,
            key,
            registered: !read_only,
            owner: !read_only,
            watch,
            len: AtomicU64::new(len),
            features,
            discard_enabled: AtomicBool::new(true),
            counters: IoCounters::default(),
        };
        // The storage owns the handles now.
        h.rados = std::ptr::null_mut();
        h.ioctx = std::ptr::null_mut();
        Ok(storage)
    }

    /// The image's features, by the names `rbd info` prints (`exclusive-lock`, …).
    pub fn feature_names(&self) -> Vec<&'static str> {
        FEATURES
            .iter()
            .filter(|(bit, _)| self.features & bit != 0)
            .map(|&(_, name)| name)
            .collect()
    }

    /// Resize the image to `len_bytes` (`rbd_resize`) and measure it again.
    pub fn resize(&self, len_bytes: u64) -> Result<u64, StorageError> {
        // SAFETY: an open image; librbd serialises a resize against in-flight I/O.
        let r = unsafe { (self.lib.rbd_resize)(self.image, len_bytes) };
        if r < 0 {
            return Err(StorageError::from_os(
                &self.name,
                IoOp::Open,
                0,
                len_bytes,
                errno_error(r.into()),
            ));
        }
        self.refresh_len()
    }

    /// The error of a write of `len_bytes` at `offset_bytes` whose librbd result is
    /// `r`: none for a success (the length written, or 0 from an aio write).
    fn write_result(
        &self,
        offset_bytes: u64,
        len_bytes: usize,
        r: isize,
    ) -> Result<(), StorageError> {
        if r < 0 {
            return Err(write_error(
                &self.name,
                self.owner,
                IoOp::Write,
                offset_bytes,
                len_bytes as u64,
                r as i64,
            ));
        }
        Ok(())
    }

    fn size_now(&self) -> Result<u64, StorageError> {
        let mut len = 0u64;
        // SAFETY: an open image and a valid out-pointer.
        let r = unsafe { (self.lib.rbd_get_size)(self.image, &mut len) };
        if r < 0 {
            return Err(StorageError::from_os(
                &self.name,
                IoOp::Open,
                0,
                0,
                errno_error(r.into()),
            ));
        }
        Ok(len)
    }
}

impl Storage for RbdStorage {
    fn read_at(&self, buf: &mut [u8], offset_bytes: u64) -> Result<(), StorageError> {
        check_bounds(
            &self.name,
            IoOp::Read,
            offset_bytes,
            buf.len() as u64,
            self.len_bytes(),
        )?;
        let mut at = offset_bytes;
        for piece in buf.chunks_mut(CALL_BYTES_MAX) {
            // SAFETY: an open image; `piece` is valid for writes of its length for
            // the whole (synchronous) call.
            let r = unsafe {
                (self.lib.rbd_read2)(
                    self.image,
                    at,
                    piece.len(),
                    piece.as_mut_ptr().cast::<c_char>(),
                    0,
                )
            };
            if r < 0 || r as usize != piece.len() {
                let source = if r < 0 {
                    errno_error(r as i64)
                } else {
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("librbd read {r} of {} bytes", piece.len()),
                    )
                };
                return Err(StorageError::from_os(
                    &self.name,
                    IoOp::Read,
                    at,
                    piece.len() as u64,
                    source,
                ));
            }
            at += piece.len() as u64;
        }
        self.counters.count_read(buf.len());
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset_bytes: u64) -> Result<(), StorageError> {
        check_bounds(
            &self.name,
            IoOp::Write,
            offset_bytes,
            buf.len() as u64,
            self.len_bytes(),
        )?;
        let mut at = offset_bytes;
        for piece in buf.chunks(CALL_BYTES_MAX) {
            // SAFETY: an open image; `piece` is valid for reads of its length for
            // the whole call (librbd copies it before returning, also into its
            // cache).
            let r = unsafe {
                (self.lib.rbd_write2)(
                    self.image,
                    at,
                    piece.len(),
                    piece.as_ptr().cast::<c_char>(),
                    0,
                )
            };
            if r < 0 {
                return Err(write_error(
                    &self.name,
                    self.owner,
                    IoOp::Write,
                    at,
                    piece.len() as u64,
                    r as i64,
                ));
            }
            if r as usize != piece.len() {
                let source = std::io::Error::new(
                    std::io::ErrorKind::WriteZero,
                    format!("librbd wrote {r} of {} bytes", piece.len()),
                );
                return Err(StorageError::from_os(
                    &self.name,
                    IoOp::Write,
                    at,
                    piece.len() as u64,
                    source,
                ));
            }
            at += piece.len() as u64;
        }
        self.counters.count_write(buf.len());
        Ok(())
    }

    fn write_batch(&self, writes: &[(u64, &[u8])]) -> Result<(), StorageError> {
        check_batch_bounds(&self.name, writes, self.len_bytes())?;
        // Oldest first: when full, the oldest is waited for before the next goes out.
        let mut in_flight: VecDeque<(InFlight<'_>, u64, usize)> =
            VecDeque::with_capacity(AIO_IN_FLIGHT_MAX);
        let mut failed = None;
        'submit: for &(offset_bytes, bytes) in writes {
            let mut at = offset_bytes;
            for piece in bytes.chunks(CALL_BYTES_MAX) {
                if in_flight.len() >= AIO_IN_FLIGHT_MAX {
                    if let Some((mut request, done_at, len)) = in_flight.pop_front() {
                        if let Err(e) = self.write_result(done_at, len, request.wait()) {
                            failed = Some(e);
                            break 'submit;
                        }
                    }
                }
                match InFlight::write(self.lib, self.image, piece, at) {
                    Ok(request) => in_flight.push_back((request, at, piece.len())),
                    Err(r) => {
                        failed = self.write_result(at, piece.len(), r as isize).err();
                        break 'submit;
                    }
                }
                at += piece.len() as u64;
            }
        }
        // Every request submitted is waited for (and its completion released) before
        // the bytes it borrows go back to the caller, also after an error.
        for (mut request, at, len) in in_flight {
            let r = self.write_result(at, len, request.wait());
            if failed.is_none() {
                failed = r.err();
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        for (_, bytes) in writes {
            self.counters.count_write(bytes.len());
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), StorageError> {
        // SAFETY: an open image. rbd_flush returns once every write acknowledged
        // before it is on the OSDs, or with the error that kept one from them.
        let r = unsafe { (self.lib.rbd_flush)(self.image) };
        if r < 0 {
            return Err(write_error(
                &self.name,
                self.owner,
                IoOp::Flush,
                0,
                0,
                r.into(),
            ));
        }
        let expected = self.len_bytes();
        let now = self.size_now()?;
        if now < expected {
            return Err(StorageError::Shrunk {
                device: self.name.clone(),
                len_bytes: now,
                expected_bytes: expected,
            });
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
            self.len_bytes(),
        )?;
        if !self.discard_enabled.load(Relaxed) {
            return Ok(DiscardOutcome::Disabled);
        }
        let Some((start, len)) = discard_pages(offset_bytes, len_bytes) else {
            return Ok(DiscardOutcome::Discarded);
        };
        let mut at = start;
        let end = start + len;
        while at < end {
            let piece = (end - at).min(CALL_BYTES_MAX as u64);
            // SAFETY: an open image; a range inside it.
            let r = unsafe { (self.lib.rbd_discard)(self.image, at, piece) };
            if r < 0 {
                return Err(write_error(
                    &self.name,
                    self.owner,
                    IoOp::Discard,
                    at,
                    piece,
                    r.into(),
                ));
            }
            at += piece;
        }
        self.counters.count_discard(len);
        Ok(DiscardOutcome::Discarded)
    }

    fn set_discard_enabled(&self, enabled: bool) {
        self.discard_enabled.store(enabled, Relaxed);
    }

    fn len_bytes(&self) -> u64 {
        self.len.load(Relaxed)
    }

    fn refresh_len(&self) -> Result<u64, StorageError> {
        let len = self.size_now()?;
        self.len.store(len, Relaxed);
        Ok(len)
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn counters(&self) -> &IoCounters {
        &self.counters
    }

    fn on_fenced(&self, fenced: FencedListener) {
        if let Some(watch) = &self.watch {
            watch.on_fenced(fenced, &self.name);
        }
    }
}

impl Drop for RbdStorage {
    fn drop(&mut self) {
        // The watch's thread uses the image: it ends first.
        drop(self.watch.take());
        // SAFETY: the handles were made in `open` and are released once, here, in
        // reverse order; `&mut self` means no call on them is in flight, and the
        // watch's thread has ended. rbd_close writes back librbd's cache (what a
        // caller did not flush may still land; nothing relies on it) and releases
        // the image's lock.
        unsafe {
            (self.lib.rbd_close)(self.image);
            (self.lib.rados_ioctx_destroy)(self.ioctx);
            (self.lib.rados_shutdown)(self.rados);
        }
        if !self.registered {
            return;
        }
        if let Some(open) = OPEN_IN_PROCESS.lock().as_mut() {
            open.remove(&self.key);
        }
    }
}
