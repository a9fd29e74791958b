//! Reservations: the space each volume holds back for itself, and the check that
//! keeps thin volumes out of it.
//!
//! A volume is thick (it reserves its whole size, and follows it through resizes),
//! thin (it reserves nothing) or reserves a fixed amount in between. What a volume
//! has **used** of its reservation is the number of its logical blocks mapped to
//! stored data (`VolumeState::mapped_blocks`), counted per volume: a block it shares
//! with a clone or through dedup counts for each volume that maps it. What it has
//! not used yet, `reserved - min(reserved, used)`, is **withheld**: the pool keeps
//! that many data blocks free for it, and room for the metadata pages those blocks
//! may need (below). So a reservation of R blocks guarantees that the volume can
//! store new data in its blocks until it maps R of them, and that the checkpoints in
//! between find room for their pages; it does not guarantee overwrites of blocks it
//! already maps and shares (a clone's inherited blocks, deduplicated blocks): those
//! take new space that nothing held back.
//!
//! **Metadata kept**: the page store holds at most 2% of the device (`geometry.rs`);
//! pages past its free slots go to data blocks. So the ledger also keeps back the
//! data blocks that the pages still to come may need beyond the free slots
//! (`metadata_room.rs`): the new pages the next checkpoint writes, and for every
//! block reserved and not yet used a block-map page share (one page per 504 blocks,
//! at worst one per block while the volume has pages it never wrote) and one new
//! object's count and fingerprint page shares (1/336 and 1/126 of a page), with the
//! directory pages above them. A pool full of fragments needs up to about 4% of its data
//! for pages; without this a thick volume could find its reserved blocks taken by
//! the pages of other volumes' data, and a checkpoint refused.
//!
//! Two checks keep the promise:
//! - [`Reservations::check_honour`]: a volume is created, cloned, grown or given a
//!   reservation only if what it would withhold, and the metadata pages that may
//!   need, fit in the data blocks that are free, less what the other volumes
//!   withhold, the metadata kept for them and the pool's reserve for trims and
//!   deletes. A thin volume withholds nothing and is never refused.
//! - [`Reservations::admit_write`]: a write that could take space others withhold
//!   (more new blocks than its own volume still holds back, with the pages they may
//!   add) fails with the no-space error (ENOSPC over NBD) before storing anything. A
//!   write budget makes this one atomic subtraction per write while the pool has
//!   room (a write is charged its blocks and the block-map pages it touches; the
//!   budget leaves room for the object pages of the blocks it admits); the exact
//!   count (every slab and volume) runs only when the budget is spent.
//!
//! Reservations live in memory here and in the catalog (`VolumeRecord`'s
//! `reservation_bytes` and thin flag), written by every checkpoint; a change is made
//! durable as every volume change is, by a checkpoint with the gate held.

use crate::api::Provisioning;
use crate::block_map::VolumeState;
use crate::geometry::{human_bytes, PoolGeometry};
use crate::metadata_room::{map_pages_for, object_pages_for, PageRoom};
use crate::slab_depot::SlabDepot;
use crate::{EngineError, Result};
use fewerbytes_format::catalog::Catalog;
use fewerbytes_format::page::MAP_ENTRIES_PER_PAGE;
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
    /// Data blocks kept for metadata pages: what the next checkpoint's new pages and
    /// the pages of the withheld blocks may need beyond the page store's free slots.
    pub metadata_blocks: u64,
    /// Free page-store slots no counted page claims: room for the pages of writes no
    /// reservation covers.
    pub spare_slots: u64,
    /// Pages counted: the next checkpoint's new pages and the withheld blocks' pages.
    claimed_pages: u64,
    /// Free page-store slots.
    free_slots: u64,
}

impl Ledger {
    /// What a write no reservation covers may still take, as
    /// [`Reservations::admit_write`] counts it for a thin volume: everything free
    /// while nothing is held back; else free less the withheld blocks, the metadata
    /// kept and `kept` (the reserve for trims and deletes).
    pub(crate) fn thin_writable_blocks(&self, kept: u64) -> u64 {
        if self.withheld_blocks + self.metadata_blocks == 0 {
            return self.free_blocks;
        }
        self.free_blocks
            .saturating_sub(self.withheld_blocks + self.metadata_blocks + kept)
    }

    /// The largest reservation a new thick volume would be granted now: R blocks
    /// such that R, and the data blocks its pages may need past what is counted
    /// already, fit in what is free for reservations (free less `kept`, the
    /// withheld blocks and the metadata kept). As [`Reservations::check_honour`]
    /// counts a new volume of R blocks.
    pub(crate) fn reservable_blocks(
        &self,
        kept: u64,
        depot: &SlabDepot,
        geometry: &PoolGeometry,
    ) -> u64 {
        let free = self
            .free_blocks
            .saturating_sub(kept)
            .saturating_sub(self.withheld_blocks)
            .saturating_sub(self.metadata_blocks);
        let objects = |n: u64| {
            object_pages_for(
                n,
                u64::from(depot.count()),
                u64::from(geometry.objects_per_slab()),
            )
        };
        let fits = |r: u64| {
            let pages =
                self.claimed_pages + map_pages_for(r, r, 0) + objects(self.withheld_blocks + r)
                    - objects(self.withheld_blocks);
            let more = pages
                .saturating_sub(self.free_slots)
                .saturating_sub(self.metadata_blocks);
            r + more <= free
        };
        // What fits grows with R one block at a time at most: the last that fits.
        let (mut lo, mut hi) = (0, free);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }
}

/// What one volume claims in a ledger.
#[derive(Debug, Clone, Copy)]
struct Claim {
    p: Provisioning,
    size_blocks: u64,
    /// Blocks mapped to stored data (what it used of its reservation).
    used_blocks: u64,
    /// Blocks mapped to data or zeros (each holds an entry in a written map page).
    written_blocks: u64,
}

impl Claim {
    fn of(p: Provisioning, v: &VolumeState) -> Self {
        Claim {
            p,
            size_blocks: v.size_blocks(),
            used_blocks: v.mapped_blocks(),
            written_blocks: v.mapped_blocks() + v.zero_blocks(),
        }
    }
}

/// Free data blocks no reservation may take, nor a thin write while anything is held
/// back: the pool's reserve for overwrites of shared blocks, trims and deletes, less
/// the part of it that is the metadata
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

    /// Blocks free beyond every withheld block and the data blocks kept for metadata
    /// pages, as the write budget has them now (0 when an exact count is due): what a
    /// checkpoint's pages may take from the data region without touching a
    /// reservation (`Inner::page_store_pressed`).
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

    /// Count everything exactly: free blocks in every slab, reservations of every
    /// volume, and the metadata pages still to place beyond `room`'s free slots.
    pub(crate) fn ledger(
        &self,
        volumes: &[Arc<VolumeState>],
        depot: &SlabDepot,
        geometry: &PoolGeometry,
        room: &PageRoom,
    ) -> Ledger {
        let claims: Vec<Claim> = {
            let by_id = self.by_id.read();
            volumes
                .iter()
                .map(|v| Claim::of(by_id.get(&v.id()).copied().unwrap_or_default(), v))
                .collect()
        };
        let (_, _, future) = claimed(&claims, depot, geometry);
        let new_pages = room.new_pages(depot, volumes, future);
        ledger_of(
            &claims,
            free_for_data(depot, geometry),
            new_pages,
            depot,
            geometry,
            room,
        )
    }
}

/// Data blocks free for volumes' data: free now, at the next checkpoint, or open in
/// a packer. Blocks freed and waiting for a checkpoint count (a write that finds
/// none takes a checkpoint and tries again), and so do blocks a packer holds open: a
/// zone takes a run of blocks at a time, and the writes that fill it need no other
/// block. A pool whose metadata pages may go to data blocks keeps each slab's last
/// free blocks for them (`geometry.rs: METADATA_HEADROOM_BLOCKS`): no volume's
/// data may take them, and they do not count.
fn free_for_data(depot: &SlabDepot, geometry: &PoolGeometry) -> u64 {
    let free: u64 = depot
        .touched()
        .map(|(_, s)| {
            let s = s.lock();
            let spare = s.pending_blocks() as usize + s.open_block_numbers().len();
            u64::from(s.free_blocks_for_data()) + spare as u64
        })
        .sum();
    // A slab never touched is free but for its headroom.
    (free + depot.untouched_blocks().1).min(geometry.data_blocks())
}

/// What `claims` add up to: (reserved blocks, withheld blocks, pages the withheld
/// blocks may still add: block-map pages per volume, object pages for one new
/// object a block).
fn claimed(claims: &[Claim], depot: &SlabDepot, geometry: &PoolGeometry) -> (u64, u64, u64) {
    let (mut reserved, mut held, mut map_pages) = (0u64, 0u64, 0u64);
    for c in claims {
        let w = withheld(c.p, c.size_blocks, c.used_blocks);
        reserved += reserved_blocks(c.p, c.size_blocks);
        held += w;
        map_pages += map_pages_for(w, c.size_blocks, c.written_blocks);
    }
    let objects = object_pages_for(
        held,
        u64::from(depot.count()),
        u64::from(geometry.objects_per_slab()),
    );
    (reserved, held, map_pages + objects)
}

/// The ledger of `claims` with `free` data blocks and the next checkpoint's
/// `new_pages`, beside `room`'s free slots.
fn ledger_of(
    claims: &[Claim],
    free: u64,
    new_pages: u64,
    depot: &SlabDepot,
    geometry: &PoolGeometry,
    room: &PageRoom,
) -> Ledger {
    let (reserved, held, future) = claimed(claims, depot, geometry);
    let pages = future + new_pages;
    Ledger {
        free_blocks: free,
        reserved_blocks: reserved,
        withheld_blocks: held,
        metadata_blocks: pages.saturating_sub(room.free_slots),
        spare_slots: room.free_slots.saturating_sub(pages),
        claimed_pages: pages,
        free_slots: room.free_slots,
    }
}

impl Reservations {
    /// Refuse, naming the figures, a reservation the pool cannot honour: volume
    /// `name` (id `id`, none if new) of `size_blocks`, using `used_blocks`, asking
    /// for `p`. What it would withhold and the metadata pages that may need (the
    /// ledger's metadata with it, less without it) must fit in what is free less
    /// the other volumes' claims and the reserve for trims and deletes. `room`: the
    /// page store's now.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check_honour(
        &self,
        volumes: &[Arc<VolumeState>],
        depot: &SlabDepot,
        geometry: &PoolGeometry,
        room: &PageRoom,
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
        let mut claims: Vec<Claim> = {
            let by_id = self.by_id.read();
            others
                .iter()
                .map(|v| Claim::of(by_id.get(&v.id()).copied().unwrap_or_default(), v))
                .collect()
        };
        let others_only = claims.len();
        claims.push(Claim {
            p,
            size_blocks,
            used_blocks,
            // An existing volume's map holds its zeros too; a new one or a clone's
            // copy holds what it uses.
            written_blocks: volumes
                .iter()
                .find(|v| Some(v.id()) == id)
                .map_or(used_blocks, |v| v.mapped_blocks() + v.zero_blocks()),
        });
        // Both counts with the same new pages (counted for the larger claim).
        let data_free = free_for_data(depot, geometry);
        let (_, _, future) = claimed(&claims, depot, geometry);
        let new_pages = room.new_pages(depot, volumes, future);
        let with = ledger_of(&claims, data_free, new_pages, depot, geometry, room);
        let without = ledger_of(
            claims.get(..others_only).unwrap_or(&[]),
            data_free,
            new_pages,
            depot,
            geometry,
            room,
        );
        let metadata = with.metadata_blocks.saturating_sub(without.metadata_blocks);
        let kept = kept_blocks(geometry, depot);
        let free = without
            .free_blocks
            .saturating_sub(kept)
            .saturating_sub(without.withheld_blocks)
            .saturating_sub(without.metadata_blocks);
        if wanted + metadata > free {
            // The metadata figures only where the page store does not hold it all.
            let for_pages = if metadata > 0 {
                format!(
                    ", and {} more kept for the metadata pages that data may need",
                    human_bytes(metadata * BLOCK)
                )
            } else {
                String::new()
            };
            let others_pages = if without.metadata_blocks > 0 {
                format!(
                    ", {} kept for metadata pages",
                    human_bytes(without.metadata_blocks * BLOCK)
                )
            } else {
                String::new()
            };
            return Err(EngineError::Refused(format!(
                "{what} would reserve {} ({} of it not yet used{for_pages}), but only {} is \
                 free for reservations: {} free, less {} that other volumes' reservations \
                 hold back{others_pages} and {} kept for trims and deletes; make it thin \
                 (--thin) or reserve less (--reserve SIZE)",
                human_bytes(reserved_blocks(p, size_blocks) * BLOCK),
                human_bytes(wanted * BLOCK),
                human_bytes(free * BLOCK),
                human_bytes(without.free_blocks * BLOCK),
                human_bytes(without.withheld_blocks * BLOCK),
                human_bytes(kept * BLOCK),
            )));
        }
        self.budget_blocks.store(0, Ordering::Release);
        Ok(())
    }

    /// Let a write of `blocks` blocks from block `first_block` of `vol` go ahead, or
    /// fail it with the no-space error when it could take blocks other volumes'
    /// reservations hold back or the data blocks kept for metadata pages.
    /// Conservative: every block written counts as new (duplicates and zeros take
    /// nothing), and the block-map pages it touches as new pages. A write inside
    /// what its own volume still holds back goes ahead: its blocks and their pages
    /// were set aside when the reservation was granted. Writes let through by one
    /// budget and still in flight when the next count runs may take a few blocks
    /// past it (at most a request per writer), and blocks open in packers count as
    /// free although some hold data: the pool's reserve for trims and deletes covers
    /// both.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn admit_write(
        &self,
        volumes: impl FnOnce() -> Vec<Arc<VolumeState>>,
        depot: &SlabDepot,
        geometry: &PoolGeometry,
        room: impl FnOnce() -> PageRoom,
        vol: &VolumeState,
        first_block: u64,
        blocks: u64,
    ) -> Result<()> {
        let per_page = MAP_ENTRIES_PER_PAGE as u64;
        let map_pages = (first_block + blocks.max(1) - 1) / per_page - first_block / per_page + 1;
        let charge = (blocks + map_pages) as i64;
        if self.budget_blocks.fetch_sub(charge, Ordering::AcqRel) >= charge {
            return Ok(());
        }
        let _one = self.recount.lock();
        let l = self.ledger(&volumes(), depot, geometry, &room());
        let own = withheld(self.of(vol.id()), vol.size_blocks(), vol.mapped_blocks());
        let inside = own.min(blocks).min(l.withheld_blocks);
        let objects = |n: u64| {
            object_pages_for(
                n,
                u64::from(depot.count()),
                u64::from(geometry.objects_per_slab()),
            )
        };
        // The part past the volume's reservation: its blocks, and the pages they may
        // add past the free slots no one else counts; and the pool's reserve for
        // trims and deletes stays free, which also covers the blocks open in packers
        // that the free count takes for free although some hold data.
        // A thick volume past its reservation is overwriting blocks it maps (it maps
        // no more than its size): the reserve is there for that, the old blocks
        // coming back at the next checkpoint. Any other volume leaves it free.
        let kept = if self.of(vol.id()) == Provisioning::Thick {
            0
        } else {
            kept_blocks(geometry, depot)
        };
        let pages = map_pages + objects(blocks - inside);
        let need = (l.withheld_blocks - inside)
            + blocks
            + l.metadata_blocks
            + kept
            + pages.saturating_sub(l.spare_slots);
        if inside == blocks || l.withheld_blocks + l.metadata_blocks == 0 || l.free_blocks >= need {
            // What writes may take before the next count: data blocks past what
            // reservations, metadata and the reserve hold, less the object pages of as
            // many new objects beyond the free slots (each write pays for its map
            // pages).
            let data = l
                .free_blocks
                .saturating_sub(l.withheld_blocks + l.metadata_blocks + kept + blocks);
            let spare = data.min((data + l.spare_slots).saturating_sub(objects(data)));
            self.budget_blocks
                .store(spare.min(i64::MAX as u64) as i64, Ordering::Release);
            return Ok(());
        }
        self.budget_blocks.store(0, Ordering::Release);
        let for_pages = if l.metadata_blocks > 0 {
            format!(
                ", and {} is kept for metadata pages",
                human_bytes(l.metadata_blocks * BLOCK)
            )
        } else {
            String::new()
        };
        Err(EngineError::NoSpace(format!(
            "volume '{}' may not take the pool's last {} of free space (Available, what \
             thin writes can use: {}): volumes' reservations hold back {} of it unused \
             ({} of that for this volume){for_pages}",
            vol.name(),
            human_bytes(l.free_blocks * BLOCK),
            human_bytes(l.thin_writable_blocks(kept_blocks(geometry, depot)) * BLOCK),
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
            limited: false,
            incomplete: false,
            lineage: id,
            origin: 0,
            snapshot: false,
            created: 0,
            guid: 0,
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
