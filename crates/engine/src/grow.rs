//! `pool grow`: the data region takes the space its device gained (a file extended
//! with `truncate`, a loop device after `losetup -c`, a grown logical volume), while
//! the pool is open and served.
//!
//! Only the data region grows; the journal and the page store keep their size, so
//! the region grows only as far as the page store can hold the pages of, at worst
//! (`PoolGeometry::data_blocks_covered`); `pool create --max-size` sizes the page
//! store for a later size. The grow holds the gate for writing (no write allocates
//! meanwhile), adds the slabs (the last slab first takes the blocks up to its full
//! size), then the geometry, then takes a checkpoint with the gate still held: its
//! super block records the new data region, slab count and device size. A crash
//! before that super block is durable leaves the pool at its old size, with nothing
//! in the new slabs (no write could allocate there); after it, at the new one.

use crate::geometry::PoolGeometry;
use crate::inner::Inner;
use crate::slab_depot::SlabDepot;
use crate::{EngineError, GrowReport, Result};
use fewerbytes_format::dir_tree::MAX_DATA_REGION_BLOCKS;
use fewerbytes_format::BLOCK_BYTES;

/// Most slabs one open of a pool may add: the depot keeps room (a few hundred bytes
/// each) for every slab the pool may grow to while open, so it is bounded even for
/// a super block whose page store would cover a huge region.
pub(crate) const GROW_SLABS_MAX: u64 = 65536;

/// The most slabs the pool may have while open: what its page store covers.
pub(crate) fn max_slabs(geometry: &PoolGeometry) -> u32 {
    let covered = geometry.data_blocks_covered(MAX_DATA_REGION_BLOCKS);
    let slabs = SlabDepot::slabs_for(covered)
        .min(u64::from(geometry.slab_count()) + GROW_SLABS_MAX)
        .max(u64::from(geometry.slab_count()));
    u32::try_from(slabs).unwrap_or(u32::MAX)
}

/// Take the space the data device gained; see the file's header.
pub(crate) fn grow(inner: &Inner) -> Result<GrowReport> {
    if inner.devices.opened_read_only() {
        return Err(EngineError::ReadOnly("opened read-only".into()));
    }
    if let Some(why) = inner.devices.latched() {
        return Err(EngineError::ReadOnly(why));
    }
    let _serial = inner.checkpointer.serialize();
    let gate = inner.locks.exclusive();
    let r = inner.devices.data().refresh_len();
    let device_bytes = inner.devices.check_io(r)?;
    let g = &inner.geometry;
    let block = BLOCK_BYTES as u64;
    let old_blocks = g.data_blocks();
    let want_blocks = (device_bytes / block)
        .saturating_sub(g.data_offset_bytes() / block)
        .min(MAX_DATA_REGION_BLOCKS);
    let mut report = GrowReport {
        device_bytes,
        old_data_bytes: old_blocks * block,
        data_bytes: old_blocks * block,
        untaken_bytes: want_blocks.saturating_sub(old_blocks) * block,
    };
    if want_blocks <= old_blocks {
        return Ok(report);
    }
    let room = u64::from(inner.depot.capacity()) * u64::from(crate::geometry::SLAB_BLOCKS);
    let new_blocks = g.data_blocks_covered(want_blocks).min(room);
    if new_blocks <= old_blocks {
        return Err(EngineError::Refused(format!(
            "the device has {} more than the data region, but the metadata page store \
             has no room for the pages of more data (it keeps its size); a pool made \
             with `pool create --max-size` can grow up to that size",
            crate::geometry::human_bytes(report.untaken_bytes)
        )));
    }
    if !inner.depot.grow(new_blocks) {
        return Err(EngineError::Refused(
            "the slab depot has no room for that many slabs".into(),
        ));
    }
    let slab_count = inner.depot.count();
    g.grow_to(device_bytes, new_blocks, slab_count);
    {
        let mut sb = inner.checkpointer.super_block();
        sb.data_blocks = new_blocks;
        sb.slab_count = slab_count;
        sb.data_device_bytes = device_bytes;
        if !g.separate_metadata() {
            sb.metadata_device_bytes = device_bytes;
        }
    }
    tracing::info!(
        "pool grow: data region {} -> {} ({slab_count} slabs) on a device of {}",
        crate::geometry::human_bytes(old_blocks * block),
        crate::geometry::human_bytes(new_blocks * block),
        crate::geometry::human_bytes(device_bytes)
    );
    crate::checkpoint::checkpoint_locked(inner, gate, true)?;
    report.data_bytes = new_blocks * block;
    report.untaken_bytes = (want_blocks - new_blocks) * block;
    Ok(report)
}
