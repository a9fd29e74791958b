//! Statistics, the region list and the reference-count audit: where every byte went.

use crate::api::*;
use crate::inner::Inner;
use crate::slab::SlabUsage;
use fewerbytes_format::location::Location;
use fewerbytes_format::BLOCK_BYTES;
use fewerbytes_storage::IoSnapshot;

const BLOCK: u64 = BLOCK_BYTES as u64;

fn device_io(s: IoSnapshot) -> DeviceIo {
    DeviceIo {
        read_bytes: s.read_bytes,
        write_bytes: s.write_bytes,
        flushes: s.flushes,
        discards: s.discards,
        discard_bytes: s.discard_bytes,
    }
}

/// Statistics (`Pool::stats`); `info` and `mode` are the pool's own.
pub(crate) fn pool_stats(i: &Inner, info: PoolInfo, mode: Mode) -> PoolStats {
    let mut total = SlabUsage::default();
    // A slab never touched holds nothing: it adds nothing here.
    for (_, slab) in i.depot.touched() {
        total.add(&slab.lock().usage());
    }
    let SlabUsage {
        used_blocks,
        objects,
        dedup_saved_blocks: saved,
        fragments,
        fragment_bytes,
        zstd_fragments,
        whole_blocks: whole,
        ..
    } = total;
    // Saturating, here and for the waste below: display figures. A miscount
    // shows as zero; `check` (the audit below) is what reports counts that disagree.
    // Blocks holding metadata pages are allocated with no holder: not data.
    let page_blocks = i.checkpointer.page_store().data_blocks();
    let used_blocks = used_blocks.saturating_sub(page_blocks);
    let packed_blocks = used_blocks.saturating_sub(whole);
    let volumes: Vec<VolumeStats> = i
        .volumes
        .all()
        .iter()
        .map(|v| {
            let (reserved_bytes, reserved_unused_bytes, _) =
                crate::reservation::volume_figures(i.volumes.reservations().of(v.id()), v);
            VolumeStats {
                name: v.name(),
                size_bytes: v.size_blocks() * BLOCK,
                logical_used_bytes: v.mapped_blocks() * BLOCK,
                zero_bytes: v.zero_blocks() * BLOCK,
                reserved_bytes,
                reserved_unused_bytes,
                counters: v.counters().snapshot(),
                no_space_refusals: v.counters().no_space_refusals(),
            }
        })
        .collect();
    let logical_used_bytes: u64 = volumes.iter().map(|v| v.logical_used_bytes).sum();
    let zero_bytes: u64 = volumes.iter().map(|v| v.zero_bytes).sum();
    // Against what stored data takes as `info.space` counted it, so that the saving
    // and Stored agree.
    let stored_bytes = info.space.stored_bytes;
    let saving_percent = if logical_used_bytes == 0 {
        0.0
    } else {
        100.0 * (1.0 - stored_bytes as f64 / logical_used_bytes as f64)
    };
    let (journal_used, journal_sectors) = i.journal.usage();
    let (index_held, index_dropped) = i.depot.index().held_and_dropped();
    PoolStats {
        index: index_status(i),
        scrub: Box::new(i.scrubber.status()),
        path: i.devices.data_path(),
        mode,
        space: info.space,
        no_space_refusals: i.counters.no_space_refusals(),
        logical_used_bytes,
        zero_bytes,
        saving_percent,
        objects,
        compressed_fragments: fragments,
        compressed_bytes: fragment_bytes,
        zstd_fragments,
        compression: info.compression,
        packed_blocks,
        packing_waste_bytes: (packed_blocks * BLOCK).saturating_sub(fragment_bytes),
        whole_blocks: whole,
        compacted_blocks: i.compactor.compacted_blocks(),
        dedup_saved_blocks: saved,
        counters: i.counters.snapshot(),
        counters_total: i.counters.total(),
        data_device: device_io(i.devices.data().counters().snapshot()),
        metadata_device: if i.devices.separate_metadata() {
            device_io(i.devices.meta().counters().snapshot())
        } else {
            device_io(i.devices.data().counters().snapshot())
        },
        separate_metadata_device: i.devices.separate_metadata(),
        metadata_written_by_region: i
            .checkpointer
            .written()
            .by_region(i.journal.written_bytes()),
        checkpoints: i.checkpointer.taken(),
        metadata_copies_repaired: i.checkpointer.copies_repaired(),
        replay_blocks_read_back: i.journal.replayed_blocks().0,
        replay_blocks_damaged: i.journal.replayed_blocks().1,
        damaged_ranges: crate::map_damage::pool_ranges(i),
        damaged_objects_known: i.depot.damaged().known(),
        damaged_objects_healed: i.depot.damaged().healed(),
        damaged_objects_carried_over: i.depot.damaged().carried_over(),
        journal_commits: i.journal.commits(),
        threads: i.zones.threads(),
        limits: vec![
            ("zones (packers)".into(), i.zones.count() as u64),
            (
                "lbn lock stripes".into(),
                crate::lbn_locks::LBN_STRIPES as u64,
            ),
            (
                "read-modify-write attempts".into(),
                u64::from(crate::read_path::RMW_ATTEMPTS_MAX),
            ),
            (
                "blocks per request step".into(),
                crate::inner::BLOCKS_PER_STEP,
            ),
            ("journal sectors".into(), journal_sectors),
            ("journal sectors in use".into(), journal_used),
            (
                "journal commit threshold bytes".into(),
                crate::journal::COMMIT_BYTES_THRESHOLD,
            ),
            ("index entries".into(), i.depot.index().entries()),
            (
                "index sample shift (sparse: 1 in 2^this blocks enters)".into(),
                u64::from(i.depot.index().sample_shift()),
            ),
            ("index window blocks".into(), i.depot.index().capacity()),
            ("index slots".into(), i.depot.index().slots()),
            ("index entries held".into(), index_held),
            ("index entries dropped since open".into(), index_dropped),
            (
                "dedup hits next to an earlier hit".into(),
                i.depot.index().neighbour_hits(),
            ),
            ("index memory bytes".into(), i.depot.index().memory_bytes()),
            (
                "damaged objects remembered".into(),
                crate::heal::DAMAGED_OBJECTS_MAX as u64,
            ),
            (
                "damaged objects not remembered (past the limit)".into(),
                i.depot.damaged().unremembered(),
            ),
            ("page store slots".into(), i.geometry.page_slots()),
            (
                "pages held for the older super block copy".into(),
                i.checkpointer.held_for_older_copy(),
            ),
            (
                "page store slots in use".into(),
                i.checkpointer.page_store().used(),
            ),
            ("data blocks holding metadata pages".into(), page_blocks),
            (
                "page store slots discarded since open".into(),
                i.checkpointer.slots_discarded(),
            ),
        ],
        volumes,
    }
}

/// Where the dedup index's build stands (`Pool::index_status`).
pub(crate) fn index_status(i: &Inner) -> IndexStatus {
    use crate::index_build::BuildState;
    IndexStatus {
        state: match i.index_build.state() {
            BuildState::NotBuilt => IndexState::NotBuilt,
            BuildState::Rebuilding => IndexState::Rebuilding,
            BuildState::Ready => IndexState::Ready,
        },
        percent: i.index_build.percent(),
        blocks_stored_while_rebuilding: i.index_build.stored_while_rebuilding(),
        loaded: i.index_build.was_loaded(),
    }
}

/// Every on-disk region (`Pool::regions`).
pub(crate) fn regions(i: &Inner) -> Vec<Region> {
    let g = &i.geometry;
    let version = i.checkpointer.super_block().version;
    let meta_dev = if i.devices.separate_metadata() {
        "metadata"
    } else {
        "data"
    };
    let meta_path = i
        .devices
        .meta_path()
        .unwrap_or_else(|| i.devices.data_path());
    let store = i.checkpointer.page_store();
    let region = |name: &str, device: &str, path: &str, start: u64, blocks: u64| Region {
        name: name.into(),
        device: device.into(),
        path: path.into(),
        start_block: start,
        blocks,
        bytes: blocks * BLOCK,
    };
    let mut out = vec![
        region("super block (copy 0)", meta_dev, &meta_path, 0, 1),
        region("super block (copy 1)", meta_dev, &meta_path, 1, 1),
        region(
            "recovery journal",
            meta_dev,
            &meta_path,
            g.journal_start_block(),
            g.journal_sectors() / 8,
        ),
        region(
            &format!(
                "page store ({}; {} of {} slots in use)",
                if version == fewerbytes_format::FORMAT_VERSION_1 {
                    "block maps, slab object tables, directories, catalog"
                } else {
                    "block maps, object counts, fingerprints, directories, catalog"
                },
                store.used().saturating_sub(1),
                g.page_slots().saturating_sub(1)
            ),
            meta_dev,
            &meta_path,
            g.pages_start_block(),
            g.page_slots(),
        ),
    ];
    if i.devices.separate_metadata() {
        out.push(region(
            "data device label",
            "data",
            &i.devices.data_path(),
            0,
            2,
        ));
    }
    out.push(region(
        "data (slabs)",
        "data",
        &i.devices.data_path(),
        g.data_offset_bytes() / BLOCK,
        g.data_blocks(),
    ));
    // Metadata pages the page store had no slot for, in runs of adjacent data blocks.
    let runs = block_runs(&store.data_block_list());
    let total = store.data_blocks();
    for (n, &(first, blocks)) in runs.iter().enumerate() {
        if n == REGION_RUNS_MAX {
            let rest: u64 = runs.iter().skip(n).map(|r| r.1).sum();
            out.push(region(
                &format!(
                    "metadata pages in the data region: {} more runs ({rest} of the {total} blocks)",
                    runs.len() - n
                ),
                "data",
                &i.devices.data_path(),
                0,
                0,
            ));
            break;
        }
        out.push(region(
            &format!("metadata pages in the data region (of {total} blocks)"),
            "data",
            &i.devices.data_path(),
            g.data_offset_bytes() / BLOCK + first,
            blocks,
        ));
    }
    out
}

/// Runs of data blocks `list-metadata` lists one by one; the rest is one line.
const REGION_RUNS_MAX: usize = 32;

/// Sorted, distinct block numbers as runs of adjacent blocks: (first, count).
fn block_runs(sorted: &[u64]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &b in sorted {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == b => *count += 1,
            _ => runs.push((b, 1)),
        }
    }
    runs
}

/// Reference-count audit: references from all maps against stored counts, and
/// block holders against live objects.
///
/// Writes pause only while the state is copied (the referenced object ids, each
/// slab's live records and block holders); the comparison runs after.
pub(crate) fn audit(i: &Inner) -> AuditReport {
    let (snapshot, stale_advice) = {
        let _gate = i.locks.exclusive();
        (AuditSnapshot::take(i), stale_index_entries(i))
    };
    let mut report = snapshot.check(
        i.geometry.slab_count(),
        u64::from(i.geometry.objects_per_slab()),
    );
    if stale_advice > 0 {
        report.problems.push(format!(
            "{stale_advice} dedup index entries name no live object (advice that points at \
             freed data)"
        ));
    }
    // Damaged map ranges first: the counts of the objects their lost entries named
    // then read as a leak below (the count pages hold more than the maps).
    let damaged: Vec<String> = crate::map_damage::pool_ranges(i)
        .iter()
        .map(|r| {
            format!(
                "{}; its entries are unknown: the objects they named stay counted",
                r.describe()
            )
        })
        .collect();
    report.problems.splice(0..0, damaged);
    report
}

/// Index entries that name no live object, with writes paused (no free runs; the
/// background build inserts only live records).
fn stale_index_entries(i: &Inner) -> u64 {
    if i.index_build.state() == crate::index_build::BuildState::NotBuilt {
        // A read-only open (`check`): the index is empty, nothing to walk.
        return 0;
    }
    let objects_per_slab = u64::from(i.geometry.objects_per_slab());
    let mut live = Vec::new();
    // Slabs never touched hold no object.
    for (s, slab) in i.depot.touched() {
        let slab = slab.lock();
        for idx in slab.objects_in_memory() {
            let rec = slab.rec(idx);
            if rec.refcount != 0 {
                let o = fewerbytes_format::location::ObjectId(
                    u64::from(s) * objects_per_slab + u64::from(idx),
                );
                live.push((rec.fingerprint, o));
            }
        }
    }
    i.depot.index().entries_naming_no_live_object(live)
}

/// What the audit compares, copied while writes are paused.
struct AuditSnapshot {
    /// Object ids referenced by block maps, one entry per reference.
    refs: Vec<u64>,
    slabs: Vec<SlabSnapshot>,
}

struct SlabSnapshot {
    /// The slab's number.
    index: u32,
    first_pbn: u64,
    /// Records in use: (object index, encoded location, reference count).
    records: Vec<(u32, u64, u32)>,
    /// Holders recorded per block.
    holders: Vec<u16>,
    /// Blocks open in a packer (each open block holds itself once per entry).
    open_blocks: Vec<u32>,
}

impl AuditSnapshot {
    fn take(i: &Inner) -> AuditSnapshot {
        let mut refs = Vec::new();
        let mut counted = crate::page_share::CountedPages::default();
        for vol in i.volumes.all() {
            vol.for_each_counted(&mut counted, |_, e| refs.extend(e.object().map(|o| o.0)));
        }
        // Slabs never touched hold no record, block or holder: nothing to compare
        // (a map reference into one is a reference to a free object, found below).
        let slabs = i
            .depot
            .touched()
            .map(|(s, slab)| {
                let slab = slab.lock();
                let records = slab
                    .objects_in_memory()
                    .filter_map(|idx| {
                        let rec = slab.rec(idx);
                        (rec.refcount != 0 || rec.location != 0).then_some((
                            idx,
                            rec.location,
                            rec.refcount,
                        ))
                    })
                    .collect();
                SlabSnapshot {
                    index: s,
                    first_pbn: slab.first_pbn(),
                    records,
                    // A slab that holds nothing has no holder to compare (and its
                    // records are none): no copy of its block count in zeros.
                    holders: if slab.holds_nothing() {
                        Vec::new()
                    } else {
                        (0..slab.block_count()).map(|b| slab.holders(b)).collect()
                    },
                    open_blocks: slab.open_block_numbers(),
                }
            })
            .collect();
        AuditSnapshot { refs, slabs }
    }

    fn check(mut self, slab_count: u32, objects_per_slab: u64) -> AuditReport {
        let mut problems = Vec::new();
        let map_entries = self.refs.len() as u64;
        self.refs.sort_unstable();
        // References per object id, in id order: (id, count).
        let mut counts = self
            .refs
            .chunk_by(|a, b| a == b)
            .map(|run| (run.first().copied().unwrap_or(0), run.len() as u64))
            .peekable();
        let mut objects_checked = 0u64;
        for slab in &self.slabs {
            let s = slab.index;
            let base = u64::from(s) * objects_per_slab;
            let mut holders = vec![0u32; slab.holders.len()];
            for &(idx, location, refcount) in &slab.records {
                let id = base + u64::from(idx);
                // References to objects below this one have no record: free objects.
                while let Some(&(rid, n)) = counts.peek() {
                    if rid >= id {
                        break;
                    }
                    problems.push(format!(
                        "maps hold {n} references to object {rid}, which is free"
                    ));
                    counts.next();
                }
                let expected = match counts.peek() {
                    Some(&(rid, n)) if rid == id => {
                        counts.next();
                        n
                    }
                    _ => 0,
                };
                if u64::from(refcount) != expected {
                    problems.push(format!(
                        "object {id}: stored count {refcount} but maps hold {expected} references"
                    ));
                }
                if refcount == 0 {
                    continue;
                }
                objects_checked += 1;
                match Location::decode(location) {
                    Ok(loc) => {
                        let (first, count) = loc.blocks();
                        for b in first..first + count {
                            // A location outside its own slab is damage.
                            let Some(h) = b
                                .checked_sub(slab.first_pbn)
                                .and_then(|i| holders.get_mut(i as usize))
                            else {
                                problems
                                    .push(format!("object {id}: block {b} is outside its slab"));
                                continue;
                            };
                            *h += 1;
                        }
                    }
                    Err(e) => problems.push(format!("object {id}: {e}")),
                }
            }
            for &b in &slab.open_blocks {
                if let Some(h) = holders.get_mut(b as usize) {
                    *h += 1;
                }
            }
            for (b, (&stored, &found)) in slab.holders.iter().zip(holders.iter()).enumerate() {
                if u32::from(stored) != found {
                    problems.push(format!(
                        "block {b} of slab {s}: {stored} holders recorded, {found} found"
                    ));
                }
            }
            // References to free objects at the end of this slab.
            let next_base = base + objects_per_slab;
            while let Some(&(rid, n)) = counts.peek() {
                if rid >= next_base {
                    break;
                }
                problems.push(format!(
                    "maps hold {n} references to object {rid}, which is free"
                ));
                counts.next();
            }
        }
        let objects = u64::from(slab_count) * objects_per_slab;
        for (rid, n) in counts {
            problems.push(if rid < objects {
                format!("maps hold {n} references to object {rid}, which is free")
            } else {
                format!("a map references object {rid}, outside the pool's {slab_count} slabs")
            });
        }
        AuditReport {
            objects_checked,
            map_entries_checked: map_entries,
            problems,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    /// One slab of 4 blocks and 8 object slots: object 0 is block 0 (2 references),
    /// object 1 is block 1 (1 reference).
    fn consistent() -> AuditSnapshot {
        AuditSnapshot {
            refs: vec![1, 0, 0],
            slabs: vec![SlabSnapshot {
                index: 0,
                first_pbn: 0,
                records: vec![
                    (0, Location::Block { pbn: 0 }.encode(), 2),
                    (1, Location::Block { pbn: 1 }.encode(), 1),
                ],
                holders: vec![1, 1, 0, 1],
                open_blocks: vec![3],
            }],
        }
    }

    fn problems(snapshot: AuditSnapshot) -> Vec<String> {
        let report = snapshot.check(1, 8);
        report.problems
    }

    #[test]
    fn a_consistent_pool_has_no_problems() {
        let report = consistent().check(1, 8);
        assert!(report.problems.is_empty(), "{:?}", report.problems);
        assert_eq!((report.objects_checked, report.map_entries_checked), (2, 3));
    }

    #[test]
    fn every_kind_of_damage_is_reported() {
        let mut wrong_count = consistent();
        wrong_count.refs.pop();
        let p = problems(wrong_count);
        assert!(
            p.iter()
                .any(|m| m.contains("object 0: stored count 2 but maps hold 1")),
            "{p:?}"
        );

        let mut to_free = consistent();
        to_free.refs.push(5);
        let p = problems(to_free);
        assert!(
            p.iter()
                .any(|m| m.contains("1 references to object 5, which is free")),
            "{p:?}"
        );

        let mut outside = consistent();
        outside.refs.push(99);
        let p = problems(outside);
        assert!(p.iter().any(|m| m.contains("object 99, outside")), "{p:?}");

        let mut holder = consistent();
        if let Some(s) = holder.slabs.first_mut() {
            s.holders[2] = 1;
        }
        let p = problems(holder);
        assert!(
            p.iter()
                .any(|m| m.contains("block 2 of slab 0: 1 holders recorded, 0 found")),
            "{p:?}"
        );

        let mut astray = consistent();
        if let Some(s) = astray.slabs.first_mut() {
            s.records[1].1 = Location::Block { pbn: 100 }.encode();
        }
        let p = problems(astray);
        assert!(
            p.iter()
                .any(|m| m.contains("object 1: block 100 is outside its slab")),
            "{p:?}"
        );

        let mut open = consistent();
        if let Some(s) = open.slabs.first_mut() {
            s.open_blocks.clear();
        }
        let p = problems(open);
        assert!(p.iter().any(|m| m.contains("block 3 of slab 0")), "{p:?}");
    }
}
