//! Loading a checkpoint: every page the super block reaches, read and verified, in
//! format version 1 or 2; and the preparation of a version-1 pool's upgrade.
//!
//! Version 2 reads each page through its parent's [`PageRef`]: besides the page's
//! own checks (checksum, nonce, slot, kind, owner, index), its crc and generation
//! must be those the parent holds, so a stale page a lost write left in its slot, or
//! a page a misdirected write put there, is reported as corruption of that region
//! and block, never loaded. Version 1 has only the page's own checks.

use crate::block_map::{VolumeState, ENTRIES_PER_PAGE};
use crate::checkpoint::{FINGERPRINT_TABLE_OWNER, OBJECT_TABLE_OWNER};
use crate::dir_tree::DirTree;
use crate::inner::Inner;
use crate::slab::ObjTable;
use crate::{EngineError, Result};
use fewerbytes_format::catalog::{Catalog, TableRoot, VolumeRecord};
use fewerbytes_format::dir_tree::{level_sizes, MAX_DEPTH};
use fewerbytes_format::page::{
    decode_page, decode_page_ref, CountRecord, ObjectRecord, PageHeader, PageKind, PageRef,
    COUNTS_PER_PAGE, FINGERPRINTS_PER_PAGE, OBJECTS_PER_PAGE, PAGE_PAYLOAD_BYTES,
    REFS_PER_DIR_PAGE, SLOTS_PER_DIR_PAGE,
};
use fewerbytes_format::superblock::FLAG_DATA_REGION_PAGES;
use fewerbytes_format::{Reader, BLOCK_BYTES, FORMAT_VERSION_1};

impl Inner {
    /// Read the page `reference` names and verify it: its own checks, its owner and
    /// index, and (version 2) the crc and generation its parent holds.
    fn read_page<'a>(
        &self,
        buf: &'a mut [u8; BLOCK_BYTES],
        kind: PageKind,
        reference: &PageRef,
        owner: u64,
        index: u64,
    ) -> Result<(PageHeader, &'a [u8])> {
        let (version, generation, data_region_pages) = {
            let sb = self.checkpointer.super_block();
            (
                sb.version,
                sb.generation,
                sb.flags & FLAG_DATA_REGION_PAGES != 0,
            )
        };
        let (device, block, corrupt) = self.page_place(kind, reference)?;
        if reference.data_block().is_some() && !data_region_pages {
            return Err(corrupt(format!(
                "page address {:#x} names a data block, but the super block does not \
                 allow pages in the data region (flags bit 3)",
                reference.address
            )));
        }
        device.read_at(&mut buf[..], block * BLOCK_BYTES as u64)?;
        let decoded = if version == FORMAT_VERSION_1 {
            decode_page(&buf[..], kind, self.geometry.nonce(), reference.address)
        } else {
            decode_page_ref(&buf[..], kind, self.geometry.nonce(), reference)
        };
        let (header, payload) = decoded.map_err(|e| corrupt(e.to_string()))?;
        if header.version != version {
            return Err(corrupt(format!(
                "a version-{} page in a version-{version} pool",
                header.version
            )));
        }
        if header.owner != owner || header.index != index {
            return Err(corrupt(format!(
                "page names owner {} index {}, expected owner {owner} index {index}",
                header.owner, header.index
            )));
        }
        if header.generation > generation {
            return Err(corrupt(format!(
                "page generation {} is newer than the super block's",
                header.generation
            )));
        }
        self.checkpointer
            .page_store()
            .mark_address(reference.address);
        Ok((header, payload))
    }

    /// Where the page a reference names lies: its device, the block there, and the
    /// corruption report for that block. An address outside its region (the page
    /// store's slots, or the data region's blocks) is corruption.
    fn page_place(
        &self,
        kind: PageKind,
        reference: &PageRef,
    ) -> Result<(
        &dyn fewerbytes_storage::Storage,
        u64,
        impl Fn(String) -> EngineError,
    )> {
        let region = kind.name();
        let (device, name, block, inside) = match reference.data_block() {
            Some(pbn) => (
                self.devices.data(),
                "data",
                (self.geometry.data_offset_bytes() / BLOCK_BYTES as u64).saturating_add(pbn),
                pbn < self.geometry.data_blocks(),
            ),
            None => {
                let slot = reference.address;
                (
                    self.devices.meta(),
                    "metadata",
                    self.geometry.pages_start_block().saturating_add(slot),
                    slot != 0 && slot < self.geometry.page_slots(),
                )
            }
        };
        let corrupt = move |reason: String| EngineError::Corrupt {
            region,
            block,
            device: name,
            reason,
        };
        if !inside {
            return Err(corrupt(format!(
                "page address {:#x} is outside its region",
                reference.address
            )));
        }
        Ok((device, block, corrupt))
    }

    /// The directory tree of a table of `entries` pages, read down from the top list
    /// of `root`, and the references of its pages. Version 2: the root's depth and
    /// top list must be the shape the page count gives (`dir_tree.rs`), and every
    /// directory page its level. Version 1: one level, as long as the catalog says.
    fn read_tree(
        &self,
        root: &TableRoot,
        owner: u64,
        entries: usize,
    ) -> Result<(DirTree, Vec<PageRef>)> {
        if self.checkpointer.super_block().version == FORMAT_VERSION_1 {
            let refs = self.read_level(&root.top, owner, entries, 0)?;
            let tree = DirTree::loaded(vec![root.top.clone()], entries);
            return Ok((tree, refs));
        }
        let sizes = level_sizes(entries as u64).unwrap_or_default();
        if sizes.len() != root.depth as usize
            || sizes.last().copied() != Some(root.top.len() as u64)
        {
            return Err(self.catalog_corrupt(format!(
                "the table of owner {owner} ({entries} pages) has a directory tree of \
                 depth {} with {} top references; its pages need {}",
                root.depth,
                root.top.len(),
                match sizes.last() {
                    Some(top) => format!("depth {} with {top}", sizes.len()),
                    None => format!("more than {MAX_DEPTH} levels"),
                }
            )));
        }
        let mut levels = vec![Vec::new(); sizes.len()];
        if let Some(top) = levels.last_mut() {
            top.clone_from(&root.top);
        }
        for k in (1..sizes.len()).rev() {
            let (below, above) = levels.split_at_mut(k);
            if let (Some(children), Some(parents), Some(&n)) =
                (below.last_mut(), above.first(), sizes.get(k - 1))
            {
                *children = self.read_level(parents, owner, n as usize, k as u8 + 1)?;
            }
        }
        let level_1 = levels.first().map_or(&[][..], Vec::as_slice);
        let refs = self.read_level(level_1, owner, entries, 1)?;
        let tree = DirTree::loaded(levels, entries);
        Ok((tree, refs))
    }

    /// The `entries` references the directory pages `dirs` (of `level`; 0 in
    /// version 1) hold.
    fn read_level(
        &self,
        dirs: &[PageRef],
        owner: u64,
        entries: usize,
        level: u8,
    ) -> Result<Vec<PageRef>> {
        let v1 = self.checkpointer.super_block().version == FORMAT_VERSION_1;
        let per_page = if v1 {
            SLOTS_PER_DIR_PAGE
        } else {
            REFS_PER_DIR_PAGE
        };
        let mut refs = Vec::with_capacity(entries);
        let mut buf = Box::new([0u8; BLOCK_BYTES]);
        for (k, d) in dirs.iter().enumerate() {
            let want = entries.saturating_sub(refs.len()).min(per_page);
            if d.is_none() {
                refs.extend(std::iter::repeat_n(PageRef::NONE, want));
                continue;
            }
            let (header, payload) =
                self.read_page(&mut buf, PageKind::Directory, d, owner, k as u64)?;
            if header.level != level {
                let (_, _, corrupt) = self.page_place(PageKind::Directory, d)?;
                return Err(corrupt(format!(
                    "directory page of level {}, expected level {level}",
                    header.level
                )));
            }
            let mut r = Reader::new("directory page", payload);
            for _ in 0..want {
                refs.push(if v1 {
                    PageRef::slot_only(r.u32()?)
                } else {
                    PageRef::decode(&mut r)?
                });
            }
        }
        refs.resize(entries, PageRef::NONE);
        Ok(refs)
    }

    /// Corruption of the catalog, reported at its first page.
    fn catalog_corrupt(&self, reason: String) -> EngineError {
        let sb = self.checkpointer.super_block();
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
    pub(crate) fn load_catalog(&self) -> Result<Catalog> {
        let sb = self.checkpointer.super_block().clone();
        let mut stream = Vec::with_capacity(sb.catalog_bytes as usize);
        let mut buf = Box::new([0u8; BLOCK_BYTES]);
        for (i, r) in sb.catalog.iter().enumerate() {
            let (header, payload) = self.read_page(&mut buf, PageKind::Catalog, r, 0, i as u64)?;
            stream.extend_from_slice(payload.get(..header.count as usize).unwrap_or(payload));
        }
        stream.truncate(sb.catalog_bytes as usize);
        let catalog = Catalog::decode(&stream).map_err(|e| self.catalog_corrupt(e.to_string()))?;
        if catalog.version != sb.version {
            return Err(self.catalog_corrupt(format!(
                "a version-{} catalog in a version-{} pool",
                catalog.version, sb.version
            )));
        }
        Ok(catalog)
    }

    /// Verify the counters page the super block names, if any, and keep its slot in
    /// use: this version defines no counters, but keeps the page of one that does.
    pub(crate) fn load_counters(&self) -> Result<()> {
        let reference = self.checkpointer.super_block().counters;
        if reference.is_none() {
            return Ok(());
        }
        let mut buf = Box::new([0u8; BLOCK_BYTES]);
        self.read_page(&mut buf, PageKind::Counters, &reference, 0, 0)?;
        Ok(())
    }

    /// Load every slab's object records: version 1's object pages, or version 2's
    /// count and fingerprint pages.
    pub(crate) fn load_objects(&self, catalog: &Catalog) -> Result<()> {
        if catalog.version == FORMAT_VERSION_1 {
            return self.load_objects_v1(&catalog.objects);
        }
        let objects = self.geometry.objects_per_slab() as usize;
        let slabs = self.geometry.slab_count() as usize;
        let per_slab = objects.div_ceil(COUNTS_PER_PAGE);
        let (count_tree, counts) =
            self.read_tree(&catalog.objects, OBJECT_TABLE_OWNER, slabs * per_slab)?;
        let mut buf = Box::new([0u8; BLOCK_BYTES]);
        for (g, r) in counts.iter().enumerate() {
            let (s, c) = ((g / per_slab) as u32, g % per_slab);
            let mut slab = self.depot.slab(s).lock();
            slab.set_durable(ObjTable::Counts, c, *r);
            if r.is_none() {
                continue;
            }
            let (_, payload) =
                self.read_page(&mut buf, PageKind::Counts, r, u64::from(s), c as u64)?;
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
        let (fp_tree, fps) = self.read_tree(
            &catalog.fingerprints,
            FINGERPRINT_TABLE_OWNER,
            slabs * per_slab,
        )?;
        for (g, r) in fps.iter().enumerate() {
            let (s, f) = ((g / per_slab) as u32, g % per_slab);
            let mut slab = self.depot.slab(s).lock();
            slab.set_durable(ObjTable::Fingerprints, f, *r);
            if r.is_none() {
                continue;
            }
            let (_, payload) =
                self.read_page(&mut buf, PageKind::Fingerprints, r, u64::from(s), f as u64)?;
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
        *self.checkpointer.count_dirs() = count_tree;
        *self.checkpointer.fp_dirs() = fp_tree;
        Ok(())
    }

    /// Version 1: object pages of 84 whole records.
    fn load_objects_v1(&self, objects: &TableRoot) -> Result<()> {
        let pages_per_slab = self.geometry.objects_per_slab() as usize / OBJECTS_PER_PAGE;
        let total = self.geometry.slab_count() as usize * pages_per_slab;
        let (tree, refs) = self.read_tree(objects, OBJECT_TABLE_OWNER, total)?;
        let mut buf = Box::new([0u8; BLOCK_BYTES]);
        for (g, r) in refs.iter().enumerate() {
            if r.is_none() {
                continue;
            }
            let (s, p) = ((g / pages_per_slab) as u32, g % pages_per_slab);
            let (_, payload) =
                self.read_page(&mut buf, PageKind::Objects, r, u64::from(s), p as u64)?;
            let mut reader = Reader::new("slab object page", payload);
            let mut slab = self.depot.slab(s).lock();
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
        *self.checkpointer.count_dirs() = tree;
        Ok(())
    }

    /// Load one volume's block map.
    pub(crate) fn load_map(&self, record: &VolumeRecord, vol: &VolumeState) -> Result<()> {
        let pages_len = vol.pages.read().len();
        let (tree, refs) = self.read_tree(&record.map, record.id, pages_len)?;
        let mut buf = Box::new([0u8; BLOCK_BYTES]);
        let pages = vol.pages.read();
        for (p, r) in refs.iter().enumerate() {
            if r.is_none() {
                continue;
            }
            let (_, payload) = self.read_page(&mut buf, PageKind::Map, r, record.id, p as u64)?;
            let mut reader = Reader::new("block map page", payload);
            if let Some(page) = pages.get(p) {
                let mut page = page.lock();
                let mut entries = Box::new([0u64; ENTRIES_PER_PAGE as usize]);
                for e in entries.iter_mut() {
                    *e = reader.u64()?;
                }
                page.entries = Some(entries);
                page.durable = *r;
                page.dirty = false;
            }
        }
        *vol.dirs.lock() = tree;
        Ok(())
    }

    /// Make the next checkpoint the upgrade of a loaded version-1 pool: every page
    /// dirty (so all are written in version 2, to free slots), no durable version-2
    /// reference yet, and every version-1 slot retired once that checkpoint is
    /// durable. Refused, with nothing written, when the page store has not the free
    /// slots the version-2 image needs beside the version-1 one.
    pub(crate) fn prepare_upgrade(&self) -> Result<()> {
        let needed = self.upgrade_pages();
        let (free, v1_slots) = {
            let store = self.checkpointer.page_store();
            (store.free_slots(), store.used_slots())
        };
        if needed > free {
            return Err(EngineError::Refused(format!(
                "this pool is format version 1 and its upgrade to version 2 needs {needed} \
                 free metadata page slots beside its {} version-1 pages, but the page store \
                 has {free}: nothing was written. Open it read-only, or copy its volumes \
                 to a new pool",
                v1_slots.len()
            )));
        }
        tracing::info!(
            "upgrading the pool from format version 1 to 2: {needed} pages to write, \
             {free} slots free"
        );
        self.checkpointer.free_after_next(v1_slots);
        self.checkpointer.super_block().catalog.clear();
        *self.checkpointer.count_dirs() = DirTree::default();
        *self.checkpointer.fp_dirs() = DirTree::default();
        for slab in self.depot.iter() {
            slab.lock().mark_all_dirty();
        }
        for vol in self.volumes.all() {
            *vol.dirs.lock() = DirTree::default();
            for page in vol.pages.read().iter() {
                let mut page = page.lock();
                page.durable = PageRef::NONE;
                page.dirty = page.entries.is_some();
            }
        }
        Ok(())
    }

    /// Pages the version-2 image of the loaded state takes: map, count and
    /// fingerprint pages, the directories above them, and the catalog.
    fn upgrade_pages(&self) -> u64 {
        // Every level of a tree, and its top list in the catalog. A tree past the
        // depth bound fails the checkpoint itself; here it counts as one level.
        let shape = |pages: u64| {
            level_sizes(pages).unwrap_or_else(|| vec![pages.div_ceil(REFS_PER_DIR_PAGE as u64)])
        };
        let dirs = |pages: u64| shape(pages).iter().sum::<u64>();
        let top = |pages: u64| 8 + 16 * shape(pages).last().copied().unwrap_or(0);
        let mut pages = 0u64;
        let mut catalog_bytes = 16u64;
        let (mut counts, mut fps) = (0u64, 0u64);
        for slab in self.depot.iter() {
            let slab = slab.lock();
            let objects = slab.objects() as usize;
            let used = |table: ObjTable| {
                (0..objects.div_ceil(table.records_per_page()))
                    .filter(|&k| slab.table_page_held(table, k))
                    .count() as u64
            };
            pages += used(ObjTable::Counts) + used(ObjTable::Fingerprints);
            counts += objects.div_ceil(COUNTS_PER_PAGE) as u64;
            fps += objects.div_ceil(FINGERPRINTS_PER_PAGE) as u64;
        }
        pages += dirs(counts) + dirs(fps);
        catalog_bytes += top(counts) + top(fps);
        for vol in self.volumes.all() {
            let map = vol.pages.read();
            pages += map.iter().filter(|p| p.lock().entries.is_some()).count() as u64;
            pages += dirs(map.len() as u64);
            catalog_bytes += 40 + vol.name().len() as u64 + top(map.len() as u64);
        }
        pages + catalog_bytes.div_ceil(PAGE_PAYLOAD_BYTES as u64)
    }
}
