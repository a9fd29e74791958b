//! Who may open which volume over TLS: the pool marks a volume *limited* (a flag in
//! its catalog, `volume allow`), and the allow file says who may open it:
//! `<pool>.allow.json` beside the pool unless `--allow-file` (or
//! `FEWERBYTES_ALLOW_FILE`) names another path.
//!
//! `{"volumes": {"vm1": ["alice", "bob"]}}`: a volume limited or named there opens
//! only for a client whose TLS identity (PSK identity, or the subject CN of a client
//! certificate `serve --tls-verify-peer` verified) is in its list; any other volume
//! opens for any client the server lets in. A snapshot `VOLUME@SNAP` has no rule of
//! its own: it opens exactly for whom VOLUME does now. `volume create --allow`, `volume allow`,
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
//!
//! Bound to its pool: the file records the pool's id (`Pool::id`, the nonce the pool's
//! creation drew) as `"pool_id"`, written by every command that changes the list. A
//! list whose id is another pool's (copied from another pool, or left by a pool made
//! anew at the same path) or that records none (written by a fewerbytes before lists
//! named their pool) is refused: `serve` says so at start, naming the file and both
//! ids, and keeps closed every volume the pool limits or the refused file names. A
//! command that changes the list refuses another pool's file (nothing is written) and
//! records this pool's id in a file that has none, keeping its entries: running
//! `volume allow NAME ID,…` once is how a list from before ids is taken up.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::homes::with_suffix;

mod policy;
pub use policy::{check_at_start, ruled_by, AllowFile};

/// The file's contents.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllowList {
    /// The id of the pool this list is for (`PoolInfo::id`); absent in a file
    /// written before lists named their pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_id: Option<String>,
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
/// one list; for a pool that is not a file (an RBD image), `<pool-id>.allow.json` in
/// the state directory (`homes`).
pub fn allow_path(pool_path: &Path) -> Result<PathBuf> {
    if let Some(path) = ALLOW_FILE.get() {
        return Ok(path.clone());
    }
    if let Some(path) = crate::homes::state_file(pool_path, ".allow.json")? {
        return Ok(path);
    }
    let real = std::fs::canonicalize(pool_path).unwrap_or_else(|_| pool_path.to_path_buf());
    Ok(with_suffix(&real, ".allow.json"))
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
    let path = allow_path(pool_path)?;
    crate::homes::make_home(pool_path, &path)?;
    Ok(path)
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

/// The allow file as one pool sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listed {
    /// No file.
    Missing,
    /// The pool's own list.
    Own(AllowList),
    /// A list that names no pool: written before lists recorded their pool's id.
    Unbound(AllowList),
    /// Another pool's list: copied from another pool, or left by a pool made anew at
    /// this path.
    Foreign(AllowList),
}

impl Listed {
    /// The file's state for the pool whose id is `pool_id`.
    pub fn of(list: Option<AllowList>, pool_id: &str) -> Listed {
        match list {
            None => Listed::Missing,
            Some(list) => match list.pool_id.as_deref() {
                Some(id) if id == pool_id => Listed::Own(list),
                Some(_) => Listed::Foreign(list),
                None => Listed::Unbound(list),
            },
        }
    }

    /// The entries a refused list holds (the volumes it names stay closed too).
    pub fn refused(&self) -> Option<&AllowList> {
        match self {
            Listed::Unbound(list) | Listed::Foreign(list) => Some(list),
            Listed::Missing | Listed::Own(_) => None,
        }
    }

    /// Why the list at `path` is not used for pool `pool_id` (`None`: it is), and what
    /// fixes it.
    pub fn refusal(&self, path: &Path, pool_id: &str) -> Option<String> {
        match self {
            Listed::Missing | Listed::Own(_) => None,
            Listed::Foreign(list) => Some(format!(
                "allow file {} is the list of pool id {}, not of this pool (pool id \
                 {pool_id}): it was copied from another pool, or this pool was made anew \
                 at its path, so none of its entries is used; move it away (or name this \
                 pool's own list with --allow-file) and name who may open each limited \
                 volume with `fewerbytes volume allow NAME ID,…`",
                path.display(),
                list.pool_id.as_deref().unwrap_or("(none)")
            )),
            Listed::Unbound(_) => Some(format!(
                "allow file {} records no pool id (written by a fewerbytes before allow \
                 files named their pool; this pool's id is {pool_id}), so none of its \
                 entries is used; if its entries are this pool's, `fewerbytes volume allow \
                 NAME ID,…` for one of them records this pool's id in it and keeps the \
                 others (check them with `fewerbytes volume allow NAME`)",
                path.display()
            )),
        }
    }
}

/// Read the allow file as pool `pool_id` sees it.
pub fn load_for(path: &Path, pool_id: &str) -> Result<Listed> {
    Ok(Listed::of(load(path)?, pool_id))
}

/// Read the allow file of pool `pool_id`, to change or show it: a missing file is an
/// empty list; one that names no pool is taken as this pool's (the next change records
/// the id); another pool's is refused.
pub fn read(path: &Path, pool_id: &str) -> Result<AllowList> {
    match load_for(path, pool_id)? {
        Listed::Missing => Ok(AllowList::default()),
        Listed::Own(list) | Listed::Unbound(list) => Ok(list),
        listed @ Listed::Foreign(_) => bail!(
            "{}",
            listed
                .refusal(path, pool_id)
                .expect("another pool's list is refused")
        ),
    }
}

/// The id of the pool at `pool_path` (the server's, when one holds it).
pub fn pool_id(pool_path: &Path) -> Result<String> {
    use crate::control::{inspect_pool, Answer, Request};
    let info = inspect_pool(pool_path, |pool| match pool.call(&Request::PoolInfo)? {
        Answer::PoolInfo(info) => Ok(*info),
        other => bail!("unexpected answer to pool info: {other:?}"),
    })?;
    if info.id.is_empty() {
        bail!(
            "the server holding {} did not say its pool id (an older fewerbytes): \
             restart it with this one before changing who may open a volume",
            pool_path.display()
        );
    }
    Ok(info.id)
}

/// Change the allow file of pool `pool_id`: read, `change`, and replace it whole
/// (written to a new file beside it, synced, renamed over it, the directory synced),
/// so a server never reads half a file and a change is durable on return. The file
/// written records `pool_id`. Another pool's file is refused, unchanged. Changes are
/// serialized by an exclusive `flock` on the file's directory, so two commands (or two
/// control requests) changing limits at once both land: neither reads the list before
/// the other has replaced it.
pub fn update(path: &Path, pool_id: &str, change: impl FnOnce(&mut AllowList)) -> Result<()> {
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
    let mut list = read(path, pool_id)?;
    let before = list.clone();
    change(&mut list);
    // A list that named no pool is this pool's from now on, even when `change` left
    // its entries as they were: that is how `volume allow` takes it up.
    list.pool_id = Some(pool_id.to_string());
    if list == before {
        return Ok(());
    }
    let mut text = serde_json::to_vec_pretty(&list)?;
    text.push(b'\n');
    fewerbytes_engine::companion::replace_file(path, &text)
        .with_context(|| format!("could not change the allow file {}", path.display()))
}

/// A new file beside `path` to stage its next contents
/// (`fewerbytes_engine::companion::create_staging`: a random name, `O_EXCL |
/// O_NOFOLLOW`, mode 0600).
pub(crate) fn create_staging(path: &Path) -> Result<(PathBuf, std::fs::File)> {
    Ok(fewerbytes_engine::companion::create_staging(path)?)
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

#[cfg(test)]
mod tests {
    use super::*;
    use fewerbytes_nbd::AccessPolicy;
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;

    const POOL: &str = "00000000000000a1";
    const OTHER_POOL: &str = "00000000000000b3";

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
        let policy = AllowFile::new(path.clone(), POOL.into(), Box::new(|name| name == "vm3"));
        assert_eq!(policy.allowed("vm1"), None, "no file: anyone");
        assert_eq!(
            policy.allowed("vm3"),
            Some(vec![]),
            "no file: a volume the pool limits opens for no one"
        );
        update(&path, POOL, |list| {
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
        assert_eq!(allow_path(&link).unwrap(), allow_path(&real).unwrap());
        assert_eq!(
            allow_path(&real).unwrap().file_name().unwrap(),
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
                        update(path, POOL, |list| {
                            list.volumes
                                .insert(format!("vm{n}-{round}"), vec![format!("id{n}")]);
                        })
                        .unwrap();
                    }
                });
            }
        });
        let list = read(&path, POOL).unwrap();
        assert_eq!(list.volumes.len(), 80, "changes were lost: {list:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_list_of_another_pool_or_of_none_opens_nothing() {
        let dir = std::env::temp_dir().join(format!("fewerbytes-allow-id-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pool.allow.json");
        update(&path, OTHER_POOL, |list| {
            list.volumes.insert("vm1".into(), vec!["alice".into()]);
        })
        .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains(OTHER_POOL),
            "the pool id is not recorded: {text}"
        );
        let policy = AllowFile::new(path.clone(), POOL.into(), Box::new(|name| name == "vm3"));
        assert_eq!(
            policy.allowed("vm1"),
            Some(vec![]),
            "named by another pool's list"
        );
        assert_eq!(policy.allowed("vm3"), Some(vec![]), "limited by the pool");
        assert_eq!(policy.allowed("vm2"), None, "neither");
        let refused = update(&path, POOL, |list| {
            list.volumes.insert("vm2".into(), vec!["bob".into()]);
        })
        .unwrap_err();
        let message = format!("{refused:#}");
        assert!(
            message.contains(OTHER_POOL) && message.contains(POOL),
            "{message}"
        );
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            text,
            "another pool's list changed"
        );

        // A list from before ids: refused by the server, taken up by a change.
        std::fs::remove_file(&path).unwrap();
        let mut old = std::fs::OpenOptions::new();
        old.write(true).create_new(true).mode(0o600);
        old.open(&path)
            .unwrap()
            .write_all(br#"{"volumes": {"vm1": ["alice"]}}"#)
            .unwrap();
        assert_eq!(policy.allowed("vm1"), Some(vec![]), "a list naming no pool");
        update(&path, POOL, |list| {
            list.volumes.insert("vm1".into(), vec!["alice".into()]);
        })
        .unwrap();
        assert_eq!(policy.allowed("vm1"), Some(vec!["alice".to_string()]));
        assert_eq!(read(&path, POOL).unwrap().pool_id.as_deref(), Some(POOL));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
