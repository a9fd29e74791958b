//! The volume requests the volume commands share, through a served pool's control
//! socket or the pool opened in this process (`control.rs`).

use anyhow::{bail, Result};
use fewerbytes_engine::VolumeInfo;
use std::path::Path;

use crate::control::{inspect_pool, with_pool, Answer, Request};

/// Whether the pool holds a volume `name` (false when it cannot be asked).
pub(crate) fn volume_exists(pool_path: &Path, name: &str) -> bool {
    list_volumes(pool_path).is_ok_and(|volumes| volumes.iter().any(|v| v.name == name))
}

/// The pool's volumes.
pub(crate) fn list_volumes(pool_path: &Path) -> Result<Vec<VolumeInfo>> {
    inspect_pool(pool_path, |pool| {
        match pool.call(&Request::ListVolumes)? {
            Answer::Volumes(volumes) => Ok(volumes),
            other => bail!("unexpected answer to volume list: {other:?}"),
        }
    })
}

/// Send `request`, whose answer is one volume.
pub(crate) fn expect_volume(pool_path: &Path, request: &Request) -> Result<VolumeInfo> {
    with_pool(pool_path, |pool| match pool.call(request)? {
        Answer::Volume(volume) => Ok(volume),
        other => bail!("unexpected answer to {request:?}: {other:?}"),
    })
}
