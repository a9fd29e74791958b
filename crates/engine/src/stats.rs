//! Statistics, the region list and the reference-count audit: where every byte went.

use crate::api::*;
use crate::pool::Pool;
use fewerbytes_format::location::Location;
use fewerbytes_format::BLOCK_BYTES;
use fewerbytes_storage::IoSnapshot;
use std::sync::atomic::Ordering::Relaxed;

const BLOCK: u64 = BLOCK_BYTES as u64;

fn device_io(s: IoSnapshot) -> DeviceIo {
    DeviceIo {
        read_bytes: s.read_bytes,
        write_bytes: s.write_bytes,
        flushes: s.flushes,
    }
}

impl Pool {
    /// Statistics.
    pub fn stats(&self) -> PoolStats {
        let i = &self.inner;
        let mut pending_blocks = 0u64;
        let (mut used_blocks, mut objects, mut fragments, mut fragment_bytes, mut whole, mut saved) =
            (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
        for s in 0..i.slab_count {
            let slab = i.slab(s).lock();
            // Blocks freed since the last checkpoint stay allocated until it (their
            // bytes may still be named by a durable mapping) but are no longer used.
            used_blocks += u64::from(slab.used_blocks() - slab.pending_blocks());
            pending_blocks += u64::from(slab.pending_blocks());
            for page in slab.pages.iter().flatten() {
                for rec in page.recs.iter().filter(|r| r.refcount > 0) {
                    objects += 1;
                    saved += u64::from(rec.refcount - 1);
                    match Location::decode(rec.location) {
                        Ok(Location::Fragment { len_bytes, .. }) => {
                            fragments += 1;
                            fragment_bytes += u64::from(len_bytes);
                        }
                        Ok(Location::Block { .. }) => whole += 1,
                        Err(_) => {}
                    }
                }
            }
        }
        let packed_blocks = used_blocks.saturating_sub(whole);
        let volumes: Vec<VolumeStats> = i
            .volumes
            .read()
            .iter()
            .flatten()
            .map(|v| VolumeStats {
                name: v.name.clone(),
                size_bytes: v.size_blocks() * BLOCK,
                logical_used_bytes: v.mapped.load(Relaxed).max(0) as u64 * BLOCK,
                zero_bytes: v.zeros.load(Relaxed).max(0) as u64 * BLOCK,
                counters: v.counters.snapshot(),
            })
            .collect();
        let logical_used_bytes: u64 = volumes.iter().map(|v| v.logical_used_bytes).sum();
        let zero_bytes: u64 = volumes.iter().map(|v| v.zero_bytes).sum();
        let data_used_bytes = used_blocks * BLOCK;
        let saving_percent = if logical_used_bytes == 0 {
            0.0
        } else {
            100.0 * (1.0 - data_used_bytes as f64 / logical_used_bytes as f64)
        };
        let info = self.info();
        let m = &i.meta_written;
        let (journal_used, journal_sectors) = i.journal.usage();
        PoolStats {
            path: i.data_path.clone(),
            mode: self.mode(),
            data_bytes: i.data_blocks * BLOCK,
            data_used_bytes,
            data_free_bytes: (i.data_blocks - (used_blocks + pending_blocks).min(i.data_blocks))
                * BLOCK,
            data_freeing_bytes: pending_blocks * BLOCK,
            metadata_bytes: info.metadata_bytes,
            logical_used_bytes,
            zero_bytes,
            saving_percent,
            objects,
            compressed_fragments: fragments,
            compressed_bytes: fragment_bytes,
            packed_blocks,
            packing_waste_bytes: (packed_blocks * BLOCK).saturating_sub(fragment_bytes),
            whole_blocks: whole,
            compacted_blocks: i.compacted_blocks.load(Relaxed),
            dedup_saved_blocks: saved,
            counters: i.counters.snapshot(),
            data_device: device_io(i.data.counters().snapshot()),
            metadata_device: if i.separate_metadata {
                device_io(i.meta.counters().snapshot())
            } else {
                device_io(i.data.counters().snapshot())
            },
            metadata_written_by_region: vec![
                ("super block".into(), m.super_bytes.load(Relaxed)),
                ("journal".into(), m.journal_bytes.load(Relaxed)),
                ("block map pages".into(), m.map_bytes.load(Relaxed)),
                ("slab object pages".into(), m.object_bytes.load(Relaxed)),
                ("directory pages".into(), m.dir_bytes.load(Relaxed)),
                ("catalog pages".into(), m.catalog_bytes.load(Relaxed)),
            ],
            checkpoints: i.checkpoints.load(Relaxed),
            journal_commits: i.commits.load(Relaxed),
            threads: i.threads,
            limits: vec![
                ("zones (packers)".into(), i.zone_count() as u64),
                ("lbn lock stripes".into(), crate::pool::LBN_STRIPES as u64),
                (
                    "blocks per request step".into(),
                    crate::pool::BLOCKS_PER_STEP,
                ),
                ("journal sectors".into(), journal_sectors),
                ("journal sectors in use".into(), journal_used),
                (
                    "journal commit threshold bytes".into(),
                    crate::journal::COMMIT_BYTES_THRESHOLD,
                ),
                ("index entries".into(), i.index.capacity()),
                ("index memory bytes".into(), i.index.memory_bytes()),
                ("page store slots".into(), i.page_slots),
                ("page store slots in use".into(), i.page_store.lock().used()),
            ],
            volumes,
        }
    }

    /// Every on-disk region.
    pub fn regions(&self) -> Vec<Region> {
        let i = &self.inner;
        let sb = i.sb.lock().clone();
        let meta_dev = if i.separate_metadata {
            "metadata"
        } else {
            "data"
        };
        let meta_path = i.meta_path.clone().unwrap_or_else(|| i.data_path.clone());
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
                sb.journal_start_block,
                sb.journal_sectors / 8,
            ),
            region(
                "page store (block maps, slab object tables, directories, catalog)",
                meta_dev,
                &meta_path,
                sb.pages_start_block,
                sb.page_slots,
            ),
        ];
        if i.separate_metadata {
            out.push(region("data device label", "data", &i.data_path, 0, 1));
        }
        out.push(region(
            "data (slabs)",
            "data",
            &i.data_path,
            sb.data_offset_bytes / BLOCK,
            sb.data_blocks,
        ));
        out
    }

    /// Reference-count audit: references from all maps against stored counts, and
    /// block holders against live objects.
    pub fn audit(&self) -> AuditReport {
        let i = &self.inner;
        let _gate = i.gate.write();
        let refs = i.count_references();
        let mut problems = Vec::new();
        let map_entries: u64 = refs.values().sum();
        let mut objects_checked = 0u64;
        for s in 0..i.slab_count {
            let slab = i.slab(s).lock();
            let mut holders = vec![0u32; slab.blocks as usize];
            for idx in 0..slab.objects() {
                let rec = slab.rec(idx);
                let id = u64::from(s) * u64::from(i.objects_per_slab) + u64::from(idx);
                let expected = refs.get(&id).copied().unwrap_or(0);
                if u64::from(rec.refcount) != expected {
                    problems.push(format!(
                        "object {id}: stored count {} but maps hold {expected} references",
                        rec.refcount
                    ));
                }
                if rec.refcount == 0 {
                    continue;
                }
                objects_checked += 1;
                match Location::decode(rec.location) {
                    Ok(loc) => {
                        let (first, count) = loc.blocks();
                        for b in first..first + count {
                            if let Some(h) = holders.get_mut((b - slab.first_pbn) as usize) {
                                *h += 1;
                            }
                        }
                    }
                    Err(e) => problems.push(format!("object {id}: {e}")),
                }
            }
            for (b, h) in holders.iter().enumerate() {
                let open = slab
                    .open_blocks
                    .iter()
                    .filter(|(ob, _)| *ob as usize == b)
                    .count() as u32;
                let stored = u32::from(slab.holders(b as u32));
                if stored != h + open {
                    problems.push(format!(
                        "block {} of slab {s}: {stored} holders recorded, {} found",
                        b,
                        h + open
                    ));
                }
            }
        }
        for id in refs.keys() {
            let (s, _) = i.split_object(fewerbytes_format::location::ObjectId(*id));
            if s >= i.slab_count {
                problems.push(format!("a map references object {id}, outside the pool"));
            }
        }
        AuditReport {
            objects_checked,
            map_entries_checked: map_entries,
            problems,
        }
    }
}
