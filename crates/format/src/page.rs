//! Metadata pages: the 4 KiB unit of the page store (block-map pages, slab object
//! pages, directory pages, catalog pages). Each names itself: pool nonce, its own
//! slot, the checkpoint generation that wrote it, its kind, owner and index.

use crate::{
    check_nonce, open_block, seal_checksum, FormatError, Reader, Writer, BLOCK_BYTES,
    FORMAT_VERSION,
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
/// Page-store slots per directory page (u32 each).
pub const SLOTS_PER_DIR_PAGE: usize = PAGE_PAYLOAD_BYTES / 4;
const CRC_OFFSET: usize = 4;

const _: () = assert!(
    MAP_ENTRIES_PER_PAGE * 8 == PAGE_PAYLOAD_BYTES,
    "map entries fill the payload exactly"
);
const _: () = assert!(
    OBJECTS_PER_PAGE * OBJECT_RECORD_BYTES == PAGE_PAYLOAD_BYTES,
    "object records fill the payload exactly"
);

/// What a page holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageKind {
    /// Block-map entries of one volume.
    Map = 1,
    /// Object records of one slab.
    Objects = 2,
    /// Page-store slots of a table's pages.
    Directory = 3,
    /// A piece of the catalog stream.
    Catalog = 4,
}

impl PageKind {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(PageKind::Map),
            2 => Some(PageKind::Objects),
            3 => Some(PageKind::Directory),
            4 => Some(PageKind::Catalog),
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
        }
    }
}

/// The self-description every page carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageHeader {
    /// What the page holds.
    pub kind: PageKind,
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
pub fn encode_page(header: &PageHeader, payload: &[u8], out: &mut [u8; BLOCK_BYTES]) {
    out.fill(0);
    let mut w = Writer::new(out);
    w.u32(PAGE_MAGIC);
    w.u32(0);
    w.u8(FORMAT_VERSION as u8);
    w.u8(header.kind as u8);
    w.u16(0);
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
    seal_checksum(out, CRC_OFFSET);
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
    if version != FORMAT_VERSION {
        return Err(FormatError::BadVersion {
            what,
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let found_kind = r.u8()?;
    if PageKind::from_u8(found_kind) != Some(kind) {
        return Err(FormatError::Invalid {
            what,
            reason: format!("page kind {found_kind}, expected {}", kind as u8),
        });
    }
    r.u16()?;
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
            kind,
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
            kind: PageKind::Map,
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
