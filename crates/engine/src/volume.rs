//! `Volume`: a handle on one volume: requests checked and cut into steps, each
//! block handed to the read path (`read_path.rs`) or the write path (`write_path.rs`).
//!
//! The life of a 4 KiB write (ARCHITECTURE.md has the numbered version):
//! zero check → keyed BLAKE3 → index advice checked against the stored
//! fingerprint → reference to the existing object, or LZ4 and the packer (or a
//! whole block) → journal record → block-map update → old reference dropped.

use crate::block_map::{VolumeState, ENTRIES_PER_PAGE};
use crate::counters::add;
use crate::error::within_mut;
use crate::inner::{Inner, Wait, BLOCKS_PER_STEP};
use crate::pool::Pool;
use crate::recovery::range_result;
use crate::{BlockSource, ChangedExtent, EngineError, Extent, Result};
use fewerbytes_format::journal::Record;
use fewerbytes_format::journal::{MAP_SET_BYTES, NEW_STORED_BYTES, RANGE_SET_BYTES};
use fewerbytes_format::location::MapEntry;
use fewerbytes_format::BLOCK_BYTES;
use std::sync::Arc;

/// Journal bytes one block may need: the larger of a block stored new (`NewStored`;
/// in a run, less) and a map change (`MapSet`). A block placed and then dropped (a
/// read-modify-write that lost a race, `partial.rs`) journals nothing.
const JOURNAL_BYTES_PER_BLOCK: u64 = if NEW_STORED_BYTES > MAP_SET_BYTES {
    NEW_STORED_BYTES as u64
} else {
    MAP_SET_BYTES as u64
};
/// Journal bytes one page of a range operation needs.
const JOURNAL_BYTES_PER_RANGE: u64 = RANGE_SET_BYTES as u64;
const BLOCK: u64 = BLOCK_BYTES as u64;

struct Handle {
    pool: Arc<Pool>,
    vol: Arc<VolumeState>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.vol.detach();
    }
}

/// A handle on a volume. Cheap to clone; counts as one user while any clone lives.
#[derive(Clone)]
pub struct Volume {
    h: Arc<Handle>,
}

impl Volume {
    pub(crate) fn new(pool: Arc<Pool>, vol: Arc<VolumeState>) -> Self {
        vol.attach();
        Volume {
            h: Arc::new(Handle { pool, vol }),
        }
    }

    fn inner(&self) -> &Inner {
        self.h.pool.inner()
    }

    /// The volume's name (a snapshot's: `VOLUME@SNAPSHOT`).
    pub fn name(&self) -> String {
        self.inner().volumes.full_name(&self.h.vol)
    }

    /// Current size in bytes (volumes can be resized while open).
    pub fn size_bytes(&self) -> u64 {
        self.h.vol.size_blocks() * BLOCK
    }

    fn check(&self, op: &'static str, offset_bytes: u64, len_bytes: u64) -> Result<()> {
        let vol = &self.h.vol;
        if vol.is_deleted() {
            return Err(EngineError::VolumeGone(vol.name()));
        }
        let size_bytes = self.size_bytes();
        if offset_bytes
            .checked_add(len_bytes)
            .is_none_or(|end| end > size_bytes)
        {
            return Err(EngineError::OutOfRange {
                volume: vol.name(),
                op,
                offset_bytes,
                len_bytes,
                size_bytes,
            });
        }
        // A damaged range's entries are unknown (`map_damage.rs`): no read, write,
        // trim or zeroes there until `check --repair` clears it.
        if len_bytes > 0 && op != "block status" {
            vol.refuse_damaged(
                op,
                offset_bytes / BLOCK,
                (offset_bytes + len_bytes).div_ceil(BLOCK),
            )?;
        }
        Ok(())
    }

    /// The damaged ranges of this volume (`map_damage.rs`): reads and writes there
    /// fail with [`EngineError::Damaged`] until `check --repair` clears them.
    pub fn damaged_ranges(&self) -> Vec<crate::DamagedRange> {
        self.h.vol.damaged_ranges()
    }

    /// Read `buf.len()` bytes at `offset_bytes` (any offset and length inside the volume).
    pub fn read(&self, offset_bytes: u64, buf: &mut [u8]) -> Result<()> {
        self.check("read", offset_bytes, buf.len() as u64)?;
        let inner = self.inner();
        let _gate = inner.locks.shared();
        self.read_blocks(offset_bytes, buf, Wait::Yes).map(|_| ())
    }

    /// Read like [`Volume::read`], but only if no step must wait: not for the disk
    /// (the bytes are in the page cache, or still in memory), nor for a checkpoint or
    /// volume operation. `Ok(false)`: it would have waited; `buf` is unspecified and
    /// nothing was counted. An NBD server runs such a read on the thread that received
    /// it, saving two thread switches; the rest go to its workers.
    pub fn read_cached(&self, offset_bytes: u64, buf: &mut [u8]) -> Result<bool> {
        self.check("read", offset_bytes, buf.len() as u64)?;
        let inner = self.inner();
        let Some(_gate) = inner.locks.try_shared() else {
            return Ok(false);
        };
        self.read_blocks(offset_bytes, buf, Wait::No)
    }

    /// The read path, under the gate. Returns false if it stopped rather than wait.
    fn read_blocks(&self, offset_bytes: u64, buf: &mut [u8], wait: Wait) -> Result<bool> {
        let inner = self.inner();
        if self.h.vol.is_deleted() {
            return Err(EngineError::VolumeGone(self.h.vol.name()));
        }
        let mut block = [0u8; BLOCK_BYTES];
        let mut pos = 0usize;
        while pos < buf.len() {
            let at = offset_bytes + pos as u64;
            let lbn = at / BLOCK;
            let within = (at % BLOCK) as usize;
            let n = (BLOCK_BYTES - within).min(buf.len() - pos);
            let out = within_mut(buf, pos..pos + n, "a read's buffer")?;
            let done = if within == 0 && n == BLOCK_BYTES {
                crate::read_path::read_block(inner, &self.h.vol, lbn, out, wait)?
            } else {
                let done = crate::read_path::read_block(inner, &self.h.vol, lbn, &mut block, wait)?;
                out.copy_from_slice(crate::error::within(
                    &block,
                    within..within + n,
                    "a partly read block",
                )?);
                done
            };
            if !done {
                return Ok(false);
            }
            pos += n;
        }
        add(&inner.counters.guest_bytes_read, buf.len() as u64);
        add(&self.h.vol.counters().guest_bytes_read, buf.len() as u64);
        Ok(true)
    }

    /// Write `data` at `offset_bytes` (any offset and length inside the volume). A
    /// block the write covers only in part is read, modified and written back under
    /// its stripe lock (`partial.rs`). With `fua`, durable on return.
    pub fn write(&self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<()> {
        let written = self.write_unsure(offset_bytes, data, fua);
        self.count_no_space(&written);
        written
    }

    /// A write refused for want of space counts in `stats` (pool and volume): an
    /// admin sees refusals there that the guest only saw as ENOSPC.
    fn count_no_space(&self, result: &Result<()>) {
        if result.as_ref().is_err_and(|e| e.is_no_space()) {
            add(&self.inner().counters.no_space_refusals, 1);
            add(&self.h.vol.counters().no_space_refusals, 1);
        }
    }

    /// Whether this is a snapshot (read-only: a point in time of its volume).
    pub fn is_snapshot(&self) -> bool {
        self.h.vol.is_snapshot()
    }

    /// The error a change to a snapshot is.
    fn refuse_snapshot(&self) -> Result<()> {
        if self.is_snapshot() {
            return Err(EngineError::ReadOnly(format!(
                "'{}' is a snapshot: it is never written (clone it to write)",
                self.inner().volumes.full_name(&self.h.vol)
            )));
        }
        Ok(())
    }

    fn write_unsure(&self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check("write", offset_bytes, data.len() as u64)?;
        self.refuse_snapshot()?;
        let inner = self.inner();
        inner.devices.ensure_writable()?;
        inner.ensure_space()?;
        // Space other volumes' reservations and the metadata pages hold back is not
        // for this write.
        let blocks = (offset_bytes + data.len() as u64).div_ceil(BLOCK) - offset_bytes / BLOCK;
        inner.volumes.reservations().admit_write(
            || inner.volumes.all(),
            &inner.depot,
            &inner.geometry,
            || inner.page_room(),
            &self.h.vol,
            offset_bytes / BLOCK,
            blocks,
        )?;
        let mut pos = 0usize;
        let step_bytes = (BLOCKS_PER_STEP * BLOCK) as usize;
        while pos < data.len() {
            // One step: at most BLOCKS_PER_STEP blocks under one journal reservation.
            let at = offset_bytes + pos as u64;
            let step_end =
                ((at / BLOCK) * BLOCK + step_bytes as u64).min(offset_bytes + data.len() as u64);
            let n = (step_end - at) as usize;
            // Blocks touched (one more: a step not block-aligned touches n/4096 + 1).
            let reserve = ((n as u64).div_ceil(BLOCK) + 1) * JOURNAL_BYTES_PER_BLOCK;
            inner.journal.reserve(reserve)?;
            let chunk = crate::error::within(data, pos..pos + n, "a write's data");
            let result = chunk.and_then(|chunk| self.write_step_reclaiming(at, chunk));
            inner.journal.unreserve(reserve);
            result?;
            pos += n;
        }
        add(&inner.counters.guest_bytes_written, data.len() as u64);
        add(
            &self.h.vol.counters().guest_bytes_written,
            data.len() as u64,
        );
        if fua {
            self.h.pool.flush()?;
        }
        Ok(())
    }

    /// One write step; when no block is free, reclaim space and try again.
    ///
    /// Space freed since the last checkpoint (overwrites, trims) is not reusable
    /// before it, and other zones may hold unfilled runs: give those back, take a
    /// checkpoint outside the gate, and try again while a block is free or waits to be.
    /// Other writers may take the reclaimed blocks first (they are making progress, so
    /// this ends); the pool is full when, after a checkpoint, no block is either. This
    /// keeps a thick pool from refusing a guest's overwrite.
    fn write_step_reclaiming(&self, offset_bytes: u64, data: &[u8]) -> Result<()> {
        let inner = self.inner();
        let mut rounds = 0;
        loop {
            match self.write_step(offset_bytes, data) {
                Err(EngineError::NoSpace(why)) => {
                    inner.zones.release_open_space(&inner.space())?;
                    crate::checkpoint::checkpoint(inner)?;
                    rounds += 1;
                    // The bound only guards against a livelock nobody has seen.
                    if rounds >= RECLAIM_ROUNDS_MAX || !inner.depot.space_to_retry() {
                        return Err(EngineError::NoSpace(why));
                    }
                }
                other => return other,
            }
        }
    }

    fn write_step(&self, offset_bytes: u64, data: &[u8]) -> Result<()> {
        let inner = self.inner();
        // Hashing needs no lock: done before the gate, all blocks together.
        let mut hashed = crate::write_path::StepFingerprints::of(inner, offset_bytes, data);
        let _gate = inner.locks.shared();
        hashed.look_before_hooks(inner);
        let vol = &self.h.vol;
        if vol.is_deleted() {
            return Err(EngineError::VolumeGone(vol.name()));
        }
        if offset_bytes + data.len() as u64 > vol.size_blocks() * BLOCK {
            return Err(EngineError::OutOfRange {
                volume: vol.name(),
                op: "write",
                offset_bytes,
                len_bytes: data.len() as u64,
                size_bytes: vol.size_blocks() * BLOCK,
            });
        }
        let mut pos = 0usize;
        let mut piece = 0usize;
        while pos < data.len() {
            let at = offset_bytes + pos as u64;
            let lbn = at / BLOCK;
            let within = (at % BLOCK) as usize;
            let whole = if within == 0 {
                (data.len() - pos) / BLOCK_BYTES
            } else {
                0
            };
            if whole > 0 {
                let src = crate::error::within(data, pos..pos + whole * BLOCK_BYTES, "a step")?;
                self.write_whole(lbn, src, &hashed, piece)?;
                pos += whole * BLOCK_BYTES;
                piece += whole;
                continue;
            }
            let n = (BLOCK_BYTES - within).min(data.len() - pos);
            let src = crate::error::within(data, pos..pos + n, "a write step's data")?;
            let stripe = inner.locks.stripe(vol.id(), lbn).lock();
            crate::partial::write_partial(inner, vol, lbn, within, src)?;
            drop(stripe);
            pos += n;
            piece += 1;
        }
        Ok(())
    }

    /// Write a step's whole blocks `data` from block `lbn` (the step's pieces from
    /// `piece` on), holding their stripes: each is placed (deduplicated or stored,
    /// `write_path.rs: place`), then each map page's entries are set and journalled
    /// together (`write_path.rs: map_placed`), so the step's new blocks are
    /// consecutive records. Caller holds the gate.
    fn write_whole(
        &self,
        lbn: u64,
        data: &[u8],
        hashed: &crate::write_path::StepFingerprints,
        piece: usize,
    ) -> Result<()> {
        use crate::write_path::{map_placed, place, unplace, Placed};
        let inner = self.inner();
        let vol = &self.h.vol;
        let blocks = data.len() / BLOCK_BYTES;
        let _stripes = inner.locks.stripes(vol.id(), lbn..lbn + blocks as u64)?;
        // No allocation per step: at most BLOCKS_PER_STEP blocks (the stripes refused more).
        let mut all = [Placed::NOTHING; BLOCKS_PER_STEP as usize];
        for (k, src) in data.chunks_exact(BLOCK_BYTES).enumerate() {
            let (earlier, rest) = all.split_at_mut(k.min(BLOCKS_PER_STEP as usize));
            let fp = hashed.get(piece + k);
            let before = fp.and_then(|fp| hashed.before_hook(piece + k, fp));
            match (
                rest.first_mut(),
                place(inner, vol, src, fp, before, earlier),
            ) {
                (Some(slot), Ok(p)) => *slot = p,
                (None, Ok(p)) => {
                    unplace(inner, earlier)?;
                    unplace(inner, &[p])?;
                    return Err(EngineError::Invariant(format!(
                        "a step of {blocks} whole blocks"
                    )));
                }
                (_, Err(e)) => {
                    unplace(inner, earlier)?;
                    return Err(e);
                }
            }
        }
        let placed = all.get(..blocks).unwrap_or_default();
        let mut k = 0usize;
        while k < blocks {
            let at = lbn + k as u64;
            let in_page = (blocks - k).min((ENTRIES_PER_PAGE - at % ENTRIES_PER_PAGE) as usize);
            let (this, rest) = placed
                .get(k..)
                .unwrap_or_default()
                .split_at(in_page.min(blocks - k));
            if let Err(e) = map_placed(inner, vol, at, this, None) {
                unplace(inner, rest)?;
                return Err(e);
            }
            k += in_page;
        }
        Ok(())
    }

    /// Make a range read as zeros, storing nothing.
    pub fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<()> {
        let zeroed = self.range_op("write_zeroes", offset_bytes, len_bytes, MapEntry::Zero, fua);
        self.count_no_space(&zeroed);
        zeroed?;
        add(&self.inner().counters.write_zeroes_bytes, len_bytes);
        add(&self.h.vol.counters().write_zeroes_bytes, len_bytes);
        Ok(())
    }

    /// Discard a range: it reads as zeros and frees what only it held.
    pub fn trim(&self, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<()> {
        self.range_op("trim", offset_bytes, len_bytes, MapEntry::Unmapped, fua)?;
        add(&self.inner().counters.trimmed_bytes, len_bytes);
        add(&self.h.vol.counters().trimmed_bytes, len_bytes);
        Ok(())
    }

    fn range_op(
        &self,
        op: &'static str,
        offset_bytes: u64,
        len_bytes: u64,
        entry: MapEntry,
        fua: bool,
    ) -> Result<()> {
        self.check(op, offset_bytes, len_bytes)?;
        self.refuse_snapshot()?;
        let inner = self.inner();
        inner.devices.ensure_writable()?;
        let end = offset_bytes + len_bytes;
        let first_full = offset_bytes.div_ceil(BLOCK);
        let last_full = end / BLOCK;
        // Partial blocks at either end are zeroed through the write path.
        if first_full > last_full {
            return self.zero_partial(entry, offset_bytes, len_bytes, fua);
        }
        if offset_bytes < first_full * BLOCK {
            self.zero_partial(
                entry,
                offset_bytes,
                first_full * BLOCK - offset_bytes,
                false,
            )?;
        }
        if end > last_full * BLOCK {
            self.zero_partial(entry, last_full * BLOCK, end - last_full * BLOCK, false)?;
        }
        let mut lbn = first_full;
        while lbn < last_full {
            inner
                .journal
                .reserve(JOURNAL_BYTES_PER_RANGE * BLOCKS_PER_STEP)?;
            let result = self.range_step(lbn, last_full, entry);
            inner
                .journal
                .unreserve(JOURNAL_BYTES_PER_RANGE * BLOCKS_PER_STEP);
            lbn = result?;
        }
        if fua {
            self.h.pool.flush()?;
        }
        Ok(())
    }

    /// Zero `[offset, offset+len)`, inside one block, by a read-modify-write.
    ///
    /// Trim frees whole blocks only; the bytes of a partial block read as zeros after
    /// it, like write-zeroes, except on a full pool: storing the zeroed block may need
    /// space, and a trim must not fail for want of space (it frees space), so there it
    /// leaves the partial block as it was, which NBD allows (a trimmed range has no
    /// defined contents until written again).
    fn zero_partial(
        &self,
        entry: MapEntry,
        offset_bytes: u64,
        len_bytes: u64,
        fua: bool,
    ) -> Result<()> {
        // A partial block's zeros: `len_bytes` is below a block, or this is a bug.
        let zeros = [0u8; BLOCK_BYTES];
        let bytes = crate::error::within(&zeros, 0..len_bytes as usize, "a partial block's zeros")?;
        match self.write(offset_bytes, bytes, fua) {
            Err(EngineError::NoSpace(why)) if entry == MapEntry::Unmapped => {
                tracing::debug!(
                    volume = %self.h.vol.name(),
                    offset_bytes,
                    len_bytes,
                    %why,
                    "trim left a partial block as it was: the pool is full"
                );
                Ok(())
            }
            other => other,
        }
    }

    /// Apply a range operation to whole blocks from `lbn` up to `end`: at most
    /// `BLOCKS_PER_STEP` steps, each one page in memory (one **RangeSet** record if
    /// it changed) or a jump over the pages not in memory up to the next one that is
    /// (they hold no entry to change), so a range over a large volume costs what its
    /// written pages do. Returns where it stopped (`range_end` when the volume was
    /// shrunk meanwhile to end before it: nothing past the end is left to change).
    fn range_step(&self, mut lbn: u64, range_end: u64, entry: MapEntry) -> Result<u64> {
        let inner = self.inner();
        let _gate = inner.locks.shared();
        let vol = &self.h.vol;
        if vol.is_deleted() {
            return Err(EngineError::VolumeGone(vol.name()));
        }
        let end = range_end.min(vol.size_blocks());
        let mut released = Vec::new();
        let pages = vol.map_pages();
        let mut steps = 0;
        while lbn < end && steps < BLOCKS_PER_STEP {
            let p = lbn / ENTRIES_PER_PAGE;
            let page_end = ((p + 1) * ENTRIES_PER_PAGE).min(end);
            let Some(page) = pages.get(p) else {
                // Nothing in memory up to the next page that is: no entry to change.
                lbn = pages
                    .next_in_memory(p)
                    .map_or(end, |q| (q * ENTRIES_PER_PAGE).clamp(page_end, end));
                steps += 1;
                continue;
            };
            let mut page = page.lock();
            if page.is_written() {
                let mut changed = false;
                for l in lbn..page_end {
                    let i = (l % ENTRIES_PER_PAGE) as usize;
                    let old = page.get(i);
                    if let Some(new) = range_result(old, entry) {
                        // A page other trees reach becomes this volume's own at its
                        // first change (`page_share.rs`).
                        let dirty = inner.checkpointer.dirty_pages();
                        let gained = page.make_own(inner.volumes.shares(), dirty);
                        if !gained.is_empty() {
                            inner.depot.add_references(&inner.devices, &gained)?;
                        }
                        page.set(i, new, dirty)?;
                        vol.account(old, new);
                        released.extend(old.object());
                        changed = true;
                    }
                }
                if changed {
                    inner.journal.append(&Record::RangeSet {
                        volume: vol.slot(),
                        lbn,
                        count: page_end - lbn,
                        entry,
                    });
                }
            }
            drop(page);
            lbn = page_end;
            steps += 1;
        }
        drop(pages);
        inner.depot.release_objects(&inner.devices, &released)?;
        Ok(if lbn < end { lbn } else { lbn.max(range_end) })
    }

    /// Make every acknowledged write (on any handle of the pool) durable.
    pub fn flush(&self) -> Result<()> {
        add(&self.h.vol.counters().flushes, 1);
        self.h.pool.flush()
    }

    /// What the map names for blocks `first_lbn .. first_lbn + out.len()`, one per
    /// element of `out` (`map_diff.rs`). A range outside the volume, or touching a
    /// damaged range (whose entries are unknown, so never reported as zeros), is
    /// refused as a read of it would be.
    pub fn block_sources(&self, first_lbn: u64, out: &mut [BlockSource]) -> Result<()> {
        let vol = &self.h.vol;
        let offset_bytes = first_lbn.saturating_mul(BLOCK);
        self.check("read", offset_bytes, out.len() as u64 * BLOCK)?;
        let _gate = self.inner().locks.shared();
        crate::map_diff::block_sources(vol, first_lbn, out);
        Ok(())
    }

    /// The runs of blocks (block ranges, in order) whose map entries differ from
    /// `base`'s: a volume of the same pool, typically a clone taken earlier
    /// (`map_diff.rs`). Blocks both read as zeros, or both take from one stored
    /// object, are the same; `base`'s blocks past its end read as zeros.
    pub fn changed_since(&self, base: &Volume) -> Result<Vec<std::ops::Range<u64>>> {
        if !Arc::ptr_eq(&self.h.pool, &base.h.pool) {
            return Err(EngineError::Refused(format!(
                "volumes '{}' and '{}' are in different pools: their maps cannot be compared",
                self.name(),
                base.name()
            )));
        }
        for vol in [&self.h.vol, &base.h.vol] {
            if vol.is_deleted() {
                return Err(EngineError::VolumeGone(vol.name()));
            }
        }
        let _gate = self.inner().locks.shared();
        Ok(crate::map_diff::changed_blocks(&self.h.vol, &base.h.vol))
    }

    /// What backs `[offset, offset+len)`: runs of data and of holes (zero/unmapped).
    pub fn extents(&self, offset_bytes: u64, len_bytes: u64) -> Result<Vec<Extent>> {
        self.check("block status", offset_bytes, len_bytes)?;
        let vol = &self.h.vol;
        let mut out: Vec<Extent> = Vec::new();
        let end = offset_bytes + len_bytes;
        let mut at = offset_bytes;
        let pages = vol.map_pages();
        while at < end {
            let lbn = at / BLOCK;
            let next = ((lbn + 1) * BLOCK).min(end);
            let p = lbn / ENTRIES_PER_PAGE;
            let damaged = vol.damage_in(lbn, lbn + 1);
            let (data, run_end) = match pages.get(p) {
                // A damaged range is reported as data: a client reads it (and gets
                // the error) rather than take it for zeros.
                _ if damaged.is_some() => (
                    true,
                    damaged.map_or(next, |d| {
                        (d.lbns(vol.size_blocks()).end * BLOCK).clamp(next, end)
                    }),
                ),
                Some(p) => {
                    let p = p.lock();
                    if !p.is_written() {
                        // A never-written page is one hole.
                        (
                            false,
                            (((lbn / ENTRIES_PER_PAGE) + 1) * ENTRIES_PER_PAGE * BLOCK).min(end),
                        )
                    } else {
                        (
                            p.get((lbn % ENTRIES_PER_PAGE) as usize).object().is_some(),
                            next,
                        )
                    }
                }
                // Not in memory: a hole up to the next page that is.
                None => (
                    false,
                    pages
                        .next_in_memory(p)
                        .map_or(end, |q| (q * ENTRIES_PER_PAGE * BLOCK).clamp(next, end)),
                ),
            };
            let len = run_end - at;
            match out.last_mut() {
                Some(last) if last.data == data => last.len_bytes += len,
                _ => out.push(Extent {
                    len_bytes: len,
                    data,
                }),
            }
            at = run_end;
        }
        Ok(out)
    }

    /// Which blocks of `[offset, offset+len)` differ from `base` (a volume of the
    /// same pool, typically a snapshot taken earlier): runs of changed and unchanged
    /// bytes, covering the range (the NBD context `qemu:dirty-bitmap:BASE`). A block
    /// is unchanged when both read as zeros or both map the same stored object;
    /// `base`'s blocks past its end read as zeros. A damaged range on either side is
    /// changed, so a backup reads it (and gets its error) rather than skip it. Work
    /// follows the map pages the range touches: pages neither volume has written
    /// are skipped whole.
    pub fn changed_extents(
        &self,
        base: &Volume,
        offset_bytes: u64,
        len_bytes: u64,
    ) -> Result<Vec<ChangedExtent>> {
        self.check("changed-block query", offset_bytes, len_bytes)?;
        if !Arc::ptr_eq(&self.h.pool, &base.h.pool) {
            return Err(EngineError::Refused(format!(
                "volumes '{}' and '{}' are in different pools: their maps cannot be compared",
                self.name(),
                base.name()
            )));
        }
        let (vol, old) = (&self.h.vol, &base.h.vol);
        if old.is_deleted() {
            return Err(EngineError::VolumeGone(old.name()));
        }
        // One view of both maps: no write step runs between their reads.
        let _gate = self.inner().locks.shared();
        Ok(crate::map_diff::changed_extents(
            vol,
            old,
            offset_bytes,
            offset_bytes + len_bytes,
        ))
    }
}

/// Checkpoints one write takes at most to reclaim space before it reports a full pool.
const RECLAIM_ROUNDS_MAX: u32 = 64;
