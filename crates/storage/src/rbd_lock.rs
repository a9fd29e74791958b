//! `Owning`: how a read-write open makes an RBD image this client's own: the
//! image's exclusive lock taken (`rbd_lock_acquire`, which makes it a managed lock
//! librbd does not hand over), or, in a take-over, the holder blocklisted
//! (`rados_blocklist_add`) and its lock broken (`rbd_lock_break`) first. See
//! `rbd.rs` for the whole picture and ARCHITECTURE.md for the failure model.

use crate::rbd_lib::errno_error;
use crate::rbd_lib::{Image, Lib, Rados, LOCK_MODE_EXCLUSIVE};
use crate::{DeviceOptions, StorageError};
use std::ffi::{c_char, CString};

/// The `exclusive-lock` feature bit (`RBD_FEATURE_EXCLUSIVE_LOCK`).
const FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;

/// An image opened read-write, being made this client's own: its exclusive lock
/// taken, or broken and taken in a take-over.
pub(crate) struct Owning<'a> {
    pub(crate) lib: &'static Lib,
    pub(crate) rados: Rados,
    pub(crate) image: Image,
    pub(crate) name: &'a str,
    /// The image as the `rbd` command names it (`POOL/IMAGE`, `--cluster` first).
    pub(crate) spec: String,
}

impl Owning<'_> {
    fn not_lockable(&self, reason: String) -> StorageError {
        StorageError::NotLockable {
            device: self.name.to_string(),
            reason,
        }
    }

    /// Take the lock (see the module's comment).
    pub(crate) fn take(&self, features: u64, options: &DeviceOptions) -> Result<(), StorageError> {
        if features & FEATURE_EXCLUSIVE_LOCK == 0 {
            return Err(self.not_lockable(format!(
                "the image has no exclusive-lock feature, without which two hosts could \
                 write it at once; enable it with `rbd feature enable {} exclusive-lock`",
                self.spec
            )));
        }
        if let Some(owner) = self.owner()? {
            let Some(take_over) = options.take_over else {
                return Err(StorageError::Owned {
                    device: self.name.to_string(),
                    owner,
                });
            };
            tracing::warn!(
                "{}: taking over from {owner}: blocklisting it and breaking its lock",
                self.name
            );
            self.fence(&owner, take_over.blocklist_expire_seconds)?;
            let owner_c = CString::new(owner.as_str())
                .map_err(|_| self.not_lockable(format!("the owner {owner:?} has a NUL")))?;
            // SAFETY: an open image; a NUL-terminated owner string read during the
            // call. The owner is fenced already (above); librbd breaks its lock even
            // while it still watches the image (a paused process).
            let r = unsafe {
                (self.lib.rbd_lock_break)(self.image, LOCK_MODE_EXCLUSIVE, owner_c.as_ptr())
            };
            // ENOENT: the lock went away meanwhile (released, or broken by another).
            if r < 0 && r != -libc::ENOENT {
                return Err(self.not_lockable(format!(
                    "{owner} is blocklisted, but its lock could not be broken: {}",
                    errno_error(r.into())
                )));
            }
        }
        // SAFETY: an open image. The call waits for the lock; once held it is managed:
        // librbd refuses to give it up when another client asks for it.
        let r = unsafe { (self.lib.rbd_lock_acquire)(self.image, LOCK_MODE_EXCLUSIVE) };
        if r < 0 {
            // Another client took it between the look and the acquire.
            if let Some(owner) = self.owner()? {
                return Err(StorageError::Owned {
                    device: self.name.to_string(),
                    owner,
                });
            }
            return Err(self.not_lockable(format!(
                "rbd_lock_acquire failed: {}",
                errno_error(r.into())
            )));
        }
        Ok(())
    }

    /// Blocklist `owner` (a client address) on the cluster: from the OSD map that
    /// carries the entry, which librados waits for before returning, the OSDs refuse
    /// everything that client sends, and its watches are dropped.
    fn fence(&self, owner: &str, expire_seconds: Option<u64>) -> Result<(), StorageError> {
        let expire = match expire_seconds {
            // 0 asks for the cluster's default expiry (`mon_osd_blocklist_default_expire`).
            None => 0,
            Some(0) => {
                return Err(self.not_lockable(
                    "a blocklist expiry of 0 seconds would not fence anything".into(),
                ))
            }
            Some(s) => u32::try_from(s).map_err(|_| {
                self.not_lockable(format!("a blocklist expiry of {s} seconds is too long"))
            })?,
        };
        let owner_c = CString::new(owner)
            .map_err(|_| self.not_lockable(format!("the owner {owner:?} has a NUL")))?;
        let mut address = owner_c.into_bytes_with_nul();
        // SAFETY: a connected cluster handle; `address` is a NUL-terminated string that
        // librados only reads (the C prototype lacks `const`), alive for the call.
        let r = unsafe {
            (self.lib.rados_blocklist_add)(
                self.rados,
                address.as_mut_ptr().cast::<c_char>(),
                expire,
            )
        };
        if r < 0 {
            return Err(self.not_lockable(format!(
                "could not blocklist {owner}, so it cannot be taken over safely: {}",
                errno_error(r.into())
            )));
        }
        Ok(())
    }

    /// The client that holds the image's exclusive lock, if any (its address).
    fn owner(&self) -> Result<Option<String>, StorageError> {
        /// More than one owner is only possible in shared mode, which is not used.
        const OWNERS_MAX: usize = 4;
        let mut owners: [*mut c_char; OWNERS_MAX] = [std::ptr::null_mut(); OWNERS_MAX];
        let mut count = OWNERS_MAX;
        let mut mode: std::ffi::c_int = 0;
        // SAFETY: an open image; `owners` has room for `count` pointers, which librbd
        // fills with strings it allocates (freed below by the cleanup call).
        let r = unsafe {
            (self.lib.rbd_lock_get_owners)(self.image, &mut mode, owners.as_mut_ptr(), &mut count)
        };
        if r == -libc::ENOENT {
            return Ok(None);
        }
        if r < 0 {
            return Err(self.not_lockable(format!(
                "could not read who holds the image's lock: {}",
                errno_error(r.into())
            )));
        }
        if count > OWNERS_MAX {
            // librbd answers -ERANGE when the room is too small: a larger count with
            // success is a broken library, and the array holds only what it had room for.
            // SAFETY: at most `OWNERS_MAX` strings were written; freed once.
            unsafe { (self.lib.rbd_lock_get_owners_cleanup)(owners.as_mut_ptr(), OWNERS_MAX) };
            return Err(self.not_lockable(format!(
                "librbd reported {count} lock owners in room for {OWNERS_MAX}"
            )));
        }
        let first = owners
            .first()
            .copied()
            .filter(|p| count > 0 && !p.is_null())
            .map(|p| {
                // SAFETY: a NUL-terminated string librbd allocated, alive until cleanup.
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            });
        // SAFETY: the `count` strings librbd returned, freed once.
        unsafe { (self.lib.rbd_lock_get_owners_cleanup)(owners.as_mut_ptr(), count) };
        Ok(first)
    }
}
