//! Internal volumes: those a multi-step operation of a frontend makes for itself (a
//! receive's partial volume, the frozen copies its references read), named with a
//! leading `%`, which `validate_name` refuses to every user call. `Pool`'s user
//! calls answer such a name as unknown and leave it out of every listing, so no
//! client can list, open, write, rename or delete one; only the calls of
//! [`InternalVolumes`] (`Pool::internal`) make, open and remove them.

use crate::{api::*, EngineError, Pool, Result, Volume};
use fewerbytes_format::catalog::{validate_name, MAX_NAME_BYTES};
use std::sync::Arc;

/// The first character of every internal volume's name, and of no user's.
pub const INTERNAL_PREFIX: char = '%';

/// Whether `name` is an internal volume's (a user call answers it as unknown).
pub fn is_internal_name(name: &str) -> bool {
    name.starts_with(INTERNAL_PREFIX)
}

/// The refusal a user call gives an internal name: the one an unknown name gets.
pub(crate) fn refuse_internal(name: &str) -> Result<()> {
    let volume = name.split_once('@').map_or(name, |(volume, _)| volume);
    if is_internal_name(volume) {
        return Err(EngineError::VolumeNotFound(name.to_string()));
    }
    Ok(())
}

/// A checked internal volume name: `%PURPOSE.OF`, `OF` a user volume's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InternalName(String);

impl InternalName {
    /// The internal volume for `purpose` (letters and digits) on behalf of user
    /// volume `of`; refused when `of` is no valid name or the whole is too long.
    pub fn new(purpose: &str, of: &str) -> Result<Self> {
        assert!(
            !purpose.is_empty() && purpose.chars().all(|c| c.is_ascii_alphanumeric()),
            "an internal volume's purpose is a word: '{purpose}'"
        );
        validate_name(of).map_err(EngineError::Refused)?;
        let name = format!("{INTERNAL_PREFIX}{purpose}.{of}");
        if name.len() > MAX_NAME_BYTES {
            return Err(EngineError::Refused(format!(
                "volume name '{of}' is too long for its internal volume '{name}' ({} \
                 bytes at most)",
                MAX_NAME_BYTES
            )));
        }
        Ok(Self(name))
    }

    /// A name read back (a frontend's progress file): `None` unless it is one
    /// [`Self::new`] makes.
    pub fn parse(name: &str) -> Option<Self> {
        let rest = name.strip_prefix(INTERNAL_PREFIX)?;
        let (purpose, of) = rest.split_once('.')?;
        Self::new(purpose, of).ok().filter(|made| made.0 == name)
    }

    /// The name as the catalog holds it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The calls that reach internal volumes (and user ones: a receive renames its
/// partial volume to the user's name, or rolls the user's volume to it).
pub struct InternalVolumes<'a> {
    pool: &'a Arc<Pool>,
}

impl<'a> InternalVolumes<'a> {
    pub(crate) fn new(pool: &'a Arc<Pool>) -> Self {
        Self { pool }
    }

    /// Whether a volume named `name` (internal or not) exists.
    pub fn exists(&self, name: &str) -> bool {
        self.pool.inner().volumes.exists(name)
    }

    /// The internal volumes' names.
    pub fn names(&self) -> Vec<String> {
        self.pool
            .inner()
            .volumes
            .all()
            .iter()
            .map(|v| v.name())
            .filter(|n| is_internal_name(n))
            .collect()
    }

    /// Create internal volume `name` (as `Pool::create_volume_with`).
    pub fn create(&self, name: &InternalName, size_bytes: u64, p: Provisioning) -> Result<()> {
        crate::volume_ops::create_named(self.pool.inner(), name.as_str(), size_bytes, p)?;
        Ok(())
    }

    /// Clone `src` (any volume or snapshot) to internal volume `dst`: an O(1)
    /// point-in-time copy that no client can write (as `Pool::clone_volume_with`).
    pub fn clone(&self, src: &str, dst: &InternalName, p: Provisioning) -> Result<()> {
        crate::volume_ops::clone_named(self.pool.inner(), src, dst.as_str(), p)?;
        Ok(())
    }

    /// Open a handle on `name`, internal or not.
    pub fn open(&self, name: &str) -> Result<Volume> {
        let vol = self.pool.inner().volumes.by_name(name)?;
        Ok(Volume::new(Arc::clone(self.pool), vol))
    }

    /// Delete `name`, internal or not (as `Pool::delete_volume`).
    pub fn delete(&self, name: &str, force: bool) -> Result<()> {
        crate::volume_ops::delete(self.pool.inner(), name, force)
    }

    /// Resize `name` (internal or not), shrinking too (as `Pool::resize_volume`).
    pub fn resize(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo> {
        crate::volume_ops::resize(self.pool.inner(), name, size_bytes, true)
    }

    /// Rename `name` (internal or not) to the user name `new_name`.
    pub fn rename(&self, name: &str, new_name: &str) -> Result<VolumeInfo> {
        crate::volume_ops::rename(self.pool.inner(), name, new_name)
    }

    /// Roll user volume `name` back to `from` (internal or not), as
    /// `Pool::rollback_volume`; with `unchanged_since`, refused in the same step,
    /// under the same gate, when `name` reads differently from that volume (it was
    /// written since that point), so no write acknowledged before the step is lost.
    pub fn rollback(
        &self,
        name: &str,
        from: &str,
        unchanged_since: Option<&str>,
    ) -> Result<VolumeInfo> {
        refuse_internal(name)?;
        crate::volume_ops::rollback(self.pool.inner(), name, from, unchanged_since)
    }

    /// Whether user volume `name` reads differently from `since` (any volume):
    /// a different size, or a block whose entry differs.
    pub fn written_since(&self, name: &str, since: &str) -> Result<bool> {
        crate::volume_ops::written_since(self.pool.inner(), name, since)
    }
}
