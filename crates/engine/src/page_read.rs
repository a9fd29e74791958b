//! Reading one metadata page by its reference: where its address lies (a page-store
//! slot or a data block, `page_place`), and the checks every page passes before it is
//! used (`read_page`, `read_page_at`: its own checksum, nonce, kind and version, the
//! owner and index it must have, and from version 2 the crc and generation its parent
//! holds). `load.rs` reads the tables through it, `dir_copies.rs` a directory page's
//! second copy, `map_damage.rs` asks where a lost page lay.
//!
//! What a page's header must name is decided here for every reader (the load, so
//! `check`, repair, `list-metadata` and `send`, which read what it loaded; and the
//! scrub, which reads the device again): [`tree_page_owner`] and [`check_names`].

use crate::inner::Inner;
use crate::page_store::address_block;
use crate::{EngineError, Result};
use fewerbytes_format::page::{
    decode_page, decode_page_ref, page_version_allowed, PageHeader, PageKind, PageRef,
    PAGE_HEADER_BYTES,
};
use fewerbytes_format::superblock::FLAG_DATA_REGION_PAGES;
use fewerbytes_format::{BLOCK_BYTES, FORMAT_VERSION_1};

/// Read the page `reference` names and verify it: its own checks, its owner and
/// index, and (version 2 and 3) the crc and generation its parent holds.
pub(crate) fn read_page<'a>(
    inner: &Inner,
    buf: &'a mut [u8; BLOCK_BYTES],
    kind: PageKind,
    reference: &PageRef,
    owner: u64,
    index: u64,
) -> Result<(PageHeader, &'a [u8])> {
    let header = read_page_at(inner, buf, kind, reference, reference.address, owner, index)?;
    Ok((header, buf.get(PAGE_HEADER_BYTES..).unwrap_or_default()))
}

/// [`read_page`] of the copy at `address` (the reference's address or its twin);
/// the payload is `buf` past the header. Every address of the reference is marked
/// used, the copy not read too.
pub(crate) fn read_page_at(
    inner: &Inner,
    buf: &mut [u8; BLOCK_BYTES],
    kind: PageKind,
    reference: &PageRef,
    address: u64,
    owner: u64,
    index: u64,
) -> Result<PageHeader> {
    let (version, generation, data_region_pages) = {
        let sb = inner.checkpointer.super_block();
        (
            sb.version,
            sb.generation,
            sb.flags & FLAG_DATA_REGION_PAGES != 0,
        )
    };
    let (device, block, corrupt) = page_place(inner, kind, address)?;
    if address_block(address).is_some() && !data_region_pages {
        return Err(corrupt(format!(
            "page address {address:#x} names a data block, but the super block does not \
             allow pages in the data region (flags bit 3)"
        )));
    }
    device.read_at(&mut buf[..], block * BLOCK_BYTES as u64)?;
    let decoded = if version == FORMAT_VERSION_1 {
        decode_page(&buf[..], kind, inner.geometry.nonce(), reference.address)
    } else {
        decode_page_ref(&buf[..], kind, inner.geometry.nonce(), reference)
    };
    let (header, _) = decoded.map_err(|e| corrupt(e.to_string()))?;
    if !page_version_allowed(version, kind, header.version) {
        return Err(corrupt(format!(
            "a version-{} page in a version-{version} pool",
            header.version
        )));
    }
    check_names(&header, owner, index, None).map_err(&corrupt)?;
    if header.generation > generation {
        return Err(corrupt(format!(
            "page generation {} is newer than the super block's",
            header.generation
        )));
    }
    let mut store = inner.checkpointer.page_store();
    for a in reference.addresses() {
        store.mark_address(a);
    }
    Ok(header)
}

/// The owner a page of volume `id`'s block-map tree names in its header (docs/format.md,
/// "Lineage"). A map page (`PageKind::Map`) names the volume's `lineage`: the id of the
/// volume the line began with, made empty. A clone, a snapshot or a rollback takes its
/// source's pages and its source's lineage whole, and every page a checkpoint writes
/// for it names that lineage too, so a page shared along a line names the same owner
/// in every tree that reaches it, and a tree's pages all name one owner. Volume ids
/// are never reused, so no volume outside the line has that id: a map page naming any
/// other owner is misplaced. A directory page names the volume's own `id` (each tree
/// has its own directory pages).
pub(crate) fn tree_page_owner(kind: PageKind, id: u64, lineage: u64) -> u64 {
    match kind {
        PageKind::Map => lineage,
        _ => id,
    }
}

/// Whether `header` names the place it was read for: `owner` (for a volume's map
/// tree, [`tree_page_owner`]), `index`, and `level` when the reader knows it. The one
/// comparison of a page's owner: every reader calls it, so a page one reader takes is
/// a page every reader takes.
pub(crate) fn check_names(
    header: &PageHeader,
    owner: u64,
    index: u64,
    level: Option<u8>,
) -> std::result::Result<(), String> {
    let level_differs = level.is_some_and(|l| l != header.level);
    if header.owner == owner && header.index == index && !level_differs {
        return Ok(());
    }
    Err(match level {
        Some(level) => format!(
            "the page names owner {} index {} level {}, expected owner {owner} index \
             {index} level {level}",
            header.owner, header.index, header.level
        ),
        None => format!(
            "the page names owner {} index {}, expected owner {owner} index {index}",
            header.owner, header.index
        ),
    })
}

/// Where the page at `address` lies: its device, the block there, and the
/// corruption report for that block. An address outside its region (the page
/// store's slots, or the data region's blocks) is corruption.
pub(crate) fn page_place(
    inner: &Inner,
    kind: PageKind,
    address: u64,
) -> Result<(
    &dyn fewerbytes_storage::Storage,
    u64,
    impl Fn(String) -> EngineError,
)> {
    let region = kind.name();
    let (device, name, block, inside) = match address_block(address) {
        Some(pbn) => (
            inner.devices.data(),
            "data",
            (inner.geometry.data_offset_bytes() / BLOCK_BYTES as u64).saturating_add(pbn),
            pbn < inner.geometry.data_blocks(),
        ),
        None => {
            let slot = address;
            (
                inner.devices.meta(),
                "metadata",
                inner.geometry.pages_start_block().saturating_add(slot),
                slot != 0 && slot < inner.geometry.page_slots(),
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
            "page address {address:#x} is outside its region"
        )));
    }
    Ok((device, block, corrupt))
}
