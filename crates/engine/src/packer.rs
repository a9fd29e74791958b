//! The packer: compressed fragments appended byte-contiguously to a stream of data
//! blocks, so the space a fragment takes is its compressed length.
//!
//! Each zone has one packer with one open block in memory. A fragment that does
//! not fit in what is left of the open block continues in the next block, which
//! must be the physically next one (the map records only where a fragment starts
//! and its length); when that block is taken, the tail of the open block is left
//! as packing waste. A full block is written at once; a partial one is written
//! sector by sector at commit, so a flush costs at most one rewritten sector.
//!
//! A block or run whose write finds the device full (`StorageError::NoSpace`) is
//! not dropped: it waits, closed but unwritten, with its holds and its bytes (reads
//! find it here), and every flush tries it again. While one waits, the zone stores
//! nothing new (the store fails with the no-space error before anything changes),
//! so at most the blocks one store closes wait in a zone.
//!
//! A run's blocks are written past the page cache (`Storage::write_pages`, from a
//! page-aligned `PageBuf`): the packer serves them from its buffer until written,
//! and random data is seldom read back at once, so copying it into the cache only
//! cost the writing thread a copy and the cache's lock. A packed block is written
//! through the cache, sector by sector. Each block is written one way while a
//! packer holds it; a block freed and taken again the other way is safe, since a
//! direct write writes back and drops the cached pages of its range.

use crate::devices::Devices;
use crate::error::{within, within_mut};
use crate::geometry::PoolGeometry;
use crate::journal::Journal;
use crate::slab::{ObjRec, Slab};
use crate::slab_depot::SlabDepot;
use crate::{EngineError, Result};
use fewerbytes_format::location::{Codec, Location, ObjectId};
use fewerbytes_format::{BLOCK_BYTES, SECTOR_BYTES};
use fewerbytes_storage::{PageBuf, PAGE_BYTES};
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;

/// The open block of a packer.
struct OpenBlock {
    /// Slab it is in.
    slab: u32,
    /// Block index within the slab.
    block: u32,
    /// Its bytes so far.
    buf: Box<[u8; BLOCK_BYTES]>,
    /// Bytes filled.
    fill: usize,
    /// Bytes already written to the device.
    written: usize,
}

/// Whole blocks a zone gathers into one write: random data costs one system call
/// per run instead of one per block. A direct write waits for the device, so a run
/// holds a 128 KiB write's 32 blocks: one wait per such write, not two (16 blocks ran
/// 128k random writes ~1.36x slower, 64 no faster: docs/benchmarks.md).
pub const RUN_BLOCKS: u32 = 32;

// A block is whole pages, so a run's blocks start on page boundaries in its buffer
// and on the device (the data region starts on a block boundary).
const _: () = assert!(BLOCK_BYTES.is_multiple_of(PAGE_BYTES));

/// A run of consecutive blocks a zone fills with whole (uncompressed) blocks.
struct OpenRun {
    /// Slab it is in.
    slab: u32,
    /// First block of the run within the slab.
    first: u32,
    /// Blocks allocated to the run (consecutive).
    len: u32,
    /// Blocks filled so far.
    filled: u32,
    /// Blocks already written to the device.
    written: u32,
    /// The run's bytes, page-aligned for a direct write; shared only while a full
    /// run is written outside the zone's lock (`Packer::writing`).
    buf: Arc<PageBuf>,
}

impl OpenRun {
    /// The same run, its buffer shared: what reads find while it is written.
    fn share(&self) -> OpenRun {
        OpenRun {
            buf: Arc::clone(&self.buf),
            ..*self
        }
    }
}

/// One zone's packer: an open block for fragments and an open run for whole blocks.
#[derive(Default)]
struct Packer {
    /// The open block, if any.
    open: Option<OpenBlock>,
    /// The open run of whole blocks, if any.
    run: Option<OpenRun>,
    /// Closed blocks whose write found the device full: written by the next flush.
    unwritten_blocks: Vec<OpenBlock>,
    /// Closed runs whose write found the device full: written by the next flush.
    unwritten_runs: Vec<OpenRun>,
    /// Full runs being written by the thread that filled them, outside the zone's
    /// lock (a direct write waits for the device): at most one per thread storing in
    /// the zone. Reads find their blocks here; a flush waits for them.
    writing: Vec<OpenRun>,
    /// The buffer of the last run closed, for the next run: a fresh zeroed 64 KiB
    /// per run cost a `memset` of 16 blocks on every 16 whole blocks stored.
    spare_run_buf: PageBuf,
}

/// What the packers work with: the slabs they allocate from, the data device they
/// write (through the latch), where the data region starts, and the journal they
/// ask for a checkpoint when space runs out.
pub(crate) struct Space<'a> {
    pub(crate) depot: &'a SlabDepot,
    pub(crate) devices: &'a Devices,
    pub(crate) geometry: &'a PoolGeometry,
    pub(crate) journal: &'a Journal,
}

/// The record of object `object`, just allocated in `slab`, to be stored: an object
/// the slab has no record for is a broken invariant (the pool latches), never a write
/// whose record is silently left unset.
fn stored_rec<'s>(space: &Space<'_>, slab: &'s mut Slab, object: u32) -> Result<&'s mut ObjRec> {
    let index = slab.index();
    let rec = slab.rec_mut_stored(object).ok_or_else(|| {
        EngineError::Invariant(format!(
            "object {object} allocated in slab {index}, which has no record for it"
        ))
    });
    space.devices.check_invariant(rec)
}

/// The zones' packers, one per zone: the whole packing policy (which slab a zone
/// fills, when a fragment spans into the next block, when a block or run closes).
pub(crate) struct Zones {
    packers: Vec<Mutex<Packer>>,
    /// Told when a run written outside its zone's lock is done (`Packer::writing`).
    run_written: Condvar,
    /// The worker threads the pool was opened with.
    threads: usize,
}

impl Zones {
    /// One zone per worker thread, capped by the slab count (a zone prefers slabs
    /// of its own), each packer with nothing open; at least one.
    pub(crate) fn new(threads: usize, slab_count: u32) -> Self {
        let zones = threads.min(slab_count as usize).max(1);
        Zones {
            packers: (0..zones).map(|_| Mutex::new(Packer::default())).collect(),
            run_written: Condvar::new(),
            threads,
        }
    }

    /// The worker threads the pool was opened with.
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Zones (packers).
    pub(crate) fn count(&self) -> usize {
        self.packers.len()
    }

    fn packer(&self, zone: usize) -> &Mutex<Packer> {
        zone.checked_rem(self.packers.len())
            .and_then(|z| self.packers.get(z))
            .expect("zones are made non-empty at open")
    }

    fn write_open_block(&self, space: &Space<'_>, open: &mut OpenBlock, upto: usize) -> Result<()> {
        let from = open.written / SECTOR_BYTES * SECTOR_BYTES;
        let to = upto.div_ceil(SECTOR_BYTES) * SECTOR_BYTES;
        if to <= from {
            return Ok(());
        }
        let offset = space.geometry.data_offset_bytes()
            + space.depot.pbn(open.slab, open.block) * BLOCK_BYTES as u64
            + from as u64;
        let bytes = within(
            open.buf.as_slice(),
            from..to,
            "an open packed block's sectors",
        )?;
        let result = space.devices.data().write_at(bytes, offset);
        space.devices.check_write_or_no_space(result)?;
        open.written = upto;
        Ok(())
    }

    /// Close the open block: write what is unwritten and drop the packer's hold. A
    /// write that finds the device full leaves the block in `unwritten`, held.
    fn close_block(
        &self,
        space: &Space<'_>,
        zone: usize,
        mut open: OpenBlock,
        unwritten: &mut Vec<OpenBlock>,
    ) -> Result<()> {
        let fill = open.fill;
        let written = self.write_open_block(space, &mut open, fill);
        if written.as_ref().is_err_and(|e| e.is_no_space()) {
            unwritten.push(open);
            return Ok(());
        }
        let dropped = Self::release_block(space, zone, &open);
        written.and(dropped)
    }

    /// Drop the packer's hold on a closed block.
    fn release_block(space: &Space<'_>, zone: usize, open: &OpenBlock) -> Result<()> {
        let mut slab = space.depot.slab(open.slab).lock();
        slab.remove_open_block(open.block, zone);
        space.devices.check_invariant(slab.drop_block(open.block))
    }

    /// Write the zone's closed blocks and runs that found the device full, and let
    /// them go; the first error (no space again) leaves the rest waiting.
    fn write_unwritten(&self, space: &Space<'_>, zone: usize, packer: &mut Packer) -> Result<()> {
        let mut result = Ok(());
        for mut open in std::mem::take(&mut packer.unwritten_blocks) {
            let fill = open.fill;
            match self.write_open_block(space, &mut open, fill) {
                Ok(()) => Self::release_block(space, zone, &open)?,
                Err(e) => {
                    packer.unwritten_blocks.push(open);
                    result = result.and(Err(e));
                }
            }
        }
        for mut run in std::mem::take(&mut packer.unwritten_runs) {
            match self.write_run(space, &mut run) {
                Ok(()) => Self::release_run(space, zone, &run)?,
                Err(e) => {
                    packer.unwritten_runs.push(run);
                    result = result.and(Err(e));
                }
            }
        }
        result
    }

    /// Open a fresh block in a slab with room for a fragment (block and object).
    fn open_block(&self, space: &Space<'_>, zone: usize) -> Result<OpenBlock> {
        for s in space.depot.order(zone, self.count()) {
            let mut slab = space.depot.slab(s).lock();
            if slab.free_blocks() == 0 {
                // A full slab: its counter says so without a scan of its bitmap.
                continue;
            }
            if slab.free_objects() == 0 || slab.free_objects() <= slab.free_blocks() / 2 {
                // Objects are the scarcer resource here; keep them for whole blocks.
                if slab.free_objects() == 0 {
                    continue;
                }
            }
            if let Some(block) = slab.alloc_block() {
                space.devices.check_invariant(slab.hold_block(block))?;
                slab.add_open_block(block, zone);
                return Ok(OpenBlock {
                    slab: s,
                    block,
                    buf: Box::new([0; BLOCK_BYTES]),
                    fill: 0,
                    written: 0,
                });
            }
        }
        space.journal.request_checkpoint();
        Err(EngineError::NoSpace("no free data blocks left".into()))
    }

    /// Store a fragment compressed with `codec`; returns its object (with one reference) and location.
    pub(crate) fn pack(
        &self,
        space: &Space<'_>,
        zone: usize,
        bytes: &[u8],
        codec: Codec,
        fingerprint: &[u8; 32],
    ) -> Result<(ObjectId, Location)> {
        let len = bytes.len();
        debug_assert!(len > 0 && len < BLOCK_BYTES);
        let mut packer = self.packer(zone).lock();
        // Nothing new while earlier blocks wait for space: fail before any change.
        self.write_unwritten(space, zone, &mut packer)?;
        let packer = &mut *packer;
        for _attempt in 0..4 {
            let mut open = match packer.open.take() {
                Some(o) => o,
                None => self.open_block(space, zone)?,
            };
            let mut slab = space.depot.slab(open.slab).lock();
            let Some(object) = slab.alloc_object() else {
                drop(slab);
                self.close_block(space, zone, open, &mut packer.unwritten_blocks)?;
                continue;
            };
            let start = open.fill;
            let spans = start + len > BLOCK_BYTES;
            if spans && !slab.alloc_block_at(open.block + 1) {
                slab.unalloc_object(object);
                drop(slab);
                self.close_block(space, zone, open, &mut packer.unwritten_blocks)?;
                continue;
            }
            let addr_bytes =
                space.depot.pbn(open.slab, open.block) * BLOCK_BYTES as u64 + start as u64;
            let location = Location::Fragment {
                addr_bytes,
                len_bytes: len as u16,
                codec,
            };
            space.devices.check_invariant(slab.hold_block(open.block))?;
            *stored_rec(space, &mut slab, object)? = ObjRec {
                location: location.encode(),
                refcount: 1,
                fingerprint: *fingerprint,
            };
            let object_id = space.depot.object_id(open.slab, object);
            let first = (BLOCK_BYTES - start).min(len);
            within_mut(
                open.buf.as_mut_slice(),
                start..start + first,
                "an open packed block",
            )?
            .copy_from_slice(within(bytes, 0..first, "a fragment's head")?);
            open.fill = start + first;
            if spans {
                let next = open.block + 1;
                space.devices.check_invariant(slab.hold_block(next))?; // the fragment's hold
                space.devices.check_invariant(slab.hold_block(next))?; // the packer's hold on its new open block
                slab.add_open_block(next, zone);
                let slab_index = open.slab;
                drop(slab);
                self.close_block(space, zone, open, &mut packer.unwritten_blocks)?;
                let mut buf = Box::new([0u8; BLOCK_BYTES]);
                let rest = len - first;
                within_mut(buf.as_mut_slice(), 0..rest, "a packed block")?.copy_from_slice(within(
                    bytes,
                    first..len,
                    "a fragment's tail",
                )?);
                packer.open = Some(OpenBlock {
                    slab: slab_index,
                    block: next,
                    buf,
                    fill: rest,
                    written: 0,
                });
            } else if open.fill == BLOCK_BYTES {
                drop(slab);
                self.close_block(space, zone, open, &mut packer.unwritten_blocks)?;
            } else {
                drop(slab);
                packer.open = Some(open);
            }
            return Ok((object_id, location));
        }
        Err(EngineError::NoSpace(
            "no room for a compressed fragment".into(),
        ))
    }

    /// Close every zone's open block and run, so their unused blocks become
    /// pending-free (reusable after the next checkpoint): a full pool's last resort.
    pub(crate) fn release_open_space(&self, space: &Space<'_>) -> Result<()> {
        for zone in 0..self.count() {
            let mut packer = self.packer(zone).lock();
            if let Some(run) = packer.run.take() {
                self.close_run(space, zone, run, &mut packer)?;
            }
            if let Some(open) = packer.open.take() {
                self.close_block(space, zone, open, &mut packer.unwritten_blocks)?;
            }
        }
        Ok(())
    }

    /// Write the unwritten part of every open block and run, after the runs being
    /// written are (before a commit's data sync).
    pub(crate) fn flush(&self, space: &Space<'_>) -> Result<()> {
        for zone in 0..self.count() {
            let mut packer = self.packer(zone).lock();
            while !packer.writing.is_empty() {
                self.run_written.wait(&mut packer);
            }
            self.write_unwritten(space, zone, &mut packer)?;
            if let Some(open) = packer.open.as_mut() {
                let fill = open.fill;
                self.write_open_block(space, open, fill)?;
            }
            if let Some(run) = packer.run.as_mut() {
                self.write_run(space, run)?;
            }
        }
        Ok(())
    }

    fn write_run(&self, space: &Space<'_>, run: &mut OpenRun) -> Result<()> {
        if run.written == run.filled {
            return Ok(());
        }
        let from = run.written as usize * BLOCK_BYTES;
        let to = run.filled as usize * BLOCK_BYTES;
        let offset = space.geometry.data_offset_bytes()
            + space.depot.pbn(run.slab, run.first + run.written) * BLOCK_BYTES as u64;
        let bytes = within(run.buf.as_bytes(), from..to, "an open run's blocks")?;
        let r = space.devices.data().write_pages(bytes, offset);
        space.devices.check_write_or_no_space(r)?;
        run.written = run.filled;
        Ok(())
    }

    /// Close a run: write what is unwritten, drop the zone's hold on every block of it
    /// (blocks never filled become free again at the next checkpoint). A write that
    /// finds the device full leaves the run in `unwritten`, held.
    fn close_run(
        &self,
        space: &Space<'_>,
        zone: usize,
        mut run: OpenRun,
        packer: &mut Packer,
    ) -> Result<()> {
        let written = self.write_run(space, &mut run);
        Self::closed_run(space, zone, run, written, packer)
    }

    /// A closed run after its write: waiting in `unwritten_runs` if the device was
    /// full, otherwise let go (its buffer kept for the next run).
    fn closed_run(
        space: &Space<'_>,
        zone: usize,
        run: OpenRun,
        written: Result<()>,
        packer: &mut Packer,
    ) -> Result<()> {
        if written.as_ref().is_err_and(|e| e.is_no_space()) {
            packer.unwritten_runs.push(run);
            return Ok(());
        }
        Self::release_run(space, zone, &run)?;
        if let Ok(buf) = Arc::try_unwrap(run.buf) {
            packer.spare_run_buf = buf;
        }
        written
    }

    /// Write a full run outside the zone's lock (`guard`, released and taken again):
    /// the zone's other threads store on meanwhile, and reads find the run in
    /// `Packer::writing`.
    fn write_full_run(
        &self,
        space: &Space<'_>,
        zone: usize,
        mut run: OpenRun,
        mut guard: parking_lot::MutexGuard<'_, Packer>,
    ) -> Result<()> {
        guard.writing.push(run.share());
        drop(guard);
        let written = self.write_run(space, &mut run);
        let mut guard = self.packer(zone).lock();
        guard.writing.retain(|w| !Arc::ptr_eq(&w.buf, &run.buf));
        let closed = Self::closed_run(space, zone, run, written, &mut guard);
        drop(guard);
        self.run_written.notify_all();
        closed
    }

    /// Drop the zone's hold on every block of a closed run.
    fn release_run(space: &Space<'_>, zone: usize, run: &OpenRun) -> Result<()> {
        let mut slab = space.depot.slab(run.slab).lock();
        for b in run.first..run.first + run.len {
            slab.remove_open_run_block(b, zone);
            space.devices.check_invariant(slab.drop_block(b))?;
        }
        Ok(())
    }

    /// Allocate a run of up to `RUN_BLOCKS` consecutive blocks in a slab with free objects.
    fn open_run(&self, space: &Space<'_>, zone: usize, spare_buf: &mut PageBuf) -> Result<OpenRun> {
        for s in space.depot.order(zone, self.count()) {
            let mut slab = space.depot.slab(s).lock();
            // A full slab is skipped on its counters: scanning its block bitmap for
            // nothing cost ~2 µs per stored block once most slabs were full.
            if slab.free_objects() == 0 || slab.free_blocks() == 0 {
                continue;
            }
            let Some(first) = slab.alloc_block() else {
                continue;
            };
            let mut len = 1;
            while len < RUN_BLOCKS && slab.alloc_block_at(first + len) {
                len += 1;
            }
            for b in first..first + len {
                space.devices.check_invariant(slab.hold_block(b))?;
                slab.add_open_block(b, zone);
            }
            return Ok(OpenRun {
                slab: s,
                first,
                len,
                filled: 0,
                written: 0,
                // Bytes past `filled` are never written nor read: a reused buffer
                // needs no zeroing, only the run's length.
                buf: {
                    let mut buf = std::mem::take(spare_buf);
                    buf.resize_pages(RUN_BLOCKS as usize * BLOCK_BYTES / PAGE_BYTES);
                    Arc::new(buf)
                },
            });
        }
        // Space freed since the last checkpoint is not reusable before it: ask for one.
        space.journal.request_checkpoint();
        Err(EngineError::NoSpace(format!(
            "all {} data blocks are in use",
            space.geometry.data_blocks()
        )))
    }

    /// Store a whole block in the zone's run; returns its object (one reference) and
    /// data block number. The bytes reach the device when the run fills or at commit.
    pub(crate) fn store_whole(
        &self,
        space: &Space<'_>,
        zone: usize,
        block: &[u8],
        fingerprint: &[u8; 32],
    ) -> Result<(ObjectId, u64)> {
        let mut guard = self.packer(zone).lock();
        // Nothing new while earlier blocks wait for space: fail before any change.
        self.write_unwritten(space, zone, &mut guard)?;
        let packer = &mut *guard;
        for _attempt in 0..4 {
            let mut run = match packer.run.take() {
                Some(r) => r,
                None => self.open_run(space, zone, &mut packer.spare_run_buf)?,
            };
            let mut slab = space.depot.slab(run.slab).lock();
            let Some(object) = slab.alloc_object() else {
                drop(slab);
                self.close_run(space, zone, run, packer)?;
                continue;
            };
            let b = run.first + run.filled;
            let pbn = space.depot.pbn(run.slab, b);
            space.devices.check_invariant(slab.hold_block(b))?;
            *stored_rec(space, &mut slab, object)? = ObjRec {
                location: Location::Block { pbn }.encode(),
                refcount: 1,
                fingerprint: *fingerprint,
            };
            drop(slab);
            let at = run.filled as usize * BLOCK_BYTES;
            // A run's buffer holds its length in blocks and `filled < len`: past it,
            // the block would be lost while its record says it is stored.
            let copied = Arc::get_mut(&mut run.buf)
                .ok_or_else(|| EngineError::Invariant("an open run's buffer is shared".into()))
                .and_then(|buf| within_mut(buf.as_bytes_mut(), at..at + BLOCK_BYTES, "a run"))
                .and_then(|dst| {
                    dst.copy_from_slice(within(block, 0..BLOCK_BYTES, "a whole block")?);
                    Ok(())
                });
            space.devices.check_invariant(copied)?;
            run.filled += 1;
            let object_id = space.depot.object_id(run.slab, object);
            if run.filled == run.len {
                self.write_full_run(space, zone, run, guard)?;
            } else {
                packer.run = Some(run);
            }
            return Ok((object_id, pbn));
        }
        Err(EngineError::NoSpace("no room for a whole block".into()))
    }

    /// Copy bytes of block `(slab, block)` at `[from, to)` from an open packer block
    /// into `out`, if a packer still holds that block open. Returns whether it did.
    pub(crate) fn read_open_block(
        &self,
        zone: usize,
        slab: u32,
        block: u32,
        from: usize,
        out: &mut [u8],
    ) -> bool {
        let packer = self.packer(zone).lock();
        let blocks = packer.open.iter().chain(&packer.unwritten_blocks);
        for open in blocks {
            if open.slab == slab && open.block == block {
                // A range outside the block (a bug) is not copied: the caller
                // reads the device, and the fingerprint check reports any mismatch.
                return open.buf.get(from..from + out.len()).is_some_and(|src| {
                    out.copy_from_slice(src);
                    true
                });
            }
        }
        let runs = packer.run.iter().chain(&packer.unwritten_runs);
        for run in runs.chain(&packer.writing) {
            if run.slab == slab && block >= run.first && block < run.first + run.filled {
                let at = (block - run.first) as usize * BLOCK_BYTES + from;
                return run
                    .buf
                    .as_bytes()
                    .get(at..at + out.len())
                    .is_some_and(|src| {
                        out.copy_from_slice(src);
                        true
                    });
            }
        }
        false
    }
}
