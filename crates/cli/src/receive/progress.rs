//! A receive's progress file, `<pool>.receive.NAME.json` (for a pool that is not a
//! file, in the state directory): which stream, how far it is durable, and the
//! volumes the receive made. It lies in a directory other users may write (a pool
//! beside other files), so it is written through `companion::replace_file` (a new
//! file of a random name made `O_EXCL | O_NOFOLLOW`, mode 0600, renamed over); it is
//! read only when it is a regular file of this user; and the volumes it names must be
//! the ones a receive into NAME makes, so a planted file can neither overwrite another
//! file nor make `--abandon` delete a volume the receive did not make.

use anyhow::{bail, Context, Result};
use fewerbytes_engine::InternalName;
use serde::{Deserialize, Serialize};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::PARTIAL_SUFFIX;
use crate::homes;

/// The progress file: which stream, and how far it is durable.
#[derive(Serialize, Deserialize, Clone)]
pub(super) struct Saved {
    /// The stream's header, hex: a resumed receive takes only this stream.
    pub header: String,
    /// The partial volume's name: internal (`%receive.NAME`), or `NAME:receiving`
    /// when an earlier version began the receive.
    pub partial: String,
    /// The first record not yet durable.
    pub next_position: u64,
    /// The first block the next record may cover (records go in block order).
    pub next_lbn: u64,
    /// Counts of the records before `next_position`, checked by the end record.
    pub data_records: u64,
    pub ref_blocks: u64,
    pub base_ref_blocks: u64,
    #[serde(default)]
    pub pool_ref_blocks: u64,
    pub zero_blocks: u64,
    /// The local base of an incremental stream, as named when the receive began.
    pub base: Option<String>,
    /// The internal copy of the base taken when the receive began, which base
    /// references read (absent in a file an earlier version wrote: they read `base`).
    #[serde(default)]
    pub frozen_base: Option<String>,
    /// The internal copy of NAME taken when a forced in-place receive began: the
    /// final step refuses NAME written since it.
    #[serde(default)]
    pub frozen_target: Option<String>,
    /// The stream updates the existing volume NAME (its base is one of NAME's
    /// snapshots): at the end NAME is rolled to the partial volume, not made.
    #[serde(default)]
    pub onto: bool,
    /// The snapshot the stream carries (record 0): made of NAME at the end.
    #[serde(default)]
    pub snapshot: Option<SavedSnapshot>,
}

/// A snapshot a stream carries: its name within the volume and its identity.
#[derive(Serialize, Deserialize, Clone)]
pub(super) struct SavedSnapshot {
    pub name: String,
    pub guid: u64,
}

/// The internal volumes a receive into `name` makes.
pub(super) struct Names {
    pub partial: InternalName,
    pub frozen_base: InternalName,
    pub frozen_target: InternalName,
}

impl Names {
    pub fn of(name: &str) -> Result<Self> {
        let make = |purpose: &str| {
            InternalName::new(purpose, name)
                .with_context(|| format!("cannot receive into volume '{name}'"))
        };
        Ok(Self {
            partial: make("receive")?,
            frozen_base: make("receivebase")?,
            frozen_target: make("receivetarget")?,
        })
    }

    /// Refuse a progress file naming volumes a receive into `name` does not make.
    fn check(&self, name: &str, saved: &Saved, path: &Path) -> Result<()> {
        let legacy = format!("{name}{PARTIAL_SUFFIX}");
        let named = |got: &Option<String>, want: &InternalName| {
            got.as_deref().is_none_or(|g| g == want.as_str())
        };
        if (saved.partial != self.partial.as_str() && saved.partial != legacy)
            || !named(&saved.frozen_base, &self.frozen_base)
            || !named(&saved.frozen_target, &self.frozen_target)
        {
            bail!(
                "the receive progress file {} names volumes a receive into '{name}' does \
                 not make: it was not written by one; remove it by hand",
                path.display()
            );
        }
        Ok(())
    }
}

/// Where a receive into `name` keeps its progress.
pub(super) fn progress_path(pool_path: &Path, name: &str) -> Result<PathBuf> {
    let suffix = format!(".receive.{name}.json");
    Ok(match homes::state_file(pool_path, &suffix)? {
        Some(path) => path,
        None => homes::with_suffix(pool_path, &suffix),
    })
}

/// The progress file of a receive into `name`, if any: a regular file of this
/// user (opened without following a link) naming only that receive's volumes.
pub(super) fn read_saved(path: &Path, name: &str, names: &Names) -> Result<Option<Saved>> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path);
    let mut file = match file {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("could not read {}", path.display())),
    };
    let meta = file.metadata()?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !meta.is_file() || meta.uid() != me {
        bail!(
            "the receive progress file {} is not a regular file of this user (uid {me}): \
             remove it by hand",
            path.display()
        );
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut file, &mut bytes)
        .with_context(|| format!("could not read {}", path.display()))?;
    let saved: Saved = serde_json::from_slice(&bytes).with_context(|| {
        format!(
            "the receive progress file {} does not parse",
            path.display()
        )
    })?;
    names.check(name, &saved, path)?;
    Ok(Some(saved))
}

/// Write the progress file durably, through the one writer of a pool's companion
/// files (`companion::replace_file`: a new file of a random name made `O_EXCL |
/// O_NOFOLLOW`, mode 0600, synced, renamed over, the directory synced).
pub(super) fn write_saved(pool_path: &Path, path: &Path, saved: &Saved) -> Result<()> {
    homes::make_home(pool_path, path)?;
    fewerbytes_engine::companion::replace_file(path, &serde_json::to_vec(saved)?)
        .with_context(|| format!("could not write {}", path.display()))
}
