//! The allow file as `serve` asks it: the NBD server's access policy (read again when
//! the file changes) and the check at start, both refusing a list that is not the
//! served pool's (see the parent module).

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use fewerbytes_nbd::AccessPolicy;

use super::{load_for, Listed};

/// Whether the pool marks a volume limited (`Pool::volume_limited`).
pub type LimitedFn = Box<dyn Fn(&str) -> bool + Send + Sync>;

/// The allow file as the NBD server asks it, beside the pool's own flags: read again
/// when its size, time or inode changes.
pub struct AllowFile {
    path: PathBuf,
    /// The served pool's id: a list recording another (or none) is refused.
    pool_id: String,
    limited: LimitedFn,
    cached: std::sync::Mutex<Cached>,
}

/// The file as last read, and the volumes whose refusal for its state was logged.
#[derive(Default)]
struct Cached {
    read: Option<(FileStamp, Result<Listed, String>)>,
    logged: BTreeSet<String>,
}

impl std::fmt::Debug for AllowFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllowFile")
            .field("path", &self.path)
            .field("pool_id", &self.pool_id)
            .finish_non_exhaustive()
    }
}

/// What tells that the file changed: modification time, size, inode.
type FileStamp = Option<(std::time::SystemTime, u64, u64)>;

impl AllowFile {
    /// The policy of the allow file at `path`, for the pool `pool_id` whose flags
    /// `limited` reads.
    pub fn new(path: PathBuf, pool_id: String, limited: LimitedFn) -> AllowFile {
        AllowFile {
            path,
            pool_id,
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
fn missing_entry(path: &Path, listed: &Listed) -> String {
    match listed {
        Listed::Missing => format!("its allow file {} is missing", path.display()),
        Listed::Own(_) => format!("its allow file {} names no identity for it", path.display()),
        Listed::Foreign(_) | Listed::Unbound(_) => {
            format!("its allow file {} is refused", path.display())
        }
    }
}

/// The volume whose rule an export follows: `VOLUME@SNAPSHOT` is limited exactly as
/// VOLUME is now, whenever either the snapshot or the limit was made (volume names
/// never hold `@`), so a snapshot taken before `volume allow` holds no older rule.
pub fn ruled_by(export: &str) -> &str {
    export.split_once('@').map_or(export, |(volume, _)| volume)
}

impl AccessPolicy for AllowFile {
    fn allowed(&self, export: &str) -> Option<Vec<String>> {
        let export = ruled_by(export);
        let stamp = self.stamp();
        let mut cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        if cached.read.as_ref().is_none_or(|(seen, _)| *seen != stamp) {
            let listed = load_for(&self.path, &self.pool_id).map_err(|e| format!("{e:#}"));
            match &listed {
                Err(e) => {
                    tracing::error!("{e}: every volume is closed to clients until it is fixed")
                }
                // Gone while serving. A file that was never there is no error by
                // itself: a pool with no limited volume needs none, and a limited
                // volume asked for says so below (and `serve` named them at start).
                Ok(Listed::Missing) if matches!(&cached.read, Some((_, Ok(was))) if *was != Listed::Missing) =>
                {
                    tracing::error!(
                        "allow file {} is missing: volumes the pool limits to TLS identities \
                     are closed to every client until it is back (`volume allow NAME ID,…` \
                     writes it; `--allow-file` names another)",
                        self.path.display()
                    )
                }
                Ok(refused @ (Listed::Foreign(_) | Listed::Unbound(_))) => tracing::warn!(
                    "{}; until then the volumes the pool limits or the file names are \
                     closed to every client",
                    refused
                        .refusal(&self.path, &self.pool_id)
                        .expect("a refused list says why")
                ),
                Ok(_) => {}
            }
            cached.read = Some((stamp, listed));
            cached.logged.clear();
        }
        let Some((_, listed)) = &cached.read else {
            return Some(Vec::new());
        };
        let listed = match listed {
            Ok(listed) => listed.clone(),
            // Fail closed: nobody's identity is in an empty list.
            Err(_) => return Some(Vec::new()),
        };
        match &listed {
            Listed::Own(list) => {
                if let Some(identities) = list.volumes.get(export) {
                    return Some(identities.clone());
                }
            }
            // Fail closed: a volume the refused list names was meant to be limited.
            Listed::Foreign(list) | Listed::Unbound(list) => {
                if list.volumes.contains_key(export) {
                    return Some(Vec::new());
                }
            }
            Listed::Missing => {}
        }
        if !(self.limited)(export) {
            return None;
        }
        if cached.logged.insert(export.to_string()) {
            tracing::error!(
                "volume '{export}' is limited to TLS identities, but {}: it is closed to \
                 every client",
                missing_entry(&self.path, &listed)
            );
        }
        Some(Vec::new())
    }
}

/// At `serve`'s start: say which limited volumes stay closed (their list is missing,
/// names no one, or is refused as another pool's or as naming no pool), and record in
/// the pool the limits only the pool's own file holds (a pool limited before the pool
/// kept the flag), so a later loss of the file keeps them closed. Returns the volumes
/// that stay closed.
pub fn check_at_start(pool: &fewerbytes_engine::Pool, path: &Path, read_only: bool) -> Vec<String> {
    let pool_id = format!("{:016x}", pool.id());
    let listed = match load_for(path, &pool_id) {
        Ok(listed) => listed,
        Err(e) => {
            tracing::error!("{e:#}: every volume is closed to clients until it is fixed");
            return pool.volume_sizes().into_iter().map(|(n, _)| n).collect();
        }
    };
    if let Some(refused) = listed.refused() {
        let closed: Vec<String> = pool
            .volume_sizes()
            .into_iter()
            .map(|(name, _)| name)
            .filter(|name| {
                pool.volume_limited(name).unwrap_or(false) || refused.volumes.contains_key(name)
            })
            .collect();
        let closed_words = if closed.is_empty() {
            "no volume is limited, none stays closed".to_string()
        } else {
            format!(
                "volumes {} (limited by the pool or named by the file) stay closed to \
                 every client",
                closed
                    .iter()
                    .map(|n| format!("'{n}'"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        tracing::warn!(
            "{}; {closed_words}",
            listed
                .refusal(path, &pool_id)
                .expect("a refused list says why")
        );
        return closed;
    }
    let named = match &listed {
        Listed::Own(list) => Some(&list.volumes),
        _ => None,
    };
    let mut closed = Vec::new();
    for (name, _) in pool.volume_sizes() {
        let in_file = named.is_some_and(|v| v.contains_key(&name));
        let flagged = pool.volume_limited(&name).unwrap_or(false);
        if flagged && !in_file {
            tracing::error!(
                "volume '{name}' is limited to TLS identities, but {}: it is closed to \
                 every client until `volume allow {name} ID,…` names who may open it",
                missing_entry(path, &listed)
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
