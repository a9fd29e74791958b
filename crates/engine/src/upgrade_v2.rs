//! The upgrade of a version-2 pool to version 3 (`docs/format.md`, "Upgrade from
//! version 2"), prepared at a read-write open: every directory page is written
//! anew, twice (its parent's twinned reference names both copies), the catalog in
//! version 3, and the super block as version 3 — by the open's checkpoint and one
//! more, so both super block copies are version 3 (version-2 code refuses the pool
//! by its version) before the version-2 directory pages are freed. Table pages
//! (map, count, fingerprint, counters) keep their version-2 pages: their layout
//! did not change.
//!
//! Crash safety is the deferred frees': the first checkpoint retires the version-2
//! directory pages, which stay untouched until the second is durable; a crash
//! between them opens from either copy (the version-2 older copy's pages are held
//! by `older_copy.rs` at the next open).

use crate::inner::Inner;
use crate::metadata_room::directory_pages;
use crate::slab::ObjTable;
use crate::{EngineError, Result};
use fewerbytes_format::dir_tree::level_sizes;
use fewerbytes_format::page::{PAGE_PAYLOAD_BYTES, TWIN_REF_BYTES};
use fewerbytes_format::FORMAT_VERSION;

/// Make the next checkpoint write every directory page of a loaded version-2 pool
/// in version 3. Refused, with nothing written and the numbers, when the free slots
/// and free data blocks together cannot hold the new directory pages (two copies
/// each) and two catalogs beside the version-2 ones.
pub(crate) fn prepare_upgrade_v2(inner: &Inner) -> Result<()> {
    let needed = upgrade_pages(inner);
    let free = inner.checkpointer.page_store().free_slots();
    let free_blocks = inner.depot.free_blocks();
    if needed > free.saturating_add(free_blocks) {
        return Err(EngineError::Refused(format!(
            "this pool is format version 2 and its upgrade to version {FORMAT_VERSION} \
             needs {needed} metadata pages (two copies of every directory page) beside its \
             version-2 pages, but the page store has {free} free slots and the data region \
             {free_blocks} free blocks: nothing was written. Open it read-only, or copy its \
             volumes to a new pool"
        )));
    }
    tracing::info!(
        "upgrading the pool from format version 2 to {FORMAT_VERSION}: {needed} pages to \
         write, {free} slots free"
    );
    let mut retired = Vec::new();
    inner.checkpointer.count_dirs().rewrite_all(&mut retired);
    inner.checkpointer.fp_dirs().rewrite_all(&mut retired);
    for vol in inner.volumes.all() {
        vol.dirs().rewrite_all(&mut retired);
    }
    // Retired by the first checkpoint (with the level-1 pages it rewrites), so
    // freed once the second is durable.
    inner.checkpointer.free_after_next(retired);
    Ok(())
}

/// Pages the upgrade writes before the version-2 directory pages are freed: every
/// directory page over the pages written, twice, and the catalog and counters page
/// in each of the two checkpoints.
fn upgrade_pages(inner: &Inner) -> u64 {
    let top = |pages: u64| {
        let top = level_sizes(pages).and_then(|s| s.last().copied());
        8 + TWIN_REF_BYTES as u64 * top.unwrap_or(0)
    };
    let mut pages = 0u64;
    let mut catalog_bytes = 16u64;
    for table in [ObjTable::Counts, ObjTable::Fingerprints] {
        let mut written = Vec::new();
        let per_slab = inner.depot.table_pages_per_slab(table);
        // Slabs never touched have no durable page.
        for (s, slab) in inner.depot.touched() {
            let slab = slab.lock();
            written.extend(
                slab.durable_table_pages(table)
                    .map(|k| u64::from(s) * per_slab + k as u64),
            );
        }
        let total = u64::from(inner.depot.count()) * per_slab;
        pages += directory_pages(&written, total);
        catalog_bytes += top(total);
    }
    for vol in inner.volumes.all() {
        let map = vol.map_pages();
        let written: Vec<u64> = map
            .iter()
            .filter(|(_, page)| !page.lock().durable().is_none())
            .map(|(p, _)| p)
            .collect();
        pages += directory_pages(&written, map.len());
        catalog_bytes += 40 + vol.name().len() as u64 + top(map.len());
    }
    let catalog_and_counters = catalog_bytes.div_ceil(PAGE_PAYLOAD_BYTES as u64) + 1;
    pages + 2 * catalog_and_counters
}
