//! The recovery journal: a ring of 512-byte sectors holding mapping changes since
//! the last checkpoint. A sector is the unit of commit and is never rewritten while
//! it holds live records, so a torn write can only lose records that were never
//! acknowledged.

use crate::location::MapEntry;
use crate::{check_nonce, open_block, seal_checksum, FormatError, Reader, Writer, SECTOR_BYTES};

/// "FBJS".
pub const SECTOR_MAGIC: u32 = 0x534a_4246;
/// Bytes of a sector header.
pub const SECTOR_HEADER_BYTES: usize = 32;
/// Bytes of records a sector can hold.
pub const SECTOR_PAYLOAD_BYTES: usize = SECTOR_BYTES - SECTOR_HEADER_BYTES;
const CRC_OFFSET: usize = 4;

/// Largest volume slot a record can name.
pub const MAX_VOLUME_SLOT: u16 = u16::MAX;
/// Largest logical block number a record can name (40 bits: 4 PiB volumes).
pub const MAX_LBN: u64 = (1 << 40) - 1;

/// A sector's self-description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectorHeader {
    /// The pool's nonce.
    pub nonce: u64,
    /// Sequence number of this sector (monotonic across the ring's laps).
    pub seq: u64,
    /// The pool's open generation when written; replay accepts only the current one.
    pub open_gen: u32,
    /// Payload bytes used by records.
    pub used: u16,
}

/// One mapping change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// Set one block-map entry (16 bytes). The old entry's reference is dropped.
    MapSet {
        /// Volume slot in the catalog.
        volume: u16,
        /// Logical block.
        lbn: u64,
        /// New entry.
        entry: MapEntry,
    },
    /// Set `count` entries starting at `lbn` to `entry` (Unmapped or Zero) (24 bytes).
    RangeSet {
        /// Volume slot.
        volume: u16,
        /// First logical block.
        lbn: u64,
        /// Number of blocks.
        count: u64,
        /// Unmapped (trim) or Zero (write-zeroes).
        entry: MapEntry,
    },
    /// A new stored object: its location and fingerprint (48 bytes). Its references
    /// come from `MapSet` records.
    NewObject {
        /// Object id (56 bits).
        object: u64,
        /// Encoded location.
        location: u64,
        /// Fingerprint.
        fingerprint: [u8; 32],
    },
}

const TAG_MAP_SET: u8 = 1;
const TAG_RANGE_SET: u8 = 2;
const TAG_NEW_OBJECT: u8 = 3;

/// Encoded size of a `MapSet` record.
pub const MAP_SET_BYTES: usize = 16;
/// Encoded size of a `RangeSet` record.
pub const RANGE_SET_BYTES: usize = 24;
/// Encoded size of a `NewObject` record.
pub const NEW_OBJECT_BYTES: usize = 48;

/// The largest record (`NewObject`): bounds the payload a sector may leave unused.
pub const RECORD_BYTES_MAX: usize = NEW_OBJECT_BYTES;

/// The encoded size of the record whose first byte (its tag) is `tag`, if `tag`
/// names a record: lets a writer cut a stream of encoded records at record
/// boundaries without decoding them.
pub fn record_len_of_tag(tag: u8) -> Option<usize> {
    match tag {
        TAG_MAP_SET => Some(MAP_SET_BYTES),
        TAG_RANGE_SET => Some(RANGE_SET_BYTES),
        TAG_NEW_OBJECT => Some(NEW_OBJECT_BYTES),
        _ => None,
    }
}

impl Record {
    /// Encoded size.
    pub fn encoded_len(&self) -> usize {
        match self {
            Record::MapSet { .. } => MAP_SET_BYTES,
            Record::RangeSet { .. } => RANGE_SET_BYTES,
            Record::NewObject { .. } => NEW_OBJECT_BYTES,
        }
    }

    /// Encode; the caller sized `w` with `encoded_len`.
    pub fn encode(&self, w: &mut Writer<'_>) {
        match *self {
            Record::MapSet { volume, lbn, entry } => {
                w.u8(TAG_MAP_SET);
                w.u16(volume);
                w.uint(lbn, 5);
                w.u64(entry.encode());
            }
            Record::RangeSet {
                volume,
                lbn,
                count,
                entry,
            } => {
                w.u8(TAG_RANGE_SET);
                w.u16(volume);
                w.uint(lbn, 5);
                w.u64(count);
                w.u64(entry.encode());
            }
            Record::NewObject {
                object,
                location,
                fingerprint,
            } => {
                w.u8(TAG_NEW_OBJECT);
                w.uint(object, 7);
                w.u64(location);
                w.put(&fingerprint);
            }
        }
    }

    /// Decode one record.
    pub fn decode(r: &mut Reader<'_>) -> Result<Self, FormatError> {
        let tag = r.u8()?;
        match tag {
            TAG_MAP_SET => {
                let volume = r.u16()?;
                let lbn = r.uint(5)?;
                let entry = MapEntry::decode(r.u64()?);
                Ok(Record::MapSet { volume, lbn, entry })
            }
            TAG_RANGE_SET => {
                let volume = r.u16()?;
                let lbn = r.uint(5)?;
                let count = r.u64()?;
                let entry = MapEntry::decode(r.u64()?);
                if entry.object().is_some() {
                    return Err(FormatError::Invalid {
                        what: "journal record",
                        reason: "range set to an object".into(),
                    });
                }
                Ok(Record::RangeSet {
                    volume,
                    lbn,
                    count,
                    entry,
                })
            }
            TAG_NEW_OBJECT => {
                let object = r.uint(7)?;
                let location = r.u64()?;
                let fingerprint = r.bytes32()?;
                Ok(Record::NewObject {
                    object,
                    location,
                    fingerprint,
                })
            }
            t => Err(FormatError::Invalid {
                what: "journal record",
                reason: format!("unknown tag {t}"),
            }),
        }
    }
}

/// Encode a sector from a header and its records' bytes.
pub fn encode_sector(header: &SectorHeader, records: &[u8], out: &mut [u8; SECTOR_BYTES]) {
    out.fill(0);
    let mut w = Writer::new(out);
    w.u32(SECTOR_MAGIC);
    w.u32(0);
    w.u64(header.nonce);
    w.u64(header.seq);
    w.u32(header.open_gen);
    w.u16(header.used);
    w.u16(0);
    debug_assert_eq!(w.pos(), SECTOR_HEADER_BYTES);
    let n = records.len().min(SECTOR_PAYLOAD_BYTES);
    w.put(records.get(..n).unwrap_or(records));
    seal_checksum(out, CRC_OFFSET);
}

/// Decode a sector; returns its header and records.
pub fn decode_sector(bytes: &[u8], nonce: u64) -> Result<(SectorHeader, Vec<Record>), FormatError> {
    let what = "journal sector";
    let mut r = open_block(what, bytes, SECTOR_BYTES, SECTOR_MAGIC)?;
    check_nonce(what, r.u64()?, nonce)?;
    let seq = r.u64()?;
    let open_gen = r.u32()?;
    let used = r.u16()?;
    r.u16()?;
    if usize::from(used) > SECTOR_PAYLOAD_BYTES {
        return Err(FormatError::Invalid {
            what,
            reason: format!("{used} payload bytes used"),
        });
    }
    let payload = r.take(usize::from(used))?;
    let mut records = Vec::new();
    let mut pr = Reader::new("journal record", payload);
    while pr.pos() < payload.len() {
        records.push(Record::decode(&mut pr)?);
    }
    Ok((
        SectorHeader {
            nonce,
            seq,
            open_gen,
            used,
        },
        records,
    ))
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "tests fail loudly by design"
)]
mod tests {
    use super::*;
    use crate::location::ObjectId;
    use proptest::prelude::*;

    #[test]
    fn sector_round_trips() {
        let recs = [
            Record::MapSet {
                volume: 3,
                lbn: MAX_LBN,
                entry: MapEntry::Object(ObjectId(12345)),
            },
            Record::RangeSet {
                volume: 1,
                lbn: 7,
                count: 1 << 33,
                entry: MapEntry::Zero,
            },
            Record::NewObject {
                object: (1 << 56) - 1,
                location: 42,
                fingerprint: [9; 32],
            },
        ];
        let mut payload = vec![0u8; recs.iter().map(Record::encoded_len).sum()];
        let mut w = Writer::new(&mut payload);
        for r in &recs {
            r.encode(&mut w);
        }
        let header = SectorHeader {
            nonce: 5,
            seq: 99,
            open_gen: 2,
            used: payload.len() as u16,
        };
        let mut sector = [0u8; SECTOR_BYTES];
        encode_sector(&header, &payload, &mut sector);
        let (h, decoded) = decode_sector(&sector, 5).unwrap();
        assert_eq!(h, header);
        assert_eq!(decoded, recs);
    }

    proptest! {
        #[test]
        fn random_sectors_never_panic(bytes in proptest::collection::vec(any::<u8>(), SECTOR_BYTES)) {
            let _ = decode_sector(&bytes, 5);
        }
    }
}
