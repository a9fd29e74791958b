//! The block write path: one whole block, zero-checked, fingerprinted, deduplicated
//! against the index's advice or stored new (compressed by the pool's codec,
//! `codec.rs`, and packed, or whole), its
//! map entry set and journalled.

use crate::block_map::{VolumeState, ENTRIES_PER_PAGE};
use crate::counters::add;
use crate::fingerprint::Fingerprint;
use crate::inner::Inner;
use crate::{EngineError, Result};
use fewerbytes_format::journal::Record;
use fewerbytes_format::location::{Location, MapEntry, ObjectId};
use fewerbytes_format::BLOCK_BYTES;
use std::cell::Cell;
use std::sync::atomic::Ordering;

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

fn is_zero(block: &[u8]) -> bool {
    let (prefix, words, suffix) = unsafe {
        // SAFETY: any byte pattern is a valid u64; align_to only reinterprets the aligned middle.
        block.align_to::<u64>()
    };
    prefix.iter().all(|b| *b == 0)
        && words.iter().all(|w| *w == 0)
        && suffix.iter().all(|b| *b == 0)
}

/// Store a new block (compressed or whole) with one reference. Counted in the pool's
/// and the writing volume's counters. Not journalled or indexed here: its map entry's
/// record stores it (`NewStored`, [`map_placed`]), which then sets its fingerprint
/// (until then `slab.rs: FINGERPRINT_IN_FLIGHT`) and indexes it.
fn store_new(
    inner: &Inner,
    block: &[u8],
    vol_counters: &crate::counters::Counters,
) -> Result<(ObjectId, Location)> {
    if !inner.journal.slim_records() {
        // Every read-write open sets flags bit 6 before a write is let in.
        return Err(EngineError::Invariant(
            "a block was stored before the open allowed slim journal records".into(),
        ));
    }
    let zone = my_zone(inner.zones.count());
    let fp = &crate::slab::FINGERPRINT_IN_FLIGHT;
    let packed = crate::codec::compress(inner.codec.get(), block, |codec, bytes| {
        inner.zones.pack(&inner.space(), zone, bytes, codec, fp)
    });
    let compressed = match packed {
        Some(Ok(v)) => Some(v),
        None | Some(Err(EngineError::NoSpace(_))) => None,
        Some(Err(e)) => return Err(e),
    };
    match compressed {
        Some(stored) => {
            add(&inner.counters.compressed_writes, 1);
            add(&vol_counters.compressed_writes, 1);
            Ok(stored)
        }
        None => {
            let (object, pbn) = inner.zones.store_whole(&inner.space(), zone, block, fp)?;
            add(&inner.counters.uncompressed_writes, 1);
            add(&vol_counters.uncompressed_writes, 1);
            Ok((object, Location::Block { pbn }))
        }
    }
}

/// The fingerprints of a write step's whole, non-zero blocks, hashed side by side
/// before the step takes its locks (`fingerprint.rs`: a 128 KiB write's 32 blocks
/// cost far less hashed together than one by one). Indexed by the block's place in
/// the step (its `k`-th piece, as `Volume::write_step` cuts it).
pub(crate) struct StepFingerprints {
    fps: [Fingerprint; BLOCKS_PER_STEP_USIZE],
    /// Bit `k`: piece `k` was hashed.
    hashed: u64,
    /// With a sparse index: where the blocks before the step's first hook hit were
    /// stored by an earlier copy (`advice.rs`).
    before: Option<crate::advice::BeforeHook>,
}

const BLOCKS_PER_STEP_USIZE: usize = crate::inner::BLOCKS_PER_STEP as usize;
// A piece per block, and a partial block at each end: at most 65 pieces, but a step
// is block-aligned at its end (`Volume::write`), and `hashed` has a bit for 64.
const _: () = assert!(BLOCKS_PER_STEP_USIZE <= 64);

impl StepFingerprints {
    /// Hash the whole, non-zero blocks of `data`, written at `offset_bytes`, when
    /// there are two or more (one alone is hashed by `write_block` as before).
    pub(crate) fn of(inner: &Inner, offset_bytes: u64, data: &[u8]) -> StepFingerprints {
        let mut step = StepFingerprints {
            fps: [[0; 32]; BLOCKS_PER_STEP_USIZE],
            hashed: 0,
            before: None,
        };
        let mut blocks: [&[u8]; BLOCKS_PER_STEP_USIZE] = [&[]; BLOCKS_PER_STEP_USIZE];
        let mut pieces = [0usize; BLOCKS_PER_STEP_USIZE];
        let mut count = 0usize;
        let mut pos = 0usize;
        let mut k = 0usize;
        while pos < data.len() && k < BLOCKS_PER_STEP_USIZE {
            let within = ((offset_bytes + pos as u64) % BLOCK_BYTES as u64) as usize;
            let n = (BLOCK_BYTES - within).min(data.len() - pos);
            if let (Some(block), Some(slot), Some(piece)) = (
                data.get(pos..pos + n),
                blocks.get_mut(count),
                pieces.get_mut(count),
            ) {
                if n == BLOCK_BYTES && !is_zero(block) {
                    *slot = block;
                    *piece = k;
                    count += 1;
                }
            }
            pos += n;
            k += 1;
        }
        if count < 2 {
            return step;
        }
        let mut fps = [[0u8; 32]; BLOCKS_PER_STEP_USIZE];
        let (Some(blocks), Some(out), Some(pieces)) = (
            blocks.get(..count),
            fps.get_mut(..count),
            pieces.get(..count),
        ) else {
            return step;
        };
        inner.geometry.fingerprint_many(blocks, out);
        for fp in out.iter() {
            inner.depot.index().prefetch(fp);
        }
        for (&k, fp) in pieces.iter().zip(out.iter()) {
            if let Some(slot) = step.fps.get_mut(k) {
                *slot = *fp;
                step.hashed |= 1 << k;
            }
        }
        step
    }

    /// With a sparse index, look the step's first hooks up before its first block
    /// is written (`advice.rs: before_first_hook`). Caller holds the gate, as for
    /// any look at the slabs.
    pub(crate) fn look_before_hooks(&mut self, inner: &Inner) {
        let hashed = self.hashed;
        let pieces = self
            .fps
            .iter()
            .enumerate()
            .filter(move |(k, _)| hashed & (1 << k) != 0);
        self.before = crate::advice::before_first_hook(&inner.depot, pieces);
    }

    /// Where an earlier copy stored the step's `k`-th piece, `fp`, if it comes
    /// before the step's first hook hit (sparse index only).
    pub(crate) fn before_hook(&self, k: usize, fp: &Fingerprint) -> Option<ObjectId> {
        self.before
            .as_ref()
            .filter(|b| k < b.piece)
            .and_then(|b| b.find(fp))
    }

    /// The fingerprint of the step's `k`-th piece, if it was hashed here.
    pub(crate) fn get(&self, k: usize) -> Option<&Fingerprint> {
        if k < 64 && self.hashed & (1 << k) != 0 {
            self.fps.get(k)
        } else {
            None
        }
    }
}

/// Make a block stored new findable as a duplicate: only once the record storing it
/// is in the journal, so a reference to it can never be durable before the object.
fn index_stored(inner: &Inner, fp: &[u8; 32], object: ObjectId) {
    inner
        .index_build
        .insert_stored(inner.depot.index(), fp, object);
}

/// Write one whole block of a volume. Caller holds the gate and the block's stripe.
///
/// With `expect`, the map is updated only if the block's entry still reads like
/// it (`block_map::reads_alike`); otherwise nothing changes and the result is
/// `false` (a read-modify-write lost a race with a range operation).
pub(crate) fn write_block(
    inner: &Inner,
    vol: &VolumeState,
    lbn: u64,
    block: &[u8],
    expect: Option<MapEntry>,
) -> Result<bool> {
    let placed = place(inner, vol, block, None, None, &[])?;
    map_placed(inner, vol, lbn, std::slice::from_ref(&placed), expect)
}

/// What a whole block of a write becomes before its map entry is set: zeros, an
/// object it duplicates (a reference taken), or an object stored new with what its
/// `NewStored` record carries.
#[derive(Clone, Copy)]
pub(crate) struct Placed {
    entry: MapEntry,
    /// A block stored new: its fingerprint (set in its record and indexed once the
    /// record storing it is in the journal), encoded location and CRC-32C. Compaction
    /// does not move it meanwhile (its record's fingerprint says it is in flight).
    new: Option<(Fingerprint, u64, u32)>,
}

impl Placed {
    /// A block not placed (yet): it holds no reference.
    pub(crate) const NOTHING: Placed = Placed {
        entry: MapEntry::Unmapped,
        new: None,
    };

    /// The new object's fingerprint, if this block was stored new.
    pub(crate) fn stored_new(&self) -> Option<(&Fingerprint, ObjectId)> {
        match (&self.new, self.entry.object()) {
            (Some((fp, _, _)), Some(o)) => Some((fp, o)),
            _ => None,
        }
    }
}

/// Zero-check, fingerprint (unless `hashed`), and deduplicate or store one whole
/// block: against `step`, the blocks stored new earlier in the same write step (not
/// yet in the index), then the index's advice (and `before`, where the step found an
/// earlier copy before its first hook, [`StepFingerprints::before_hook`]). Caller
/// holds the gate.
pub(crate) fn place(
    inner: &Inner,
    vol: &VolumeState,
    block: &[u8],
    hashed: Option<&Fingerprint>,
    before: Option<ObjectId>,
    step: &[Placed],
) -> Result<Placed> {
    add(&inner.counters.blocks_written, 1);
    add(&vol.counters().blocks_written, 1);
    if hashed.is_none() && is_zero(block) {
        add(&inner.counters.zero_blocks_written, 1);
        add(&vol.counters().zero_blocks_written, 1);
        return Ok(Placed {
            entry: MapEntry::Zero,
            new: None,
        });
    }
    let fp = match hashed {
        Some(fp) => *fp,
        None => inner.geometry.fingerprint(block),
    };
    let earlier = step
        .iter()
        .filter_map(Placed::stored_new)
        .find(|(f, _)| **f == fp)
        .map(|(_, o)| o);
    let found = match earlier {
        Some(o) => {
            inner.depot.add_references(&inner.devices, &[o])?;
            Some(o)
        }
        None => {
            let (found, stale) = crate::advice::take_duplicate(&inner.depot, &fp, before);
            add(&inner.counters.advice_stale, stale);
            add(&vol.counters().advice_stale, stale);
            if found.is_some() {
                add(&inner.counters.advice_valid, 1);
                add(&vol.counters().advice_valid, 1);
            }
            found
        }
    };
    // A known damaged object holding this data, which the index did not name
    // (still being built, sparse, or past its window): healed below all the same.
    let found = found.or_else(|| {
        let o = inner.depot.damaged().find(&fp)?;
        crate::advice::take_object(&inner.depot, o, &fp)
    });
    let found = match found {
        Some(o) if inner.depot.damaged().contains(o) => {
            // A write of a damaged object's data heals it for every map naming it;
            // when it cannot, this block is stored anew, so this map reads good.
            let healed = crate::heal::heal_object(inner, o, block, &fp);
            if !matches!(healed, Ok(true)) {
                inner.depot.release_object(&inner.devices, o)?;
            }
            healed?.then_some(o)
        }
        other => other,
    };
    if let Some(o) = found {
        add(&inner.counters.dedup_hits, 1);
        add(&vol.counters().dedup_hits, 1);
        return Ok(Placed {
            entry: MapEntry::Object(o),
            new: None,
        });
    }
    let (object, location) = store_new(inner, block, vol.counters())?;
    Ok(Placed {
        entry: MapEntry::Object(object),
        new: Some((fp, location.encode(), crc32c::crc32c(block))),
    })
}

/// Append the records of `placed`, whose entries are set, and then make their new
/// objects findable: by advice, which reads their records, and by the index; and
/// readable, once the caller releases the map page's lock. Called under that lock,
/// so a trim of a block right after frees its object after it is indexed (and the
/// free takes it out of the index again).
fn journalled(inner: &Inner, records: &[Record], placed: &[Placed]) -> Result<()> {
    inner.journal.append_all(records);
    for (fp, o) in placed.iter().filter_map(Placed::stored_new) {
        inner.depot.set_fingerprint(o, fp)?;
        index_stored(inner, fp, o);
    }
    Ok(())
}

/// What the unused part of a step's record array holds (never appended).
const NO_RECORD: Record = Record::MapSet {
    volume: 0,
    lbn: 0,
    entry: MapEntry::Unmapped,
};

/// Drop the references placed blocks took, when their entries are not set.
pub(crate) fn unplace(inner: &Inner, placed: &[Placed]) -> Result<()> {
    for p in placed {
        if let Some(o) = p.entry.object() {
            inner.depot.release_object(&inner.devices, o)?;
        }
    }
    Ok(())
}

/// Set the entries of blocks `lbn..` to `placed` (within one map page), journal them
/// together under the page's lock (so journal order matches map order per block, and
/// a step's new blocks are consecutive records, written as runs), then index the new
/// objects and drop the old entries' references. Caller holds the gate and the
/// blocks' stripes.
///
/// With `expect` (one block only), the map is updated only if the block's entry
/// still reads like it (`block_map::reads_alike`); otherwise nothing changes and the
/// result is `false` (a read-modify-write lost a race with a range operation).
pub(crate) fn map_placed(
    inner: &Inner,
    vol: &VolumeState,
    lbn: u64,
    placed: &[Placed],
    expect: Option<MapEntry>,
) -> Result<bool> {
    let first = (lbn % ENTRIES_PER_PAGE) as usize;
    let mut olds = [MapEntry::Unmapped; crate::inner::BLOCKS_PER_STEP as usize];
    if first + placed.len() > ENTRIES_PER_PAGE as usize
        || placed.len() > olds.len()
        || (expect.is_some() && placed.len() != 1)
    {
        unplace(inner, placed)?;
        return Err(EngineError::Invariant(format!(
            "{} entries from block {lbn} set as one page's",
            placed.len()
        )));
    }
    {
        let Some(slot) = vol.page_for_write(lbn / ENTRIES_PER_PAGE) else {
            unplace(inner, placed)?;
            return Err(EngineError::VolumeGone(vol.name()));
        };
        let mut page = slot.lock();
        if page.is_damaged() {
            // `Volume::check` refuses requests into a damaged range before this.
            drop(page);
            drop(slot);
            unplace(inner, placed)?;
            return Err(EngineError::Invariant(format!(
                "a write reached block {lbn} of volume '{}', in a damaged range",
                vol.name()
            )));
        }
        if expect.is_some_and(|e| !crate::block_map::reads_alike(page.get(first), e)) {
            drop(page);
            drop(slot);
            unplace(inner, placed)?;
            return Ok(false);
        }
        // A page other trees reach becomes this volume's own: a new page, whose
        // objects each gain a reference (`page_share.rs`).
        let gained = page.make_own(inner.volumes.shares(), inner.checkpointer.dirty_pages());
        if !gained.is_empty() {
            inner.depot.add_references(&inner.devices, &gained)?;
        }
        // No allocation per step: at most BLOCKS_PER_STEP records (`olds` holds as many).
        let mut records = [NO_RECORD; crate::inner::BLOCKS_PER_STEP as usize];
        let mut n = 0usize;
        for (k, (p, old)) in placed.iter().zip(olds.iter_mut()).enumerate() {
            let l = lbn + k as u64;
            match page.set(first + k, p.entry, inner.checkpointer.dirty_pages()) {
                Ok(was) => *old = was,
                Err(e) => {
                    // Journal what was set; the rest is not.
                    let set = placed.get(..k).unwrap_or_default();
                    journalled(inner, records.get(..n).unwrap_or_default(), set)?;
                    drop(page);
                    drop(slot);
                    unplace(inner, placed.get(k..).unwrap_or_default())?;
                    return Err(e);
                }
            }
            let Some(record) = records.get_mut(k) else {
                unreachable!("{} entries fit `olds`, as long as `records`", placed.len())
            };
            n += 1;
            *record = match (p.new, p.entry.object()) {
                (Some((_, location, crc)), Some(o)) => Record::NewStored {
                    volume: vol.slot(),
                    lbn: l,
                    object: o.0,
                    location,
                    crc,
                },
                _ => Record::MapSet {
                    volume: vol.slot(),
                    lbn: l,
                    entry: p.entry,
                },
            };
        }
        journalled(inner, records.get(..n).unwrap_or_default(), placed)?;
    }
    for (p, old) in placed.iter().zip(olds) {
        vol.account(old, p.entry);
        if let Some(o) = old.object() {
            inner.depot.release_object(&inner.devices, o)?;
        }
    }
    Ok(true)
}
