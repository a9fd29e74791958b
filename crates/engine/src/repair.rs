//! Repair (`fewerbytes check --repair`): reference counts, free space and the index
//! rebuilt from the block maps and the object records, every change said.
//!
//! The block maps and each object's record (location and fingerprint) are what the
//! pool knows; reference counts, block holders, allocation and the index follow from
//! them. So a repair counts the references every map holds and makes each record's
//! count agree, frees objects nothing refers to, and rebuilds the rest. A map entry
//! naming an object that is not stored (a free record: no fingerprint, or a location
//! outside its slab) has no data to name: it is set to ZERO, its volume and byte range
//! listed as lost (docs/check.md says why zeros rather than an unreadable block).
//!
//! A repair holds the checkpoint lock and the gate exclusively from its first read to
//! the end of its checkpoint, like a volume operation: nothing reads or writes the pool
//! meanwhile, and the repaired state is durable when it returns. It changes nothing a
//! person did not ask for: with `apply` unset it only reports what it would change.

use crate::api::RepairReport;
use crate::block_map::ENTRIES_PER_PAGE;
use crate::inner::Inner;
use crate::inner::Wait;
use crate::journal_read::JournalRead;
use crate::slab::REFCOUNT_MAX;
use crate::{EngineError, Result};
use fewerbytes_format::location::{Location, MapEntry, ObjectId};
use fewerbytes_format::BLOCK_BYTES;
use std::collections::{BTreeMap, HashMap};

const BLOCK: u64 = BLOCK_BYTES as u64;

/// What a repair may do.
#[derive(Debug, Clone, Copy, Default)]
pub struct RepairOptions {
    /// Change the pool (else only report what would change).
    pub apply: bool,
    /// Read every stored object and check it against its fingerprint.
    pub verify_data: bool,
}

/// The step a repair is in, for a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepairPhase {
    /// Counting the references of every block map (`done`/`total`: map pages).
    ReadingMaps,
    /// Comparing each object record with the references found (slabs).
    CheckingObjects,
    /// Reading stored data back against its fingerprints (objects).
    VerifyingData,
    /// Taking the checkpoint that makes the repair durable.
    Writing,
}

impl RepairPhase {
    /// A few words for a person.
    pub fn describe(self) -> &'static str {
        match self {
            RepairPhase::ReadingMaps => "reading block maps",
            RepairPhase::CheckingObjects => "checking object records",
            RepairPhase::VerifyingData => "verifying data",
            RepairPhase::Writing => "writing checkpoint",
        }
    }
}

/// A map entry naming an object that is not stored.
struct Dangling {
    volume: String,
    lbn: u64,
    object: u64,
}

/// Check the pool and, with `options.apply`, repair it: see the module comment.
/// `progress` is called now and then with the phase, work done and work in all.
pub(crate) fn repair(
    i: &Inner,
    options: &RepairOptions,
    progress: &dyn Fn(RepairPhase, u64, u64),
) -> Result<RepairReport> {
    if options.apply {
        i.devices.ensure_writable()?;
    }
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    if options.apply {
        // Open blocks and runs hold blocks no record names; closing them makes
        // every holder one a record accounts for.
        i.zones.release_open_space(&i.space())?;
    }
    let mut report = RepairReport {
        repairs: i.repair.take_restored(),
        lost_bytes: i.repair.take_lost_bytes(),
        ..RepairReport::default()
    };
    // Damaged map ranges first: cleared, their entries unmapped, so the counts
    // below are recomputed without them (which frees their leak).
    crate::map_damage::clear_for_repair(i, options.apply, &mut report)?;
    // Holders against the records as they are (a freed leak's blocks are not a
    // second finding), then the records against the maps.
    check_holders(i, options.apply, &mut report);
    let mut refs = count_references(i, options.apply, progress, &mut report);
    repair_records(i, &mut refs, options.apply, progress, &mut report);
    if options.verify_data {
        verify_data(i, options.apply, progress, &mut report)?;
    }
    if options.apply && !report.repairs.is_empty() {
        progress(RepairPhase::Writing, 0, 1);
        // Allocation, holders and usage follow from the records now.
        crate::recovery::rebuild(i)?;
        crate::checkpoint::checkpoint_locked(i, gate, true)?;
        progress(RepairPhase::Writing, 1, 1);
        tracing::warn!("repair made {} change(s)", report.repairs.len());
    }
    Ok(report)
}

/// At open, after replay: records with no references whose object the block maps
/// still name. The open's rebuild would free them (a record without references is
/// an object stored but never mapped before a crash), so their entries would name
/// nothing. A normal open refuses the pool instead; an open for repair restores
/// each count from the maps when the object's data still matches its fingerprint
/// (the record keeps its location and fingerprint), and leaves it to be freed, its
/// entries read as lost by the repair, when it does not.
pub(crate) fn restore_counts(inner: &Inner) -> Result<()> {
    // Object id → (references, the first volume and block naming it).
    let mut found: BTreeMap<u64, (u64, String, u64)> = BTreeMap::new();
    let mut counted = crate::page_share::CountedPages::default();
    for vol in inner.volumes.all() {
        vol.for_each_counted(&mut counted, |lbn, e| {
            let Some(o) = e.object().filter(|&o| inner.depot.valid_object(o)) else {
                return;
            };
            let (s, idx) = inner.depot.split_object(o);
            let rec = inner.depot.slab(s).lock().rec(idx);
            if rec.refcount == 0 && rec.fingerprint != [0; 32] {
                found.entry(o.0).or_insert_with(|| (0, vol.name(), lbn)).0 += 1;
            }
        });
    }
    let Some((&first, (refs, volume, lbn))) = found.iter().next() else {
        return Ok(());
    };
    if !inner.repair.enabled() {
        return Err(EngineError::Corrupt {
            region: "slab object page",
            block: 0,
            device: "metadata",
            reason: format!(
                "{} object(s) record no references while block maps refer to them                      (object {first}: {refs}, the first from block {lbn} of volume '{volume}');                      `fewerbytes check --repair` restores their counts",
                found.len()
            ),
        });
    }
    let mut buf = vec![0u8; BLOCK_BYTES];
    for (id, (refs, ..)) in found {
        let o = ObjectId(id);
        if !stored(inner, o) {
            continue;
        }
        let (s, idx) = inner.depot.split_object(o);
        let count = refs.min(u64::from(REFCOUNT_MAX)) as u32;
        if let Some(rec) = inner.depot.slab(s).lock().rec_mut(idx) {
            rec.refcount = count;
        }
        let sentence = match crate::read_path::read_object(inner, o, &mut buf, Wait::Yes) {
            Ok(_) => format!(
                "object {id}: reference count 0 → {count} (its data matches its fingerprint)"
            ),
            Err(EngineError::Corrupt { reason, .. }) => {
                if let Some(rec) = inner.depot.slab(s).lock().rec_mut(idx) {
                    rec.refcount = 0;
                }
                format!(
                    "object {id}: reference count 0 but maps hold {count}, and its data                          cannot be used ({reason}): not restored"
                )
            }
            Err(e) => return Err(e),
        };
        tracing::warn!("{sentence}");
        inner.repair.record(sentence);
    }
    Ok(())
}

/// At open, after reading the journal: sectors lost to damage (a bad sector that
/// parity cannot rebuild, with whole commits after it) refuse a normal open, naming
/// them; an open for repair goes on without their records, and says so.
pub(crate) fn journal_damage(inner: &Inner, journal: &JournalRead) -> Result<()> {
    if let Some(error) = journal.damage() {
        if !inner.repair.enabled() {
            return Err(error);
        }
    }
    for lost in &journal.lost {
        let sentence = format!(
            "journal sector seq {} (byte {} of the metadata device) could not be read or \
             rebuilt from its parity ({}), though commits after it are whole: the block \
             changes it held (at most {} records) are lost, and which blocks they changed \
             cannot be known: those blocks read as before them; every other journal \
             record was replayed",
            lost.seq,
            lost.offset_bytes,
            lost.why,
            fewerbytes_format::journal::SECTOR_PAYLOAD_BYTES
                / fewerbytes_format::journal::MAP_SET_BYTES
        );
        tracing::warn!("{sentence}");
        inner.repair.record(sentence);
    }
    Ok(())
}

/// At open for repair, after a replay around lost journal sectors: map entries that
/// name an object whose storing record (`NewStored` or `NewObject`) was lost
/// (`unstored`) have no data to read. Each becomes ZERO and is listed, volume, block and bytes, as lost; the
/// open's checkpoint then holds no entry naming a free object.
pub(crate) fn drop_unstored_references(inner: &Inner, unstored: &[u64]) -> Result<()> {
    if unstored.is_empty() {
        return Ok(());
    }
    if !inner.repair.enabled() {
        return Err(EngineError::Invariant(format!(
            "{} objects referenced but never stored were let through a normal open",
            unstored.len()
        )));
    }
    for vol in inner.volumes.all() {
        let mut lost = Vec::new();
        vol.for_each_mapped(|lbn, e| {
            if let Some(o) = e.object().filter(|o| unstored.binary_search(&o.0).is_ok()) {
                lost.push((lbn, o.0));
            }
        });
        for (lbn, object) in lost {
            let page = vol.page_for_write(lbn / ENTRIES_PER_PAGE).ok_or_else(|| {
                EngineError::Invariant(format!(
                    "block {lbn} of volume '{}' is mapped but has no map page",
                    vol.name()
                ))
            })?;
            let mut page = page.lock();
            let dirty = inner.checkpointer.dirty_pages();
            // Made the volume's own first: its stored objects each gain a reference
            // (the lost ones have none to gain).
            let gained: Vec<ObjectId> = page
                .make_own(inner.volumes.shares(), dirty)
                .into_iter()
                .filter(|o| unstored.binary_search(&o.0).is_err())
                .collect();
            inner.depot.add_references(&inner.devices, &gained)?;
            page.set((lbn % ENTRIES_PER_PAGE) as usize, MapEntry::Zero, dirty)?;
            drop(page);
            let sentence = format!(
                "volume {}: block {lbn} (bytes {}-{}) was written by a journal record whose \
                 object {object} was stored in a lost journal sector: now reads as zeros \
                 (its data is lost)",
                vol.name(),
                lbn * BLOCK,
                (lbn + 1) * BLOCK - 1
            );
            tracing::warn!("{sentence}");
            inner.repair.record(sentence);
            inner.repair.lost(BLOCK);
        }
    }
    Ok(())
}

/// Whether object `o` is stored: its record has a fingerprint and a location in
/// its own slab. A free record is all zeros.
fn stored(inner: &Inner, o: ObjectId) -> bool {
    if !inner.depot.valid_object(o) {
        return false;
    }
    let (s, idx) = inner.depot.split_object(o);
    let rec = inner.depot.slab(s).lock().rec(idx);
    rec.fingerprint != [0; 32]
        && Location::decode(rec.location).is_ok_and(|loc| inner.depot.valid_location(s, loc))
}

/// References from every map, per object id; entries naming objects that are not
/// stored are reported (and, with `apply`, set to ZERO) and not counted.
fn count_references(
    inner: &Inner,
    apply: bool,
    progress: &dyn Fn(RepairPhase, u64, u64),
    report: &mut RepairReport,
) -> HashMap<u64, u64> {
    let vols = inner.volumes.all();
    // The pages in memory (only those can hold entries).
    let pages_total: u64 = vols
        .iter()
        .map(|v| v.map_pages().iter().count() as u64)
        .sum();
    let mut pages_done = 0u64;
    let mut refs: HashMap<u64, u64> = HashMap::new();
    let mut dangling = Vec::new();
    let mut counted = crate::page_share::CountedPages::default();
    for vol in &vols {
        let pages = vol.map_pages();
        for (p, page) in pages.iter() {
            let page = page.lock();
            // A page several trees reach counts once; its dangling entries are
            // listed for each volume (each is set to zero in its own copy).
            let counts = counted.counts(page.is_shared(), page.durable());
            for k in 0..ENTRIES_PER_PAGE as usize {
                // Counted as `audit` counts: entries naming objects.
                let MapEntry::Object(o) = page.get(k) else {
                    continue;
                };
                if !counts && stored(inner, o) {
                    continue;
                }
                report.map_entries_checked += 1;
                if stored(inner, o) {
                    *refs.entry(o.0).or_insert(0) += 1;
                } else {
                    dangling.push(Dangling {
                        volume: vol.name(),
                        lbn: p * ENTRIES_PER_PAGE + k as u64,
                        object: o.0,
                    });
                }
            }
            pages_done += 1;
            if pages_done.is_multiple_of(256) {
                progress(RepairPhase::ReadingMaps, pages_done, pages_total);
            }
        }
    }
    progress(RepairPhase::ReadingMaps, pages_total, pages_total);
    for d in dangling {
        let (first, last) = (d.lbn * BLOCK, (d.lbn + 1) * BLOCK - 1);
        report.repairs.push(format!(
            "volume {}: block {} (bytes {first}-{last}) referred to object {}, which is \
             not stored: {} zeros (its data is lost)",
            d.volume,
            d.lbn,
            d.object,
            if apply {
                "now reads as"
            } else {
                "would read as"
            }
        ));
        report.lost_bytes += BLOCK;
        if apply {
            if let Ok(vol) = inner.volumes.by_name(&d.volume) {
                let pages = vol.map_pages();
                if let Some(page) = pages.get(d.lbn / ENTRIES_PER_PAGE) {
                    let mut page = page.lock();
                    let dirty = inner.checkpointer.dirty_pages();
                    // Made the volume's own: a new page, whose stored objects each
                    // gain the reference this count finds.
                    for o in page.make_own(inner.volumes.shares(), dirty) {
                        if stored(inner, o) {
                            *refs.entry(o.0).or_insert(0) += 1;
                        }
                    }
                    if let Err(e) =
                        page.set((d.lbn % ENTRIES_PER_PAGE) as usize, MapEntry::Zero, dirty)
                    {
                        report.repairs.push(format!("not repaired: {e}"));
                    }
                }
            }
        }
    }
    refs
}

/// Make each record's count the references found; free what nothing refers to.
fn repair_records(
    inner: &Inner,
    refs: &mut HashMap<u64, u64>,
    apply: bool,
    progress: &dyn Fn(RepairPhase, u64, u64),
    report: &mut RepairReport,
) {
    let objects_per_slab = u64::from(inner.geometry.objects_per_slab());
    for (s, slab) in inner.depot.touched() {
        let mut slab = slab.lock();
        let held: Vec<u32> = slab.objects_in_memory().collect();
        for idx in held {
            let rec = slab.rec(idx);
            if rec.refcount == 0 && rec.fingerprint == [0; 32] {
                continue;
            }
            let id = u64::from(s) * objects_per_slab + u64::from(idx);
            report.objects_checked += 1;
            let found = refs.remove(&id).unwrap_or(0);
            let want = found.min(u64::from(REFCOUNT_MAX)) as u32;
            if rec.refcount == want {
                continue;
            }
            if want == 0 {
                let stored = Location::decode(rec.location)
                    .map(|l| l.stored_bytes())
                    .unwrap_or(0);
                report.repairs.push(format!(
                    "object {id}: reference count {} → 0, no map refers to it: {} \
                     ({stored} bytes of data)",
                    rec.refcount,
                    if apply { "freed" } else { "would be freed" }
                ));
                if apply {
                    if let Some(r) = slab.rec_mut(idx) {
                        *r = Default::default();
                    }
                    inner.depot.index().remove(&rec.fingerprint, ObjectId(id));
                }
            } else {
                report.repairs.push(format!(
                    "object {id}: reference count {} → {want}",
                    rec.refcount
                ));
                if apply {
                    if let Some(r) = slab.rec_mut(idx) {
                        r.refcount = want;
                    }
                }
            }
        }
        progress(
            RepairPhase::CheckingObjects,
            u64::from(s) + 1,
            u64::from(inner.geometry.slab_count()),
        );
    }
    // Every counted reference was to a stored object, whose record the loop saw.
    debug_assert!(refs.is_empty(), "references to unseen objects: {refs:?}");
}

/// Block holders and allocation against the records (and the blocks packers
/// hold open): each difference is reported; the rebuild after a repair fixes it.
fn check_holders(inner: &Inner, apply: bool, report: &mut RepairReport) {
    let verb = if apply {
        "corrected"
    } else {
        "would be corrected"
    };
    // Blocks holding metadata pages are allocated with no holder.
    let pages = inner.checkpointer.page_store();
    for (s, slab) in inner.depot.touched() {
        let slab = slab.lock();
        if slab.holds_nothing() {
            continue;
        }
        let mut found = vec![0u32; slab.block_count() as usize];
        for idx in slab.objects_in_memory() {
            let rec = slab.rec(idx);
            if rec.refcount == 0 {
                continue;
            }
            if let Ok(loc) = Location::decode(rec.location) {
                let (first, count) = loc.blocks();
                for b in first..first + count {
                    if let Some(h) = b
                        .checked_sub(slab.first_pbn())
                        .and_then(|local| found.get_mut(local as usize))
                    {
                        *h += 1;
                    }
                }
            }
        }
        for b in slab.open_block_numbers() {
            if let Some(h) = found.get_mut(b as usize) {
                *h += 1;
            }
        }
        let pending = slab.pending_block_list();
        for (b, &want) in found.iter().enumerate() {
            let b = b as u32;
            let have = slab.holders(b);
            if u32::from(have) != want {
                report.repairs.push(format!(
                    "slab {s} block {b}: {have} holders recorded, {want} found: {verb}"
                ));
            } else if want == 0
                && slab.block_used(b)
                && !pending.contains(&b)
                && !pages.holds_block(slab.first_pbn() + u64::from(b))
            {
                report.repairs.push(format!(
                    "slab {s} block {b}: allocated but holds no data: {}",
                    if apply { "freed" } else { "would be freed" }
                ));
            }
        }
    }
}

/// Read every stored object back and check it against its fingerprint; each one
/// that fails is healed from another object holding the same data (with `apply`),
/// or is damage left in place, named with the volume bytes it backs.
fn verify_data(
    inner: &Inner,
    apply: bool,
    progress: &dyn Fn(RepairPhase, u64, u64),
    report: &mut RepairReport,
) -> Result<()> {
    let objects_per_slab = u64::from(inner.geometry.objects_per_slab());
    let mut live = Vec::new();
    for (s, slab) in inner.depot.touched() {
        let slab = slab.lock();
        live.extend(
            slab.objects_in_memory()
                .filter(|&idx| slab.rec(idx).refcount > 0)
                .map(|idx| u64::from(s) * objects_per_slab + u64::from(idx)),
        );
    }
    let total = live.len() as u64;
    let mut bad: BTreeMap<u64, (u64, String)> = BTreeMap::new();
    let mut buf = vec![0u8; BLOCK_BYTES];
    for (n, &id) in live.iter().enumerate() {
        match crate::read_path::read_object(inner, ObjectId(id), &mut buf, Wait::Yes) {
            Ok(_) => {}
            Err(EngineError::Corrupt { block, reason, .. }) => {
                bad.insert(id, (block, reason));
            }
            Err(e) => return Err(e),
        }
        if (n as u64).is_multiple_of(1024) {
            progress(RepairPhase::VerifyingData, n as u64, total);
        }
    }
    progress(RepairPhase::VerifyingData, total, total);
    heal_from_copies(inner, &mut bad, apply, report)?;
    if bad.is_empty() {
        return Ok(());
    }
    let mut users: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for vol in inner.volumes.all() {
        vol.for_each_mapped(|lbn, e| {
            if let Some((o, (block, _))) = e
                .object()
                .and_then(|o| bad.get(&o.0).map(|found| (o, found)))
            {
                users
                    .entry(o.0)
                    .or_default()
                    .push(crate::damage::volume_range(
                        &vol.name(),
                        lbn * BLOCK,
                        BLOCK,
                        crate::damage::DamagedAt::PoolBlock(*block),
                    ));
            }
        });
    }
    // One line per damaged volume block, as a read of it names it; a stored block
    // no volume maps is named by its pool block.
    for (id, (block, reason)) in bad {
        let cause = crate::damage::cause(&reason, block);
        let named = users.remove(&id).unwrap_or_default();
        if named.is_empty() {
            report
                .damage_left
                .push(format!("pool block {block} (no volume maps it): {cause}"));
        }
        for range in named {
            report.damage_left.push(format!("{range}: {cause}"));
        }
    }
    Ok(())
}

/// Heal each damaged object of `bad` that another live object holding the same
/// fingerprint (so the same data: a copy the index did not find, stored by a
/// later write) can heal, from that copy's bytes (`heal.rs`), each said in
/// `report.repairs`; healed objects leave `bad`. Without `apply`, only says so.
fn heal_from_copies(
    inner: &Inner,
    bad: &mut BTreeMap<u64, (u64, String)>,
    apply: bool,
    report: &mut RepairReport,
) -> Result<()> {
    let mut wanted: HashMap<[u8; 32], u64> = HashMap::new();
    for &id in bad.keys() {
        let (s, idx) = inner.depot.split_object(ObjectId(id));
        wanted.insert(inner.depot.slab(s).lock().rec(idx).fingerprint, id);
    }
    // (damaged object, a live copy of its data): records only, no data read.
    let mut copies: Vec<(u64, u64, [u8; 32])> = Vec::new();
    for (s, slab) in inner.depot.touched() {
        let slab = slab.lock();
        for idx in slab.objects_in_memory() {
            let rec = slab.rec(idx);
            let id = inner.depot.object_id(s, idx).0;
            if rec.refcount == 0 || bad.contains_key(&id) {
                continue;
            }
            if let Some(damaged) = wanted.remove(&rec.fingerprint) {
                copies.push((damaged, id, rec.fingerprint));
            }
        }
    }
    let mut buf = vec![0u8; BLOCK_BYTES];
    for (damaged, copy, fp) in copies {
        // Read back a moment ago, and good: read again for its bytes.
        crate::read_path::read_object(inner, ObjectId(copy), &mut buf, Wait::Yes)?;
        if !apply {
            report.repairs.push(format!(
                "object {damaged}: its damaged data would be healed from object {copy},                  which holds the same data"
            ));
            continue;
        }
        if crate::heal::heal_object(inner, ObjectId(damaged), &buf, &fp)? {
            bad.remove(&damaged);
            report.repairs.push(format!(
                "object {damaged}: its damaged data was healed from object {copy}, which                  holds the same data: every volume block naming it reads good"
            ));
        }
    }
    Ok(())
}

// Test hooks (`Pool::object_of`, `Pool::damage_*`): damage a pool the way a bug
// would, through its memory and a checkpoint, so tests need not know the page format.

/// The object `lbn` of `volume` maps to, if any.
pub(crate) fn object_of(i: &Inner, volume: &str, lbn: u64) -> Result<Option<u64>> {
    let vol = i.volumes.by_name(volume)?;
    Ok(vol.get(lbn).object().map(|o| o.0))
}

/// Set object `object`'s reference count to `count`, nothing else, and checkpoint.
pub(crate) fn damage_reference_count(i: &Inner, object: u64, count: u32) -> Result<()> {
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    let (s, idx) = i.depot.split_object(ObjectId(object));
    if let Some(rec) = i.depot.slab(s).lock().rec_mut(idx) {
        rec.refcount = count;
    }
    crate::checkpoint::checkpoint_locked(i, gate, true)
}

/// Set entry `lbn` of `volume` to `object` (`None`: unmapped) without changing
/// any reference count, and checkpoint.
pub(crate) fn damage_map_entry(
    i: &Inner,
    volume: &str,
    lbn: u64,
    object: Option<u64>,
) -> Result<()> {
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    let vol = i.volumes.by_name(volume)?;
    let entry = object.map_or(MapEntry::Unmapped, |o| MapEntry::Object(ObjectId(o)));
    if let Some(page) = vol.page_for_write(lbn / ENTRIES_PER_PAGE) {
        let mut page = page.lock();
        let gained = page.make_own(i.volumes.shares(), i.checkpointer.dirty_pages());
        i.depot.add_references(&i.devices, &gained)?;
        let old = page.set(
            (lbn % ENTRIES_PER_PAGE) as usize,
            entry,
            i.checkpointer.dirty_pages(),
        )?;
        drop(page);
        vol.account(old, entry);
    }
    crate::checkpoint::checkpoint_locked(i, gate, true)
}
