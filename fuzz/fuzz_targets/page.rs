//! A metadata page: its header checks, then its payload read as the engine reads it
//! (object records, map entries and their locations, directory slots).
//!
//! Input: a flags byte, then the 4 KiB page. Flag bit 0 re-seals the crc; bit 1
//! expects the nonce and slot the page itself names (so those checks pass and the
//! fuzzer goes deeper); bits 2-3 pick the kind expected.
#![no_main]

use fewerbytes_format::location::{Location, MapEntry};
use fewerbytes_format::page::{decode_page, ObjectRecord, PageKind, OBJECTS_PER_PAGE};
use fewerbytes_format::{Reader, BLOCK_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let mut page = rest.to_vec();
    if flags & 1 != 0 && page.len() == BLOCK_BYTES {
        let mut b = [0u8; BLOCK_BYTES];
        b.copy_from_slice(&page);
        fewerbytes_fuzz::reseal_block(&mut b);
        page = b.to_vec();
    }
    let (nonce, slot) = if flags & 2 != 0 {
        (
            fewerbytes_fuzz::u64_at(&page, 16),
            fewerbytes_fuzz::u64_at(&page, 24),
        )
    } else {
        (0, 0)
    };
    let kind = match (flags >> 2) & 3 {
        0 => PageKind::Map,
        1 => PageKind::Objects,
        2 => PageKind::Directory,
        _ => PageKind::Catalog,
    };
    let Ok((header, payload)) = decode_page(&page, kind, nonce, slot) else {
        return;
    };
    assert_eq!(header.kind, kind);
    let mut r = Reader::new("payload", payload);
    match kind {
        PageKind::Objects => {
            for _ in 0..OBJECTS_PER_PAGE {
                let rec = ObjectRecord::decode(&mut r).expect("a page holds whole records");
                if let Ok(loc) = Location::decode(rec.location) {
                    let (_, n) = loc.blocks();
                    assert!(n == 1 || n == 2);
                    assert!(loc.stored_bytes() <= BLOCK_BYTES as u64);
                }
            }
        }
        PageKind::Map => {
            while let Ok(raw) = r.u64() {
                assert_eq!(MapEntry::decode(raw).encode(), raw);
            }
        }
        PageKind::Directory => while r.u32().is_ok() {},
        PageKind::Catalog => {
            let used = payload.get(..header.count as usize).unwrap_or(payload);
            let _ = fewerbytes_format::catalog::Catalog::decode(used);
        }
    }
});
