//! Reservations: the space each volume holds back for itself, and the check that
//! keeps thin volumes out of it.
//!
//! A volume is thick (it reserves its whole size, and follows it through resizes),
//! thin (it reserves nothing) or reserves a fixed amount in between. What a volume
//! has **used** of its reservation is the number of its logical blocks mapped to
//! stored data (`VolumeState::mapped_blocks`), counted per volume: a block it shares
//! with a clone or through dedup counts for each volume that maps it. What it has
//! not used yet, `reserved - min(reserved, used)`, is **withheld**: the pool keeps
//! that many data blocks free for it. So a reservation of R blocks guarantees that
//! the volume can store new data in its blocks until it maps R of them; it does not
//! guarantee overwrites of blocks it already maps and shares (a clone's inherited
//! blocks, deduplicated blocks): those take new space that nothing held back.
//!
//! Two checks keep the promise:
//! - [`Reservations::check_honour`]: a volume is created, cloned, grown or given a
//!   reservation only if what it would withhold fits in the data blocks that are
//!   free, less what the other volumes withhold and less the pool's reserve for trims
//!   and deletes. A thin volume withholds nothing and is never refused.
//! - [`Reservations::admit_write`]: a write that could take space others withhold
//!   (more new blocks than its own volume still holds back) fails with the no-space
//!   error (ENOSPC over NBD) before storing anything. A write budget makes this one
//!   atomic subtraction per write while the pool has room; the exact count (every
//!   slab and volume) runs only when the budget is spent.
//!
//! Reservations live in memory here and in the catalog (`VolumeRecord`'s
//! `reservation_bytes` and thin flag), written by every checkpoint; a change is made
//! durable as every volume change is, by a checkpoint with the gate held.

use crate::api::Provisioning;
use crate::block_map::VolumeState;
use crate::geometry::{human_bytes, PoolGeometry};
use crate::slab_depot::SlabDepot;
use crate::{EngineError, Result};
use fewerbytes_format::catalog::Catalog;
use fewerbytes_format::BLOCK_BYTES;
use fewerbytes_format::FORMAT_VERSION_1;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

const BLOCK: u64 = BLOCK_BYTES as u64;

/// Every volume's provisioning, by volume id, and the write budget.
#[derive(Default)]
pub(crate) struct Reservations {
    by_id: RwLock<HashMap<u64, Provisioning>>,
    /// Blocks writes may still take, by any volume, before the exact count runs
    /// again: what is free beyond every withheld block when it last ran.
    budget_blocks: AtomicI64,
    /// One exact count at a time.
    recount: Mutex<()>,
}

/// The space figures of the pool, counted exactly.
pub(crate) struct Ledger {
    /// Data blocks free now, at the next checkpoint, or open in a packer.
    pub free_blocks: u64,
    /// Blocks the volumes reserve (`reserved`), summed.
    pub reserved_blocks: u64,
    /// Blocks reserved and not yet used, summed: held back from other volumes.
    pub withheld_blocks: u64,
}

/// Free data blocks no reservation may take: the pool's reserve for overwrites of
/// shared blocks, trims and deletes, less the part of it that is the metadata
/// headroom (already left out of the free blocks a ledger counts).
pub(crate) fn kept_blocks(geometry: &PoolGeometry, depot: &SlabDepot) -> u64 {
    geometry
        .reserve_blocks()
        .saturating_sub(depot.metadata_headroom_blocks())
}
/// Blocks a volume of `size_blocks` reserves.
pub(crate) fn reserved_blocks(p: Provisioning, size_blocks: u64) -> u64 {
    match p {
        Provisioning::Thick => size_blocks,
        Provisioning::Reserve(bytes) => (bytes / BLOCK).min(size_blocks),
    }
}

/// Blocks of its reservation a volume has not used yet.
fn withheld(p: Provisioning, size_blocks: u64, used_blocks: u64) -> u64 {
    reserved_blocks(p, size_blocks).saturating_sub(used_blocks)
}

impl Reservations {
    /// The provisioning of volume `id` (thick if never set).
    pub(crate) fn of(&self, id: u64) -> Provisioning {
        self.by_id.read().get(&id).copied().unwrap_or_default()
    }

    /// Set volume `id`'s provisioning; the next write counts again.
    pub(crate) fn set(&self, id: u64, p: Provisioning) {
        self.by_id.write().insert(id, p);
        self.budget_blocks.store(0, Ordering::Release);
    }

    /// Blocks free beyond every withheld block, as the write budget has them now (0
    /// when an exact count is due): what a checkpoint's pages may take from the data
    /// region without touching a reservation (`Inner::page_store_pressed`).
    pub(crate) fn spare_blocks(&self) -> u64 {
        self.budget_blocks.load(Ordering::Acquire).max(0) as u64
    }

    /// A checkpoint put `blocks` pages in free data blocks, which the write budget
    /// still counts as free: spend them from it (the next exact count finds them
    /// used, and those the pages leave free again).
    pub(crate) fn taken_for_metadata(&self, blocks: u64) {
        self.budget_blocks
            .fetch_sub(blocks.min(i64::MAX as u64) as i64, Ordering::AcqRel);
    }

    /// Forget a deleted volume.
    pub(crate) fn remove(&self, id: u64) {
        self.by_id.write().remove(&id);
        self.budget_blocks.store(0, Ordering::Release);
    }

    /// Reservations as the catalog holds them. Version 2 records each volume's own.
    /// A version-1 catalog has none: the pool's overcommit flag decided, so an
    /// overcommitted pool's volumes open thin and the others thick.
    pub(crate) fn load(&self, catalog: &Catalog, overcommit: bool) {
        let mut by_id = self.by_id.write();
        by_id.clear();
        for record in &catalog.volumes {
            let p = if catalog.version == FORMAT_VERSION_1 {
                if overcommit {
                    Provisioning::Reserve(0)
                } else {
                    Provisioning::Thick
                }
            } else if record.thin {
                Provisioning::Reserve(record.reservation_bytes)
            } else {
                Provisioning::Thick
            };
            by_id.insert(record.id, p);
        }
        self.budget_blocks.store(0, Ordering::Release);
    }

    /// What the catalog records for volume `id` of `size_bytes`:
    /// (`reservation_bytes`, thin).
    pub(crate) fn record(&self, id: u64, size_bytes: u64) -> (u64, bool) {
        match self.of(id) {
            Provisioning::Thick => (size_bytes, false),
            Provisioning::Reserve(bytes) => (bytes.min(size_bytes), true),
        }
    }

    /// Count everything exactly: free blocks in every slab, reservations of every volume.
    pub(crate) fn ledger(
        &self,
        volumes: &[Arc<VolumeState>],
        depot: &SlabDepot,
        geometry: &PoolGeometry,
    ) -> Ledger {
        // Blocks freed and waiting for a checkpoint count as free (a write that finds
        // none takes a checkpoint and tries again), and so do blocks a packer holds
        // open: a zone takes a run of blocks at a time, and the writes that fill it
        // need no other block.
        // Free for data: a pool whose metadata pages may go to data blocks keeps each
        // slab's last free blocks for them (`slab_depot.rs: METADATA_HEADROOM_BLOCKS`),
        // which no volume's data may take.
        let free: u64 = depot
            .iter()
            .map(|s| {
                let s = s.lock();
                let spare = s.pending_blocks() as usize + s.open_block_numbers().len();
                u64::from(s.free_blocks_for_data()) + spare as u64
            })
            .sum();
        let data_blocks = geometry.data_blocks();
        let by_id = self.by_id.read();
        let (mut reserved, mut held) = (0u64, 0u64);
        for v in volumes {
            let p = by_id.get(&v.id()).copied().unwrap_or_default();
            reserved += reserved_blocks(p, v.size_blocks());
            held += withheld(p, v.size_blocks(), v.mapped_blocks());
        }
        Ledger {
            free_blocks: free.min(data_blocks),
            reserved_blocks: reserved,
            withheld_blocks: held,
        }
    }

    /// Refuse, naming the figures, a reservation the pool cannot honour: volume
    /// `name` (id `id`, none if new) of `size_blocks`, using `used_blocks`, asking
    /// for `p`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check_honour(
        &self,
        volumes: &[Arc<VolumeState>],
        depot: &SlabDepot,
        geometry: &PoolGeometry,
        what: &str,
        id: Option<u64>,
        size_blocks: u64,
        used_blocks: u64,
        p: Provisioning,
    ) -> Result<()> {
        let others: Vec<Arc<VolumeState>> = volumes
            .iter()
            .filter(|v| Some(v.id()) != id)
            .cloned()
            .collect();
        let wanted = withheld(p, size_blocks, used_blocks);
        if wanted == 0 {
            return Ok(());
        }
        let l = self.ledger(&others, depot, geometry);
        let kept = kept_blocks(geometry, depot);
        let room = l
            .free_blocks
            .saturating_sub(kept)
            .saturating_sub(l.withheld_blocks);
        if wanted > room {
            return Err(EngineError::Refused(format!(
                "{what} would reserve {} ({} of it not yet used), but only {} is free for \
                 reservations: {} free, less {} that other volumes' reservations hold back \
                 and {} kept for trims and deletes; make it thin (--thin) or reserve less \
                 (--reserve SIZE)",
                human_bytes(reserved_blocks(p, size_blocks) * BLOCK),
                human_bytes(wanted * BLOCK),
                human_bytes(room * BLOCK),
                human_bytes(l.free_blocks * BLOCK),
                human_bytes(l.withheld_blocks * BLOCK),
                human_bytes(kept * BLOCK),
            )));
        }
        self.budget_blocks.store(0, Ordering::Release);
        Ok(())
    }

    /// Let a write of up to `blocks` new blocks into `vol` go ahead, or fail it with
    /// the no-space error when it could take blocks other volumes' reservations hold
    /// back. Conservative: every block written counts as new (duplicates and zeros
    /// take nothing). Writes let through by one budget and still in flight when the
    /// next count runs may take a few blocks past it (at most a request per writer),
    /// and blocks open in packers count as free although some hold data: the pool's
    /// reserve for trims and deletes covers both.
    pub(crate) fn admit_write(
        &self,
        volumes: impl FnOnce() -> Vec<Arc<VolumeState>>,
        depot: &SlabDepot,
        geometry: &PoolGeometry,
        vol: &VolumeState,
        blocks: u64,
    ) -> Result<()> {
        let k = blocks as i64;
        if self.budget_blocks.fetch_sub(k, Ordering::AcqRel) >= k {
            return Ok(());
        }
        let _one = self.recount.lock();
        let l = self.ledger(&volumes(), depot, geometry);
        let own = withheld(self.of(vol.id()), vol.size_blocks(), vol.mapped_blocks());
        // After the write: free - blocks, and the volume's own withheld space smaller
        // by what the write used of it.
        let must_stay_free = l.withheld_blocks - own.min(l.withheld_blocks) + own - own.min(blocks);
        if must_stay_free == 0 || l.free_blocks >= must_stay_free + blocks {
            let spare = l
                .free_blocks
                .saturating_sub(l.withheld_blocks)
                .saturating_sub(blocks);
            self.budget_blocks
                .store(spare.min(i64::MAX as u64) as i64, Ordering::Release);
            return Ok(());
        }
        self.budget_blocks.store(0, Ordering::Release);
        Err(EngineError::NoSpace(format!(
            "volume '{}' may not take the pool's last {} of free space: volumes' \
             reservations hold back {} of it ({} of that for this volume)",
            vol.name(),
            human_bytes(l.free_blocks * BLOCK),
            human_bytes(l.withheld_blocks * BLOCK),
            human_bytes(own * BLOCK),
        )))
    }
}

/// The figures a volume shows: (reserved bytes, withheld bytes, thin).
pub(crate) fn volume_figures(p: Provisioning, vol: &VolumeState) -> (u64, u64, bool) {
    (
        reserved_blocks(p, vol.size_blocks()) * BLOCK,
        withheld(p, vol.size_blocks(), vol.mapped_blocks()) * BLOCK,
        p != Provisioning::Thick,
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use fewerbytes_format::catalog::VolumeRecord;

    #[test]
    fn a_reservation_never_exceeds_the_size() {
        assert_eq!(reserved_blocks(Provisioning::Thick, 10), 10);
        assert_eq!(reserved_blocks(Provisioning::Reserve(0), 10), 0);
        assert_eq!(reserved_blocks(Provisioning::Reserve(4 * BLOCK), 10), 4);
        assert_eq!(reserved_blocks(Provisioning::Reserve(40 * BLOCK), 10), 10);
        assert_eq!(withheld(Provisioning::Thick, 10, 4), 6);
        assert_eq!(withheld(Provisioning::Thick, 10, 14), 0);
    }

    #[test]
    fn version_2_records_are_taken_as_written() {
        let r = Reservations::default();
        let record = |id, reservation_bytes, thin| VolumeRecord {
            slot: id as u16,
            id,
            name: format!("v{id}"),
            size_bytes: 1 << 20,
            reservation_bytes,
            thin,
            map: Default::default(),
        };
        let catalog = Catalog {
            version: fewerbytes_format::FORMAT_VERSION,
            next_volume_id: 4,
            objects: Default::default(),
            fingerprints: Default::default(),
            volumes: vec![
                record(1, 1 << 20, false),
                record(2, 0, true),
                record(3, 8192, true),
            ],
        };
        r.load(&catalog, true);
        assert_eq!(r.of(1), Provisioning::Thick);
        assert_eq!(r.of(2), Provisioning::Reserve(0));
        assert_eq!(r.record(3, 1 << 20), (8192, true));
        assert_eq!(r.record(1, 1 << 20), (1 << 20, false));
    }
}
