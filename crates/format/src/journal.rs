//! The recovery journal: a ring of 512-byte sectors holding mapping changes since
//! the last checkpoint. A sector is the unit of commit and is never rewritten while
//! it holds live records, so a torn write can only lose records that were never
//! acknowledged.
//!
//! In pools with the super block's journal-commits flag, each record sector carries its
//! index in its commit (so a reader knows where each commit began), and every group of
//! up to [`PARITY_GROUP_SECTORS`] record sectors of a commit is followed by a parity
//! sector: the XOR of the group's bytes a reader cannot know, from which one bad
//! sector of the group is rebuilt exactly (the rebuilt sector must pass its own crc).

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

/// "FBJP": a parity sector.
pub const PARITY_MAGIC: u32 = 0x504a_4246;
/// Record sectors a parity sector covers at most: one bad sector in this many (plus
/// their parity) is rebuilt, for one sector of ring in this many plus one.
pub const PARITY_GROUP_SECTORS: usize = 16;
/// Bytes of a parity sector's header; the rest holds the XOR of the covered sectors'
/// bytes at the same offsets (28–511), and bytes 24–27 the XOR of their crcs.
pub const PARITY_HEADER_BYTES: usize = 24;
/// Where a record sector's bytes that a reader cannot know (`used`, `index`, the
/// records) begin: everything before but the crc follows from where the sector is.
const UNKNOWN_FROM: usize = 28;
/// Where a parity sector keeps the XOR of the covered sectors' crcs.
const PARITY_CRC_XOR_OFFSET: usize = 24;
/// Sectors one commit may hold (its sector indexes are 16 bits).
pub const COMMIT_SECTORS_MAX: usize = 1 << 16;

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
    /// The sector's place in its commit (0: the commit's first sector), counting
    /// parity sectors; 0 in pools without the journal-commits flag (reserved there).
    pub index: u16,
}

/// A parity sector's self-description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParityHeader {
    /// Sequence number of this sector.
    pub seq: u64,
    /// The pool's open generation when written.
    pub open_gen: u32,
    /// The sector's place in its commit.
    pub index: u16,
    /// How many record sectors it covers: the ones just before it (1 to
    /// [`PARITY_GROUP_SECTORS`]).
    pub covers: u16,
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
    /// A block stored new and mapped (27 bytes; pools with `FLAG_SLIM_RECORDS`): what a
    /// `NewObject` and a `MapSet` say together, without the fingerprint. The data is
    /// durable before the commit that names it, so replay reads the block back,
    /// checks it against `crc`, and computes the fingerprint from it.
    NewStored {
        /// Volume slot.
        volume: u16,
        /// Logical block.
        lbn: u64,
        /// Object id (56 bits), with one reference from this entry.
        object: u64,
        /// Encoded location.
        location: u64,
        /// CRC-32C of the block's 4,096 bytes before compression.
        crc: u32,
    },
    /// `count` blocks stored new and mapped, as `count` `NewStored` records would say
    /// (22 + 4 × `count` bytes; pools with `FLAG_SLIM_RECORDS`): block `k` is logical
    /// block `lbn + k`, object `object + k`, stored whole at PBN `pbn + k`; a write of
    /// consecutive blocks of new data stores them so.
    NewStoredRun {
        /// Volume slot.
        volume: u16,
        /// The first logical block.
        lbn: u64,
        /// The first object id (56 bits).
        object: u64,
        /// The first block's PBN (48 bits).
        pbn: u64,
        /// Blocks: 2 to [`RUN_BLOCKS_MAX`].
        count: u8,
        /// Each block's CRC-32C; those past `count` are 0.
        crcs: [u32; RUN_BLOCKS_MAX],
    },
}

/// Blocks one `NewStoredRun` record holds at most.
pub const RUN_BLOCKS_MAX: usize = 8;

/// One block a `NewStored` or `NewStoredRun` record stores and maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredBlock {
    /// Volume slot.
    pub volume: u16,
    /// Logical block.
    pub lbn: u64,
    /// Object id.
    pub object: u64,
    /// Encoded location.
    pub location: u64,
    /// CRC-32C of the block's 4,096 bytes.
    pub crc: u32,
}

impl Record {
    /// The blocks this record stores new, in order: one for a `NewStored`, `count`
    /// for a `NewStoredRun` (block `k` at LBN, object and PBN + `k`), none for any
    /// other record.
    pub fn stored_blocks(&self) -> impl Iterator<Item = StoredBlock> {
        let (volume, lbn, object, first, crcs, count, run) = match *self {
            Record::NewStored {
                volume,
                lbn,
                object,
                location,
                crc,
            } => (
                volume,
                lbn,
                object,
                location,
                [crc; RUN_BLOCKS_MAX],
                1,
                false,
            ),
            Record::NewStoredRun {
                volume,
                lbn,
                object,
                pbn,
                count,
                crcs,
            } => (volume, lbn, object, pbn, crcs, usize::from(count), true),
            _ => (0, 0, 0, 0, [0; RUN_BLOCKS_MAX], 0, false),
        };
        (0u64..)
            .zip(crcs)
            .take(count)
            .map(move |(k, crc)| StoredBlock {
                volume,
                lbn: lbn + k,
                object: object + k,
                location: if run {
                    crate::location::Location::Block { pbn: first + k }.encode()
                } else {
                    first
                },
                crc,
            })
    }
}

const TAG_MAP_SET: u8 = 1;
const TAG_RANGE_SET: u8 = 2;
const TAG_NEW_OBJECT: u8 = 3;
const TAG_NEW_STORED: u8 = 4;
const TAG_NEW_STORED_RUN: u8 = 5;

/// Encoded size of a `MapSet` record.
pub const MAP_SET_BYTES: usize = 16;
/// Encoded size of a `RangeSet` record.
pub const RANGE_SET_BYTES: usize = 24;
/// Encoded size of a `NewObject` record.
pub const NEW_OBJECT_BYTES: usize = 48;
/// Encoded size of a `NewStored` record.
pub const NEW_STORED_BYTES: usize = 27;

/// Encoded size of a `NewStoredRun` record of `count` blocks.
pub const fn new_stored_run_bytes(count: usize) -> usize {
    22 + 4 * count
}

/// The largest record (`NewStoredRun` of [`RUN_BLOCKS_MAX`] blocks): bounds the
/// payload a sector may leave unused.
pub const RECORD_BYTES_MAX: usize = new_stored_run_bytes(RUN_BLOCKS_MAX);
const _: () = assert!(RECORD_BYTES_MAX >= NEW_OBJECT_BYTES);

/// The encoded size of the record `bytes` begins with (its tag, and for a run its
/// count), if they begin a record: lets a writer cut a stream of encoded records at
/// record boundaries without decoding them.
pub fn record_len(bytes: &[u8]) -> Option<usize> {
    match *bytes.first()? {
        TAG_MAP_SET => Some(MAP_SET_BYTES),
        TAG_RANGE_SET => Some(RANGE_SET_BYTES),
        TAG_NEW_OBJECT => Some(NEW_OBJECT_BYTES),
        TAG_NEW_STORED => Some(NEW_STORED_BYTES),
        TAG_NEW_STORED_RUN => {
            let count = usize::from(*bytes.get(1)?);
            (2..=RUN_BLOCKS_MAX)
                .contains(&count)
                .then(|| new_stored_run_bytes(count))
        }
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
            Record::NewStored { .. } => NEW_STORED_BYTES,
            Record::NewStoredRun { count, .. } => new_stored_run_bytes(usize::from(*count)),
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
            Record::NewStored {
                volume,
                lbn,
                object,
                location,
                crc,
            } => {
                w.u8(TAG_NEW_STORED);
                w.u16(volume);
                w.uint(lbn, 5);
                w.uint(object, 7);
                w.u64(location);
                w.u32(crc);
            }
            Record::NewStoredRun {
                volume,
                lbn,
                object,
                pbn,
                count,
                crcs,
            } => {
                w.u8(TAG_NEW_STORED_RUN);
                w.u8(count);
                w.u16(volume);
                w.uint(lbn, 5);
                w.uint(object, 7);
                w.uint(pbn, 6);
                for crc in crcs.iter().take(usize::from(count)) {
                    w.u32(*crc);
                }
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
            TAG_NEW_STORED => {
                let volume = r.u16()?;
                let lbn = r.uint(5)?;
                let object = r.uint(7)?;
                let location = r.u64()?;
                let crc = r.u32()?;
                Ok(Record::NewStored {
                    volume,
                    lbn,
                    object,
                    location,
                    crc,
                })
            }
            TAG_NEW_STORED_RUN => {
                let count = r.u8()?;
                let volume = r.u16()?;
                let lbn = r.uint(5)?;
                let object = r.uint(7)?;
                let pbn = r.uint(6)?;
                let n = u64::from(count);
                if !(2..=RUN_BLOCKS_MAX).contains(&usize::from(count))
                    || lbn + n - 1 > MAX_LBN
                    || object + n > 1 << 56
                    || pbn + n - 1 > crate::location::MAX_PBN
                {
                    return Err(FormatError::Invalid {
                        what: "journal record",
                        reason: format!(
                            "a run of {count} blocks from LBN {lbn}, object {object}, PBN {pbn}"
                        ),
                    });
                }
                let mut crcs = [0u32; RUN_BLOCKS_MAX];
                for crc in crcs.iter_mut().take(usize::from(count)) {
                    *crc = r.u32()?;
                }
                Ok(Record::NewStoredRun {
                    volume,
                    lbn,
                    object,
                    pbn,
                    count,
                    crcs,
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
    w.u16(header.index);
    debug_assert_eq!(w.pos(), SECTOR_HEADER_BYTES);
    assert!(
        records.len() <= SECTOR_PAYLOAD_BYTES,
        "{} bytes of records do not fit a journal sector",
        records.len()
    );
    w.put(records);
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
    let index = r.u16()?;
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
            index,
        },
        records,
    ))
}

/// Whether `bytes` begins with the parity magic (else it is read as a record sector).
pub fn is_parity(bytes: &[u8]) -> bool {
    bytes.get(..4) == Some(&PARITY_MAGIC.to_le_bytes()[..])
}

/// A parity sector's crc: over the pool's nonce (which it does not store) and its
/// bytes, its crc field taken as zero.
fn parity_checksum(bytes: &[u8], nonce: u64) -> u32 {
    let head = bytes.get(..CRC_OFFSET).unwrap_or(bytes);
    let tail = bytes.get(CRC_OFFSET + 4..).unwrap_or(&[]);
    let crc = crc32c::crc32c(&nonce.to_le_bytes());
    let crc = crc32c::crc32c_append(crc, head);
    let crc = crc32c::crc32c_append(crc, &[0; 4]);
    crc32c::crc32c_append(crc, tail)
}

/// The bytes of a record sector that a parity sector keeps, each paired with
/// where the parity keeps it: the crc (4–7 → 24–27) and 28–511 (at the same offsets).
fn parity_pairs() -> impl Iterator<Item = (usize, usize)> {
    (0..4)
        .map(|k| (CRC_OFFSET + k, PARITY_CRC_XOR_OFFSET + k))
        .chain((UNKNOWN_FROM..SECTOR_BYTES).map(|k| (k, k)))
}

/// XOR the bytes of record sector `sector` a reader cannot know into `parity`.
pub fn xor_into_parity(parity: &mut [u8; SECTOR_BYTES], sector: &[u8; SECTOR_BYTES]) {
    for (from, to) in parity_pairs() {
        if let (Some(p), Some(s)) = (parity.get_mut(to), sector.get(from)) {
            *p ^= s;
        }
    }
}

/// Write a parity sector's header and crc over `parity`, which holds the XOR of
/// the sectors it covers (`xor_into_parity`).
pub fn seal_parity(header: &ParityHeader, nonce: u64, parity: &mut [u8; SECTOR_BYTES]) {
    let mut w = Writer::new(parity);
    w.u32(PARITY_MAGIC);
    w.u32(0);
    w.u64(header.seq);
    w.u32(header.open_gen);
    w.u16(header.index);
    w.u16(header.covers);
    debug_assert_eq!(w.pos(), PARITY_HEADER_BYTES);
    let crc = parity_checksum(parity, nonce);
    let mut w = Writer::new(parity);
    w.seek(CRC_OFFSET);
    w.u32(crc);
}

/// Decode a parity sector's header, checking its magic and crc.
pub fn decode_parity(bytes: &[u8], nonce: u64) -> Result<ParityHeader, FormatError> {
    let what = "journal parity sector";
    if bytes.len() != SECTOR_BYTES {
        return Err(FormatError::Truncated {
            what,
            got: bytes.len(),
            need: SECTOR_BYTES,
        });
    }
    let mut r = Reader::new(what, bytes);
    let magic = r.u32()?;
    if magic != PARITY_MAGIC {
        return Err(FormatError::BadMagic {
            what,
            found: u64::from(magic),
        });
    }
    let expected = r.u32()?;
    let got = parity_checksum(bytes, nonce);
    if got != expected {
        return Err(FormatError::ChecksumMismatch {
            what,
            got,
            expected,
        });
    }
    let header = ParityHeader {
        seq: r.u64()?,
        open_gen: r.u32()?,
        index: r.u16()?,
        covers: r.u16()?,
    };
    if header.covers == 0 || usize::from(header.covers) > PARITY_GROUP_SECTORS {
        return Err(FormatError::Invalid {
            what,
            reason: format!("covers {} sectors", header.covers),
        });
    }
    Ok(header)
}

/// Rebuild the record sector at `seq` (open generation `open_gen`) from its group's
/// parity sector and the group's other record sectors. The result is what was
/// written only if `decode_sector` accepts it (its crc) and its index is the one
/// its place in the commit implies; the caller checks both.
pub fn rebuild_sector<'a>(
    parity: &[u8; SECTOR_BYTES],
    others: impl IntoIterator<Item = &'a [u8; SECTOR_BYTES]>,
    nonce: u64,
    seq: u64,
    open_gen: u32,
) -> [u8; SECTOR_BYTES] {
    let mut out = [0u8; SECTOR_BYTES];
    for (at, from) in parity_pairs() {
        if let (Some(o), Some(p)) = (out.get_mut(at), parity.get(from)) {
            *o = *p;
        }
    }
    for other in others {
        for (at, _) in parity_pairs() {
            if let (Some(o), Some(s)) = (out.get_mut(at), other.get(at)) {
                *o ^= s;
            }
        }
    }
    let mut w = Writer::new(&mut out);
    w.u32(SECTOR_MAGIC);
    w.seek(8);
    w.u64(nonce);
    w.u64(seq);
    w.u32(open_gen);
    out
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
            Record::NewStored {
                volume: u16::MAX,
                lbn: MAX_LBN,
                object: (1 << 56) - 2,
                location: u64::MAX - 1,
                crc: 0xdead_beef,
            },
            Record::NewStoredRun {
                volume: 2,
                lbn: MAX_LBN - 7,
                object: (1 << 56) - 8,
                pbn: 77,
                count: 8,
                crcs: [1, 2, 3, 4, 5, 6, 7, u32::MAX],
            },
            Record::NewStoredRun {
                volume: 0,
                lbn: 0,
                object: 1,
                pbn: 0,
                count: 2,
                crcs: [9, 10, 0, 0, 0, 0, 0, 0],
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
            index: 7,
        };
        let mut sector = [0u8; SECTOR_BYTES];
        encode_sector(&header, &payload, &mut sector);
        let (h, decoded) = decode_sector(&sector, 5).unwrap();
        assert_eq!(h, header);
        assert_eq!(decoded, recs);
    }

    #[test]
    fn a_run_stores_its_blocks_in_order_and_other_records_none() {
        let run = Record::NewStoredRun {
            volume: 4,
            lbn: 10,
            object: 20,
            pbn: 30,
            count: 3,
            crcs: [7, 8, 9, 0, 0, 0, 0, 0],
        };
        let blocks: Vec<_> = run.stored_blocks().collect();
        let want = |k: u64, crc| StoredBlock {
            volume: 4,
            lbn: 10 + k,
            object: 20 + k,
            location: crate::location::Location::Block { pbn: 30 + k }.encode(),
            crc,
        };
        assert_eq!(blocks, vec![want(0, 7), want(1, 8), want(2, 9)]);
        let one = Record::NewStored {
            volume: 1,
            lbn: 2,
            object: 3,
            location: 1 << 63 | 5,
            crc: 6,
        };
        assert_eq!(one.stored_blocks().count(), 1);
        assert_eq!(
            one.stored_blocks().next().map(|b| b.location),
            Some(1 << 63 | 5)
        );
        let map_set = Record::MapSet {
            volume: 0,
            lbn: 0,
            entry: MapEntry::Zero,
        };
        assert_eq!(map_set.stored_blocks().count(), 0);
    }

    fn record_sector(seq: u64, index: u16, fill: u8) -> [u8; SECTOR_BYTES] {
        let rec = Record::MapSet {
            volume: 1,
            lbn: u64::from(fill),
            entry: MapEntry::Zero,
        };
        let mut payload = vec![0u8; MAP_SET_BYTES * (1 + usize::from(fill) % 20)];
        for chunk in payload.chunks_mut(MAP_SET_BYTES) {
            rec.encode(&mut Writer::new(chunk));
        }
        let header = SectorHeader {
            nonce: 5,
            seq,
            open_gen: 3,
            used: payload.len() as u16,
            index,
        };
        let mut sector = [0u8; SECTOR_BYTES];
        encode_sector(&header, &payload, &mut sector);
        sector
    }

    #[test]
    fn any_one_sector_of_a_group_is_rebuilt_exactly_from_its_parity() {
        let group: Vec<_> = (0..PARITY_GROUP_SECTORS as u16)
            .map(|i| record_sector(100 + u64::from(i), i, i as u8 * 7))
            .collect();
        let mut parity = [0u8; SECTOR_BYTES];
        for s in &group {
            xor_into_parity(&mut parity, s);
        }
        let header = ParityHeader {
            seq: 116,
            open_gen: 3,
            index: 16,
            covers: 16,
        };
        seal_parity(&header, 5, &mut parity);
        assert!(is_parity(&parity));
        assert_eq!(decode_parity(&parity, 5).unwrap(), header);
        assert!(decode_parity(&parity, 6).is_err(), "another pool's parity");
        for lost in 0..group.len() {
            let others = group.iter().enumerate().filter(|(i, _)| *i != lost);
            let rebuilt = rebuild_sector(&parity, others.map(|(_, s)| s), 5, 100 + lost as u64, 3);
            assert_eq!(rebuilt, group[lost], "sector {lost}");
            decode_sector(&rebuilt, 5).unwrap();
        }
        // With a second sector missing, the rebuild fails its crc.
        let others = group.iter().skip(2);
        let rebuilt = rebuild_sector(&parity, others, 5, 100, 3);
        assert!(decode_sector(&rebuilt, 5).is_err());
    }

    proptest! {
        #[test]
        fn random_parity_sectors_never_panic(bytes in proptest::collection::vec(any::<u8>(), SECTOR_BYTES)) {
            let _ = decode_parity(&bytes, 5);
        }

        #[test]
        fn random_sectors_never_panic(bytes in proptest::collection::vec(any::<u8>(), SECTOR_BYTES)) {
            let _ = decode_sector(&bytes, 5);
        }
    }
}
