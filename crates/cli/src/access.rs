//! Who may open which volume over TLS: the allow file, `<pool>.allow.json` beside the
//! pool unless `--allow-file` (or `FEWERBYTES_ALLOW_FILE`) names another path.
//!
//! `{"volumes": {"vm1": ["alice", "bob"]}}`: a volume named there opens only for a
//! client whose TLS identity (PSK identity, or the subject CN of a client certificate
//! `serve --tls-verify-peer` verified) is in its list; a volume not named opens for
//! any client the server lets in. `volume create --allow`, `volume allow`, `rename`,
//! `clone` and `delete` keep it up to date; `serve` reads it again whenever it changes,
//! so a change holds for the next client without a restart.
//!
//! Why a file beside the pool and not the pool's catalog: the catalog's format belongs
//! to the engine, which this change leaves alone (a later format version can take the
//! lists in; the file then becomes its import). An allow file that cannot be read or
//! parsed while serving closes every volume (fail closed), with an error in the log.

use anyhow::{Context, Result};
use fewerbytes_nbd::AccessPolicy;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
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

/// Read the allow file; a missing file is an empty list.
pub fn read(path: &Path) -> Result<AllowList> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not an allow file", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(AllowList::default()),
        Err(e) => Err(e).with_context(|| format!("could not read {}", path.display())),
    }
}

/// Change the allow file: read, `change`, and replace it whole (written beside it,
/// synced, renamed over it, the directory synced), so a server never reads half a file
/// and a change is durable on return. Changes are serialized by an exclusive `flock` on
/// the file's directory, so two commands (or two control requests) changing limits at
/// once both land: neither reads the list before the other has replaced it.
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
    let staging = with_suffix(path, ".new");
    let mut text = serde_json::to_vec_pretty(&list)?;
    text.push(b'\n');
    let written = std::fs::File::create(&staging).and_then(|mut file| {
        file.write_all(&text)?;
        file.sync_all()
    });
    written.with_context(|| format!("could not write {}", staging.display()))?;
    std::fs::rename(&staging, path)
        .with_context(|| format!("could not replace {}", path.display()))?;
    dir_file
        .sync_all()
        .with_context(|| format!("could not sync {}", dir.display()))?;
    Ok(())
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

/// The allow file as the NBD server asks it: read again when its size or time changes.
#[derive(Debug)]
pub struct AllowFile {
    path: PathBuf,
    cached: std::sync::Mutex<Option<(FileStamp, Result<AllowList, String>)>>,
}

/// What tells that the file changed: modification time, size, inode.
type FileStamp = Option<(std::time::SystemTime, u64, u64)>;

impl AllowFile {
    /// The policy of the allow file at `path`.
    pub fn new(path: PathBuf) -> AllowFile {
        AllowFile {
            path,
            cached: std::sync::Mutex::new(None),
        }
    }

    fn stamp(&self) -> FileStamp {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&self.path).ok()?;
        Some((meta.modified().ok()?, meta.len(), meta.ino()))
    }
}

impl AccessPolicy for AllowFile {
    fn allowed(&self, export: &str) -> Option<Vec<String>> {
        let stamp = self.stamp();
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        if cached.as_ref().is_none_or(|(seen, _)| *seen != stamp) {
            let list = read(&self.path).map_err(|e| format!("{e:#}"));
            if let Err(e) = &list {
                tracing::error!("{e}: every volume is closed to clients until it is fixed");
            }
            *cached = Some((stamp, list));
        }
        match cached.as_ref().map(|(_, list)| list) {
            Some(Ok(list)) => list.volumes.get(export).cloned(),
            // Fail closed: nobody's identity is in an empty list.
            Some(Err(_)) | None => Some(Vec::new()),
        }
    }
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
        let policy = AllowFile::new(path.clone());
        assert_eq!(policy.allowed("vm1"), None, "no file: anyone");
        update(&path, |list| {
            list.volumes.insert("vm1".into(), vec!["alice".into()]);
        })
        .unwrap();
        assert_eq!(policy.allowed("vm1"), Some(vec!["alice".to_string()]));
        assert_eq!(policy.allowed("vm2"), None);
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
