//! At open, the pages the older super block copy reaches and the loaded image does
//! not: held (marked used) until the open's own checkpoint is durable, as the
//! deferred frees of a running pool hold them (`checkpoint.rs`). Without this, the
//! open's checkpoint would write its pages over them, and a crash before its super
//! block lands, with the newer copy then found damaged, would leave no whole copy.
//!
//! Only what differs is read: a page whose address the loaded image already holds is
//! the same page (copy-on-write never rewrites a page in place), and neither it nor
//! what is below it is read again. A page-store slot the loaded image does not use is
//! free, so holding it is safe whatever it holds; a data block is held only when it
//! still holds the page its reference names (a pool last written by an engine
//! without deferred frees may have given the block to data since). Both copies of a
//! version-3 directory page are held, each on those terms; its payload is taken
//! from whichever reads good.

use crate::inner::Inner;
use crate::page_store::address_block;
use crate::Result;
use fewerbytes_format::catalog::{Catalog, TableRoot};
use fewerbytes_format::page::{decode_page_ref, refs_per_dir_page, PageKind, PageRef};
use fewerbytes_format::superblock::SuperBlock;
use fewerbytes_format::{Reader, BLOCK_BYTES, FORMAT_VERSION, FORMAT_VERSION_1};
use std::collections::BTreeSet;

/// Hold the pages `older` (the other valid copy, one generation below the loaded
/// one) reaches beyond the loaded image: marked used now, and freed once the open's
/// checkpoint is durable. What cannot be read is left out, with a note: that copy
/// was not whole, and holding less changes nothing the loaded image needs.
pub(crate) fn hold_older_pages(inner: &Inner, older: &SuperBlock) -> Result<()> {
    let loaded_generation = inner.checkpointer.super_block().generation;
    if older.version == FORMAT_VERSION_1 || older.generation + 1 != loaded_generation {
        return Ok(());
    }
    let mut walk = OlderPages {
        inner,
        version: older.version,
        held: BTreeSet::new(),
        missing: 0,
    };
    let mut stream = Vec::new();
    for r in &older.catalog {
        match walk.visit(r, PageKind::Catalog) {
            Some(page) => {
                stream.extend_from_slice(page.payload.get(..page.count).unwrap_or_default())
            }
            None => {
                // Unreadable (or, impossibly, shared: every checkpoint writes the
                // catalog anew): its tables cannot be walked.
                stream.clear();
                break;
            }
        }
    }
    walk.visit(&older.counters, PageKind::Counters);
    stream.truncate(older.catalog_bytes as usize);
    if let Ok(catalog) = Catalog::decode(&stream) {
        walk.table(&catalog.objects, PageKind::Counts);
        walk.table(&catalog.fingerprints, PageKind::Fingerprints);
        for v in &catalog.volumes {
            walk.table(&v.map, PageKind::Map);
        }
    }
    if walk.missing > 0 {
        tracing::info!(
            "{}: {} pages of the older super block copy (generation {}) are not on the \
             device as it names them (written by an engine without deferred frees); the \
             newest copy holds everything",
            inner.devices.meta().name(),
            walk.missing,
            older.generation
        );
    }
    let held: Vec<u64> = walk.held.into_iter().collect();
    let mut store = inner.checkpointer.page_store();
    for a in &held {
        store.mark_address(*a);
    }
    drop(store);
    let before = inner.checkpointer.retire(held);
    debug_assert!(before.is_empty(), "an open holds nothing before this");
    Ok(())
}

struct OlderPages<'a> {
    inner: &'a Inner,
    /// The older copy's format version (2 or 3: its directory pages' layout).
    version: u32,
    held: BTreeSet<u64>,
    missing: u64,
}

/// A page the walk read.
struct Read {
    level: u8,
    count: usize,
    payload: Vec<u8>,
}

impl OlderPages<'_> {
    /// Hold the page `r` names (each of its copies) if the loaded image does not;
    /// return it when a copy was read good.
    fn visit(&mut self, r: &PageRef, kind: PageKind) -> Option<Read> {
        if r.is_none() || self.loaded(r.address) || self.held.contains(&r.address) {
            return None;
        }
        let mut page = None;
        for address in r.addresses() {
            let read = self.read_copy(r, address, kind);
            match &read {
                Some(_) => {
                    self.held.insert(address);
                }
                None => {
                    self.missing += 1;
                    // A free slot is safe to hold whatever it holds; a data block only
                    // when it holds this page.
                    if address_block(address).is_none() {
                        self.held.insert(address);
                    }
                }
            }
            page = page.or(read);
        }
        page
    }

    /// Read and verify the copy at `address` of the page `r` names.
    fn read_copy(&self, r: &PageRef, address: u64, kind: PageKind) -> Option<Read> {
        let g = &self.inner.geometry;
        let (device, at) = match address_block(address) {
            Some(pbn) if pbn < g.data_blocks() => (
                self.inner.devices.data(),
                g.data_offset_bytes() + pbn * BLOCK_BYTES as u64,
            ),
            None if address < g.page_slots() => (
                self.inner.devices.meta(),
                (g.pages_start_block() + address) * BLOCK_BYTES as u64,
            ),
            _ => return None,
        };
        let mut buf = vec![0u8; BLOCK_BYTES];
        device
            .read_at(&mut buf, at)
            .ok()
            .and_then(|()| decode_page_ref(&buf, kind, g.nonce(), r).ok())
            .map(|(h, payload)| Read {
                level: h.level,
                count: h.count as usize,
                payload: payload.to_vec(),
            })
    }

    /// Whether the loaded image holds this address.
    fn loaded(&self, address: u64) -> bool {
        let store = self.inner.checkpointer.page_store();
        match address_block(address) {
            Some(pbn) => store.holds_block(pbn),
            None => store.is_used(address),
        }
    }

    /// Walk a table's tree from its top list: directory pages read for the
    /// references below, table pages held without reading but in the data region.
    fn table(&mut self, root: &TableRoot, leaf: PageKind) {
        let mut dirs: Vec<PageRef> = root.top.clone();
        // Bounded: each page is visited once (`held` or loaded ones are skipped),
        // and the tree is at most four levels.
        while let Some(d) = dirs.pop() {
            let Some(page) = self.visit(&d, PageKind::Directory) else {
                continue;
            };
            let level = page.level;
            let twinned = self.version >= FORMAT_VERSION && level >= 2;
            let mut r = Reader::new("directory page", &page.payload);
            for _ in 0..refs_per_dir_page(self.version, level) {
                let Ok(child) = PageRef::decode_as(twinned, &mut r) else {
                    break;
                };
                if level > 1 {
                    dirs.push(child);
                } else if address_block(child.address).is_some() {
                    self.visit(&child, leaf);
                } else if !child.is_none()
                    && child.address < self.inner.geometry.page_slots()
                    && !self.loaded(child.address)
                {
                    self.held.insert(child.address);
                }
            }
        }
    }
}
