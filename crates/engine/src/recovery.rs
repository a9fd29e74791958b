//! Recovery: replay the journal over the loaded checkpoint, then rebuild what is
//! derived (allocation bitmaps, block holders, usage counts; the dedup index is
//! built after the open, in the background: `index_build.rs`).
//!
//! The checkpoint is an exact image at the journal position it names, so records
//! are applied in order, once. Reference-count changes commute; they are summed
//! and applied at the end, where a negative or impossible count is corruption.

use crate::block_map::ENTRIES_PER_PAGE;
use crate::inner::Inner;
use crate::{EngineError, Result};
use fewerbytes_format::journal::Record;
use fewerbytes_format::location::{Location, MapEntry, ObjectId};
use std::collections::HashMap;

fn corrupt(reason: String) -> EngineError {
    EngineError::Corrupt {
        region: "journal",
        block: 0,
        device: "metadata",
        reason,
    }
}

/// A reference-count change per object, summed over the replay.
type Deltas = HashMap<u64, i64>;

fn change(deltas: &mut Deltas, old: MapEntry, new: MapEntry) {
    if let Some(o) = new.object() {
        *deltas.entry(o.0).or_insert(0) += 1;
    }
    if let Some(o) = old.object() {
        *deltas.entry(o.0).or_insert(0) -= 1;
    }
}

/// Apply journal records in order. `slim`: the super block the journal was written
/// under has `FLAG_SLIM_RECORDS` (a `NewStored` record in a pool without it is
/// corruption). Returns the objects the maps refer to that were never stored: only
/// with `records_lost` (an open for repair replaying around lost journal sectors,
/// where such an object's storing record may have been in a lost sector); otherwise one
/// is corruption.
pub(crate) fn replay(
    inner: &Inner,
    records: &[Record],
    slim: bool,
    records_lost: bool,
) -> Result<Vec<u64>> {
    let mut deltas: Deltas = HashMap::new();
    // Objects a `NewStored` record stored, whose fingerprints are computed from
    // their data once the records are applied: object id to (location, crc).
    let mut fresh: HashMap<u64, (u64, u32)> = HashMap::new();
    let vols = inner.volumes.by_slot();
    for (n, record) in records.iter().enumerate() {
        match *record {
            Record::NewObject {
                object,
                location,
                fingerprint,
            } => {
                // A block moved by compaction keeps its fingerprint, journalled.
                fresh.remove(&object);
                set_stored(inner, n, object, location, Some(fingerprint))?;
            }
            Record::NewStored { .. } | Record::NewStoredRun { .. } => {
                if !slim {
                    return Err(corrupt(format!(
                        "record {n}: a slim new-block record in a pool whose super block \
                         does not allow them"
                    )));
                }
                for b in record.stored_blocks() {
                    set_stored(inner, n, b.object, b.location, None)?;
                    fresh.insert(b.object, (b.location, b.crc));
                    let entry = MapEntry::Object(ObjectId(b.object));
                    map_set(inner, &vols, &mut deltas, n, b.volume, b.lbn, entry)?;
                }
            }
            Record::MapSet { volume, lbn, entry } => {
                map_set(inner, &vols, &mut deltas, n, volume, lbn, entry)?;
            }
            Record::RangeSet {
                volume,
                lbn,
                count,
                entry,
            } => {
                let vol = volume_in(&vols, volume, n)?;
                if lbn
                    .checked_add(count)
                    .is_none_or(|end| end > vol.size_blocks())
                {
                    return Err(corrupt(format!(
                        "record {n}: range {lbn}+{count} past the end of volume '{}'",
                        vol.name()
                    )));
                }
                // Only pages in memory can hold entries a range changes.
                let end = lbn + count;
                let pages = vol.map_pages();
                for (p, page) in pages.iter_from(lbn / ENTRIES_PER_PAGE) {
                    let first = p * ENTRIES_PER_PAGE;
                    if first >= end {
                        break;
                    }
                    let mut page = page.lock();
                    // A damaged page is not written: its unknown entries are not
                    // changed, and no reference is dropped for them.
                    if !page.is_written() {
                        continue;
                    }
                    for l in lbn.max(first)..end.min(first + ENTRIES_PER_PAGE) {
                        let i = (l - first) as usize;
                        let old = page.get(i);
                        if let Some(new) = range_result(old, entry) {
                            // As the trim did: a shared page is made the volume's
                            // own at its first change.
                            let dirty = inner.checkpointer.dirty_pages();
                            for o in page.make_own(inner.volumes.shares(), dirty) {
                                *deltas.entry(o.0).or_insert(0) += 1;
                            }
                            page.set(i, new, dirty)?;
                            change(&mut deltas, old, new);
                        }
                    }
                }
            }
        }
    }
    let mut unstored = Vec::new();
    for (o, d) in deltas {
        if d == 0 {
            continue;
        }
        let (s, i) = inner.depot.split_object(ObjectId(o));
        let mut slab = inner.depot.slab(s).lock();
        let Some(rec) = slab.rec_mut(i) else {
            return Err(corrupt(format!("object {o} outside its slab")));
        };
        let count = i64::from(rec.refcount) + d;
        if count < 0 || count > i64::from(crate::slab::REFCOUNT_MAX) {
            return Err(corrupt(format!(
                "object {o} would have {count} references after replay"
            )));
        }
        rec.refcount = count as u32;
        if rec.refcount > 0 && rec.location == 0 && rec.fingerprint == [0; 32] {
            if !records_lost {
                return Err(corrupt(format!(
                    "object {o} is referenced but was never stored"
                )));
            }
            // Its entries are set to zero and listed (`repair::drop_unstored_references`).
            rec.refcount = 0;
            unstored.push(o);
        }
    }
    unstored.sort_unstable();
    fingerprint_fresh(inner, fresh)?;
    crate::map_damage::untouched_by_replay(inner)?;
    Ok(unstored)
}

/// A stored object's location (and, from a `NewObject`, its fingerprint), as record
/// `n` journalled it.
fn set_stored(
    inner: &Inner,
    n: usize,
    object: u64,
    location: u64,
    fingerprint: Option<[u8; 32]>,
) -> Result<()> {
    let o = ObjectId(object);
    let loc = Location::decode(location).map_err(|e| corrupt(format!("record {n}: {e}")))?;
    let (s, i) = inner.depot.split_object(o);
    if !inner.depot.valid_object(o) || !inner.depot.valid_location(s, loc) {
        return Err(corrupt(format!(
            "record {n}: object {object} at {loc:?} is outside the pool"
        )));
    }
    let mut slab = inner.depot.slab(s).lock();
    if let Some(rec) = slab.rec_mut_stored(i) {
        rec.location = location;
        // Until its data is read back (`fingerprint_fresh`), a block a `NewStored`
        // record stored has the fingerprint that says so.
        rec.fingerprint = fingerprint.unwrap_or(UNREAD_FINGERPRINT);
    }
    Ok(())
}

/// The fingerprint a block journalled by a `NewStored` record has until replay
/// has read it back: no block's keyed BLAKE3 value (odds 2^-256), so a read of it
/// fails its check like damaged data, and it is never dedup advice.
const UNREAD_FINGERPRINT: [u8; 32] = [0xff; 32];

/// Set one map entry as record `n` journalled it (a `MapSet`, or a `NewStored`'s).
fn map_set(
    inner: &Inner,
    vols: &[Option<std::sync::Arc<crate::block_map::VolumeState>>],
    deltas: &mut Deltas,
    n: usize,
    volume: u16,
    lbn: u64,
    entry: MapEntry,
) -> Result<()> {
    let vol = volume_in(vols, volume, n)?;
    if lbn >= vol.size_blocks() || entry.object().is_some_and(|o| !inner.depot.valid_object(o)) {
        return Err(corrupt(format!(
            "record {n}: block {lbn} of volume '{}' or its entry is out of range",
            vol.name()
        )));
    }
    if vol.damage_in(lbn, lbn + 1).is_some() {
        // The page's entries are unknown (`map_damage.rs`): the entry is not set
        // (the page stays as its durable copy failed), the new entry's reference is
        // added and the old one's, unknown, is not dropped. Counts may end too high
        // (a leak), never too low.
        if let Some(o) = entry.object() {
            *deltas.entry(o.0).or_insert(0) += 1;
        }
        return Ok(());
    }
    let page = vol
        .page_for_write(lbn / ENTRIES_PER_PAGE)
        .ok_or_else(|| corrupt(format!("record {n}: no map page")))?;
    let mut page = page.lock();
    // As the write did: a shared page is made the volume's own first.
    for o in page.make_own(inner.volumes.shares(), inner.checkpointer.dirty_pages()) {
        *deltas.entry(o.0).or_insert(0) += 1;
    }
    let old = page.set(
        (lbn % ENTRIES_PER_PAGE) as usize,
        entry,
        inner.checkpointer.dirty_pages(),
    )?;
    change(deltas, old, entry);
    Ok(())
}

/// Compute the fingerprints of the blocks `NewStored` records stored and the maps
/// still reference, from their data: the commit that named each made its data
/// durable first, so it is there to read, and its crc says whether it is what was
/// written. A block that cannot be read or fails its crc keeps the fingerprint no
/// data has ([`UNREAD_FINGERPRINT`]): its reads and the scrub report it as damaged
/// data, as for a block that fails its fingerprint, and it is never dedup advice.
/// Read in location order (new blocks are appended, so mostly one pass).
fn fingerprint_fresh(inner: &Inner, fresh: HashMap<u64, (u64, u32)>) -> Result<()> {
    let mut fresh: Vec<(u64, u64, u32)> = fresh
        .into_iter()
        .map(|(o, (location, crc))| (location, o, crc))
        .collect();
    fresh.sort_unstable();
    // Blocks that passed their crc, hashed side by side (`fingerprint.rs`) in groups.
    let mut buf = vec![0u8; FRESH_GROUP * fewerbytes_format::BLOCK_BYTES];
    let mut group: Vec<ObjectId> = Vec::with_capacity(FRESH_GROUP);
    let (mut read, mut damaged) = (0u64, 0u64);
    for (location, object, crc) in fresh {
        let o = ObjectId(object);
        {
            // Dropped again later in the journal (its location may hold another
            // block's data since), or moved: nothing to compute.
            let (s, i) = inner.depot.split_object(o);
            let slab = inner.depot.slab(s).lock();
            let rec = slab.rec(i);
            if rec.refcount == 0 || rec.location != location {
                continue;
            }
        }
        let at = group.len() * fewerbytes_format::BLOCK_BYTES;
        let block = crate::error::within_mut(
            &mut buf,
            at..at + fewerbytes_format::BLOCK_BYTES,
            "a replay group",
        )?;
        read += 1;
        match crate::read_path::read_object_unchecked(inner, o, block) {
            Ok(()) if crc32c::crc32c(block) == crc => group.push(o),
            Ok(()) => {
                tracing::error!(
                    "object {object}: the block a journal record stored does not match \
                     its crc; its reads fail as damaged data"
                );
                damaged += 1;
            }
            Err(e) => {
                tracing::error!(
                    "object {object}: the block a journal record stored cannot be read \
                     back ({e}); its reads fail as damaged data"
                );
                damaged += 1;
            }
        }
        if group.len() == FRESH_GROUP {
            set_fingerprints(inner, &group, &buf);
            group.clear();
        }
    }
    set_fingerprints(inner, &group, &buf);
    inner.journal.note_replayed_blocks(read, damaged);
    if damaged > 0 {
        tracing::error!(
            "{damaged} blocks the journal stored did not read back whole: `fewerbytes scrub` \
             names the volumes and offsets"
        );
    }
    Ok(())
}

/// Blocks [`fingerprint_fresh`] hashes together.
const FRESH_GROUP: usize = 16;

/// Set the fingerprints of `group`'s objects from their blocks, in order in `buf`.
fn set_fingerprints(inner: &Inner, group: &[ObjectId], buf: &[u8]) {
    let blocks: Vec<&[u8]> = buf
        .chunks_exact(fewerbytes_format::BLOCK_BYTES)
        .take(group.len())
        .collect();
    let mut fps = [[0u8; 32]; FRESH_GROUP];
    let Some(out) = fps.get_mut(..blocks.len()) else {
        return;
    };
    inner.geometry.fingerprint_many(&blocks, out);
    for (&o, fp) in group.iter().zip(out.iter()) {
        let (s, i) = inner.depot.split_object(o);
        let mut slab = inner.depot.slab(s).lock();
        if let Some(rec) = slab.rec_mut_stored(i) {
            rec.fingerprint = *fp;
        }
    }
}

/// Rebuild allocation state and usage counts from the tables.
pub(crate) fn rebuild(inner: &Inner) -> Result<()> {
    // A slab never touched holds no object: nothing to rebuild.
    for (s, slab) in inner.depot.touched() {
        let mut slab = slab.lock();
        for (i, rec) in slab.rebuild()? {
            let loc = Location::decode(rec.location).map_err(|e| EngineError::Corrupt {
                region: "slab object page",
                block: 0,
                device: "metadata",
                reason: format!("object {i} of slab {s}: {e}"),
            })?;
            if !inner.depot.valid_location(s, loc) {
                return Err(EngineError::Corrupt {
                    region: "slab object page",
                    block: 0,
                    device: "metadata",
                    reason: format!("object {i} of slab {s} lies outside its slab"),
                });
            }
        }
    }
    for vol in inner.volumes.all() {
        let (mut mapped, mut zeros) = (0i64, 0i64);
        let mut bad = None;
        vol.for_each_mapped(|lbn, e| match e {
            MapEntry::Object(o) => {
                mapped += 1;
                if !inner.depot.valid_object(o) {
                    bad = Some(lbn);
                }
            }
            MapEntry::Zero => zeros += 1,
            MapEntry::Unmapped => {}
        });
        if let Some(lbn) = bad {
            return Err(EngineError::Corrupt {
                region: "block map page",
                block: 0,
                device: "metadata",
                reason: format!(
                    "block {lbn} of volume '{}' names an object outside the pool",
                    vol.name()
                ),
            });
        }
        vol.set_usage(mapped, zeros);
    }
    // Data blocks holding metadata pages: known from the references loaded (and
    // those the page store holds since), not from the object records.
    let blocks = inner.checkpointer.page_store().data_block_list();
    inner.depot.hold_metadata_blocks(&inner.geometry, &blocks)?;
    Ok(())
}

/// The volume a record names by slot.
fn volume_in(
    vols: &[Option<std::sync::Arc<crate::block_map::VolumeState>>],
    slot: u16,
    record: usize,
) -> Result<&crate::block_map::VolumeState> {
    vols.get(usize::from(slot))
        .and_then(|v| v.as_deref())
        .ok_or_else(|| corrupt(format!("record {record}: no volume in slot {slot}")))
}

/// What a range operation makes of an entry: trim unmaps everything; write-zeroes
/// turns data and zero entries into zero and leaves unmapped ones unmapped (they
/// read as zeros already). `None` means unchanged.
pub(crate) fn range_result(old: MapEntry, op: MapEntry) -> Option<MapEntry> {
    match (old, op) {
        (MapEntry::Unmapped, _) => None,
        (MapEntry::Zero, MapEntry::Zero) => None,
        (_, new) => Some(new),
    }
}
