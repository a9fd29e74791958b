//! `Volume`: a handle on one volume, and the read and write paths.
//!
//! The life of a 4 KiB write (ARCHITECTURE.md has the numbered version):
//! zero check → keyed BLAKE3 → index advice checked against the stored
//! fingerprint → reference to the existing object, or compression (codec.rs) and the packer (or a
//! whole block) → journal record → block-map update → old reference dropped.

use crate::block_map::{VolumeState, ENTRIES_PER_PAGE};
use crate::counters::add;
use crate::error::within_mut;
use crate::inner::{Inner, Wait, BLOCKS_PER_STEP};
use crate::pool::Pool;
use crate::recovery::range_result;
use crate::slab::ObjRec;
use crate::{EngineError, Extent, Result};
use fewerbytes_format::journal::Record;
use fewerbytes_format::journal::{MAP_SET_BYTES, NEW_OBJECT_BYTES, RANGE_SET_BYTES};
use fewerbytes_format::location::{Location, MapEntry, ObjectId};
use fewerbytes_format::BLOCK_BYTES;
use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Journal bytes one block may need: a new object and a map change.
const JOURNAL_BYTES_PER_BLOCK: u64 = (NEW_OBJECT_BYTES + MAP_SET_BYTES) as u64;
/// Journal bytes one page of a range operation needs.
const JOURNAL_BYTES_PER_RANGE: u64 = RANGE_SET_BYTES as u64;
const BLOCK: u64 = BLOCK_BYTES as u64;

thread_local! {
    static ZONE: Cell<usize> = const { Cell::new(usize::MAX) };
}

static NEXT_ZONE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The zone (packer and preferred slabs) of the calling thread: threads spread
/// over zones round-robin so their packers and slabs do not contend.
fn my_zone(zones: usize) -> usize {
    ZONE.with(|z| {
        if z.get() == usize::MAX {
            z.set(NEXT_ZONE.fetch_add(1, Ordering::Relaxed));
        }
        z.get() % zones
    })
}

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
        &self.h.pool.inner
    }

    /// The volume's name.
    pub fn name(&self) -> String {
        self.h.vol.name()
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
        Ok(())
    }

    /// Read `buf.len()` bytes at `offset_bytes` (any offset and length inside the volume).
    pub fn read(&self, offset_bytes: u64, buf: &mut [u8]) -> Result<()> {
        self.check("read", offset_bytes, buf.len() as u64)?;
        let inner = self.inner();
        let _gate = inner.gate.read();
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
        let Some(_gate) = inner.gate.try_read() else {
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
                inner.read_block(&self.h.vol, lbn, out, wait)?
            } else {
                let done = inner.read_block(&self.h.vol, lbn, &mut block, wait)?;
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
        self.check("write", offset_bytes, data.len() as u64)?;
        let inner = self.inner();
        inner.devices.ensure_writable()?;
        inner.ensure_space()?;
        let mut pos = 0usize;
        let step_bytes = (BLOCKS_PER_STEP * BLOCK) as usize;
        while pos < data.len() {
            // One step: at most BLOCKS_PER_STEP blocks under one journal reservation.
            let at = offset_bytes + pos as u64;
            let step_end =
                ((at / BLOCK) * BLOCK + step_bytes as u64).min(offset_bytes + data.len() as u64);
            let n = (step_end - at) as usize;
            // Blocks touched, plus an abandoned attempt for each partial block at the
            // step's two ends (see `partial.rs`).
            let reserve = ((n as u64).div_ceil(BLOCK) + 1) * JOURNAL_BYTES_PER_BLOCK
                + 2 * JOURNAL_BYTES_PER_RMW_RETRY;
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
                    inner.checkpoint()?;
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
        let _gate = inner.gate.read();
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
        while pos < data.len() {
            let at = offset_bytes + pos as u64;
            let lbn = at / BLOCK;
            let within = (at % BLOCK) as usize;
            let n = (BLOCK_BYTES - within).min(data.len() - pos);
            let src = crate::error::within(data, pos..pos + n, "a write step's data")?;
            let stripe = inner.stripe(vol, lbn).lock();
            if n == BLOCK_BYTES {
                inner.write_block(vol, lbn, src, None)?;
            } else {
                inner.write_partial(vol, lbn, within, src)?;
            }
            drop(stripe);
            pos += n;
        }
        Ok(())
    }

    /// Make a range read as zeros, storing nothing.
    pub fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<()> {
        self.range_op("write_zeroes", offset_bytes, len_bytes, MapEntry::Zero, fua)?;
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
            let page_end = ((lbn / ENTRIES_PER_PAGE) + 1) * ENTRIES_PER_PAGE;
            let step_end = page_end
                .min(last_full)
                .min(lbn + ENTRIES_PER_PAGE * BLOCKS_PER_STEP);
            inner
                .journal
                .reserve(JOURNAL_BYTES_PER_RANGE * BLOCKS_PER_STEP)?;
            let result = self.range_step(lbn, step_end, entry);
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

    /// Apply a range operation to whole pages from `lbn` up to `end`, at most
    /// `BLOCKS_PER_STEP` pages. Returns where it stopped.
    fn range_step(&self, mut lbn: u64, end: u64, entry: MapEntry) -> Result<u64> {
        let inner = self.inner();
        let _gate = inner.gate.read();
        let vol = &self.h.vol;
        if vol.is_deleted() {
            return Err(EngineError::VolumeGone(vol.name()));
        }
        let end = end.min(vol.size_blocks());
        let mut released = Vec::new();
        let pages = vol.pages.read();
        let mut steps = 0;
        while lbn < end && steps < BLOCKS_PER_STEP {
            let p = lbn / ENTRIES_PER_PAGE;
            let page_end = ((p + 1) * ENTRIES_PER_PAGE).min(end);
            if let Some(page) = pages.get(p as usize) {
                let mut page = page.lock();
                if page.entries.is_some() {
                    let mut changed = false;
                    for l in lbn..page_end {
                        let i = (l % ENTRIES_PER_PAGE) as usize;
                        let old = page.get(i);
                        if let Some(new) = range_result(old, entry) {
                            page.set(i, new, &inner.dirty_pages);
                            vol.account(old, new);
                            released.extend(old.object());
                            changed = true;
                        }
                    }
                    if changed {
                        inner.journal.append(&Record::RangeSet {
                            volume: vol.slot,
                            lbn,
                            count: page_end - lbn,
                            entry,
                        });
                    }
                }
            }
            lbn = page_end;
            steps += 1;
        }
        drop(pages);
        inner.depot.release_objects(&inner.devices, &released)?;
        Ok(lbn)
    }

    /// Make every acknowledged write (on any handle of the pool) durable.
    pub fn flush(&self) -> Result<()> {
        add(&self.h.vol.counters().flushes, 1);
        self.h.pool.flush()
    }

    /// What backs `[offset, offset+len)`: runs of data and of holes (zero/unmapped).
    pub fn extents(&self, offset_bytes: u64, len_bytes: u64) -> Result<Vec<Extent>> {
        self.check("block status", offset_bytes, len_bytes)?;
        let vol = &self.h.vol;
        let mut out: Vec<Extent> = Vec::new();
        let end = offset_bytes + len_bytes;
        let mut at = offset_bytes;
        let pages = vol.pages.read();
        while at < end {
            let lbn = at / BLOCK;
            let next = ((lbn + 1) * BLOCK).min(end);
            let page = pages.get((lbn / ENTRIES_PER_PAGE) as usize);
            let (data, run_end) = match page {
                Some(p) => {
                    let p = p.lock();
                    if p.entries.is_none() {
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
                None => (false, end),
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
}

/// Journal bytes an abandoned attempt may leave behind: the `NewObject` record of a
/// block stored and then dropped because a range operation won the race.
const JOURNAL_BYTES_PER_RMW_RETRY: u64 = NEW_OBJECT_BYTES as u64;

/// Checkpoints one write takes at most to reclaim space before it reports a full pool.
const RECLAIM_ROUNDS_MAX: u32 = 64;

fn is_zero(block: &[u8]) -> bool {
    let (prefix, words, suffix) = unsafe {
        // SAFETY: any byte pattern is a valid u64; align_to only reinterprets the aligned middle.
        block.align_to::<u64>()
    };
    prefix.iter().all(|b| *b == 0)
        && words.iter().all(|w| *w == 0)
        && suffix.iter().all(|b| *b == 0)
}

impl Inner {
    pub(crate) fn stripe(&self, vol: &VolumeState, lbn: u64) -> &parking_lot::Mutex<()> {
        let h = (lbn ^ (vol.id.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
            .wrapping_mul(0xff51_afd7_ed55_8ccd)
            >> 40;
        crate::inner::pick(&self.stripes, h as usize)
    }

    fn fingerprint(&self, block: &[u8]) -> [u8; 32] {
        *blake3::keyed_hash(self.geometry.fingerprint_key(), block).as_bytes()
    }

    /// Read one block into `out` (4096 bytes). Caller holds the gate and no stripe
    /// lock. Returns false (with `Wait::No`) if the block's bytes are not at hand
    /// without waiting.
    ///
    /// A write of the block may drop the object being read between the map lookup
    /// and the read of its record (its record is cleared; its bytes stay until a
    /// checkpoint, which the gate holds off). That is a race, not corruption: the
    /// read starts again under the block's stripe lock, where no write of the block
    /// runs, and a range operation can only leave it reading as zeros
    /// (`partial::read_object_settled`).
    pub(crate) fn read_block(
        &self,
        vol: &VolumeState,
        lbn: u64,
        out: &mut [u8],
        wait: Wait,
    ) -> Result<bool> {
        let entry = vol.get(lbn);
        let first = match entry {
            MapEntry::Unmapped | MapEntry::Zero => {
                out.fill(0);
                return Ok(true);
            }
            MapEntry::Object(o) => self.read_object(o, out, wait),
        };
        match first {
            Err(e) if crate::block_map::reads_alike(vol.get(lbn), entry) => {
                Err(in_volume(e, vol, lbn))
            }
            Err(_) => {
                let stripe = self.stripe(vol, lbn);
                let _held = match wait {
                    Wait::Yes => stripe.lock(),
                    Wait::No => match stripe.try_lock() {
                        Some(held) => held,
                        None => return Ok(false),
                    },
                };
                self.read_object_settled(vol, lbn, out, wait)
                    .map(|read| read.0)
                    .map_err(|e| in_volume(e, vol, lbn))
            }
            done => done,
        }
    }

    /// A stored object whose bytes (or record) fail their checks, named by the data
    /// block its location starts at (`location`, its record's raw location word),
    /// or by its slab's first block when the location itself is bad.
    fn corrupt_object(&self, o: ObjectId, location: u64, reason: String) -> EngineError {
        let (s, _) = self.depot.split_object(o);
        let data_first_block = self.geometry.data_offset_bytes() / BLOCK;
        let (block, what) = match Location::decode(location) {
            Ok(loc) => {
                let pbn = loc.blocks().0;
                let what = match loc {
                    Location::Block { .. } => format!("object {} (data block {pbn})", o.0),
                    Location::Fragment { len_bytes, .. } => format!(
                        "object {} (a {len_bytes}-byte fragment in data block {pbn})",
                        o.0
                    ),
                };
                (data_first_block + pbn, what)
            }
            Err(_) => (
                data_first_block + u64::from(s) * u64::from(crate::geometry::SLAB_BLOCKS),
                format!("object {} of slab {s}", o.0),
            ),
        };
        EngineError::Corrupt {
            region: "data",
            block,
            device: "data",
            reason: format!("{what}: {reason}"),
        }
    }

    pub(crate) fn read_object(&self, o: ObjectId, out: &mut [u8], wait: Wait) -> Result<bool> {
        let (s, i) = self.depot.split_object(o);
        let (rec, open) = {
            let slab = self.depot.slab(s).lock();
            let rec = slab.rec(i);
            let loc = Location::decode(rec.location)
                .map_err(|e| self.corrupt_object(o, rec.location, e.to_string()))?;
            let (first, count) = loc.blocks();
            // A location touches at most two blocks: no allocation on the read path.
            let mut open: [(u64, Option<usize>); 2] = [(first, None), (first + 1, None)];
            for (b, zone) in open.iter_mut().take(count as usize) {
                *zone = slab.open_zone((*b - slab.first_pbn()) as u32);
            }
            (rec, open)
        };
        if rec.refcount == 0 {
            return Err(self.corrupt_object(
                o,
                rec.location,
                "mapped but has no references".into(),
            ));
        }
        if !self.read_location(o, &rec, open, out, wait)? {
            return Ok(false);
        }
        // Every stored block keeps its fingerprint: a block that no longer matches it
        // is reported, never returned (1.8 µs per block on these machines).
        if self.fingerprint(out) != rec.fingerprint {
            return Err(self.corrupt_object(
                o,
                rec.location,
                "stored data does not match its fingerprint".into(),
            ));
        }
        Ok(true)
    }

    /// Read data-device bytes; with `Wait::No`, only if they are cached (false if not).
    /// A failed read fails its request and does not latch the pool: nothing was
    /// changed, and a bad sector under one block must not stop writes to the rest.
    fn read_data(&self, buf: &mut [u8], offset_bytes: u64, wait: Wait) -> Result<bool> {
        let r = match wait {
            Wait::Yes => self
                .devices
                .data()
                .read_at(buf, offset_bytes)
                .map(|()| true),
            Wait::No => self.devices.data().read_at_cached(buf, offset_bytes),
        };
        Ok(r?)
    }

    fn read_location(
        &self,
        o: ObjectId,
        rec: &ObjRec,
        open: [(u64, Option<usize>); 2],
        out: &mut [u8],
        wait: Wait,
    ) -> Result<bool> {
        let s = self.depot.split_object(o).0;
        let slab_first = u64::from(s) * u64::from(crate::geometry::SLAB_BLOCKS);
        let location = Location::decode(rec.location)
            .map_err(|e| self.corrupt_object(o, rec.location, e.to_string()))?;
        let (_, blocks) = location.blocks();
        match location {
            Location::Block { pbn } => {
                let zone = open.first().and_then(|(_, z)| *z);
                if zone.is_some_and(|z| {
                    self.zones
                        .read_open_block(z, s, (pbn - slab_first) as u32, 0, out)
                }) {
                    return Ok(true);
                }
                self.read_data(out, self.geometry.data_offset_bytes() + pbn * BLOCK, wait)
            }
            Location::Fragment {
                addr_bytes,
                len_bytes,
                codec,
            } => {
                let len = usize::from(len_bytes);
                let mut packed = [0u8; BLOCK_BYTES];
                let mut done = 0usize;
                // Bytes past the first block are always within `len`, so at most
                // `blocks` (1 or 2) entries of `open` are used.
                for (b, zone) in open.into_iter().take(blocks as usize) {
                    let block_start = b * BLOCK;
                    let from = (addr_bytes + done as u64 - block_start) as usize;
                    let n = (BLOCK_BYTES - from).min(len - done);
                    let dst = within_mut(&mut packed, done..done + n, "a fragment's bytes")?;
                    let from_packer = zone.is_some_and(|z| {
                        self.zones
                            .read_open_block(z, s, (b - slab_first) as u32, from, dst)
                    });
                    if !from_packer
                        && !self.read_data(
                            dst,
                            self.geometry.data_offset_bytes() + block_start + from as u64,
                            wait,
                        )?
                    {
                        return Ok(false);
                    }
                    done += n;
                }
                let n = crate::codec::decompress(
                    codec,
                    crate::error::within(&packed, 0..len, "a fragment's bytes")?,
                    out,
                )
                .map_err(|why| self.corrupt_object(o, rec.location, why))?;
                if n != BLOCK_BYTES {
                    return Err(self.corrupt_object(
                        o,
                        rec.location,
                        format!("fragment decodes to {n} bytes, not {BLOCK_BYTES}"),
                    ));
                }
                Ok(true)
            }
        }
    }

    /// Store a new block (compressed or whole) with one reference; journals it.
    /// Counted in the pool's and the writing volume's counters.
    fn store_new(
        &self,
        block: &[u8],
        fp: &[u8; 32],
        vol_counters: &crate::counters::Counters,
    ) -> Result<ObjectId> {
        let zone = my_zone(self.zones.count());
        let packed = crate::codec::compress(self.codec.get(), block, |codec, bytes| {
            self.zones.pack(&self.space(), zone, bytes, codec, fp)
        });
        let compressed = match packed {
            Some(Ok(v)) => Some(v),
            None | Some(Err(EngineError::NoSpace(_))) => None,
            Some(Err(e)) => return Err(e),
        };
        let (object, location) = match compressed {
            Some(v) => {
                add(&self.counters.compressed_writes, 1);
                add(&vol_counters.compressed_writes, 1);
                v
            }
            None => {
                let (object, pbn) = self.zones.store_whole(&self.space(), zone, block, fp)?;
                add(&self.counters.uncompressed_writes, 1);
                add(&vol_counters.uncompressed_writes, 1);
                (object, Location::Block { pbn })
            }
        };
        // Journalled before anyone can find it in the index, so a reference to it
        // can never be durable before the object itself.
        self.journal.append(&Record::NewObject {
            object: object.0,
            location: location.encode(),
            fingerprint: *fp,
        });
        self.depot.index().insert(fp, object);
        Ok(object)
    }

    /// Write one whole block of a volume. Caller holds the gate and the block's stripe.
    ///
    /// With `expect`, the map is updated only if the block's entry still reads like
    /// it (`block_map::reads_alike`); otherwise nothing changes and the result is
    /// `false` (a read-modify-write lost a race with a range operation).
    pub(crate) fn write_block(
        &self,
        vol: &VolumeState,
        lbn: u64,
        block: &[u8],
        expect: Option<MapEntry>,
    ) -> Result<bool> {
        add(&self.counters.blocks_written, 1);
        add(&vol.counters().blocks_written, 1);
        let entry = if is_zero(block) {
            add(&self.counters.zero_blocks_written, 1);
            add(&vol.counters().zero_blocks_written, 1);
            MapEntry::Zero
        } else {
            let fp = self.fingerprint(block);
            let (found, stale) = self.depot.take_duplicate(&fp);
            add(&self.counters.advice_stale, stale);
            add(&vol.counters().advice_stale, stale);
            if found.is_some() {
                add(&self.counters.advice_valid, 1);
                add(&vol.counters().advice_valid, 1);
            }
            match found {
                Some(o) => {
                    add(&self.counters.dedup_hits, 1);
                    add(&vol.counters().dedup_hits, 1);
                    MapEntry::Object(o)
                }
                None => MapEntry::Object(self.store_new(block, &fp, vol.counters())?),
            }
        };
        let old = {
            let pages = vol.pages.read();
            let Some(page) = pages.get((lbn / ENTRIES_PER_PAGE) as usize) else {
                drop(pages);
                if let Some(o) = entry.object() {
                    self.depot.release_object(&self.devices, o)?;
                }
                return Err(EngineError::VolumeGone(vol.name()));
            };
            let mut page = page.lock();
            let i = (lbn % ENTRIES_PER_PAGE) as usize;
            if expect.is_some_and(|e| !crate::block_map::reads_alike(page.get(i), e)) {
                drop(page);
                drop(pages);
                if let Some(o) = entry.object() {
                    self.depot.release_object(&self.devices, o)?;
                }
                return Ok(false);
            }
            let old = page.set(i, entry, &self.dirty_pages);
            // Appended under the page lock: journal order matches map order per block.
            self.journal.append(&Record::MapSet {
                volume: vol.slot,
                lbn,
                entry,
            });
            old
        };
        vol.account(old, entry);
        if let Some(o) = old.object() {
            self.depot.release_object(&self.devices, o)?;
        }
        Ok(true)
    }
}

/// A data corruption error with the volume and offset it was read for.
fn in_volume(e: EngineError, vol: &VolumeState, lbn: u64) -> EngineError {
    match e {
        EngineError::Corrupt {
            region: "data",
            block,
            device,
            reason,
        } => EngineError::Corrupt {
            region: "data",
            block,
            device,
            reason: format!(
                "volume '{}' at offset {}: {reason}",
                vol.name(),
                lbn * BLOCK
            ),
        },
        other => other,
    }
}
