//! Healing damaged objects: a stored object whose bytes fail their fingerprint (or
//! their decoding) is *known damaged* once a read, the scrub or `check --verify-data`
//! met it; a later write of data with that fingerprint (the good bytes: keyed
//! BLAKE3-256) stores them afresh and points the object there, so every map naming
//! the object reads good at once.
//!
//! Why a set and not a check on every dedup hit: dedup advice is verified without
//! reading data (ARCHITECTURE.md, "The life of a write"), so a damaged object keeps taking references
//! from writes of its good data. Only objects a read found damaged are looked at,
//! and the look is one atomic load while none is known.
//!
//! Why a move and not a rewrite in place: a fragment shares its block with other
//! fragments, and a torn rewrite of a whole block must not be able to leave worse
//! than it found. A heal is compaction's move (`compact.rs`): the good bytes go
//! whole into a fresh block of the object's slab, written before the record points
//! there, then under the slab lock the record's location changes and a `NewObject`
//! record journals it; the old blocks lose their holder and stay pending-free until
//! the next checkpoint. A crash before that record is durable finds the object
//! where it was (damaged, and reported by reads and the scrub as before); after,
//! at the good copy. The data sync before every journal write (`journal.rs:
//! commit`) makes the block durable before the record.
//!
//! The set lives in memory, and is kept as a hint beside the pool
//! (`damage_hint.rs`): the next read-write open reads each object it names again and
//! knows those that still fail, so a write of good data after a restart heals too.

use crate::fingerprint::Fingerprint;
use crate::inner::Inner;
use crate::{EngineError, Result};
use fewerbytes_format::journal::{Record, NEW_OBJECT_BYTES};
use fewerbytes_format::location::{Location, ObjectId};
use fewerbytes_format::BLOCK_BYTES;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Damaged objects remembered at once. Each entry is an object id and the reason
/// its read gave (about 150 bytes): 4,096 of them take well under a MiB. A pool
/// with more damaged blocks than this has a failing device; those past the limit
/// are counted ([`DamagedObjects::unremembered`]) and heal only once a read meets
/// them again after others healed.
pub(crate) const DAMAGED_OBJECTS_MAX: usize = 4096;

/// The objects known damaged, and the heals since open.
#[derive(Default)]
pub(crate) struct DamagedObjects {
    /// Entries in `objects`: read without the lock on every dedup hit.
    known: AtomicUsize,
    /// Object id to its record's fingerprint and the reason its read failed, and
    /// fingerprint to object id (a write finds the object by its data even where the
    /// dedup index would not: being built, sparse, or past its window).
    objects: Mutex<Known>,
    /// Objects healed by a write (or by a repair) since open.
    healed: AtomicU64,
    /// Damaged objects met while the set was full.
    unremembered: AtomicU64,
    /// Changes to `objects` since open: the hint is written again when they moved.
    changes: AtomicU64,
    /// Objects the hint named at open that failed their read again then.
    carried_over: AtomicU64,
    /// Where the hint is kept and when it was last written (`damage_hint.rs`).
    pub(crate) hint: Mutex<crate::damage_hint::HintState>,
}

/// The damaged objects, both ways.
#[derive(Default)]
struct Known {
    by_object: BTreeMap<u64, (Fingerprint, String)>,
    by_fingerprint: HashMap<Fingerprint, u64>,
}

impl DamagedObjects {
    /// A read found object `o`, whose record holds `fp`, damaged for `reason`.
    pub(crate) fn note(&self, o: ObjectId, fp: &Fingerprint, reason: String) {
        let mut known = self.objects.lock();
        if known.by_object.contains_key(&o.0) {
            return;
        }
        if known.by_object.len() >= DAMAGED_OBJECTS_MAX {
            self.unremembered.fetch_add(1, Ordering::Relaxed);
            return;
        }
        known.by_object.insert(o.0, (*fp, reason));
        known.by_fingerprint.insert(*fp, o.0);
        self.known.store(known.by_object.len(), Ordering::Release);
        self.changes.fetch_add(1, Ordering::Release);
    }

    /// Whether object `o` is known damaged.
    pub(crate) fn contains(&self, o: ObjectId) -> bool {
        self.known.load(Ordering::Acquire) > 0 && self.objects.lock().by_object.contains_key(&o.0)
    }

    /// A damaged object whose record holds `fp`, if one is known (advice: its
    /// record is checked when a reference is taken).
    pub(crate) fn find(&self, fp: &Fingerprint) -> Option<ObjectId> {
        if self.known.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.objects
            .lock()
            .by_fingerprint
            .get(fp)
            .copied()
            .map(ObjectId)
    }

    /// Take object `o` out of the set (a heal claims it, a free forgets it): its
    /// fingerprint and reason, if it was known.
    pub(crate) fn take(&self, o: ObjectId) -> Option<(Fingerprint, String)> {
        if self.known.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut known = self.objects.lock();
        let taken = known.by_object.remove(&o.0);
        if let Some((fp, _)) = &taken {
            if known.by_fingerprint.get(fp) == Some(&o.0) {
                known.by_fingerprint.remove(fp);
            }
            self.changes.fetch_add(1, Ordering::Release);
        }
        self.known.store(known.by_object.len(), Ordering::Release);
        taken
    }

    /// Every known damaged object: id, fingerprint and reason, by id.
    pub(crate) fn entries(&self) -> Vec<(u64, Fingerprint, String)> {
        let known = self.objects.lock();
        known
            .by_object
            .iter()
            .map(|(o, (fp, reason))| (*o, *fp, reason.clone()))
            .collect()
    }

    /// Changes to the set since open.
    pub(crate) fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// Count an object the hint named that is still damaged.
    pub(crate) fn count_carried_over(&self) {
        self.carried_over.fetch_add(1, Ordering::Relaxed);
    }

    /// Objects the hint named at open that were still damaged then.
    pub(crate) fn carried_over(&self) -> u64 {
        self.carried_over.load(Ordering::Relaxed)
    }

    /// Objects known damaged now.
    pub(crate) fn known(&self) -> u64 {
        self.known.load(Ordering::Acquire) as u64
    }

    /// Objects healed since open.
    pub(crate) fn healed(&self) -> u64 {
        self.healed.load(Ordering::Relaxed)
    }

    /// Damaged objects met while [`DAMAGED_OBJECTS_MAX`] were known.
    pub(crate) fn unremembered(&self) -> u64 {
        self.unremembered.load(Ordering::Relaxed)
    }
}

/// Heal object `o`, if it is known damaged, with `block`, data whose fingerprint
/// `fp` the object's record holds (see the file's header). Caller holds the gate.
/// Returns whether the object may be used for `block`: true when it was not known
/// damaged or is healed now; false when it stays damaged (no free block in its slab,
/// no journal room without waiting, its bytes still in a packer, or it changed
/// meanwhile), and stays known.
pub(crate) fn heal_object(
    inner: &Inner,
    o: ObjectId,
    block: &[u8],
    fp: &Fingerprint,
) -> Result<bool> {
    // A writer that finds it taken dedups onto an object being healed: its reads
    // are good once the heal ends.
    let Some((noted, reason)) = inner.depot.damaged().take(o) else {
        return Ok(true);
    };
    // The write step's reservation covers its own records, not this one; waiting
    // for room under the gate would wait for a checkpoint that needs the gate.
    let bytes = NEW_OBJECT_BYTES as u64;
    if !inner.journal.try_reserve(bytes) {
        inner.depot.damaged().note(o, &noted, reason);
        return Ok(false);
    }
    let moved = move_to_fresh_block(inner, o, block, fp);
    inner.journal.unreserve(bytes);
    match moved {
        Ok(true) => {
            inner.depot.damaged().healed.fetch_add(1, Ordering::Relaxed);
            tracing::info!("object {} healed by a write of its data ({reason})", o.0);
            Ok(true)
        }
        other => {
            inner.depot.damaged().note(o, &noted, reason);
            other
        }
    }
}

/// Store `block` whole in a fresh block of object `o`'s slab and point the object
/// there (compaction's move, `compact.rs`). False: nothing changed.
fn move_to_fresh_block(inner: &Inner, o: ObjectId, block: &[u8], fp: &Fingerprint) -> Result<bool> {
    if block.len() != BLOCK_BYTES || inner.geometry.fingerprint(block) != *fp {
        return Err(EngineError::Invariant(format!(
            "object {} was to be healed with data that is not its own",
            o.0
        )));
    }
    let (s, i) = inner.depot.split_object(o);
    let (old, fresh) = {
        let mut slab = inner.depot.slab(s).lock();
        let rec = slab.rec(i);
        let Ok(old) = Location::decode(rec.location) else {
            return Ok(false);
        };
        let (first, count) = old.blocks();
        let slab_first = slab.first_pbn();
        if rec.refcount == 0
            || rec.fingerprint != *fp
            || (first..first + count).any(|b| slab.is_open((b - slab_first) as u32))
        {
            return Ok(false);
        }
        let Some(fresh) = slab.alloc_block() else {
            return Ok(false);
        };
        // The object's holder of its new block, taken now so nothing frees it.
        inner.devices.check_invariant(slab.hold_block(fresh))?;
        (old, fresh)
    };
    let pbn = inner.depot.pbn(s, fresh);
    let written = inner.devices.data().write_at(
        block,
        inner.geometry.data_offset_bytes() + pbn * BLOCK_BYTES as u64,
    );
    if let Err(e) = inner.devices.check_write_or_no_space(written) {
        // No record points at the block: it is freed again, nothing else changed.
        if let Err(broken) = inner.depot.slab(s).lock().drop_block(fresh) {
            tracing::error!("{broken}");
        }
        return Err(e);
    }
    let mut slab = inner.depot.slab(s).lock();
    let rec = slab.rec(i);
    // Freed, or moved by compaction, since it was looked at.
    if rec.refcount == 0 || rec.location != old.encode() {
        inner.devices.check_invariant(slab.drop_block(fresh))?;
        return Ok(false);
    }
    let new = Location::Block { pbn };
    let record = slab
        .rec_mut(i)
        .ok_or_else(|| EngineError::Invariant(format!("object {} to heal has no record", o.0)));
    inner.devices.check_invariant(record)?.location = new.encode();
    let (first, count) = old.blocks();
    let slab_first = slab.first_pbn();
    for b in first..first + count {
        inner
            .devices
            .check_invariant(slab.drop_block((b - slab_first) as u32))?;
    }
    // Under the slab lock, as compaction's: a free of the object cannot come
    // between the move and its record.
    inner.journal.append(&Record::NewObject {
        object: o.0,
        location: new.encode(),
        fingerprint: rec.fingerprint,
    });
    Ok(true)
}
