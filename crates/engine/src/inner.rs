//! `Inner`: what the pool's threads share — the parts, each owning its state — and the
//! few questions that need more than one part (the space the packers may use, the group
//! commit, whether a checkpoint is due). `Pool` (pool.rs) opens and closes it; the
//! operation files (checkpoint, load, recovery, repair, compaction, the read and write
//! paths) are functions that take it.

use crate::counters::Counters;
use crate::devices::Devices;
use crate::geometry::PoolGeometry;
use crate::journal::Journal;
use crate::lbn_locks::LbnLocks;
use crate::metadata_room::PageRoom;
use crate::open_repair::OpenRepair;
use crate::packer::{Space, Zones};
use crate::slab_depot::SlabDepot;
use crate::volumes::Volumes;
use crate::{EngineError, Result};
use fewerbytes_format::dir_tree::MAX_DEPTH;
use fewerbytes_format::BLOCK_BYTES;
use std::sync::Arc;

use crate::checkpointer::Checkpointer;
use crate::codec::PoolCodec;
use crate::compactor::Compactor;
use crate::scrubber::Scrubber;

/// Blocks per step of a large request: bounds the journal space one step reserves
/// and how long it holds the gate.
pub const BLOCKS_PER_STEP: u64 = 64;

/// Dirty pages that take a checkpoint whatever the room for them: a checkpoint
/// encodes its pages with the gate held (128 MiB of pages at most, a few tens of
/// milliseconds).
pub const CHECKPOINT_DIRTY_PAGES_MAX: u64 = 32 * 1024;

/// Whether a read may wait for the disk (or a checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Read whatever it takes.
    Yes,
    /// Stop, reporting false, where the read would wait.
    No,
}

/// Everything the pool's threads share: the parts, each owning its state.
pub(crate) struct Inner {
    /// Layout and identity, read-only, from the super block.
    pub geometry: PoolGeometry,
    /// The devices and the read-only latch.
    pub devices: Devices,
    /// The gate and the lock stripes.
    pub locks: LbnLocks,
    /// The volume list.
    pub volumes: Volumes,
    /// Slabs: reference counts, free space.
    pub depot: SlabDepot,
    /// The zones' packers.
    pub zones: Zones,
    /// How new blocks are compressed.
    pub codec: PoolCodec,
    pub journal: Arc<Journal>,
    /// The super block, page store, directory trees and lock of the checkpoints.
    pub checkpointer: Checkpointer,
    pub counters: Counters,
    /// The compactor's wake-up and what it emptied.
    pub compactor: Compactor,
    /// Opened by `check --repair`: what the open may restore (`repair.rs`).
    pub repair: OpenRepair,
    /// The online scrub's state and progress (`scrub.rs`).
    pub scrubber: Scrubber,
    /// The dedup index's background build (`index_build.rs`).
    pub index_build: crate::index_build::IndexBuild,
}

impl Inner {
    /// What the packers work with.
    pub fn space(&self) -> Space<'_> {
        Space {
            depot: &self.depot,
            devices: &self.devices,
            geometry: &self.geometry,
            journal: &self.journal,
        }
    }

    /// One group commit (`journal.rs`): the packers' unwritten bytes and the data
    /// device made durable, then the journal's batch. A failure latches the pool,
    /// unless a device was only full: then nothing durable changed, and the journal
    /// keeps the batch for the next commit (`journal.rs: stall`).
    pub fn commit(&self) -> Result<()> {
        let data_durable = || {
            self.zones.flush(&self.space())?;
            let r = self.devices.data().flush();
            self.devices.check_io(r)
        };
        let r = self.journal.commit(
            self.devices.meta(),
            self.devices.separate_metadata(),
            data_durable,
        );
        r.inspect_err(|e| {
            if !e.is_no_space() {
                self.devices.latch(e)
            }
        })
    }

    /// Refuse, with the no-space error, a change that needs a commit while commits
    /// find a device full; one commit is tried first, so the pool resumes by itself
    /// as soon as space is back.
    pub fn ensure_space(&self) -> Result<()> {
        let Some(why) = self.journal.stalled() else {
            return Ok(());
        };
        match self.commit() {
            Err(e) if e.is_no_space() => Err(EngineError::NoSpace(format!(
                "waiting for space on the device below: {why}"
            ))),
            other => other,
        }
    }

    /// Before a checkpoint's snapshot: commits are not stalled and the packers'
    /// data is written, or the no-space error, with nothing changed. A checkpoint
    /// whose page writes then find the device full still latches the pool: its
    /// snapshot took the dirty pages and cannot be taken back.
    pub fn checkpoint_space(&self) -> Result<()> {
        self.ensure_space()?;
        match self.zones.flush(&self.space()) {
            Err(e) if e.is_no_space() => {
                // A commit finds the same: it stalls the journal, so the commit
                // thread retries once a second instead of asking again at once.
                let _ = self.commit();
                Err(EngineError::NoSpace(format!(
                    "no checkpoint while the device below is full: {e}"
                )))
            }
            other => other,
        }
    }

    /// Give a new pool's whole data region back to its device (as `mkfs` does): a
    /// device or file that held other data keeps none of it allocated. Only for a
    /// pool that stores nothing yet.
    pub(crate) fn discard_data_region(&self) {
        let len_bytes = self.geometry.data_blocks() * BLOCK_BYTES as u64;
        let r = self
            .devices
            .data()
            .discard(self.geometry.data_offset_bytes(), len_bytes);
        if let Err(e) = r {
            tracing::warn!("the new pool's data region was not discarded: {e}");
        }
    }

    /// Whether dirty pages would soon need more fresh slots than the page store has
    /// free: a checkpoint then, before many pages have to go to the data region
    /// (`PageStore::pressed`).
    ///
    /// A pool whose pages may go to data blocks (one that keeps a headroom for them)
    /// also counts half of the free blocks no reservation holds back, as the write
    /// budget last counted them: with the store full, pressure alone would take a
    /// checkpoint every few thousand dirty pages and rewrite each page many times
    /// (a 4 KiB random write test spent 7.9% of its bytes on metadata that way, 2.9%
    /// without). At most [`CHECKPOINT_DIRTY_PAGES_MAX`] wait for one checkpoint,
    /// which encodes them with the gate held.
    pub fn page_store_pressed(&self) -> bool {
        let dirty = self.checkpointer.dirty_page_count();
        let headroom = self.depot.metadata_headroom_blocks();
        let spill = if headroom > 0 {
            self.volumes.reservations().spare_blocks() / 2
        } else {
            0
        };
        dirty > CHECKPOINT_DIRTY_PAGES_MAX
            || self
                .checkpointer
                .page_store()
                .pressed(dirty, headroom + spill)
    }

    /// What the page store offers the space ledger now (`reservation.rs`): its free
    /// slots and the pages turned dirty since the last checkpoint.
    pub fn page_room(&self) -> PageRoom {
        PageRoom {
            free_slots: self.checkpointer.page_store().free_slots(),
            dirty_pages: self.checkpointer.dirty_page_count(),
        }
    }

    /// Before a checkpoint's snapshot (the gate held, so no page turns dirty): the
    /// no-space error, with nothing changed, when its pages may not fit in the page
    /// store's free slots and the data region's free blocks together. Counted only
    /// when the dirty pages could pass the free slots (`metadata_room.rs`).
    pub fn metadata_room(&self) -> Result<()> {
        self.metadata_room_with(0)
    }

    /// [`Inner::metadata_room`] with `extra` pages more: a volume operation asks
    /// before it changes anything (a clone's copied map pages), so that a refusal
    /// leaves nothing behind for a later checkpoint to make durable.
    pub fn metadata_room_with(&self, extra: u64) -> Result<()> {
        let dirty = self.checkpointer.dirty_page_count() + extra;
        let free_slots = self.checkpointer.page_store().free_slots();
        let catalog = self.checkpointer.super_block().catalog.len() as u64;
        let volumes = self.volumes.all();
        // Cheap first: four pages a dirty page, directories for every table.
        let quick = dirty * 4 + (volumes.len() as u64 + 2) * 2 * MAX_DEPTH as u64 + catalog + 2;
        if quick <= free_slots {
            return Ok(());
        }
        let need = crate::metadata_room::pages_to_write(&self.depot, &volumes, catalog) + extra;
        if need <= free_slots {
            return Ok(());
        }
        let free_blocks = self.depot.free_blocks();
        if need > free_slots + free_blocks {
            return Err(EngineError::NoSpace(format!(
                "a checkpoint needs up to {need} metadata pages, and the page store has \
                 {free_slots} free slots and the data region {free_blocks} free blocks"
            )));
        }
        Ok(())
    }
}
