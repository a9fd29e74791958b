//! "One bad copy of a directory page" faults: at some crash points where no other
//! fault was made, one bit of one copy (the first or the second, chosen by seed) of
//! one top-level directory page the newest super block copy reaches reads back
//! flipped, as a bad sector would (`FaultPlan::flip_read`). Format version 3 writes
//! every directory page twice: the open reads the other copy, and every guarantee
//! of a crash still holds.

use crate::common::BLOCK;
use crate::workload::Devices;
use fewerbytes_engine::storage::{FaultPlan, FlipRead, Storage as _};
use fewerbytes_format::catalog::Catalog;
use fewerbytes_format::page::{decode_page_ref, PageKind, PageRef, ADDRESS_DATA_REGION};
use fewerbytes_format::superblock::SuperBlock;

/// One crash point in this many (among those with no other fault) also has a bad
/// copy of a directory page.
pub(crate) const BAD_COPY_EVERY: u64 = 3;

/// For one crash point in [`BAD_COPY_EVERY`] (chosen by `h`), flip a bit of one copy
/// of a top-level directory page of the newest valid super block copy's catalog.
/// Returns what was flipped, for a failure's message; `None` when the point was not
/// chosen or no directory page is reachable (a pool with no tables written yet).
pub(crate) fn flip_one_copy(devices: &Devices, h: u64) -> Option<String> {
    if !h.is_multiple_of(BAD_COPY_EVERY) {
        return None;
    }
    let meta = devices.meta.as_ref().unwrap_or(&devices.data);
    let sb = (0..2u64)
        .filter_map(|copy| {
            let mut block = vec![0u8; BLOCK];
            meta.read_at(&mut block, copy * BLOCK as u64).ok()?;
            SuperBlock::decode(&block).ok()
        })
        .max_by_key(|sb| sb.generation)?;
    // Where a page address lies: its device and byte offset.
    let place = |address: u64| {
        if address & ADDRESS_DATA_REGION != 0 {
            let pbn = address & !ADDRESS_DATA_REGION;
            (&devices.data, sb.data_offset_bytes + pbn * BLOCK as u64)
        } else {
            (meta, (sb.pages_start_block + address) * BLOCK as u64)
        }
    };
    let mut stream = Vec::new();
    for r in &sb.catalog {
        let (device, at) = place(r.address);
        let mut block = vec![0u8; BLOCK];
        device.read_at(&mut block, at).ok()?;
        let (header, payload) = decode_page_ref(&block, PageKind::Catalog, sb.nonce, r).ok()?;
        stream.extend_from_slice(payload.get(..header.count as usize)?);
    }
    stream.truncate(sb.catalog_bytes as usize);
    let catalog = Catalog::decode(&stream).ok()?;
    let tops: Vec<PageRef> = [&catalog.objects, &catalog.fingerprints]
        .into_iter()
        .chain(catalog.volumes.iter().map(|v| &v.map))
        .flat_map(|root| root.top.iter().copied())
        .filter(|r| !r.is_none() && r.twin != 0)
        .collect();
    if tops.is_empty() {
        return None;
    }
    let page = tops[((h >> 8) % tops.len() as u64) as usize];
    let second = (h >> 24) % 2 == 1;
    let address = if second { page.twin } else { page.address };
    let (device, at) = place(address);
    let byte = (h >> 32) % BLOCK as u64;
    let flip = FlipRead {
        offset_bytes: at + byte,
        mask: 1 << ((h >> 48) % 8),
    };
    device.set_plan(FaultPlan {
        flip_read: Some(flip),
        ..FaultPlan::default()
    });
    Some(format!(
        "the {} copy of a top-level directory page (address {address:#x}) reading back with \
         bits {:#04x} of byte {byte} flipped",
        if second { "second" } else { "first" },
        flip.mask
    ))
}
