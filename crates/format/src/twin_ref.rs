//! Twinned references (format version 3): a parent's pointer to a directory page,
//! which is written twice, naming both copies (`docs/format.md`, "Version 3: two
//! copies of every directory page"), and the fan-out of directory pages they give.

use crate::page::{PageRef, PAGE_PAYLOAD_BYTES, REFS_PER_DIR_PAGE};
use crate::{FormatError, Reader, Writer, FORMAT_VERSION};

/// Bytes of a twinned reference (version 3): address, twin address, crc, generation.
pub const TWIN_REF_BYTES: usize = 24;
/// Twinned references per directory page of level 2 and above (version 3): 168, the
/// payload's 4,032 bytes hold exactly that many.
pub const TWIN_REFS_PER_DIR_PAGE: usize = PAGE_PAYLOAD_BYTES / TWIN_REF_BYTES;
const _: () = assert!(
    TWIN_REFS_PER_DIR_PAGE == 168 && TWIN_REFS_PER_DIR_PAGE * TWIN_REF_BYTES == PAGE_PAYLOAD_BYTES,
    "twinned references fill the payload exactly"
);

/// References a directory page of `level` holds in format `version` (2 or 3): 252
/// of table pages at level 1, and in version 3, 168 twinned references of directory
/// pages above it.
pub fn refs_per_dir_page(version: u32, level: u8) -> usize {
    if version >= FORMAT_VERSION && level >= 2 {
        TWIN_REFS_PER_DIR_PAGE
    } else {
        REFS_PER_DIR_PAGE
    }
}

impl PageRef {
    /// Encode into 24 bytes (a twinned reference: address, twin, crc, generation).
    pub fn encode_twinned(&self, w: &mut Writer<'_>) {
        w.u64(self.address);
        w.u64(self.twin);
        w.u32(self.crc);
        w.u32(self.generation);
    }
    /// Decode 24 bytes of a twinned reference. A reference that names a page must
    /// name two different addresses, and one that names none, no twin.
    pub fn decode_twinned(r: &mut Reader<'_>) -> Result<Self, FormatError> {
        let found = PageRef {
            address: r.u64()?,
            twin: r.u64()?,
            crc: r.u32()?,
            generation: r.u32()?,
        };
        let whole = if found.is_none() {
            found == PageRef::NONE
        } else {
            found.twin != 0 && found.twin != found.address
        };
        if !whole {
            return Err(FormatError::Invalid {
                what: "twinned page reference",
                reason: format!(
                    "address {:#x} with twin {:#x}: a page has two different addresses, \
                     and no page none",
                    found.address, found.twin
                ),
            });
        }
        Ok(found)
    }
    /// Encode twinned (24 bytes) or not (16): a version-3 directory page of level 2
    /// and above, and a version-3 catalog's top lists, hold twinned references.
    pub fn encode_as(&self, twinned: bool, w: &mut Writer<'_>) {
        if twinned {
            self.encode_twinned(w)
        } else {
            self.encode(w)
        }
    }
    /// Decode as [`Self::encode_as`] encodes.
    pub fn decode_as(twinned: bool, r: &mut Reader<'_>) -> Result<Self, FormatError> {
        if twinned {
            Self::decode_twinned(r)
        } else {
            Self::decode(r)
        }
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "tests fail loudly by design"
)]
mod tests {
    use super::*;
    use crate::page::{
        decode_page_ref, encode_page, page_version_allowed, PageHeader, PageKind,
        ADDRESS_DATA_REGION,
    };
    use crate::{BLOCK_BYTES, FORMAT_VERSION_2};

    fn header() -> PageHeader {
        PageHeader {
            version: FORMAT_VERSION,
            kind: PageKind::Map,
            level: 0,
            count: 3,
            nonce: 77,
            slot: 9,
            generation: 4,
            owner: 1,
            index: 2,
        }
    }

    #[test]
    fn twinned_refs_round_trip_and_name_two_different_addresses() {
        let r = PageRef {
            address: ADDRESS_DATA_REGION | 12345,
            crc: 0xdead_beef,
            generation: 7,
            twin: 44,
        };
        let mut buf = [0u8; TWIN_REF_BYTES];
        r.encode_twinned(&mut Writer::new(&mut buf));
        assert_eq!(
            PageRef::decode_twinned(&mut Reader::new("ref", &buf)).unwrap(),
            r
        );
        assert_eq!(r.addresses().collect::<Vec<_>>(), [r.address, 44]);
        assert_eq!(PageRef::NONE.addresses().count(), 0);
        let zeros = [0u8; TWIN_REF_BYTES];
        assert_eq!(
            PageRef::decode_twinned(&mut Reader::new("ref", &zeros)).unwrap(),
            PageRef::NONE
        );
        for bad in [
            PageRef { twin: 0, ..r },
            PageRef {
                twin: r.address,
                ..r
            },
            PageRef {
                twin: 5,
                ..PageRef::NONE
            },
        ] {
            bad.encode_twinned(&mut Writer::new(&mut buf));
            assert!(PageRef::decode_twinned(&mut Reader::new("ref", &buf)).is_err());
        }
        assert_eq!(refs_per_dir_page(FORMAT_VERSION, 1), 252);
        assert_eq!(refs_per_dir_page(FORMAT_VERSION, 2), 168);
        assert_eq!(refs_per_dir_page(FORMAT_VERSION_2, 3), 252);
    }

    #[test]
    fn a_twin_copy_is_checked_against_the_reference_that_names_its_first_copy() {
        let mut page = [0u8; BLOCK_BYTES];
        let crc = encode_page(
            &PageHeader {
                kind: PageKind::Directory,
                level: 2,
                ..header()
            },
            &[1u8; 24],
            &mut page,
        );
        let r = PageRef {
            address: 9,
            crc,
            generation: 4,
            twin: ADDRESS_DATA_REGION | 70,
        };
        // The same bytes at the twin's address pass through the reference.
        assert!(decode_page_ref(&page, PageKind::Directory, 77, &r).is_ok());
        // A page written for the twin's own address does not.
        let wrong = PageRef {
            address: r.twin,
            ..r
        };
        assert!(matches!(
            decode_page_ref(&page, PageKind::Directory, 77, &wrong),
            Err(FormatError::WrongAddress { .. })
        ));
        assert!(page_version_allowed(
            FORMAT_VERSION,
            PageKind::Map,
            FORMAT_VERSION_2
        ));
        assert!(!page_version_allowed(
            FORMAT_VERSION,
            PageKind::Directory,
            FORMAT_VERSION_2
        ));
        assert!(!page_version_allowed(
            FORMAT_VERSION_2,
            PageKind::Map,
            FORMAT_VERSION
        ));
    }
}
