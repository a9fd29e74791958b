//! Loading a pool at open (`load`): the checkpoint — every page the super block
//! reaches, read and verified, in format version 1 or 2 — then the journal replayed,
//! the derived state rebuilt, and a fresh checkpoint that records who holds the pool;
//! and the preparation of a version-1 pool's upgrade.
//!
//! Version 2 reads each page through its parent's [`PageRef`]: besides the page's
//! own checks (checksum, nonce, slot, kind, owner, index), its crc and generation
//! must be those the parent holds, so a stale page a lost write left in its slot, or
//! a page a misdirected write put there, is reported as corruption of that region
//! and block, never loaded. Version 1 has only the page's own checks. Version 3
//! reads a directory page from its second copy when the first fails
//! (`dir_copies.rs`).

use crate::block_map::{VolumeState, ENTRIES_PER_PAGE};
use crate::checkpoint::{FINGERPRINT_TABLE_OWNER, OBJECT_TABLE_OWNER};
use crate::dir_tree::{DirLevel, DirTree, SparseRefs};
use crate::inner::Inner;
use crate::journal_read::{read_journal, Ring};
use crate::map_damage::LostPage;
use crate::map_pages::Entries;
use crate::page_read::{check_names, page_place, read_page, tree_page_owner};
use crate::slab::ObjTable;
use crate::{EngineError, Result};
use fewerbytes_format::catalog::{Catalog, TableRoot, VolumeRecord};
use fewerbytes_format::counters::decode_counters;
use fewerbytes_format::dir_tree::{level_sizes, level_sizes_of, MAX_DEPTH, MAX_VOLUME_BYTES};
use fewerbytes_format::page::{
    refs_per_dir_page, CountRecord, ObjectRecord, PageHeader, PageKind, PageRef, COUNTS_PER_PAGE,
    FINGERPRINTS_PER_PAGE, OBJECTS_PER_PAGE, PAGE_HEADER_BYTES, PAGE_PAYLOAD_BYTES,
    REFS_PER_DIR_PAGE, SLOTS_PER_DIR_PAGE,
};
use fewerbytes_format::superblock::{Holder, SuperBlock, FLAG_JOURNAL_COMMITS, FLAG_SLIM_RECORDS};
use fewerbytes_format::{Reader, BLOCK_BYTES, FORMAT_VERSION, FORMAT_VERSION_1};
use std::collections::HashMap;
use std::sync::Arc;

/// The directory tree of a table of `entries` pages, read down from the top list
/// of `root`, and the references of its pages written (those not NONE). Version 2:
/// the root's depth and top list must be the shape the page count gives
/// (`dir_tree.rs`), and every directory page its level. Version 1: one level, as
/// long as the catalog says. Only the directory pages written are read: a large
/// table with few pages written costs what those pages do.
fn read_tree(
    inner: &Inner,
    root: &TableRoot,
    owner: u64,
    entries: u64,
    mut lost: Option<&mut Vec<LostPage>>,
) -> Result<(DirTree, SparseRefs)> {
    let version = inner.checkpointer.super_block().version;
    if version == FORMAT_VERSION_1 {
        let mut top = DirLevel::from_list(&root.top);
        let refs = read_level(inner, &mut top, owner, entries, 0, 1, lost)?;
        return Ok((DirTree::loaded(vec![top], entries), refs));
    }
    let sizes = level_sizes_of(version, entries).unwrap_or_default();
    if sizes.len() != root.depth as usize || sizes.last().copied() != Some(root.top.len() as u64) {
        return Err(catalog_corrupt(
            inner,
            format!(
                "the table of owner {owner} ({entries} pages) has a directory tree of \
             depth {} with {} top references; its pages need {}",
                root.depth,
                root.top.len(),
                match sizes.last() {
                    Some(top) => format!("depth {} with {top}", sizes.len()),
                    None => format!("more than {MAX_DEPTH} levels"),
                }
            ),
        ));
    }
    // Top down: level k + 1 from the references level k + 2 holds.
    let mut levels = vec![DirLevel::from_list(&root.top)];
    for k in (1..sizes.len()).rev() {
        if let (Some(parents), Some(&n)) = (levels.last_mut(), sizes.get(k - 1)) {
            // A child of a level-(k + 1) page is a level-k page over the table pages
            // its levels 1 to k fan out to.
            let span: u64 = (1..=k as u8)
                .map(|l| refs_per_dir_page(version, l) as u64)
                .product();
            let refs = read_level(
                inner,
                parents,
                owner,
                n,
                k as u8 + 1,
                span,
                lost.as_deref_mut(),
            )?;
            levels.push(DirLevel::new(n, refs));
        }
    }
    levels.reverse();
    let refs = match levels.first_mut() {
        Some(level_1) => read_level(inner, level_1, owner, entries, 1, 1, lost)?,
        None => Vec::new(),
    };
    Ok((DirTree::loaded(levels, entries), refs))
}

/// The references (not NONE) the written directory pages of `dirs` (of `level`; 0
/// in version 1) hold over a level of `entries` pages. A page read from its second
/// copy is marked for rewriting (`dir_copies.rs`). With `lost` (a block map's tree,
/// opened past damage: `map_damage.rs`), a directory page both of whose copies fail
/// their checks is listed there, with the table pages under it (each child spans
/// `span` of them), instead of failing the load: its children are unknown.
fn read_level(
    inner: &Inner,
    dirs: &mut DirLevel,
    owner: u64,
    entries: u64,
    level: u8,
    span: u64,
    mut lost: Option<&mut Vec<LostPage>>,
) -> Result<SparseRefs> {
    let version = inner.checkpointer.super_block().version;
    let v1 = version == FORMAT_VERSION_1;
    let per_page = if v1 {
        SLOTS_PER_DIR_PAGE
    } else {
        refs_per_dir_page(version, level)
    } as u64;
    let twinned = version >= FORMAT_VERSION && level >= 2;
    let mut refs = Vec::new();
    let mut from_twin = Vec::new();
    let mut buf = Box::new([0u8; BLOCK_BYTES]);
    for (k, d) in dirs.refs() {
        let first = k * per_page;
        let want = entries.saturating_sub(first).min(per_page);
        let read = crate::dir_copies::read_dir_page(inner, &mut buf, &d, owner, k).and_then(
            |(header, second)| {
                if header.level != level {
                    let (_, _, corrupt) = page_place(inner, PageKind::Directory, d.address)?;
                    return Err(corrupt(format!(
                        "directory page of level {}, expected level {level}",
                        header.level
                    )));
                }
                Ok(second)
            },
        );
        let second = match (read, lost.as_deref_mut()) {
            (Ok(second), _) => second,
            (
                Err(EngineError::Corrupt {
                    block,
                    device,
                    reason,
                    ..
                }),
                Some(lost),
            ) => {
                let pages = per_page.saturating_mul(span);
                let failed = (block, device, reason);
                lost.push(LostPage::new(
                    inner,
                    level.max(1),
                    d,
                    k * pages,
                    pages,
                    failed,
                ));
                continue;
            }
            (Err(e), _) => return Err(e),
        };
        if second {
            from_twin.push(k);
        }
        let payload = buf.get(PAGE_HEADER_BYTES..).unwrap_or_default();
        let mut r = Reader::new("directory page", payload);
        for i in first..first + want {
            let child = if v1 {
                PageRef::slot_only(r.u32()?)
            } else {
                PageRef::decode_as(twinned, &mut r)?
            };
            if !child.is_none() {
                refs.push((i, child));
            }
        }
    }
    for k in from_twin {
        dirs.mark_rewrite(k);
    }
    Ok(refs)
}

/// Corruption of the catalog, reported at its first page.
fn catalog_corrupt(inner: &Inner, reason: String) -> EngineError {
    let sb = inner.checkpointer.super_block();
    let block = sb.pages_start_block
        + sb.catalog
            .first()
            .and_then(|r| r.page_store_slot())
            .unwrap_or(0);
    EngineError::Corrupt {
        region: "catalog",
        block,
        device: "metadata",
        reason,
    }
}

/// Load the catalog named by the super block.
pub(crate) fn load_catalog(inner: &Inner) -> Result<Catalog> {
    let sb = inner.checkpointer.super_block().clone();
    let mut stream = Vec::with_capacity(sb.catalog_bytes as usize);
    let mut buf = Box::new([0u8; BLOCK_BYTES]);
    for (i, r) in sb.catalog.iter().enumerate() {
        let (header, payload) = read_page(inner, &mut buf, PageKind::Catalog, r, 0, i as u64)?;
        stream.extend_from_slice(payload.get(..header.count as usize).unwrap_or(payload));
    }
    stream.truncate(sb.catalog_bytes as usize);
    let catalog = Catalog::decode(&stream).map_err(|e| catalog_corrupt(inner, e.to_string()))?;
    if catalog.version != sb.version {
        return Err(catalog_corrupt(
            inner,
            format!(
                "a version-{} catalog in a version-{} pool",
                catalog.version, sb.version
            ),
        ));
    }
    let flagged = sb.flags & fewerbytes_format::superblock::FLAG_SHARED_MAPS != 0;
    if catalog.has_lineage() != flagged {
        return Err(catalog_corrupt(
            inner,
            format!(
                "the catalog {} lineages but the super block's flag bit 7 (shared map \
                 pages) is {}",
                if catalog.has_lineage() {
                    "carries"
                } else {
                    "carries no"
                },
                if flagged { "set" } else { "clear" }
            ),
        ));
    }
    Ok(catalog)
}

/// Load the pool's cumulative counters from the counters page the super block
/// names, if any (a pool without one, or a version-1 pool, starts them at 0).
pub(crate) fn load_counters(inner: &Inner) -> Result<()> {
    let reference = inner.checkpointer.super_block().counters;
    if reference.is_none() {
        return Ok(());
    }
    let mut buf = Box::new([0u8; BLOCK_BYTES]);
    let (header, payload) = read_page(inner, &mut buf, PageKind::Counters, &reference, 0, 0)?;
    let values = decode_counters(header.count, payload).map_err(|e| EngineError::Corrupt {
        region: PageKind::Counters.name(),
        block: inner.geometry.pages_start_block() + reference.page_store_slot().unwrap_or(0),
        device: "metadata",
        reason: e.to_string(),
    })?;
    inner.counters.load_kept(values);
    Ok(())
}

/// Load every slab's object records: version 1's object pages, or version 2's
/// count and fingerprint pages.
pub(crate) fn load_objects(inner: &Inner, catalog: &Catalog) -> Result<()> {
    if catalog.version == FORMAT_VERSION_1 {
        return load_objects_v1(inner, &catalog.objects);
    }
    let objects = inner.geometry.objects_per_slab() as usize;
    let slabs = inner.geometry.slab_count() as usize;
    let per_slab = objects.div_ceil(COUNTS_PER_PAGE);
    let (count_tree, counts) = read_tree(
        inner,
        &catalog.objects,
        OBJECT_TABLE_OWNER,
        (slabs * per_slab) as u64,
        None,
    )?;
    let mut buf = Box::new([0u8; BLOCK_BYTES]);
    for (g, r) in &counts {
        let g = *g as usize;
        let (s, c) = ((g / per_slab) as u32, g % per_slab);
        let mut slab = inner.depot.slab(s).lock();
        slab.set_durable(ObjTable::Counts, c, *r);
        let (_, payload) = read_page(inner, &mut buf, PageKind::Counts, r, u64::from(s), c as u64)?;
        let mut reader = Reader::new("object count page", payload);
        let first = c * COUNTS_PER_PAGE;
        for i in first..(first + COUNTS_PER_PAGE).min(objects) {
            let rec = CountRecord::decode(&mut reader)?;
            slab.load_rec(i as u32, |m| {
                m.location = rec.location;
                m.refcount = rec.refcount;
            });
        }
    }
    let per_slab = objects.div_ceil(FINGERPRINTS_PER_PAGE);
    let (fp_tree, fps) = read_tree(
        inner,
        &catalog.fingerprints,
        FINGERPRINT_TABLE_OWNER,
        (slabs * per_slab) as u64,
        None,
    )?;
    for (g, r) in &fps {
        let g = *g as usize;
        let (s, f) = ((g / per_slab) as u32, g % per_slab);
        let mut slab = inner.depot.slab(s).lock();
        slab.set_durable(ObjTable::Fingerprints, f, *r);
        let (_, payload) = read_page(
            inner,
            &mut buf,
            PageKind::Fingerprints,
            r,
            u64::from(s),
            f as u64,
        )?;
        let mut reader = Reader::new("fingerprint page", payload);
        let first = f * FINGERPRINTS_PER_PAGE;
        for i in first..(first + FINGERPRINTS_PER_PAGE).min(objects) {
            let fingerprint = reader.bytes32()?;
            // A free object's fingerprint is meaningless: only stored ones load.
            if slab.rec(i as u32) != Default::default() {
                slab.load_rec(i as u32, |m| m.fingerprint = fingerprint);
            }
        }
    }
    *inner.checkpointer.count_dirs() = count_tree;
    *inner.checkpointer.fp_dirs() = fp_tree;
    Ok(())
}

/// Version 1: object pages of 84 whole records.
fn load_objects_v1(inner: &Inner, objects: &TableRoot) -> Result<()> {
    let pages_per_slab = inner.geometry.objects_per_slab() as usize / OBJECTS_PER_PAGE;
    let total = inner.geometry.slab_count() as usize * pages_per_slab;
    let (tree, refs) = read_tree(inner, objects, OBJECT_TABLE_OWNER, total as u64, None)?;
    let mut buf = Box::new([0u8; BLOCK_BYTES]);
    for (g, r) in &refs {
        let g = *g as usize;
        let (s, p) = ((g / pages_per_slab) as u32, g % pages_per_slab);
        let (_, payload) = read_page(
            inner,
            &mut buf,
            PageKind::Objects,
            r,
            u64::from(s),
            p as u64,
        )?;
        let mut reader = Reader::new("slab object page", payload);
        let mut slab = inner.depot.slab(s).lock();
        for i in 0..OBJECTS_PER_PAGE {
            let rec = ObjectRecord::decode(&mut reader)?;
            if rec.refcount == 0 && rec.location == 0 {
                continue;
            }
            slab.load_rec((p * OBJECTS_PER_PAGE + i) as u32, |m| {
                m.location = rec.location;
                m.refcount = rec.refcount;
                m.fingerprint = rec.fingerprint;
            });
        }
    }
    *inner.checkpointer.count_dirs() = tree;
    Ok(())
}

/// Load one volume's block map: the pages written, each into memory.
///
/// With `tolerate_damage` (the older super block copy cannot stand in:
/// `map_damage.rs`), a map page or map directory page that fails its checks marks
/// the volume range it maps damaged, and the load goes on.
///
/// A map page another tree loaded already (`loaded`, by address, with its header) is
/// not read again: the volumes share its entries in memory, and the
/// caller counts the trees reaching each page once every map is loaded
/// ([`share_loaded_pages`]). Its header must name this tree's owner and index as its
/// own read would check them (`page_read::check_names`): a page reached from two
/// lines is misplaced.
pub(crate) fn load_map(
    inner: &Inner,
    record: &VolumeRecord,
    vol: &VolumeState,
    tolerate_damage: bool,
    loaded: &mut HashMap<u64, (Entries, PageHeader)>,
) -> Result<()> {
    let pages_len = vol.map_pages().len();
    let mut lost = Vec::new();
    let (tree, refs) = read_tree(
        inner,
        &record.map,
        tree_page_owner(PageKind::Directory, record.id, record.lineage),
        pages_len,
        tolerate_damage.then_some(&mut lost),
    )?;
    let mut buf = Box::new([0u8; BLOCK_BYTES]);
    let owner = tree_page_owner(PageKind::Map, record.id, record.lineage);
    for (p, r) in &refs {
        let read = match loaded.get(&r.address) {
            Some((entries, header)) => check_names(header, owner, *p, None)
                .or_else(|reason| {
                    let (_, _, corrupt) = page_place(inner, PageKind::Map, r.address)?;
                    Err(corrupt(format!("{reason} (another tree reaches it)")))
                })
                .map(|()| Loaded::Shared(entries.clone())),
            None => read_page(inner, &mut buf, PageKind::Map, r, owner, *p)
                .map(|(header, payload)| Loaded::Read(header, payload)),
        };
        let (header, payload) = match read {
            Ok(Loaded::Shared(entries)) => {
                vol.load_page(*p, entries, *r);
                continue;
            }
            Ok(Loaded::Read(header, payload)) => (header, payload),
            Err(EngineError::Corrupt {
                block,
                device,
                reason,
                ..
            }) if tolerate_damage => {
                lost.push(LostPage::new(inner, 0, *r, *p, 1, (block, device, reason)));
                continue;
            }
            Err(e) => return Err(e),
        };
        let mut reader = Reader::new("block map page", payload);
        let mut entries = [0u64; ENTRIES_PER_PAGE as usize];
        for e in entries.iter_mut() {
            *e = reader.u64()?;
        }
        let entries = Entries::new(entries);
        loaded.insert(r.address, (entries.clone(), header));
        vol.load_page(*p, entries, *r);
    }
    *vol.dirs() = tree;
    crate::map_damage::record_lost(vol, lost, pages_len);
    vol.tree_written();
    Ok(())
}

/// A map page as [`load_map`] found it: read now (its header and payload), or
/// loaded by another tree already.
enum Loaded<'a> {
    Read(PageHeader, &'a [u8]),
    Shared(Entries),
}

/// Once every map is loaded: the durable map pages more than one tree reaches,
/// counted into the shares table and marked shared in each tree
/// (`page_share.rs`). A damaged page's failed reference counts as any other.
pub(crate) fn share_loaded_pages(inner: &Inner) {
    let shares = inner.volumes.shares();
    shares.clear();
    let vols = inner.volumes.all();
    let mut reached: HashMap<u64, u32> = HashMap::new();
    for vol in &vols {
        for (_, page) in vol.map_pages().iter() {
            let durable = page.lock().durable();
            if !durable.is_none() {
                *reached.entry(durable.address).or_insert(0) += 1;
            }
        }
    }
    for vol in &vols {
        for (_, page) in vol.map_pages().iter() {
            let mut page = page.lock();
            let durable = page.durable();
            if !durable.is_none() && reached.get(&durable.address).is_some_and(|&n| n > 1) {
                page.mark_shared();
            }
        }
    }
    // Each page two or more trees reach joins the table once per referrer past the
    // first.
    let joined: Vec<PageRef> = reached
        .into_iter()
        .filter(|&(_, n)| n > 1)
        .flat_map(|(address, n)| {
            (1..n).map(move |_| PageRef {
                address,
                ..PageRef::NONE
            })
        })
        .collect();
    shares.join_all(&joined);
}

/// Make the next checkpoint the upgrade of a loaded version-1 pool: every page
/// dirty (so all are written in version 3: to free slots, and past them to free
/// data blocks, which sets flags bit 3), and no durable version-3 reference yet.
/// Returns the version-1 slots, which the caller retires once the version-3 super
/// block is durable in both copies (`load`). Refused, with nothing written and the
/// numbers, when the free slots and free data blocks together cannot hold the
/// version-3 image beside the version-1 one.
pub(crate) fn prepare_upgrade(inner: &Inner) -> Result<Vec<u64>> {
    let needed = upgrade_pages(inner);
    let (free, v1_slots) = {
        let store = inner.checkpointer.page_store();
        (store.free_slots(), store.used_slots())
    };
    let free_blocks = inner.depot.free_blocks();
    if needed > free.saturating_add(free_blocks) {
        return Err(EngineError::Refused(format!(
            "this pool is format version 1 and its upgrade to version {FORMAT_VERSION} needs {needed} \
             metadata pages beside its {} version-1 pages, but the page store has {free} \
             free slots and the data region {free_blocks} free blocks: nothing was \
             written. Open it read-only, or copy its volumes to a new pool",
            v1_slots.len()
        )));
    }
    let to_data_blocks = needed.saturating_sub(free);
    tracing::info!(
        "upgrading the pool from format version 1 to {FORMAT_VERSION}: {needed} pages to write, \
         {free} slots free, {to_data_blocks} pages to data blocks"
    );
    inner.checkpointer.super_block().catalog.clear();
    *inner.checkpointer.count_dirs() = DirTree::default();
    *inner.checkpointer.fp_dirs() = DirTree::default();
    for (_, slab) in inner.depot.touched() {
        slab.lock().mark_all_dirty();
    }
    for vol in inner.volumes.all() {
        *vol.dirs() = DirTree::default();
        for (_, page) in vol.map_pages().iter() {
            page.lock().forget_durable();
        }
    }
    Ok(v1_slots)
}

/// Pages the upgrade writes before the version-1 slots are freed: the version-3
/// image of the loaded state (map, count and fingerprint pages, the directories
/// above them, the catalog and the counters page), and the catalog and counters
/// page again for the second checkpoint (`load`).
fn upgrade_pages(inner: &Inner) -> u64 {
    // Every level of a tree, and its top list in the catalog. A tree past the
    // depth bound fails the checkpoint itself; here it counts as one level.
    let shape = |pages: u64| {
        level_sizes(pages).unwrap_or_else(|| vec![pages.div_ceil(REFS_PER_DIR_PAGE as u64)])
    };
    let copies = crate::metadata_room::DIR_PAGE_COPIES;
    let dirs = |pages: u64| copies * shape(pages).iter().sum::<u64>();
    let top = |pages: u64| 8 + 24 * shape(pages).last().copied().unwrap_or(0);
    let mut pages = 0u64;
    let mut catalog_bytes = 16u64;
    let slabs = u64::from(inner.depot.count());
    let counts = slabs * inner.depot.table_pages_per_slab(ObjTable::Counts);
    let fps = slabs * inner.depot.table_pages_per_slab(ObjTable::Fingerprints);
    // Slabs never touched hold no page.
    for (_, slab) in inner.depot.touched() {
        let slab = slab.lock();
        let used = |table: ObjTable| slab.table_pages_in_memory(table).count() as u64;
        pages += used(ObjTable::Counts) + used(ObjTable::Fingerprints);
    }
    pages += dirs(counts) + dirs(fps);
    catalog_bytes += top(counts) + top(fps);
    for vol in inner.volumes.all() {
        // Only the pages written, and the directory pages over them.
        let map = vol.map_pages();
        let written: Vec<u64> = map
            .iter()
            .filter(|(_, page)| page.lock().is_written())
            .map(|(p, _)| p)
            .collect();
        pages += written.len() as u64;
        pages += crate::metadata_room::directory_pages(&written, map.len());
        catalog_bytes += 40 + vol.name().len() as u64 + top(map.len());
    }
    // And the counters page, in each of the two checkpoints.
    let catalog_and_counters = catalog_bytes.div_ceil(PAGE_PAYLOAD_BYTES as u64) + 1;
    pages + 2 * catalog_and_counters
}

/// Load the checkpoint, replay the journal, rebuild derived state, and write a
/// fresh checkpoint in the new open generation. The pages of `older` (the other
/// valid super block copy) are held until that checkpoint is durable.
///
/// With `tolerate_map_damage`, a block-map page or map directory page that fails
/// its checks marks the range it maps damaged instead of failing the open
/// (`map_damage.rs`); the caller asks for it only when the older super block copy
/// cannot stand in.
pub(crate) fn load(
    inner: &Inner,
    sb: &SuperBlock,
    older: Option<&SuperBlock>,
    tolerate_map_damage: bool,
) -> Result<()> {
    if sb.holder.is_set() {
        tracing::warn!(
            "{}: the pool is marked open by {}: that opener did not close it (it \
             stopped without closing, or another host still has the device open)",
            inner.devices.meta().name(),
            describe_holder(&sb.holder)
        );
    }
    if sb.generation > 0 {
        let catalog = crate::load::load_catalog(inner)?;
        crate::load::load_counters(inner)?;
        crate::load::load_objects(inner, &catalog)?;
        inner.volumes.set_next_id(catalog.next_volume_id);
        inner
            .volumes
            .reservations()
            .load(&catalog, inner.geometry.overcommit());
        let mut loaded = HashMap::new();
        for record in &catalog.volumes {
            let corrupt = |reason: String| EngineError::Corrupt {
                region: "catalog",
                block: 0,
                device: "metadata",
                reason,
            };
            if !record.size_bytes.is_multiple_of(BLOCK_BYTES as u64) {
                return Err(corrupt(format!(
                    "volume '{}' size {} is not whole blocks",
                    record.name, record.size_bytes
                )));
            }
            if record.size_bytes > MAX_VOLUME_BYTES {
                return Err(corrupt(format!(
                    "volume '{}' of {} bytes is larger than the format's maximum of {} bytes \
                     (4 PiB)",
                    record.name, record.size_bytes, MAX_VOLUME_BYTES
                )));
            }
            let vol = Arc::new(VolumeState::new(
                record.slot,
                record.id,
                record.name.clone(),
                record.size_bytes / BLOCK_BYTES as u64,
            ));
            vol.set_limited(record.limited);
            vol.set_incomplete(record.incomplete);
            vol.set_lineage(record.lineage);
            let vol = Arc::into_inner(vol)
                .ok_or_else(|| corrupt("a volume loaded is held elsewhere".into()))?
                .made_at(record.created);
            let vol = Arc::new(if record.snapshot {
                vol.with_origin(record.origin, record.guid)
            } else {
                vol
            });
            crate::load::load_map(inner, record, &vol, tolerate_map_damage, &mut loaded)?;
            inner.volumes.insert(vol);
        }
        // A snapshot's origin is a volume of the pool: a volume with snapshots is
        // never deleted, so one without is a damaged catalog.
        for record in catalog.volumes.iter().filter(|r| r.snapshot) {
            let origin = catalog
                .volumes
                .iter()
                .find(|v| v.id == record.origin && !v.snapshot);
            if origin.is_none() {
                return Err(catalog_corrupt(
                    inner,
                    format!(
                        "snapshot '{}' names volume id {} as its origin, which the pool \
                         does not hold",
                        record.name, record.origin
                    ),
                ));
            }
        }
        crate::load::share_loaded_pages(inner);
        crate::map_damage::warn_lost(inner);
    }
    if let (Some(older), false) = (older, inner.devices.opened_read_only()) {
        crate::older_copy::hold_older_pages(inner, older)?;
    }
    let ring = Ring {
        nonce: inner.geometry.nonce(),
        start_block: inner.geometry.journal_start_block(),
        sectors: inner.geometry.journal_sectors(),
        replay_seq: sb.journal_replay_seq,
        open_gen: sb.open_gen,
        commits: sb.flags & FLAG_JOURNAL_COMMITS != 0,
    };
    let journal = read_journal(inner.devices.meta(), &ring)?;
    crate::repair::journal_damage(inner, &journal)?;
    let next_seq = journal.next_seq;
    if sb.generation > 0 && !journal.records.is_empty() {
        tracing::info!("replaying {} journal records", journal.records.len());
        let slim = sb.flags & FLAG_SLIM_RECORDS != 0;
        let unstored =
            crate::recovery::replay(inner, &journal.records, slim, !journal.lost.is_empty())?;
        crate::repair::drop_unstored_references(inner, &unstored)?;
    }
    // New sectors follow the replayed ones, which stay: the copy they were replayed
    // from is the older one after this open's checkpoint, and replays them again if
    // the newer is lost.
    inner.journal.replayed(next_seq);
    crate::repair::restore_counts(inner)?;
    crate::recovery::rebuild(inner)?;
    if inner.devices.opened_read_only() {
        inner.devices.latch_opened_read_only();
        return Ok(());
    }
    // A pool closed cleanly (nothing replayed) may find the index it saved then.
    if journal.records.is_empty()
        && journal.lost.is_empty()
        && crate::index_save::load(inner, sb.generation)
    {
        inner.index_build.loaded();
    }
    let upgrade = sb.version != FORMAT_VERSION;
    if upgrade {
        crate::map_damage::before_upgrade(inner, sb.version)?;
    }
    let v1_slots = if sb.version == FORMAT_VERSION_1 {
        crate::load::prepare_upgrade(inner)?
    } else {
        if upgrade {
            crate::upgrade_v2::prepare_upgrade_v2(inner)?;
        }
        Vec::new()
    };
    // A fresh checkpoint in the new open generation retires the replayed journal
    // and records who holds the pool.
    {
        let mut current = inner.checkpointer.super_block();
        current.open_gen = inner.journal.open_gen();
        // Sectors of the new generation carry their commit and parity, and
        // journal a block stored new as one slim record.
        current.flags |= FLAG_JOURNAL_COMMITS | FLAG_SLIM_RECORDS;
        current.holder = this_holder();
    }
    crate::checkpoint::checkpoint(inner)?;
    inner.journal.use_slim_records();
    if upgrade {
        // The other super block copy still holds the old version: one more
        // checkpoint overwrites it, so older code refuses the pool by its version
        // rather than open that older checkpoint. Its pages stay untouched until
        // then: version 1's slots are freed (and discarded) once that checkpoint is
        // durable, version 2's directory pages (retired by the first checkpoint,
        // `upgrade_v2.rs`) as deferred frees are.
        inner.checkpointer.free_after_next(v1_slots);
        crate::checkpoint::checkpoint(inner)?;
        tracing::info!(
            "{}: upgraded from format version {} to {FORMAT_VERSION}",
            inner.devices.meta().name(),
            sb.version
        );
    }
    Ok(())
}

pub(crate) fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The open-by-host marker of this process: host name, boot id, pid, now. Each part
/// is best effort (a person reads it); unknown parts stay empty.
fn this_holder() -> Holder {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let mut host_bytes = host
        .len()
        .min(fewerbytes_format::superblock::MAX_HOST_BYTES);
    while !host.is_char_boundary(host_bytes) {
        host_bytes -= 1;
    }
    let mut boot_id = [0u8; 16];
    if let Ok(text) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let hex: Vec<u8> = text
            .trim()
            .chars()
            .filter_map(|c| c.to_digit(16))
            .map(|d| d as u8)
            .collect();
        for (b, pair) in boot_id.iter_mut().zip(hex.chunks(2)) {
            *b = pair.iter().fold(0, |acc, d| acc << 4 | d);
        }
    }
    Holder {
        pid: std::process::id(),
        open_unix: now_unix().max(1),
        boot_id,
        host: host.get(..host_bytes).unwrap_or_default().to_string(),
    }
}

fn describe_holder(h: &Holder) -> String {
    let boot: String = h.boot_id.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "host '{}' (boot id {boot}), pid {}, at {}",
        h.host,
        h.pid,
        crate::scrubber::iso8601(h.open_unix)
    )
}
