//! The catalog stream. A catalog that decodes must encode back to one that decodes
//! to the same value.
#![no_main]

use fewerbytes_format::catalog::Catalog;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(catalog) = Catalog::decode(data) {
        let again = catalog.encode();
        assert_eq!(
            Catalog::decode(&again).as_ref(),
            Ok(&catalog),
            "catalog round trip"
        );
    }
});
