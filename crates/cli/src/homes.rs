//! Where the files kept for a pool live: beside a pool file, or, for a pool that is
//! not a file (an RBD image, `rbd:POOL/IMAGE`), in a directory of this host named by
//! the pool's id.
//!
//! A pool file keeps its companions beside it: `<pool>.ctl` (the control socket),
//! `<pool>.sock` (the NBD socket), `<pool>.allow.json` (the allow list) and
//! `<pool>.index` (the saved dedup index, `engine/src/index_save.rs`). A pool on an RBD
//! image has no directory; its companions are named by its id (`Pool::id`, the nonce
//! in its super block, read from the device without opening the pool):
//! - sockets in the run directory, `$FEWERBYTES_RUN_DIR`, else `/run/fewerbytes`:
//!   `<pool-id>.ctl` and `<pool-id>.sock`;
//! - the allow list in the state directory, `$FEWERBYTES_STATE_DIR`, else
//!   `/var/lib/fewerbytes` (where the engine keeps `<pool-id>.index` too):
//!   `<pool-id>.allow.json`.
//!
//! Pool names reach the commands as paths; [`pool_name`] turns a `file:` URI into
//! its path at the start, so every file pool behaves exactly as one named by its path,
//! and only an RBD name stays a URI (in its canonical spelling).

use anyhow::{Context, Result};
use fewerbytes_engine::storage::DeviceUri;
use fewerbytes_engine::Pool;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Where sockets of pools that are not files go, unless `FEWERBYTES_RUN_DIR` says.
pub const RUN_DIR: &str = "/run/fewerbytes";

/// The pool a command was given, as the rest of the CLI takes it: a path or a
/// `file:` URI becomes the file's path, an RBD name its canonical URI; anything else
/// is refused with what is wrong with it.
pub fn pool_name(given: PathBuf) -> Result<PathBuf> {
    let uri = DeviceUri::from_path(&given)?;
    Ok(match uri {
        DeviceUri::File(path) => path,
        DeviceUri::Rbd { .. } => PathBuf::from(uri.to_string()),
    })
}

/// Whether the pool is somewhere other than a file or block device of this host (an
/// RBD image): its companions then live in the run and state directories. A name
/// that does not parse is taken as a file (opening it reports the error).
pub fn is_elsewhere(pool_path: &Path) -> bool {
    DeviceUri::from_path(pool_path).is_ok_and(|uri| !uri.is_file())
}

/// Pool ids read in this process, by the pool's name (reading one is a connection to
/// the cluster; a command asks for its pool's several times).
static IDS: Mutex<Vec<(PathBuf, u64)>> = Mutex::new(Vec::new());

/// Remember that the pool named `pool_path` has the id `id` (the server, which has
/// opened it, knows).
pub fn remember_id(pool_path: &Path, id: u64) {
    let mut ids = IDS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if !ids.iter().any(|(path, _)| path == pool_path) {
        ids.push((pool_path.to_path_buf(), id));
    }
}

/// The pool's id as `pool info` shows it, read from its device (super block or
/// label) without opening the pool, so it works while a server holds it.
pub fn pool_id(pool_path: &Path) -> Result<String> {
    let known = IDS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .iter()
        .find(|(path, _)| path == pool_path)
        .map(|(_, id)| *id);
    if let Some(id) = known {
        return Ok(format!("{id:016x}"));
    }
    let id = Pool::read_id(pool_path)
        .with_context(|| format!("could not read the id of pool {}", pool_path.display()))?;
    remember_id(pool_path, id);
    Ok(format!("{id:016x}"))
}

fn dir_of(variable: &str, default: &str) -> PathBuf {
    std::env::var_os(variable)
        .filter(|dir| !dir.is_empty())
        .map_or_else(|| PathBuf::from(default), PathBuf::from)
}

/// A socket of the pool: `<pool><suffix>` beside a pool file, else
/// `<run dir>/<pool-id><suffix>`.
pub fn run_file(pool_path: &Path, suffix: &str) -> Result<PathBuf> {
    if !is_elsewhere(pool_path) {
        return Ok(with_suffix(pool_path, suffix));
    }
    let id = pool_id(pool_path)?;
    Ok(dir_of("FEWERBYTES_RUN_DIR", RUN_DIR).join(format!("{id}{suffix}")))
}

/// A file the pool keeps across restarts, for a pool that is not a file:
/// `<state dir>/<pool-id><suffix>`; `None` for a pool file (its files lie beside it).
pub fn state_file(pool_path: &Path, suffix: &str) -> Result<Option<PathBuf>> {
    if !is_elsewhere(pool_path) {
        return Ok(None);
    }
    let id = pool_id(pool_path)?;
    Ok(Some(
        fewerbytes_engine::state_dir().join(format!("{id}{suffix}")),
    ))
}

/// Make the directory `file` (a companion of the pool named `pool_path`) goes in, if
/// it is one of the run or state directories of a pool that is not a file and does not
/// exist yet (a host that never ran the service has no `/run/fewerbytes`). A pool
/// file's directory is never made: its companions go beside it.
pub fn make_home(pool_path: &Path, file: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let Some(dir) = file.parent().filter(|_| is_elsewhere(pool_path)) else {
        return Ok(());
    };
    if dir.as_os_str().is_empty() || dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .with_context(|| {
            format!(
                "could not make {} for the files of pool {} (set FEWERBYTES_RUN_DIR or \
                 FEWERBYTES_STATE_DIR to a directory this user may write)",
                dir.display(),
                pool_path.display()
            )
        })
}

/// Make the state directory a pool that is not a file saves its index in at a clean
/// close (`engine/src/index_save.rs` writes `<pool-id>.index` there but makes no
/// directory). Best effort: without it the index is rebuilt at the next open, which
/// the close's warning says; nothing is refused for it.
pub fn make_state_home(pool_path: &Path) {
    let made = state_file(pool_path, ".index")
        .and_then(|index| index.map_or(Ok(()), |index| make_home(pool_path, &index)));
    if let Err(e) = made {
        tracing::warn!("{e:#}");
    }
}

/// `path` with `suffix` appended to its last component (`a/b.pool` → `a/b.pool.ctl`):
/// a file beside the pool.
pub fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = std::ffi::OsString::from(path.as_os_str());
    name.push(suffix);
    PathBuf::from(name)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn file_uris_become_paths_and_rbd_names_stay_canonical() {
        assert_eq!(
            pool_name("file:///var/lib/vm.pool".into()).unwrap(),
            PathBuf::from("/var/lib/vm.pool")
        );
        assert_eq!(
            pool_name("vm.pool".into()).unwrap(),
            PathBuf::from("vm.pool")
        );
        assert_eq!(
            pool_name("rbd:vms/pool0@ceph".into()).unwrap(),
            PathBuf::from("rbd:vms/pool0")
        );
        assert!(pool_name("nbd:host".into()).is_err());
        assert!(is_elsewhere(Path::new("rbd:vms/pool0")));
        assert!(!is_elsewhere(Path::new("/var/lib/vm.pool")));
    }

    #[test]
    fn a_pool_file_keeps_its_sockets_beside_it() {
        assert_eq!(
            run_file(Path::new("/var/lib/vm.pool"), ".ctl").unwrap(),
            PathBuf::from("/var/lib/vm.pool.ctl")
        );
        assert_eq!(
            state_file(Path::new("/var/lib/vm.pool"), ".allow.json").unwrap(),
            None
        );
    }
}
