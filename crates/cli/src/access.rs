//! Who may open which volume over TLS: the pool marks a volume *limited* (a flag in
//! its catalog, `volume allow`), and the allow file says who may open it:
//! `<pool>.allow.json` beside the pool unless `--allow-file` (or
//! `FEWERBYTES_ALLOW_FILE`) names another path.
//!
//! `{"volumes": {"vm1": ["alice", "bob"]}}`: a volume limited or named there opens
//! only for a client whose TLS identity (PSK identity, or the subject CN of a client
//! certificate `serve --tls-verify-peer` verified) is in its list; any other volume
//! opens for any client the server lets in. `volume create --allow`, `volume allow`,
//! `rename`, `clone` and `delete` keep both up to date; `serve` reads the file again
//! whenever it changes, so a change holds for the next client without a restart.
//!
//! Fail closed: the flag lives in the pool, so a pool served by another name (a hard
//! link, a copy, `/dev/loopN`) or whose file was deleted still knows which volumes
//! are limited, and keeps them closed to every client, saying so in the log. An allow
//! file that cannot be read or parsed, or that another user could have written,
//! closes every volume. The file is replaced whole through a temporary file of a
//! random name made with `O_EXCL | O_NOFOLLOW`, mode 0600: no name another user can
//! take beforehand is ever written through.

use anyhow::{bail, Context, Result};
use fewerbytes_nbd::AccessPolicy;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::control::with_suffix;

/// The file's contents.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllowList {
    /// Volume name → the TLS identities that may open it.
    #[serde(default)]
    pub volumes: BTreeMap<String, Vec<String>>,
}

/// Set by `--allow-file`, once, before any command runs.
static ALLOW_FILE: OnceLock<PathBuf> = OnceLock::new();

/// Make `path` the allow file of this process's pool.
pub fn set_allow_file(path: PathBuf) {
    let _ = ALLOW_FILE.set(path);
}

/// The allow file: `--allow-file`, else `<pool>.allow.json` beside the pool file itself
/// (symbolic links followed), so a pool named through a link and by its real path has
/// one list.
pub fn allow_path(pool_path: &Path) -> PathBuf {
    match ALLOW_FILE.get() {
        Some(path) => path.clone(),
        None => {
            let real = std::fs::canonicalize(pool_path).unwrap_or_else(|_| pool_path.to_path_buf());
            with_suffix(&real, ".allow.json")
        }
    }
}

/// The allow file, to add limits to. A pool on a block device has no directory of its
/// own (`/dev` forgets files at boot), so its allow file must be named.
pub fn allow_path_to_write(pool_path: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let on_device = std::fs::metadata(pool_path).is_ok_and(|m| m.file_type().is_block_device());
    if on_device && ALLOW_FILE.get().is_none() {
        anyhow::bail!(
            "pool {} is a block device, and a file beside it in /dev would not last: name \
             the allow file with --allow-file PATH (or FEWERBYTES_ALLOW_FILE), the same for \
             serve, e.g. /etc/fewerbytes/NAME.allow.json",
            pool_path.display()
        );
    }
    Ok(allow_path(pool_path))
}

/// Read the allow file; `None` when there is none. A file that another user owns, or
/// that group or others may write, is refused: whoever can write it decides who
/// opens a limited volume.
pub fn load(path: &Path) -> Result<Option<AllowList>> {
    let mut file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("could not read {}", path.display())),
    };
    let meta = file
        .metadata()
        .with_context(|| format!("could not read {}", path.display()))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me && meta.uid() != 0 {
        bail!(
            "{} belongs to uid {}, not to this user (uid {me}) or root: another user may \
             have made it; remove it and set the limits again with `volume allow`",
            path.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o022 != 0 {
        bail!(
            "{} may be written by others (mode {:o}): make it its owner's only \
             (chmod 600) or set the limits again with `volume allow`",
            path.display(),
            meta.mode() & 0o777
        );
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .with_context(|| format!("could not read {}", path.display()))?;
    let list = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not an allow file", path.display()))?;
    Ok(Some(list))
}

/// Read the allow file; a missing file is an empty list.
pub fn read(path: &Path) -> Result<AllowList> {
    Ok(load(path)?.unwrap_or_default())
}

/// Change the allow file: read, `change`, and replace it whole (written to a new file
/// beside it, synced, renamed over it, the directory synced), so a server never reads
/// half a file and a change is durable on return. Changes are serialized by an
/// exclusive `flock` on the file's directory, so two commands (or two control requests)
/// changing limits at once both land: neither reads the list before the other has
/// replaced it.
pub fn update(path: &Path, change: impl FnOnce(&mut AllowList)) -> Result<()> {
    let dir = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let dir_file = std::fs::File::open(dir)
        .with_context(|| format!("could not open {} to lock it", dir.display()))?;
    // SAFETY: flock on a descriptor this function owns; the lock goes with the descriptor.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&dir_file), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("could not lock {}", dir.display()));
    }
    let mut list = read(path)?;
    let before = list.clone();
    change(&mut list);
    if list == before {
        return Ok(());
    }
    let mut text = serde_json::to_vec_pretty(&list)?;
    text.push(b'\n');
    let (staging, mut file) = create_staging(path)?;
    let written = file.write_all(&text).and_then(|()| file.sync_all());
    let replaced = written
        .with_context(|| format!("could not write {}", staging.display()))
        .and_then(|()| {
            std::fs::rename(&staging, path)
                .with_context(|| format!("could not replace {}", path.display()))
        });
    if let Err(e) = replaced {
        let _ = std::fs::remove_file(&staging);
        return Err(e);
    }
    dir_file
        .sync_all()
        .with_context(|| format!("could not sync {}", dir.display()))?;
    Ok(())
}

/// A new file beside `path` to stage its next contents: a random name, created with
/// `O_EXCL | O_NOFOLLOW` (a file or link someone placed there is never opened) and
/// mode 0600. Retries a few names, in case one was taken.
fn create_staging(path: &Path) -> Result<(PathBuf, std::fs::File)> {
    use std::hash::{BuildHasher, Hasher};
    let mut last = None;
    for attempt in 0..8u32 {
        // RandomState is seeded from the OS's random source: the name cannot be
        // guessed before it is made.
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(attempt);
        hasher.write_u32(std::process::id());
        let staging = with_suffix(path, &format!(".{:016x}.new", hasher.finish()));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&staging)
        {
            Ok(file) => return Ok((staging, file)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => {
                return Err(e).with_context(|| format!("could not create {}", staging.display()))
            }
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no attempt made")))
        .with_context(|| format!("could not create a new file beside {}", path.display()))
}

/// TLS identities as a command line gives them (`alice,bob`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identities(pub Vec<String>);

/// Parse `alice,bob` into identities (empty names refused).
pub fn parse_identities(text: &str) -> Result<Identities, String> {
    let identities: Vec<String> = text.split(',').map(|s| s.trim().to_string()).collect();
    if identities.iter().any(String::is_empty) {
        return Err("identities are names separated by commas, none empty".into());
    }
    Ok(Identities(identities))
}

/// Whether the pool marks a volume limited (`Pool::volume_limited`).
pub type LimitedFn = Box<dyn Fn(&str) -> bool + Send + Sync>;

/// The allow file as the NBD server asks it, beside the pool's own flags: read again
/// when its size, time or inode changes.
pub struct AllowFile {
    path: PathBuf,
    limited: LimitedFn,
    cached: std::sync::Mutex<Cached>,
}

/// The file as last read, and the volumes whose refusal for its state was logged.
#[derive(Default)]
struct Cached {
    read: Option<(FileStamp, Result<Option<AllowList>, String>)>,
    logged: BTreeSet<String>,
}

impl std::fmt::Debug for AllowFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllowFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// What tells that the file changed: modification time, size, inode.
type FileStamp = Option<(std::time::SystemTime, u64, u64)>;

impl AllowFile {
    /// The policy of the allow file at `path`, for a pool whose flags `limited` reads.
    pub fn new(path: PathBuf, limited: LimitedFn) -> AllowFile {
        AllowFile {
            path,
            limited,
            cached: std::sync::Mutex::new(Cached::default()),
        }
    }

    fn stamp(&self) -> FileStamp {
        let meta = std::fs::metadata(&self.path).ok()?;
        Some((meta.modified().ok()?, meta.len(), meta.ino()))
    }
}

/// Why a limited volume has no identities: the file's state, for the log.
fn missing_entry(path: &Path, list: &Option<AllowList>) -> String {
    match list {
        None => format!("its allow file {} is missing", path.display()),
        Some(_) => format!("its allow file {} names no identity for it", path.display()),
    }
}

impl AccessPolicy for AllowFile {
    fn allowed(&self, export: &str) -> Option<Vec<String>> {
        let stamp = self.stamp();
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        if cached.read.as_ref().is_none_or(|(seen, _)| *seen != stamp) {
            let list = load(&self.path).map_err(|e| format!("{e:#}"));
            match &list {
                Err(e) => {
                    tracing::error!("{e}: every volume is closed to clients until it is fixed")
                }
                // Gone while serving. A file that was never there is no error by
                // itself: a pool with no limited volume needs none, and a limited
                // volume asked for says so below (and `serve` named them at start).
                Ok(None) if matches!(cached.read, Some((_, Ok(Some(_))))) => tracing::error!(
                    "allow file {} is missing: volumes the pool limits to TLS identities \
                     are closed to every client until it is back (`volume allow NAME ID,…` \
                     writes it; `--allow-file` names another)",
                    self.path.display()
                ),
                Ok(_) => {}
            }
            cached.read = Some((stamp, list));
            cached.logged.clear();
        }
        let Some((_, list)) = &cached.read else {
            return Some(Vec::new());
        };
        let list = match list {
            Ok(list) => list.clone(),
            // Fail closed: nobody's identity is in an empty list.
            Err(_) => return Some(Vec::new()),
        };
        if let Some(identities) = list.as_ref().and_then(|l| l.volumes.get(export)) {
            return Some(identities.clone());
        }
        if !(self.limited)(export) {
            return None;
        }
        if cached.logged.insert(export.to_string()) {
            tracing::error!(
                "volume '{export}' is limited to TLS identities, but {}: it is closed to \
                 every client",
                missing_entry(&self.path, &list)
            );
        }
        Some(Vec::new())
    }
}

/// At `serve`'s start: say which limited volumes stay closed (their list is missing or
/// names no one), and record in the pool the limits only the file holds (a pool
/// limited before the pool kept the flag), so a later loss of the file keeps them
/// closed. Returns the volumes that stay closed.
pub fn check_at_start(pool: &fewerbytes_engine::Pool, path: &Path, read_only: bool) -> Vec<String> {
    let list = match load(path) {
        Ok(list) => list,
        Err(e) => {
            tracing::error!("{e:#}: every volume is closed to clients until it is fixed");
            return pool.volume_sizes().into_iter().map(|(n, _)| n).collect();
        }
    };
    let named = list.as_ref().map(|l| &l.volumes);
    let mut closed = Vec::new();
    for (name, _) in pool.volume_sizes() {
        let in_file = named.is_some_and(|v| v.contains_key(&name));
        let flagged = pool.volume_limited(&name).unwrap_or(false);
        if flagged && !in_file {
            tracing::error!(
                "volume '{name}' is limited to TLS identities, but {}: it is closed to \
                 every client until `volume allow {name} ID,…` names who may open it",
                missing_entry(path, &list)
            );
            closed.push(name);
        } else if in_file && !flagged && !read_only {
            match pool.set_volume_limited(&name, true) {
                Ok(_) => tracing::info!(
                    "volume '{name}': its limit in {} is now recorded in the pool too",
                    path.display()
                ),
                Err(e) => tracing::warn!("volume '{name}': could not record its limit: {e}"),
            }
        }
    }
    closed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_comma_separated_names() {
        assert_eq!(
            parse_identities("alice, bob").unwrap().0,
            vec!["alice".to_string(), "bob".to_string()]
        );
        assert!(parse_identities("alice,,bob").is_err());
        assert!(parse_identities("").is_err());
    }

    #[test]
    fn the_policy_follows_the_file() {
        let dir = std::env::temp_dir().join(format!("fewerbytes-allow-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pool.allow.json");
        let policy = AllowFile::new(path.clone(), Box::new(|name| name == "vm3"));
        assert_eq!(policy.allowed("vm1"), None, "no file: anyone");
        assert_eq!(
            policy.allowed("vm3"),
            Some(vec![]),
            "no file: a volume the pool limits opens for no one"
        );
        update(&path, |list| {
            list.volumes.insert("vm1".into(), vec!["alice".into()]);
        })
        .unwrap();
        assert_eq!(policy.allowed("vm1"), Some(vec!["alice".to_string()]));
        assert_eq!(policy.allowed("vm2"), None);
        assert_eq!(
            policy.allowed("vm3"),
            Some(vec![]),
            "limited, named by no one"
        );
        std::fs::write(&path, b"{not json").unwrap();
        assert_eq!(
            policy.allowed("vm2"),
            Some(vec![]),
            "a broken file closes all"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_pool_named_through_a_link_has_the_list_of_its_file() {
        let dir =
            std::env::temp_dir().join(format!("fewerbytes-allow-link-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let real = dir.join("pool.img");
        std::fs::write(&real, b"").unwrap();
        let link = dir.join("link.img");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert_eq!(allow_path(&link), allow_path(&real));
        assert_eq!(
            allow_path(&real).file_name().unwrap(),
            "pool.img.allow.json"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn changes_made_at_once_all_land() {
        let dir =
            std::env::temp_dir().join(format!("fewerbytes-allow-race-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pool.allow.json");
        std::thread::scope(|scope| {
            for n in 0..8 {
                let path = &path;
                scope.spawn(move || {
                    for round in 0..10 {
                        update(path, |list| {
                            list.volumes
                                .insert(format!("vm{n}-{round}"), vec![format!("id{n}")]);
                        })
                        .unwrap();
                    }
                });
            }
        });
        let list = read(&path).unwrap();
        assert_eq!(list.volumes.len(), 80, "changes were lost: {list:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
