//! Block-map entries and object locations: every 8 bytes of input is one word.
#![no_main]

use fewerbytes_format::location::{Location, MapEntry};
use fewerbytes_format::BLOCK_BYTES;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for word in data.chunks_exact(8) {
        let raw = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        assert_eq!(MapEntry::decode(raw).encode(), raw, "map entry round trip");
        if let Ok(loc) = Location::decode(raw) {
            assert_eq!(
                Location::decode(loc.encode()),
                Ok(loc),
                "location round trip"
            );
            let (_, blocks) = loc.blocks();
            assert!(
                blocks == 1 || blocks == 2,
                "a location touches one or two blocks"
            );
            assert!(loc.stored_bytes() <= BLOCK_BYTES as u64);
        }
    }
});
