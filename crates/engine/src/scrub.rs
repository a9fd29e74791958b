//! The online scrub (ZFS's `zpool scrub`): both super block copies, every page the
//! current checkpoint reaches (catalog, counters, directory, count, fingerprint and
//! block-map pages, each through the reference its parent holds, checked as the
//! load checks it) and every stored object (decoded by its codec and verified
//! against its stored fingerprint, as a read is), read at a bounded rate on a
//! thread of its own. The scrubber's state is `scrubber.rs`.
//!
//! Nothing is held across a read but what makes the read exact: a page is read
//! under the checkpoint lock (so the reference it is read through is the durable
//! one and its slot cannot be retired meanwhile), an object under the gate held
//! shared (as every request step holds it). Requests never wait for the scrub's
//! reads but for one 4 KiB read at a time.
//!
//! Both copies of a directory page (format version 3) are read and verified. A
//! map page several trees share (a clone's, a snapshot's, a rollback's: format
//! flag bit 7) is one durable copy: it is read once, checked against the owner its
//! lineage names (`page_read::tree_page_owner`, as the load checks it), and a
//! failure is reported once, naming every volume and snapshot that reaches it.
//!
//! Repairs: while a pool is open its memory holds every page's content, loaded
//! verified at open and changed since only by the engine. A damaged page is
//! marked dirty (a directory page: marked for rewriting, which rewrites the path
//! up to it; both its copies go to fresh addresses) and a checkpoint writes it to
//! a fresh slot; a damaged super block copy
//! is rewritten by the checkpoints that land on it. A repair counts once the page
//! (or copy) reads back good. A damaged data block has no second copy: it is
//! reported with the volumes and byte ranges that map it (reads of them fail).

use crate::api::ScrubFinding;
use crate::block_map::{VolumeState, ENTRIES_PER_PAGE};
use crate::checkpoint::{FINGERPRINT_TABLE_OWNER, OBJECT_TABLE_OWNER};
use crate::dir_tree::DirTree;
use crate::inner::{Inner, Wait};
use crate::page_read::{check_names, tree_page_owner};
use crate::slab::ObjTable;
use crate::Result;
use fewerbytes_format::location::{Location, MapEntry, ObjectId};
use fewerbytes_format::page::{
    decode_page, decode_page_ref, page_version_allowed, PageKind, PageRef,
};
use fewerbytes_format::superblock::SuperBlock;
use fewerbytes_format::{BLOCK_BYTES, FORMAT_VERSION_1};
use parking_lot::MutexGuard;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

/// The scrub's read rate unless `--rate` says otherwise: 64 MiB/s, a fraction of
/// what one disk streams (a SATA SSD ~500 MiB/s, a 7200 rpm disk ~150 MiB/s), so
/// guests keep most of the device; a TiB of stored data takes about 4.5 hours.
pub const SCRUB_RATE_DEFAULT_BYTES_PER_S: u64 = 64 << 20;

const BLOCK: u64 = BLOCK_BYTES as u64;

/// Which directory tree a directory page belongs to.
#[derive(Clone)]
enum Tree {
    Counts,
    Fingerprints,
    Map(Arc<VolumeState>),
}

/// Where a page is found: how its current reference is looked up, and what its
/// header must say.
#[derive(Clone)]
enum Site {
    Catalog(usize),
    Counters,
    /// A directory page: its tree, its level's place in the tree (0 up), the level
    /// its header names (1 up; 0 in version 1) and its index.
    Dir(Tree, usize, u8, u64),
    /// Page `k` of a slab's count or fingerprint table.
    Table(ObjTable, u32, usize),
    /// Page `p` of a volume's block map.
    Map(Arc<VolumeState>, u64),
}

impl Site {
    /// What the page's header must name: kind, owner, index, level.
    fn expected(&self) -> (PageKind, u64, u64, u8) {
        match self {
            Site::Catalog(i) => (PageKind::Catalog, 0, *i as u64, 0),
            Site::Counters => (PageKind::Counters, 0, 0, 0),
            Site::Dir(tree, _, level, k) => (PageKind::Directory, tree.owner(), *k, *level),
            Site::Table(ObjTable::Counts, s, k) => (PageKind::Counts, u64::from(*s), *k as u64, 0),
            Site::Table(ObjTable::Fingerprints, s, k) => {
                (PageKind::Fingerprints, u64::from(*s), *k as u64, 0)
            }
            Site::Map(vol, p) => (
                PageKind::Map,
                tree_page_owner(PageKind::Map, vol.id(), vol.lineage()),
                *p,
                0,
            ),
        }
    }

    /// The region a finding names (as `list-metadata` and `docs/format.md` do).
    fn region(&self) -> &'static str {
        match self {
            Site::Catalog(_) => "catalog",
            Site::Counters => "counters",
            Site::Dir(..) => "directory",
            Site::Table(ObjTable::Counts, ..) => "counts",
            Site::Table(ObjTable::Fingerprints, ..) => "fingerprints",
            Site::Map(..) => "map",
        }
    }

    /// The page in words, for the report.
    fn describe(&self, inner: &Inner) -> String {
        match self {
            Site::Catalog(i) => format!("catalog page {i}"),
            Site::Counters => "counters page".into(),
            Site::Dir(tree, l, _, k) => {
                format!(
                    "{} directory page {k} of level {}",
                    tree.describe(inner),
                    l + 1
                )
            }
            Site::Table(ObjTable::Counts, s, k) => format!("count page {k} of slab {s}"),
            Site::Table(ObjTable::Fingerprints, s, k) => {
                format!("fingerprint page {k} of slab {s}")
            }
            Site::Map(vol, p) => format!(
                "block-map page {p} of {}",
                map_range(&inner.volumes.full_name(vol), *p)
            ),
        }
    }

    /// Its durable reference now (none: no durable copy, nothing to verify). The
    /// caller holds the checkpoint lock.
    fn reference(&self, inner: &Inner) -> PageRef {
        match self {
            Site::Catalog(i) => inner
                .checkpointer
                .super_block()
                .catalog
                .get(*i)
                .copied()
                .unwrap_or_default(),
            Site::Counters => inner.checkpointer.super_block().counters,
            // A deleted volume's tree still names the slots its delete retired.
            Site::Dir(Tree::Map(vol), ..) if vol.is_deleted() => PageRef::NONE,
            Site::Dir(tree, l, _, k) => tree
                .lock(inner)
                .level_mut(*l)
                .map(|level| level.get(*k))
                .unwrap_or_default(),
            Site::Table(table, s, k) => inner.depot.slab(*s).lock().durable_ref(*table, *k),
            Site::Map(vol, p) => {
                if vol.is_deleted() {
                    return PageRef::NONE;
                }
                let pages = vol.map_pages();
                pages
                    .get(*p)
                    .map(|m| m.lock().durable())
                    .unwrap_or_default()
            }
        }
    }
}

impl Tree {
    fn owner(&self) -> u64 {
        match self {
            Tree::Counts => OBJECT_TABLE_OWNER,
            Tree::Fingerprints => FINGERPRINT_TABLE_OWNER,
            Tree::Map(vol) => tree_page_owner(PageKind::Directory, vol.id(), vol.lineage()),
        }
    }

    fn describe(&self, inner: &Inner) -> String {
        match self {
            Tree::Counts => "count table".into(),
            Tree::Fingerprints => "fingerprint table".into(),
            Tree::Map(vol) => format!("volume '{}' block-map", inner.volumes.full_name(vol)),
        }
    }

    fn lock<'a>(&'a self, inner: &'a Inner) -> MutexGuard<'a, DirTree> {
        match self {
            Tree::Counts => inner.checkpointer.count_dirs(),
            Tree::Fingerprints => inner.checkpointer.fp_dirs(),
            Tree::Map(vol) => vol.dirs(),
        }
    }
}

/// The scrub thread's body: one whole scrub, from start to report.
pub(crate) fn scrub(inner: &Inner) {
    let total = bytes_to_verify(inner);
    inner.scrubber.set_total(total);
    let stopped = match walk(inner) {
        Ok(true) => None,
        Ok(false) => Some("the pool closed before the scrub finished".to_string()),
        Err(e) => Some(format!("the scrub stopped: {e}")),
    };
    if let Some(why) = &stopped {
        tracing::warn!("{why}");
    }
    let s = inner.scrubber.status();
    tracing::info!(
        "scrub done: {} bytes verified, {} errors found, {} repaired",
        s.bytes_verified,
        s.errors_found,
        s.repaired
    );
    inner.scrubber.finish(stopped);
}

/// Super blocks, pages, objects. False if the pool closed first.
fn walk(inner: &Inner) -> Result<bool> {
    let closed = || inner.devices.is_closed();
    let mut pace = (Instant::now(), 0u64);
    macro_rules! step {
        () => {
            match inner.scrubber.pace(pace, closed) {
                Some(p) => pace = p,
                None => return Ok(false),
            }
        };
    }
    for copy in 0..2u64 {
        step!();
        check_super_copy(inner, copy);
    }
    for site in pool_sites(inner) {
        step!();
        check_site(inner, &site);
    }
    // Only slabs touched can hold pages or objects (one never touched has none,
    // and costs nothing here).
    let slabs: Vec<u32> = inner.depot.touched().map(|(s, _)| s).collect();
    for &s in &slabs {
        for table in [ObjTable::Counts, ObjTable::Fingerprints] {
            // Only pages with a durable copy can be read.
            let pages: Vec<usize> = inner
                .depot
                .slab(s)
                .lock()
                .durable_table_pages(table)
                .collect();
            for k in pages {
                step!();
                check_site(inner, &Site::Table(table, s, k));
            }
        }
    }
    let mut met = MetPages::default();
    for vol in inner.volumes.all() {
        let mut next = 0u64;
        while let Some(p) = next_written_page(&vol, next) {
            step!();
            if met.first_meeting(&vol, p) {
                check_site(inner, &Site::Map(vol.clone(), p));
            }
            next = p + 1;
        }
    }
    for &s in &slabs {
        for (location, i) in stored_objects(inner, s) {
            step!();
            check_object(inner, s, i, location);
        }
    }
    Ok(true)
}

/// The pages outside the tables' leaves: catalog, counters, and every directory
/// page (a few per table).
fn pool_sites(inner: &Inner) -> Vec<Site> {
    let (catalog, counters) = {
        let sb = inner.checkpointer.super_block();
        (sb.catalog.len(), !sb.counters.is_none())
    };
    let v1 = inner.checkpointer.super_block().version == FORMAT_VERSION_1;
    let mut sites: Vec<Site> = (0..catalog).map(Site::Catalog).collect();
    if counters {
        sites.push(Site::Counters);
    }
    let mut trees = vec![Tree::Counts, Tree::Fingerprints];
    trees.extend(inner.volumes.all().into_iter().map(Tree::Map));
    for tree in trees {
        let mut t = tree.lock(inner);
        for l in 0.. {
            let Some(level) = t.level_mut(l) else { break };
            let number = if v1 { 0 } else { l as u8 + 1 };
            for (k, _) in level.refs() {
                sites.push(Site::Dir(tree.clone(), l, number, k));
            }
        }
    }
    sites
}

/// The shared map pages a walk has met: a page several trees reach (a clone's, a
/// snapshot's, a rollback's) is one durable copy, read and reported once.
#[derive(Default)]
struct MetPages {
    seen: HashSet<(u64, u32, u32)>,
}

impl MetPages {
    /// Whether page `p` of `vol` is met for the first time: a page only this tree
    /// reaches always is; a shared one, the first time its durable copy is met.
    fn first_meeting(&mut self, vol: &VolumeState, p: u64) -> bool {
        let pages = vol.map_pages();
        let Some(page) = pages.get(p) else {
            return true;
        };
        let page = page.lock();
        let d = page.durable();
        !page.is_shared() || self.seen.insert((d.address, d.crc, d.generation))
    }
}

/// `volume 'NAME' bytes A..B`: the bytes map page `p` maps, as a person names them.
fn map_range(name: &str, p: u64) -> String {
    format!(
        "volume '{name}' bytes {}..{}",
        p * ENTRIES_PER_PAGE * BLOCK,
        (p + 1) * ENTRIES_PER_PAGE * BLOCK - 1
    )
}

/// The first page at or after `p` with a durable copy.
fn next_written_page(vol: &VolumeState, p: u64) -> Option<u64> {
    let pages = vol.map_pages();
    let next = pages
        .iter_from(p)
        .find(|(_, page)| !page.lock().durable().is_none())
        .map(|(p, _)| p);
    next
}

/// The stored objects of slab `s` (locations and indexes), in the order of their
/// first data block: the device reads them front to back, as its read-ahead
/// expects (object order follows allocation, which freed and reused objects
/// scatter). 12 bytes an object, one slab at a time.
fn stored_objects(inner: &Inner, s: u32) -> Vec<(u64, u32)> {
    let slab = inner.depot.slab(s).lock();
    let mut stored: Vec<(u64, u32)> = slab
        .objects_in_memory()
        .filter_map(|i| {
            let rec = slab.rec(i);
            (rec.refcount > 0).then_some((rec.location, i))
        })
        .collect();
    drop(slab);
    // By first data block (an undecodable location sorts first; its read reports it).
    stored.sort_unstable_by_key(|(location, i)| {
        (Location::decode(*location).map_or(0, |l| l.blocks().0), *i)
    });
    stored
}

/// What the scrub will read: both super block copies, every page with a durable
/// copy, and the stored bytes of every object.
fn bytes_to_verify(inner: &Inner) -> u64 {
    let mut pages: u64 = pool_sites(inner)
        .iter()
        .map(|site| match site {
            Site::Dir(..) => site.reference(inner).addresses().count().max(1) as u64,
            _ => 1,
        })
        .sum();
    let mut stored = 0u64;
    for (_, slab) in inner.depot.touched() {
        let slab = slab.lock();
        for table in [ObjTable::Counts, ObjTable::Fingerprints] {
            pages += slab.durable_table_pages(table).count() as u64;
        }
        for i in slab.objects_in_memory() {
            let rec = slab.rec(i);
            if rec.refcount > 0 {
                stored += stored_bytes(rec.location);
            }
        }
    }
    let mut met = MetPages::default();
    for vol in inner.volumes.all() {
        let mut next = 0u64;
        while let Some(p) = next_written_page(&vol, next) {
            pages += u64::from(met.first_meeting(&vol, p));
            next = p + 1;
        }
    }
    (2 + pages) * BLOCK + stored
}

/// Bytes an object's location names on the device (a fragment's length, or a block).
fn stored_bytes(location: u64) -> u64 {
    match Location::decode(location) {
        Ok(Location::Fragment { len_bytes, .. }) => u64::from(len_bytes),
        _ => BLOCK,
    }
}

/// Read the page `site` names through its durable reference and verify it as the
/// load does, each of its copies (two for a version-3 directory page). `Ok(0)`: no
/// durable copy (gone since the scrub listed it); `Ok(n)`: its `n` copies are good.
/// `Err((n, reason))`: of its `n` copies, one or both fail a check, with where
/// they lie.
fn verify_page(inner: &Inner, site: &Site) -> std::result::Result<u64, (u64, String)> {
    let _ck = inner.checkpointer.serialize();
    let reference = site.reference(inner);
    let copies = reference.addresses().count() as u64;
    let mut bad = Vec::new();
    for (n, address) in reference.addresses().enumerate() {
        if let Err(reason) = verify_copy(inner, site, &reference, address) {
            bad.push(match (copies, n) {
                (1, _) => reason,
                (_, 0) => format!("its first copy: {reason}"),
                _ => format!("its second copy: {reason}"),
            });
        }
    }
    if bad.is_empty() {
        Ok(copies)
    } else {
        Err((copies, bad.join("; ")))
    }
}

/// Verify the copy at `address` of the page `reference` names.
fn verify_copy(
    inner: &Inner,
    site: &Site,
    reference: &PageRef,
    address: u64,
) -> std::result::Result<(), String> {
    let (version, generation) = {
        let sb = inner.checkpointer.super_block();
        (sb.version, sb.generation)
    };
    let data_block = crate::page_store::address_block(address);
    let (device, name, block) = match data_block {
        Some(pbn) => (
            inner.devices.data(),
            "data",
            inner.geometry.data_offset_bytes() / BLOCK + pbn,
        ),
        None => (
            inner.devices.meta(),
            "metadata",
            inner.geometry.pages_start_block() + address,
        ),
    };
    let at = format!("{name} device block {block}");
    let inside = match data_block {
        Some(pbn) => pbn < inner.geometry.data_blocks(),
        None => address != 0 && address < inner.geometry.page_slots(),
    };
    if !inside {
        return Err(format!("its address {address:#x} is outside its region"));
    }
    let mut buf = vec![0u8; BLOCK_BYTES];
    device
        .read_at(&mut buf, block * BLOCK)
        .map_err(|e| format!("{at}: the read failed: {e}"))?;
    let (kind, owner, index, level) = site.expected();
    let decoded = if version == FORMAT_VERSION_1 {
        decode_page(&buf, kind, inner.geometry.nonce(), reference.address)
    } else {
        decode_page_ref(&buf, kind, inner.geometry.nonce(), reference)
    };
    let (header, _) = decoded.map_err(|e| format!("{at}: {e}"))?;
    if !page_version_allowed(version, kind, header.version) {
        return Err(format!(
            "{at}: a version-{} page in a version-{version} pool",
            header.version
        ));
    }
    check_names(&header, owner, index, Some(level)).map_err(|e| format!("{at}: {e}"))?;
    if header.generation > generation {
        return Err(format!(
            "{at}: page generation {} is newer than the super block's {generation}",
            header.generation
        ));
    }
    Ok(())
}

/// Verify one page; report, and repair, a failure. A damaged map page is reported
/// once with every volume and snapshot whose tree reaches it: each loses the bytes
/// it maps until the page is rewritten.
fn check_site(inner: &Inner, site: &Site) {
    match verify_page(inner, site) {
        Ok(copies) => {
            if copies > 0 {
                inner.scrubber.verified(copies * BLOCK, true);
            }
        }
        Err((copies, reason)) => {
            inner.scrubber.verified(copies * BLOCK, true);
            let sharers = sharers(inner, site);
            let mut what = format!("{}: {reason}", site.describe(inner));
            if sharers.len() > 1 {
                what.push_str(&format!(
                    " (one copy {} volumes and snapshots share: each maps these bytes \
                     through it)",
                    sharers.len()
                ));
            }
            tracing::error!("scrub: {what}");
            let repaired = repair_page(inner, &sharers);
            if repaired {
                tracing::info!("scrub: rewrote {} from memory", site.describe(inner));
            }
            let volumes = sharers
                .iter()
                .filter_map(|s| match s {
                    Site::Map(vol, p) => Some(map_range(&inner.volumes.full_name(vol), *p)),
                    _ => None,
                })
                .collect();
            inner.scrubber.found(ScrubFinding {
                region: site.region().to_string(),
                what,
                volumes,
                repaired,
            });
        }
    }
}

/// The sites that reach the page `site` names: for a map page, page `p` of every
/// tree whose durable reference is the same copy (a clone, a snapshot or a
/// rollback shares its source's page `p` as its own page `p`); else `site` alone.
fn sharers(inner: &Inner, site: &Site) -> Vec<Site> {
    let Site::Map(vol, p) = site else {
        return vec![site.clone()];
    };
    let _ck = inner.checkpointer.serialize();
    let reference = site.reference(inner);
    let mut found = vec![site.clone()];
    if reference.is_none() {
        return found;
    }
    for other in inner.volumes.all() {
        let at = Site::Map(other.clone(), *p);
        if other.id() != vol.id() && at.reference(inner) == reference {
            found.push(at);
        }
    }
    found
}

/// Whether the pool may be written (a repair is a checkpoint).
fn writable(inner: &Inner) -> bool {
    !inner.devices.opened_read_only() && inner.devices.latched().is_none()
}

/// Mark the page dirty in every tree that reaches it (`sites`), take a checkpoint,
/// and read each again: true if every one now reads back good.
fn repair_page(inner: &Inner, sites: &[Site]) -> bool {
    if !writable(inner) {
        return false;
    }
    // Every site marked, even past one that cannot be: each marked one is rewritten.
    let marked = sites.iter().filter(|site| mark_page(inner, site)).count();
    if marked < sites.len() {
        return false;
    }
    if let Err(e) = crate::checkpoint::checkpoint(inner) {
        tracing::error!(
            "scrub: the checkpoint that rewrites {} failed: {e}",
            sites.first().map(|s| s.describe(inner)).unwrap_or_default()
        );
        return false;
    }
    sites
        .iter()
        .all(|site| matches!(verify_page(inner, site), Ok(n) if n > 0))
}

/// Mark the page `site` names for the next checkpoint to rewrite; false if it
/// cannot be (no longer written, or gone).
fn mark_page(inner: &Inner, site: &Site) -> bool {
    match site {
        // The catalog is rewritten whole by every checkpoint.
        Site::Catalog(_) => true,
        Site::Counters => {
            inner.counters.rewrite_page();
            true
        }
        Site::Table(table, s, k) => inner
            .depot
            .slab(*s)
            .lock()
            .mark_table_page_dirty(*table, *k),
        Site::Map(vol, p) => mark_map_page(inner, vol, *p),
        Site::Dir(tree, l, _, k) => match tree.lock(inner).level_mut(*l) {
            Some(level) if !level.get(*k).is_none() => {
                level.mark_rewrite(*k);
                true
            }
            _ => false,
        },
    }
}

fn mark_map_page(inner: &Inner, vol: &VolumeState, p: u64) -> bool {
    let pages = vol.map_pages();
    match pages.get(p) {
        Some(page) => {
            let mut page = page.lock();
            if !page.is_written() {
                return false;
            }
            // A page other trees reach is made this volume's own: `repair_page`
            // marks each tree that reaches it, and the last one left holds the
            // durable copy alone, so its page is rewritten in place of it.
            let gained = page.make_own(inner.volumes.shares(), inner.checkpointer.dirty_pages());
            if inner.depot.add_references(&inner.devices, &gained).is_err() {
                return false;
            }
            page.mark_dirty(inner.checkpointer.dirty_pages()).is_ok()
        }
        None => false,
    }
}

/// Read super block copy `copy` and check it decodes (and, for the copy the last
/// checkpoint wrote, that it is that checkpoint); rewrite a damaged copy by
/// taking the checkpoints that land on it.
fn check_super_copy(inner: &Inner, copy: u64) {
    let verdict = verify_super_copy(inner, copy);
    inner.scrubber.verified(BLOCK, true);
    let Err(reason) = verdict else { return };
    let what = format!("super block copy {copy} (metadata device block {copy}): {reason}");
    tracing::error!("scrub: {what}");
    let mut repaired = false;
    if writable(inner) {
        // A checkpoint writes copy `generation % 2`: at most two land on `copy`.
        for _ in 0..2 {
            if let Err(e) = crate::checkpoint::checkpoint(inner) {
                tracing::error!(
                    "scrub: the checkpoint that rewrites super block copy {copy} failed: {e}"
                );
                break;
            }
            if inner.checkpointer.super_block().generation % 2 == copy {
                repaired = verify_super_copy(inner, copy).is_ok();
                break;
            }
        }
    }
    inner.scrubber.found(ScrubFinding {
        region: "super block".into(),
        what,
        volumes: Vec::new(),
        repaired,
    });
}

fn verify_super_copy(inner: &Inner, copy: u64) -> std::result::Result<(), String> {
    let _ck = inner.checkpointer.serialize();
    let mut block = vec![0u8; BLOCK_BYTES];
    inner
        .devices
        .meta()
        .read_at(&mut block, copy * BLOCK)
        .map_err(|e| format!("the read failed: {e}"))?;
    let current = inner.checkpointer.super_block().generation;
    // Copy 1 of a pool never opened read-write (generation 0) was never written.
    if copy == 1 && current == 0 {
        return Ok(());
    }
    let sb = SuperBlock::decode(&block).map_err(|e| e.to_string())?;
    if current % 2 == copy && sb.generation != current {
        return Err(format!(
            "it holds generation {}, and the last checkpoint wrote generation {current} there",
            sb.generation
        ));
    }
    Ok(())
}

/// Read one stored object and verify it against its fingerprint; report a failure
/// with the volumes and ranges that map it.
fn check_object(inner: &Inner, s: u32, i: u32, location: u64) {
    let o = inner.depot.object_id(s, i);
    let mut buf = vec![0u8; BLOCK_BYTES];
    let result = {
        let _gate = inner.locks.shared();
        // Stored by a write step that has yet to journal it: its fingerprint is not
        // set yet (`slab.rs: FINGERPRINT_IN_FLIGHT`), nothing to check it against.
        let listed = inner.depot.slab(s).lock().rec(i);
        if listed.fingerprint == crate::slab::FINGERPRINT_IN_FLIGHT {
            return;
        }
        let r = crate::read_path::read_object(inner, o, &mut buf, Wait::Yes);
        // Moved (compaction) or dropped since it was listed: not damage.
        let rec = inner.depot.slab(s).lock().rec(i);
        if rec.location != location || rec.refcount == 0 {
            return;
        }
        r
    };
    inner.scrubber.verified(stored_bytes(location), false);
    let Err(e) = result else { return };
    // A walk of every map per damaged block: only for the findings the report keeps
    // (a drive returning garbage everywhere must not make the scrub quadratic).
    let at = crate::damage::read_damage(&e).unwrap_or(crate::damage::DamagedAt::Unknown);
    let volumes = if inner.scrubber.keeps_more() {
        mapped_by(inner, o, at)
    } else {
        Vec::new()
    };
    tracing::error!(
        "scrub: {e} (mapped by {})",
        if volumes.is_empty() {
            "no volume".to_string()
        } else {
            volumes.join(", ")
        }
    );
    inner.scrubber.found(ScrubFinding {
        region: "data".into(),
        what: e.to_string(),
        volumes,
        repaired: false,
    });
}

/// The volumes mapping object `o` (stored `at`), each byte range it maps it at named
/// as a read of it names it (`crate::damage`).
fn mapped_by(inner: &Inner, o: ObjectId, at: crate::damage::DamagedAt) -> Vec<String> {
    let mut found = Vec::new();
    for vol in inner.volumes.all() {
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        vol.for_each_mapped(|lbn, entry| {
            if entry == MapEntry::Object(o) {
                match ranges.last_mut() {
                    Some((_, end)) if *end == lbn => *end = lbn + 1,
                    _ => ranges.push((lbn, lbn + 1)),
                }
            }
        });
        for (a, b) in ranges {
            found.push(crate::damage::volume_range(
                &inner.volumes.full_name(&vol),
                a * BLOCK,
                (b - a) * BLOCK,
                at,
            ));
        }
    }
    found
}
