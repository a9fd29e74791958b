//! The pool's space, counted once: the figures `pool info`, `stats`, the low-water
//! warning and the Proxmox plugin all show, each under one name (README.md,
//! "Capacity"; ARCHITECTURE.md, "Space figures").
//!
//! As ZFS's AVAIL accounts for other datasets' reservations, **Available** is what a
//! write no reservation covers (a thin volume's) can still take, and **Used** is the
//! rest of **Size**: stored data, metadata, what reservations hold back unused and the
//! free space no write may take. So Used + Available = Size always, and a thin
//! volume on a pool whose thick volume reserves everything sees Available near 0, as
//! its writes do.

use crate::inner::Inner;
use crate::reservation::kept_blocks;
use fewerbytes_format::BLOCK_BYTES;
use serde::{Deserialize, Serialize};

const BLOCK: u64 = BLOCK_BYTES as u64;

/// The space figures of a pool (`PoolInfo` and `PoolStats` carry the same, under the
/// same JSON keys). All in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    /// Size: the data region and the metadata regions (the device, less what no
    /// region takes). Used + Available.
    pub size_bytes: u64,
    /// Used: Size less Available: Stored + Metadata + Reserved unused + Kept free,
    /// less the blocks packers hold open (at most 17 a zone: Stored counts them, and
    /// so does Available, since the writes that fill them need no other block). When
    /// overwrites of shared blocks took space reservations held back, Available is 0
    /// and Used is Size, less than its parts.
    pub used_bytes: u64,
    /// Available: what a write no reservation covers (a thin volume's, or a
    /// partly-reserved one's past its reservation) can still take: free data space
    /// (blocks freeing at the next checkpoint included) less what reservations hold
    /// back unused, the space kept for metadata pages and, while anything is held
    /// back, the reserve for trims and deletes.
    pub available_bytes: u64,
    /// Data region: the part of Size that holds stored blocks.
    pub data_bytes: u64,
    /// Stored: the data blocks stored data takes (whole blocks and blocks packed with
    /// compressed fragments, those packers hold open included), after dedup and
    /// compression.
    pub stored_bytes: u64,
    /// Metadata: the metadata regions (super blocks, journal, page store) and the
    /// data blocks holding metadata pages the page store had no slot for.
    pub metadata_bytes: u64,
    /// Of Metadata, the data blocks holding metadata pages.
    pub metadata_in_data_bytes: u64,
    /// Freeing: blocks freed by trims, overwrites and deletes that are reusable from
    /// the next checkpoint on (counted as free: in Available, or held back).
    pub freeing_bytes: u64,
    /// Reserved: the volumes' reservations added up (thick: their size).
    pub reserved_bytes: u64,
    /// Reserved unused: of Reserved, what the volumes have not used yet; held back
    /// from every other write.
    pub reserved_unused_bytes: u64,
    /// Kept free: free space no write takes: the reserve for trims and deletes (while
    /// anything is held back), the space kept for metadata pages still to come
    /// (`metadata_kept_bytes`) and each slab's headroom for a checkpoint's pages.
    pub kept_bytes: u64,
    /// Of Kept free, what the pages of the next checkpoint and of the reserved data
    /// may need past the page store's free slots.
    pub metadata_kept_bytes: u64,
    /// Reservable: the largest reservation a new volume would be granted now (the
    /// size of a new thick volume): free data space less what reservations hold back,
    /// the space kept for metadata and the reserve for trims and deletes, less what
    /// the new reservation's own metadata pages may need.
    pub reservable_bytes: u64,
    /// Promised: the volumes' sizes added up.
    pub promised_bytes: u64,
}

/// Count the pool's space now (every slab touched, and volume).
pub(crate) fn capacity(i: &Inner) -> Capacity {
    let g = &i.geometry;
    let volumes = i.volumes.all();
    let ledger = i
        .volumes
        .reservations()
        .ledger(&volumes, &i.depot, g, &i.page_room());
    let kept_for_trims = kept_blocks(g, &i.depot);
    let available = ledger.thin_writable_blocks(kept_for_trims);
    let reservable = ledger.reservable_blocks(kept_for_trims, &i.depot, g);
    let (mut allocated, mut freeing, mut headroom) = (0u64, 0u64, 0u64);
    for (_, slab) in i.depot.touched() {
        let s = slab.lock();
        allocated += u64::from(s.used_blocks() - s.pending_blocks());
        freeing += u64::from(s.pending_blocks());
        headroom += u64::from(s.free_blocks() - s.free_blocks_for_data());
    }
    // Slabs never touched hold nothing but keep their headroom.
    let (untouched, untouched_for_data) = i.depot.untouched_blocks();
    headroom += untouched - untouched_for_data;
    // Blocks holding metadata pages are allocated with no holder: metadata, not data.
    let page_blocks = i.checkpointer.page_store().data_blocks();
    // Saturating, here and below: display figures; `check` is what reports counts
    // that disagree.
    let stored = allocated.saturating_sub(page_blocks);
    let size = g.data_blocks() + g.metadata_blocks();
    let trims = if ledger.withheld_blocks + ledger.metadata_blocks > 0 {
        kept_for_trims
    } else {
        0
    };
    Capacity {
        size_bytes: size * BLOCK,
        used_bytes: size.saturating_sub(available) * BLOCK,
        available_bytes: available * BLOCK,
        data_bytes: g.data_blocks() * BLOCK,
        stored_bytes: stored * BLOCK,
        metadata_bytes: (g.metadata_blocks() + page_blocks) * BLOCK,
        metadata_in_data_bytes: page_blocks * BLOCK,
        freeing_bytes: freeing * BLOCK,
        reserved_bytes: ledger.reserved_blocks * BLOCK,
        reserved_unused_bytes: ledger.withheld_blocks * BLOCK,
        kept_bytes: (trims + ledger.metadata_blocks + headroom) * BLOCK,
        metadata_kept_bytes: ledger.metadata_blocks * BLOCK,
        reservable_bytes: reservable * BLOCK,
        promised_bytes: i.volumes.allocated_blocks().saturating_mul(BLOCK),
    }
}
