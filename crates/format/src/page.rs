//! Metadata pages: the 4 KiB unit of the page store (block-map pages, object pages
//! of version 1, count and fingerprint pages of version 2, directory pages, catalog
//! pages). Each names itself: pool nonce, its own slot, the checkpoint generation
//! that wrote it, its kind, owner and index. In version 2 each is also named by its
//! parent: a [`PageRef`] holds its address, crc and generation. In version 3 a
//! directory page is written twice, byte for byte, and its parent's *twinned
//! reference* names both addresses.

use crate::{
    check_nonce, open_block, seal_checksum, FormatError, Reader, Writer, BLOCK_BYTES,
    FORMAT_VERSION, FORMAT_VERSION_1, FORMAT_VERSION_2,
};

/// "FBPG".
pub const PAGE_MAGIC: u32 = 0x4750_4246;
/// Bytes of the page header.
pub const PAGE_HEADER_BYTES: usize = 64;
/// Bytes of payload in a page.
pub const PAGE_PAYLOAD_BYTES: usize = BLOCK_BYTES - PAGE_HEADER_BYTES;
/// Block-map entries per map page (8 bytes each).
pub const MAP_ENTRIES_PER_PAGE: usize = PAGE_PAYLOAD_BYTES / 8;
/// Bytes of one object record.
pub const OBJECT_RECORD_BYTES: usize = 48;
/// Object records per object page.
pub const OBJECTS_PER_PAGE: usize = PAGE_PAYLOAD_BYTES / OBJECT_RECORD_BYTES;
/// Page-store slots per directory page of version 1 (u32 each).
pub const SLOTS_PER_DIR_PAGE: usize = PAGE_PAYLOAD_BYTES / 4;
/// Bytes of a page reference (version 2).
pub const PAGE_REF_BYTES: usize = 16;
/// Page references per directory page of version 2, and per level-1 directory page
/// of version 3 (whose children, table pages, have one copy).
pub const REFS_PER_DIR_PAGE: usize = PAGE_PAYLOAD_BYTES / PAGE_REF_BYTES;
pub use crate::twin_ref::{refs_per_dir_page, TWIN_REFS_PER_DIR_PAGE, TWIN_REF_BYTES};
/// Most directory levels of a table: a directory page's header holds its level, 1 to
/// this (the tree's shape: [`crate::dir_tree`]).
pub const MAX_DEPTH: u32 = 4;
/// Bytes of one count record (version 2): location u64, refcount u32.
pub const COUNT_RECORD_BYTES: usize = 12;
/// Count records per object count page (version 2).
pub const COUNTS_PER_PAGE: usize = PAGE_PAYLOAD_BYTES / COUNT_RECORD_BYTES;
/// Bytes of a fingerprint.
pub const FINGERPRINT_BYTES: usize = 32;
/// Fingerprints per fingerprint page (version 2).
pub const FINGERPRINTS_PER_PAGE: usize = PAGE_PAYLOAD_BYTES / FINGERPRINT_BYTES;
/// Address bit 63 of a page reference: the page is in the data region, bits 0–62
/// its data block number (PBN). A page there records this whole address (bit 63
/// included) in its header's `slot` field.
pub const ADDRESS_DATA_REGION: u64 = 1 << 63;
const CRC_OFFSET: usize = 4;

const _: () = assert!(
    MAP_ENTRIES_PER_PAGE * 8 == PAGE_PAYLOAD_BYTES,
    "map entries fill the payload exactly"
);
const _: () = assert!(
    OBJECTS_PER_PAGE * OBJECT_RECORD_BYTES == PAGE_PAYLOAD_BYTES,
    "object records fill the payload exactly"
);
const _: () = assert!(
    COUNTS_PER_PAGE * COUNT_RECORD_BYTES == PAGE_PAYLOAD_BYTES
        && COUNTS_PER_PAGE.is_multiple_of(OBJECTS_PER_PAGE),
    "count records fill the payload, and a count page covers whole v1 object pages"
);
const _: () = assert!(
    FINGERPRINTS_PER_PAGE * FINGERPRINT_BYTES == PAGE_PAYLOAD_BYTES,
    "fingerprints fill the payload exactly"
);
const _: () = assert!(
    REFS_PER_DIR_PAGE * PAGE_REF_BYTES == PAGE_PAYLOAD_BYTES,
    "page references fill the payload exactly"
);
/// What a page holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageKind {
    /// Block-map entries of one volume.
    Map = 1,
    /// Object records of one slab.
    Objects = 2,
    /// References of a table's pages, or (above level 1) of directory pages.
    Directory = 3,
    /// A piece of the catalog stream.
    Catalog = 4,
    /// Locations and reference counts of one slab's objects (version 2).
    Counts = 5,
    /// Fingerprints of one slab's objects (version 2).
    Fingerprints = 6,
    /// The pool's cumulative counters, kept across restarts (version 2; `counters.rs`).
    Counters = 7,
}

impl PageKind {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(PageKind::Map),
            2 => Some(PageKind::Objects),
            3 => Some(PageKind::Directory),
            4 => Some(PageKind::Catalog),
            5 => Some(PageKind::Counts),
            6 => Some(PageKind::Fingerprints),
            7 => Some(PageKind::Counters),
            _ => None,
        }
    }
    /// A name for messages.
    pub fn name(self) -> &'static str {
        match self {
            PageKind::Map => "block map page",
            PageKind::Objects => "slab object page",
            PageKind::Directory => "directory page",
            PageKind::Catalog => "catalog page",
            PageKind::Counts => "object count page",
            PageKind::Fingerprints => "fingerprint page",
            PageKind::Counters => "counters page",
        }
    }
    /// Whether pages of this kind exist in format `version`.
    pub fn in_version(self, version: u32) -> bool {
        match self {
            PageKind::Map | PageKind::Directory | PageKind::Catalog => true,
            PageKind::Objects => version == FORMAT_VERSION_1,
            PageKind::Counts | PageKind::Fingerprints | PageKind::Counters => {
                version >= FORMAT_VERSION_2
            }
        }
    }
}

/// A parent's pointer to a metadata page (version 2): where it is, and the crc and
/// generation it was written with, so a stale or misplaced page is caught by the
/// parent even though it passes its own checks. Version-1 pointers decode into this
/// with only the address set (see [`PageRef::slot_only`]). A twinned reference
/// (version 3, of a directory page) also names the page's second copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageRef {
    /// Bit 63: region (0 page store, 1 data region); bits 0–62: slot or PBN. 0: none.
    /// The page's header names this address (both copies' headers do).
    pub address: u64,
    /// The page's crc field as written.
    pub crc: u32,
    /// The low 32 bits of the page's generation.
    pub generation: u32,
    /// Where the second copy of the page is, encoded as `address`; 0 for a page with
    /// one copy (every page but a version-3 directory page).
    pub twin: u64,
}

impl PageRef {
    /// No page.
    pub const NONE: PageRef = PageRef {
        address: 0,
        crc: 0,
        generation: 0,
        twin: 0,
    };
    /// A version-1 pointer: a slot, nothing to check against.
    pub fn slot_only(slot: u32) -> Self {
        PageRef {
            address: u64::from(slot),
            ..PageRef::NONE
        }
    }
    /// The addresses its page is at: the address, then the twin's if it has one.
    pub fn addresses(&self) -> impl Iterator<Item = u64> {
        let twin = (!self.is_none() && self.twin != 0).then_some(self.twin);
        (!self.is_none())
            .then_some(self.address)
            .into_iter()
            .chain(twin)
    }
    /// Whether it points to no page.
    pub fn is_none(&self) -> bool {
        self.address == 0
    }
    /// The page-store slot it names, or `None` for a data-region address.
    pub fn page_store_slot(&self) -> Option<u64> {
        (self.address & ADDRESS_DATA_REGION == 0).then_some(self.address)
    }
    /// The data block (PBN) it names, or `None` for a page-store address.
    pub fn data_block(&self) -> Option<u64> {
        (self.address & ADDRESS_DATA_REGION != 0).then_some(self.address & !ADDRESS_DATA_REGION)
    }
    /// Encode into 16 bytes (a reference of one copy: the twin is not kept).
    pub fn encode(&self, w: &mut Writer<'_>) {
        w.u64(self.address);
        w.u32(self.crc);
        w.u32(self.generation);
    }
    /// Decode 16 bytes.
    pub fn decode(r: &mut Reader<'_>) -> Result<Self, FormatError> {
        Ok(PageRef {
            address: r.u64()?,
            crc: r.u32()?,
            generation: r.u32()?,
            twin: 0,
        })
    }
}

/// The low 32 bits of a generation, as page references hold it.
pub fn ref_generation(generation: u64) -> u32 {
    (generation & u64::from(u32::MAX)) as u32
}

/// The self-description every page carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageHeader {
    /// Format version of the pool that wrote it (1 or 2).
    pub version: u32,
    /// What the page holds.
    pub kind: PageKind,
    /// Level of a directory page in its table's tree (version 2: 1 holds table
    /// pages, *k* holds level-(*k* − 1) directory pages); 0 for every other page and
    /// for every version-1 page.
    pub level: u8,
    /// Kind-specific count (entries used, or payload bytes for catalog pages).
    pub count: u32,
    /// The pool's nonce.
    pub nonce: u64,
    /// The page-store slot it was written to.
    pub slot: u64,
    /// The checkpoint generation that wrote it.
    pub generation: u64,
    /// Owner: volume id (map), slab (objects), table id (directory), 0 (catalog).
    pub owner: u64,
    /// Index of the page within its owner.
    pub index: u64,
}

/// Encode a page: header, then `payload` (at most `PAGE_PAYLOAD_BYTES`), zero-padded.
/// Returns its crc, which a version-2 parent's [`PageRef`] holds.
pub fn encode_page(header: &PageHeader, payload: &[u8], out: &mut [u8; BLOCK_BYTES]) -> u32 {
    out.fill(0);
    let mut w = Writer::new(out);
    w.u32(PAGE_MAGIC);
    w.u32(0);
    w.u8(header.version as u8);
    w.u8(header.kind as u8);
    w.u8(header.level);
    w.u8(0);
    w.u32(header.count);
    w.u64(header.nonce);
    w.u64(header.slot);
    w.u64(header.generation);
    w.u64(header.owner);
    w.u64(header.index);
    w.u64(0);
    debug_assert_eq!(w.pos(), PAGE_HEADER_BYTES);
    let n = payload.len().min(PAGE_PAYLOAD_BYTES);
    w.put(payload.get(..n).unwrap_or(payload));
    seal_checksum(out, CRC_OFFSET)
}

/// Decode and verify a page read from `slot`, expecting `kind` and the pool's `nonce`.
pub fn decode_page(
    bytes: &[u8],
    kind: PageKind,
    nonce: u64,
    slot: u64,
) -> Result<(PageHeader, &[u8]), FormatError> {
    let what = kind.name();
    let mut r = open_block(what, bytes, BLOCK_BYTES, PAGE_MAGIC)?;
    r.seek(8);
    let version = u32::from(r.u8()?);
    if !(FORMAT_VERSION_1..=FORMAT_VERSION).contains(&version) {
        return Err(FormatError::BadVersion {
            what,
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let found_kind = r.u8()?;
    if PageKind::from_u8(found_kind) != Some(kind) || !kind.in_version(version) {
        return Err(FormatError::Invalid {
            what,
            reason: format!("page kind {found_kind}, expected {}", kind as u8),
        });
    }
    let level = r.u8()?;
    let reserved = r.u8()?;
    let levelled = version >= FORMAT_VERSION_2 && kind == PageKind::Directory;
    let level_ok = if levelled {
        (1..=MAX_DEPTH).contains(&u32::from(level))
    } else {
        level == 0
    };
    if !level_ok || reserved != 0 {
        return Err(FormatError::Invalid {
            what,
            reason: format!("directory level {level} (reserved byte {reserved})"),
        });
    }
    let count = r.u32()?;
    check_nonce(what, r.u64()?, nonce)?;
    let found_slot = r.u64()?;
    if found_slot != slot {
        return Err(FormatError::WrongAddress {
            what,
            found: found_slot,
            expected: slot,
        });
    }
    let generation = r.u64()?;
    let owner = r.u64()?;
    let index = r.u64()?;
    r.seek(PAGE_HEADER_BYTES);
    let payload = r.take(PAGE_PAYLOAD_BYTES)?;
    Ok((
        PageHeader {
            version,
            kind,
            level,
            count,
            nonce,
            slot,
            generation,
            owner,
            index,
        },
        payload,
    ))
}

/// Decode and verify a page through its parent's reference (version 2 and 3): the
/// page's own checks (its header's `slot` must be the reference's whole address, a
/// data-region address included), then its crc and generation against the
/// reference's. Both copies of a twinned page are checked this way: the second
/// copy, read from the reference's `twin`, is byte for byte the first, so its header
/// names the reference's `address` too. Whether a data-region address may appear at
/// all (super block flags bit 3) is the reader's check, and which page versions a
/// pool may hold is [`page_version_allowed`].
pub fn decode_page_ref<'a>(
    bytes: &'a [u8],
    kind: PageKind,
    nonce: u64,
    reference: &PageRef,
) -> Result<(PageHeader, &'a [u8]), FormatError> {
    let what = kind.name();
    let slot = reference.address;
    let (header, payload) = decode_page(bytes, kind, nonce, slot)?;
    let mut r = Reader::new(what, bytes);
    r.seek(CRC_OFFSET);
    let found_crc = r.u32()?;
    let found_generation = ref_generation(header.generation);
    if header.version == FORMAT_VERSION_1
        || found_crc != reference.crc
        || found_generation != reference.generation
    {
        return Err(FormatError::StalePage {
            what,
            found_crc,
            expected_crc: reference.crc,
            found_generation,
            expected_generation: reference.generation,
        });
    }
    Ok((header, payload))
}

/// Whether a pool of format `pool_version` may hold a page of `kind` written in
/// `page_version`: its own version, except that a version-3 pool keeps the table
/// pages (map, count, fingerprint, counters) its upgrade from version 2 did not
/// rewrite; its directory and catalog pages are all version 3 (the upgrade rewrote
/// every one, `docs/format.md`, "Upgrade from version 2").
pub fn page_version_allowed(pool_version: u32, kind: PageKind, page_version: u32) -> bool {
    match kind {
        PageKind::Directory | PageKind::Catalog => page_version == pool_version,
        _ if pool_version == FORMAT_VERSION => {
            page_version == FORMAT_VERSION || page_version == FORMAT_VERSION_2
        }
        _ => page_version == pool_version,
    }
}

/// One count record (12 bytes, version 2): the part of an object record that
/// changes with references.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CountRecord {
    /// Encoded [`crate::location::Location`]; meaningless when `refcount == 0`.
    pub location: u64,
    /// References from block maps. 0 means the slot is free.
    pub refcount: u32,
}

impl CountRecord {
    /// Encode into 12 bytes.
    pub fn encode(&self, w: &mut Writer<'_>) {
        w.u64(self.location);
        w.u32(self.refcount);
    }
    /// Decode 12 bytes.
    pub fn decode(r: &mut Reader<'_>) -> Result<Self, FormatError> {
        Ok(CountRecord {
            location: r.u64()?,
            refcount: r.u32()?,
        })
    }
}

/// One slab object record (48 bytes): where a stored block or fragment is, how many
/// block-map entries reference it, and its fingerprint (kept so dedup advice is
/// verified without reading data).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ObjectRecord {
    /// Encoded [`crate::location::Location`]; meaningless when `refcount == 0`.
    pub location: u64,
    /// References from block maps. 0 means the slot is free.
    pub refcount: u32,
    /// Keyed BLAKE3-256 of the uncompressed 4 KiB block.
    pub fingerprint: [u8; 32],
}

impl ObjectRecord {
    /// Encode into 48 bytes.
    pub fn encode(&self, w: &mut Writer<'_>) {
        w.u64(self.location);
        w.u32(self.refcount);
        w.u32(0);
        w.put(&self.fingerprint);
    }
    /// Decode 48 bytes.
    pub fn decode(r: &mut Reader<'_>) -> Result<Self, FormatError> {
        let location = r.u64()?;
        let refcount = r.u32()?;
        r.u32()?;
        let fingerprint = r.bytes32()?;
        Ok(ObjectRecord {
            location,
            refcount,
            fingerprint,
        })
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
    fn page_round_trips_and_detects_every_flipped_bit_in_its_header() {
        let mut page = [0u8; BLOCK_BYTES];
        encode_page(&header(), &[5u8; 100], &mut page);
        let (h, payload) = decode_page(&page, PageKind::Map, 77, 9).unwrap();
        assert_eq!(h, header());
        assert_eq!(payload[..100], [5u8; 100]);
        for bit in 0..(PAGE_HEADER_BYTES * 8) {
            let mut bad = page;
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(
                decode_page(&bad, PageKind::Map, 77, 9).is_err(),
                "bit {bit} flip undetected"
            );
        }
    }

    #[test]
    fn a_page_is_checked_against_its_reference() {
        let mut page = [0u8; BLOCK_BYTES];
        let crc = encode_page(&header(), &[5u8; 10], &mut page);
        let good = PageRef {
            address: 9,
            crc,
            generation: 4,
            twin: 0,
        };
        assert!(decode_page_ref(&page, PageKind::Map, 77, &good).is_ok());
        // The same slot holding an older page (a lost write): its own checks pass.
        let mut older = [0u8; BLOCK_BYTES];
        encode_page(
            &PageHeader {
                generation: 3,
                ..header()
            },
            &[6u8; 10],
            &mut older,
        );
        assert!(decode_page(&older, PageKind::Map, 77, 9).is_ok());
        assert!(matches!(
            decode_page_ref(&older, PageKind::Map, 77, &good),
            Err(FormatError::StalePage {
                found_generation: 3,
                expected_generation: 4,
                ..
            })
        ));
        let wrong_crc = PageRef { crc: !crc, ..good };
        assert!(matches!(
            decode_page_ref(&page, PageKind::Map, 77, &wrong_crc),
            Err(FormatError::StalePage { .. })
        ));
        // A page-store page named by a data-region address (or the reverse) fails
        // its slot check: the page records the whole address it was written to.
        let data_region = PageRef {
            address: ADDRESS_DATA_REGION | 9,
            ..good
        };
        assert!(matches!(
            decode_page_ref(&page, PageKind::Map, 77, &data_region),
            Err(FormatError::WrongAddress { .. })
        ));
        let mut in_data = [0u8; BLOCK_BYTES];
        let crc = encode_page(
            &PageHeader {
                slot: ADDRESS_DATA_REGION | 9,
                ..header()
            },
            &[5u8; 10],
            &mut in_data,
        );
        let r = PageRef { crc, ..data_region };
        assert!(decode_page_ref(&in_data, PageKind::Map, 77, &r).is_ok());
        assert!(decode_page_ref(&in_data, PageKind::Map, 77, &PageRef { crc, ..good }).is_err());
    }

    #[test]
    fn version_1_pages_still_decode_but_not_through_a_reference() {
        let v1 = PageHeader {
            version: FORMAT_VERSION_1,
            kind: PageKind::Objects,
            ..header()
        };
        let mut page = [0u8; BLOCK_BYTES];
        let crc = encode_page(&v1, &[], &mut page);
        assert_eq!(decode_page(&page, PageKind::Objects, 77, 9).unwrap().0, v1);
        let r = PageRef {
            address: 9,
            crc,
            generation: 4,
            twin: 0,
        };
        assert!(decode_page_ref(&page, PageKind::Objects, 77, &r).is_err());
        // Kind 2 does not exist in version 2, nor kinds 5-7 in version 1.
        encode_page(
            &PageHeader {
                version: FORMAT_VERSION,
                ..v1
            },
            &[],
            &mut page,
        );
        assert!(decode_page(&page, PageKind::Objects, 77, 9).is_err());
        encode_page(
            &PageHeader {
                kind: PageKind::Counts,
                ..v1
            },
            &[],
            &mut page,
        );
        assert!(decode_page(&page, PageKind::Counts, 77, 9).is_err());
    }

    #[test]
    fn a_directory_page_carries_its_level_and_no_other_page_does() {
        let mut page = [0u8; BLOCK_BYTES];
        let dir = |level| PageHeader {
            kind: PageKind::Directory,
            level,
            ..header()
        };
        for level in 1..=MAX_DEPTH as u8 {
            encode_page(&dir(level), &[], &mut page);
            let (h, _) = decode_page(&page, PageKind::Directory, 77, 9).unwrap();
            assert_eq!(h.level, level);
        }
        for level in [0, MAX_DEPTH as u8 + 1] {
            encode_page(&dir(level), &[], &mut page);
            assert!(decode_page(&page, PageKind::Directory, 77, 9).is_err());
        }
        encode_page(
            &PageHeader {
                level: 1,
                ..header()
            },
            &[],
            &mut page,
        );
        assert!(decode_page(&page, PageKind::Map, 77, 9).is_err());
    }

    #[test]
    fn page_refs_round_trip() {
        let r = PageRef {
            address: ADDRESS_DATA_REGION | 12345,
            crc: 0xdead_beef,
            generation: 7,
            twin: 0,
        };
        let mut buf = [0u8; PAGE_REF_BYTES];
        r.encode(&mut Writer::new(&mut buf));
        assert_eq!(PageRef::decode(&mut Reader::new("ref", &buf)).unwrap(), r);
        assert_eq!(r.page_store_slot(), None);
        assert_eq!(PageRef::slot_only(5).page_store_slot(), Some(5));
    }

    #[test]
    fn misplaced_page_is_refused() {
        let mut page = [0u8; BLOCK_BYTES];
        encode_page(&header(), &[], &mut page);
        assert!(matches!(
            decode_page(&page, PageKind::Map, 77, 10),
            Err(FormatError::WrongAddress { .. })
        ));
        assert!(matches!(
            decode_page(&page, PageKind::Map, 78, 9),
            Err(FormatError::WrongPool { .. })
        ));
    }
}
