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
