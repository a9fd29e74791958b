//! A metadata page: its header checks, then its payload read as the engine reads it
//! (object records, count records, fingerprints, map entries and their locations,
//! directory slots and page references), then the same page checked through a
//! version-2 page reference.
//!
//! Input: a flags byte, then the 4 KiB page. Flag bit 0 re-seals the crc; bit 1
//! expects the nonce and slot the page itself names (so those checks pass and the
//! fuzzer goes deeper); bits 2-4 pick the kind expected; bit 5 builds the reference
//! from the page's own crc and generation (so the reference check passes).
#![no_main]

use fewerbytes_format::counters::{decode_counters, MAX_COUNTERS};
use fewerbytes_format::location::{Location, MapEntry};
use fewerbytes_format::page::{
    decode_page, decode_page_ref, ref_generation, CountRecord, ObjectRecord, PageKind, PageRef,
    COUNTS_PER_PAGE, OBJECTS_PER_PAGE,
};
use fewerbytes_format::{Reader, BLOCK_BYTES};
use libfuzzer_sys::fuzz_target;

fn check_location(raw: u64) {
    if let Ok(loc) = Location::decode(raw) {
        let (_, n) = loc.blocks();
        assert!(n == 1 || n == 2);
        assert!(loc.stored_bytes() <= BLOCK_BYTES as u64);
    }
}

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
    let kind = match (flags >> 2) & 7 {
        0 => PageKind::Map,
        1 => PageKind::Objects,
        2 => PageKind::Directory,
        3 => PageKind::Catalog,
        4 => PageKind::Counts,
        5 => PageKind::Fingerprints,
        _ => PageKind::Counters,
    };
    let reference = if flags & 32 != 0 {
        PageRef {
            address: slot,
            crc: fewerbytes_fuzz::u64_at(&page, 4) as u32,
            generation: ref_generation(fewerbytes_fuzz::u64_at(&page, 32)),
            twin: 0,
        }
    } else {
        PageRef {
            address: slot,
            ..PageRef::NONE
        }
    };
    if let Ok((header, _)) = decode_page_ref(&page, kind, nonce, &reference) {
        assert_eq!(header.kind, kind);
        assert_eq!(header.slot, slot);
        assert_eq!(ref_generation(header.generation), reference.generation);
    }
    let Ok((header, payload)) = decode_page(&page, kind, nonce, slot) else {
        return;
    };
    assert_eq!(header.kind, kind);
    assert!(kind.in_version(header.version));
    let mut r = Reader::new("payload", payload);
    match kind {
        PageKind::Objects => {
            for _ in 0..OBJECTS_PER_PAGE {
                let rec = ObjectRecord::decode(&mut r).expect("a page holds whole records");
                check_location(rec.location);
            }
        }
        PageKind::Counts => {
            for _ in 0..COUNTS_PER_PAGE {
                let rec = CountRecord::decode(&mut r).expect("a page holds whole records");
                check_location(rec.location);
            }
        }
        PageKind::Fingerprints => while r.bytes32().is_ok() {},
        PageKind::Map => {
            while let Ok(raw) = r.u64() {
                assert_eq!(MapEntry::decode(raw).encode(), raw);
            }
        }
        PageKind::Directory => {
            if header.version == 1 {
                while r.u32().is_ok() {}
            } else {
                // Version 3 above level 1: twinned references (a bad one is an error,
                // never a panic).
                let twinned = header.version >= 3 && header.level >= 2;
                while PageRef::decode_as(twinned, &mut r).is_ok() {}
            }
        }
        PageKind::Counters => {
            if let Ok(values) = decode_counters(header.count, payload) {
                assert_eq!(values.len(), header.count as usize);
                assert!(values.len() <= MAX_COUNTERS);
            }
        }
        PageKind::Catalog => {
            let used = payload.get(..header.count as usize).unwrap_or(payload);
            let _ = fewerbytes_format::catalog::Catalog::decode(used);
        }
    }
});
