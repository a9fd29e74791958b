//! `volume allow`, and the allow-list upkeep of the volume commands that name a volume
//! anew or drop one (create, clone, rename, delete): the pool's flag and the pool's
//! own allow file (`crate::access`) kept in step.

use anyhow::{bail, Result};
use std::path::Path;

use crate::access;
use crate::control::Request;
use crate::volume_requests::{expect_volume, list_volumes, volume_exists};

/// `volume allow`.
pub(crate) fn allow(
    pool_path: &Path,
    name: &str,
    identities: Option<access::Identities>,
    anyone: bool,
) -> Result<()> {
    let identities = identities.map(|i| i.0);
    let volume = access::ruled_by(name);
    if volume != name {
        if identities.is_some() || anyone {
            bail!(
                "'{name}' is a snapshot: it opens exactly for whom volume '{volume}' does, \
                 so change the volume's limit (`volume allow {volume} ID,…` or `--anyone`)"
            );
        }
        if !snapshot_exists(pool_path, name)? {
            bail!("no snapshot named '{name}' in this pool");
        }
        println!("Snapshot '{name}' opens exactly for whom volume '{volume}' does:");
        return allow(pool_path, volume, None, false);
    }
    let pool_id = access::pool_id(pool_path)?;
    let path = match identities {
        Some(_) => access::allow_path_to_write(pool_path)?,
        None => access::allow_path(pool_path)?,
    };
    if (identities.is_some() || anyone) && !volume_exists(pool_path, name) {
        bail!("no volume named '{name}' in this pool");
    }
    match (identities, anyone) {
        (Some(identities), _) => {
            access::update(&path, &pool_id, |list| {
                list.volumes.insert(name.to_string(), identities.clone());
            })?;
            limit(pool_path, name, true)?;
            println!(
                "Volume '{name}' opens only for TLS identities: {}.",
                identities.join(", ")
            );
        }
        (None, true) => {
            // The pool's flag first: until the file's entry is gone too, the
            // volume stays limited, never open to all with the flag left behind.
            limit(pool_path, name, false)?;
            access::update(&path, &pool_id, |list| {
                list.volumes.remove(name);
            })?;
            println!("Volume '{name}' opens for any client the server lets in.");
        }
        (None, false) => {
            let flagged = list_volumes(pool_path)?
                .iter()
                .any(|v| v.name == name && v.limited);
            let listed = access::load_for(&path, &pool_id)?;
            if let Some(refusal) = listed.refusal(&path, &pool_id) {
                println!("Volume '{name}': {refusal}.");
                return Ok(());
            }
            let list = match listed {
                access::Listed::Own(list) => list,
                _ => access::AllowList::default(),
            };
            match (list.volumes.get(name), flagged) {
                (Some(identities), _) => println!(
                    "Volume '{name}' opens only for TLS identities: {}.",
                    identities.join(", ")
                ),
                (None, true) => println!(
                    "Volume '{name}' is limited, but {} names no identity for it: it \
                     opens for no client (`volume allow {name} ID,…` names who may).",
                    path.display()
                ),
                (None, false) => {
                    println!("Volume '{name}' opens for any client the server lets in.")
                }
            }
        }
    }
    Ok(())
}

/// Whether the pool holds the snapshot `VOLUME@SNAPSHOT` `full_name` names.
fn snapshot_exists(pool_path: &Path, full_name: &str) -> Result<bool> {
    let Some((volume, _)) = full_name.split_once('@') else {
        return Ok(false);
    };
    if !volume_exists(pool_path, volume) {
        return Ok(false);
    }
    let request = Request::ListSnapshots {
        name: volume.to_string(),
    };
    let answer = crate::control::inspect_pool(pool_path, |pool| pool.call(&request))?;
    match answer {
        crate::control::Answer::Volumes(snapshots) => {
            Ok(snapshots.iter().any(|s| s.name == full_name))
        }
        other => bail!("unexpected answer to snapshot list: {other:?}"),
    }
}

/// Set or lift the pool's own mark that `name` is limited.
pub(crate) fn limit(pool_path: &Path, name: &str, limited: bool) -> Result<()> {
    expect_volume(
        pool_path,
        &Request::LimitVolume {
            name: name.to_string(),
            limited,
        },
    )?;
    Ok(())
}

/// Give `to` the limit `from` has (before a volume appears as `to`).
pub(crate) fn copy_allowed(pool_path: &Path, from: &str, to: &str) -> Result<()> {
    let path = access::allow_path(pool_path)?;
    let pool_id = access::pool_id(pool_path)?;
    if let Some(identities) = access::read(&path, &pool_id)?.volumes.get(from).cloned() {
        access::update(&path, &pool_id, |list| {
            list.volumes.insert(to.to_string(), identities);
        })?;
    }
    Ok(())
}

/// Drop the limit of a volume that is gone (after it is). A list that does not name it
/// is left as it is.
pub(crate) fn forget_allowed(pool_path: &Path, name: &str) -> Result<()> {
    let path = access::allow_path(pool_path)?;
    let pool_id = access::pool_id(pool_path)?;
    if !access::read(&path, &pool_id)?.volumes.contains_key(name) {
        return Ok(());
    }
    access::update(&path, &pool_id, |list| {
        list.volumes.remove(name);
    })
}
