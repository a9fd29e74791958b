//! The pool: its devices, its volumes, and the operations on them.

use crate::{api::*, Result, Volume};
use std::path::Path;
use std::sync::Arc;

/// An open pool. Shared by `Arc`; closing happens when the last handle drops or at `close`.
pub struct Pool {}

impl Pool {
    /// Format the device(s) as a new pool.
    pub fn create(opts: &CreateOptions) -> Result<PoolInfo> { let _ = opts; todo!() }
    /// Open a pool (exclusive), replaying its journal.
    pub fn open(path: &Path, opts: &OpenOptions) -> Result<Arc<Pool>> { let _ = (path, opts); todo!() }
    /// Geometry and settings.
    pub fn info(&self) -> PoolInfo { todo!() }
    /// All volumes.
    pub fn list_volumes(&self) -> Vec<VolumeInfo> { todo!() }
    /// Create a volume; refused past the pool's addressable size unless overcommitted.
    pub fn create_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo> { let _ = (name, size_bytes); todo!() }
    /// Delete a volume; refused while handles are open unless `force`.
    pub fn delete_volume(&self, name: &str, force: bool) -> Result<()> { let _ = (name, force); todo!() }
    /// Grow a volume (or shrink with `allow_shrink`).
    pub fn resize_volume(&self, name: &str, size_bytes: u64, allow_shrink: bool) -> Result<VolumeInfo> { let _ = (name, size_bytes, allow_shrink); todo!() }
    /// Clone a volume: shares every block by reference.
    pub fn clone_volume(&self, src: &str, dst: &str) -> Result<VolumeInfo> { let _ = (src, dst); todo!() }
    /// Open a handle on a volume.
    pub fn open_volume(self: &Arc<Self>, name: &str) -> Result<Volume> { let _ = name; todo!() }
    /// Make every acknowledged write durable.
    pub fn flush(&self) -> Result<()> { todo!() }
    /// Statistics.
    pub fn stats(&self) -> PoolStats { todo!() }
    /// Every metadata region.
    pub fn regions(&self) -> Vec<Region> { todo!() }
    /// Reference-count audit: references from all maps against stored counts.
    pub fn audit(&self) -> AuditReport { todo!() }
    /// Final checkpoint and release of the devices.
    pub fn close(self: Arc<Self>) -> Result<()> { todo!() }
}
