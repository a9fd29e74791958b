//! The send stream (`volume send` / `volume receive`, docs/stream.md): a header, then
//! records in block order, each with its own checksum and its position in the stream.
//!
//! This is a wire format, not a pool structure: nothing here is ever stored in a
//! pool. Like the pool's structures it is a pair of a Rust value and a fixed-width
//! little-endian encoding, decoded through checks in a fixed order (length, magic,
//! version, checksum, then each field's bounds) into a typed [`FormatError`].

use crate::{FormatError, BLOCK_BYTES};
use crate::{Reader, Writer};

/// "FBSTREAM" read as a little-endian u64.
pub const STREAM_MAGIC: u64 = u64::from_le_bytes(*b"FBSTREAM");
/// The stream version this code writes and reads.
pub const STREAM_VERSION: u32 = 1;
/// Bytes of the header.
pub const HEADER_BYTES: usize = 192;
/// Bytes of the base's name in the header (a volume name's longest).
pub const BASE_NAME_BYTES: usize = crate::catalog::MAX_NAME_BYTES;
/// Bytes of a record before its payload.
pub const RECORD_HEAD_BYTES: usize = 32;
/// The largest payload a record may carry: one block, stored whole. A decoder
/// refuses a larger length before it reads (or allocates) anything.
pub const PAYLOAD_BYTES_MAX: usize = BLOCK_BYTES;
/// Bytes of a reference's payload: the source block number.
pub const REF_PAYLOAD_BYTES: usize = 8;
/// Bytes of the end record's payload: five counts.
pub const END_PAYLOAD_BYTES: usize = 40;
/// Bytes of a snapshot record's payload before the snapshot's name: its identity.
pub const SNAPSHOT_GUID_BYTES: usize = 8;
/// Bytes of a block's digest in a negotiated stream's offers and pool references:
/// the first 16 of its keyed BLAKE3 under the stream key.
pub const OFFER_DIGEST_BYTES: usize = 16;
/// Digests one offer record carries at most (a payload's limit).
pub const OFFER_DIGESTS_MAX: usize = PAYLOAD_BYTES_MAX / OFFER_DIGEST_BYTES;
/// "FBANSWER" read as a little-endian u64: the receiver's answer to the offers.
pub const ANSWER_MAGIC: u64 = u64::from_le_bytes(*b"FBANSWER");
/// Bytes of the answer before its bitmap: magic, count, crc.
pub const ANSWER_HEAD_BYTES: usize = 20;

/// Header flag: the stream is incremental (its base is named by size and digest).
pub const FLAG_INCREMENTAL: u32 = 1;
/// Header flag: two-way mode: the sender offers digests and reads the receiver's
/// answer before the block records (docs/stream.md, "Two-way mode").
pub const FLAG_NEGOTIATED: u32 = 2;
/// Header flag: the stream's source is a snapshot; record 0 is a snapshot record
/// carrying its identity and name, and the receiver makes the same snapshot
/// (docs/stream.md, "Snapshots").
pub const FLAG_SNAPSHOT: u32 = 4;
/// Header flag: the base of an incremental stream is a snapshot, named by its
/// identity (the header's last 8 bytes) instead of a content digest.
pub const FLAG_BASE_SNAPSHOT: u32 = 8;
const FLAGS_KNOWN: u32 = FLAG_INCREMENTAL | FLAG_NEGOTIATED | FLAG_SNAPSHOT | FLAG_BASE_SNAPSHOT;

const WHAT_HEADER: &str = "stream header";
const WHAT_RECORD: &str = "stream record";
const HEADER_CRC_OFFSET: usize = 12;
const RECORD_CRC_OFFSET: usize = 28;

/// What a stream carries, before its records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamHeader {
    /// Bytes of the volume the stream makes.
    pub volume_size_bytes: u64,
    /// The sending pool's id (`pool info`), for messages and the receiver's record.
    pub source_pool_id: u64,
    /// A random key chosen for this stream: it keys the stream's content digests
    /// (two-way mode) and every record's checksum, and names the stream on resume.
    pub stream_key: [u8; 32],
    /// The base of an incremental stream; `None`: a full stream.
    pub base: Option<BaseId>,
    /// Two-way mode: offers and an answer come before the block records.
    pub negotiated: bool,
    /// A digest of the source volume's block map when the stream was made: a resumed
    /// send refuses a source that changed since (docs/stream.md, "Resume").
    pub source_map_digest: u64,
    /// The source is a snapshot: record 0 carries its identity and name.
    pub snapshot: bool,
}

/// What names the base of an incremental stream on both sides: its size and the
/// digest of its content (docs/stream.md, "Base digest").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseId {
    /// The base's name in the sending pool, zero-padded: what the receiver looks
    /// for unless told another name.
    pub name: [u8; BASE_NAME_BYTES],
    /// Bytes of the base volume.
    pub size_bytes: u64,
    /// BLAKE3 of the base's content in canonical form; zeros when `guid` names the
    /// base (a snapshot is never written, so its identity is its content).
    pub content_digest: [u8; 32],
    /// The base snapshot's identity (never 0), when the base is a snapshot.
    pub guid: Option<u64>,
}

impl BaseId {
    /// `name` zero-padded into the header's field; `None` if it does not fit.
    pub fn pad_name(name: &str) -> Option<[u8; BASE_NAME_BYTES]> {
        let mut out = [0u8; BASE_NAME_BYTES];
        out.get_mut(..name.len())?.copy_from_slice(name.as_bytes());
        Some(out)
    }

    /// The base's name: the bytes before the padding, if they are a volume name or
    /// a snapshot's (`VOLUME@SNAPSHOT`).
    pub fn name_str(&self) -> Option<&str> {
        let len = self
            .name
            .iter()
            .position(|b| *b == 0)
            .unwrap_or(BASE_NAME_BYTES);
        let name = std::str::from_utf8(self.name.get(..len)?).ok()?;
        let (volume, snapshot) = name.split_once('@').unwrap_or((name, "x"));
        crate::catalog::validate_name(volume).ok()?;
        crate::catalog::validate_name(snapshot).ok()?;
        Some(name)
    }
}

impl StreamHeader {
    /// The 192-byte header.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        let mut w = Writer::new(&mut out);
        w.u64(STREAM_MAGIC);
        w.u32(STREAM_VERSION);
        w.u32(0); // crc, sealed below
        let incremental = if self.base.is_some() {
            FLAG_INCREMENTAL
        } else {
            0
        };
        let negotiated = if self.negotiated { FLAG_NEGOTIATED } else { 0 };
        let snapshot = if self.snapshot { FLAG_SNAPSHOT } else { 0 };
        let base_guid = self.base.and_then(|b| b.guid);
        let base_snapshot = if base_guid.is_some() {
            FLAG_BASE_SNAPSHOT
        } else {
            0
        };
        w.u32(incremental | negotiated | snapshot | base_snapshot);
        w.u32(BLOCK_BYTES as u32);
        w.u64(self.volume_size_bytes);
        w.u64(self.source_pool_id);
        w.put(&self.stream_key);
        let base = self.base.unwrap_or(BaseId {
            name: [0; BASE_NAME_BYTES],
            size_bytes: 0,
            content_digest: [0; 32],
            guid: None,
        });
        w.u64(base.size_bytes);
        w.put(&base.content_digest);
        w.u64(self.source_map_digest);
        w.put(&base.name);
        w.u64(base_guid.unwrap_or(0));
        debug_assert_eq!(w.pos(), HEADER_BYTES, "the header's layout");
        crate::seal_checksum(&mut out, HEADER_CRC_OFFSET);
        out
    }

    /// Decode and check a header: length, magic, version, checksum, then fields.
    pub fn decode(bytes: &[u8]) -> Result<StreamHeader, FormatError> {
        if bytes.len() != HEADER_BYTES {
            return Err(FormatError::Truncated {
                what: WHAT_HEADER,
                got: bytes.len(),
                need: HEADER_BYTES,
            });
        }
        let mut r = Reader::new(WHAT_HEADER, bytes);
        let magic = r.u64()?;
        if magic != STREAM_MAGIC {
            return Err(FormatError::BadMagic {
                what: WHAT_HEADER,
                found: magic,
            });
        }
        let version = r.u32()?;
        if version != STREAM_VERSION {
            return Err(FormatError::BadVersion {
                what: WHAT_HEADER,
                found: version,
                supported: STREAM_VERSION,
            });
        }
        crate::verify_checksum(WHAT_HEADER, bytes, HEADER_CRC_OFFSET)?;
        r.u32()?;
        let flags = r.u32()?;
        if flags & !FLAGS_KNOWN != 0 {
            return Err(invalid(WHAT_HEADER, format!("unknown flags {flags:#x}")));
        }
        let block_bytes = r.u32()?;
        if block_bytes != BLOCK_BYTES as u32 {
            return Err(invalid(
                WHAT_HEADER,
                format!("block size {block_bytes} (this build moves {BLOCK_BYTES}-byte blocks)"),
            ));
        }
        let volume_size_bytes = r.u64()?;
        if volume_size_bytes % BLOCK_BYTES as u64 != 0 || volume_size_bytes == 0 {
            return Err(invalid(
                WHAT_HEADER,
                format!("volume size {volume_size_bytes} is not a positive whole number of blocks"),
            ));
        }
        let source_pool_id = r.u64()?;
        let stream_key = r.bytes32()?;
        let base_size_bytes = r.u64()?;
        let content_digest = r.bytes32()?;
        let source_map_digest = r.u64()?;
        let mut name = [0u8; BASE_NAME_BYTES];
        name.copy_from_slice(r.take(BASE_NAME_BYTES)?);
        let base_guid = r.u64()?;
        let guid = match (flags & FLAG_BASE_SNAPSHOT != 0, base_guid) {
            (false, 0) => None,
            (false, found) => {
                return Err(invalid(
                    WHAT_HEADER,
                    format!("the base identity field holds {found:#x} without flag bit 3"),
                ))
            }
            (true, 0) => return Err(invalid(WHAT_HEADER, "a base snapshot of identity 0".into())),
            (true, guid) => Some(guid),
        };
        if guid.is_some() && flags & FLAG_INCREMENTAL == 0 {
            return Err(invalid(
                WHAT_HEADER,
                "a full stream names a base snapshot".into(),
            ));
        }
        let base = if flags & FLAG_INCREMENTAL != 0 {
            if base_size_bytes % BLOCK_BYTES as u64 != 0 || base_size_bytes == 0 {
                return Err(invalid(
                    WHAT_HEADER,
                    format!("base size {base_size_bytes} is not a positive whole number of blocks"),
                ));
            }
            let base = BaseId {
                name,
                size_bytes: base_size_bytes,
                content_digest,
                guid,
            };
            if base.name_str().is_none() {
                return Err(invalid(
                    WHAT_HEADER,
                    "the base's name is not a volume name".into(),
                ));
            }
            Some(base)
        } else {
            if base_size_bytes != 0 || content_digest != [0; 32] || name != [0; BASE_NAME_BYTES] {
                return Err(invalid(WHAT_HEADER, "a full stream names a base".into()));
            }
            None
        };
        Ok(StreamHeader {
            volume_size_bytes,
            source_pool_id,
            stream_key,
            base,
            negotiated: flags & FLAG_NEGOTIATED != 0,
            source_map_digest,
            snapshot: flags & FLAG_SNAPSHOT != 0,
        })
    }

    /// Blocks of the volume the stream makes.
    pub fn volume_blocks(&self) -> u64 {
        self.volume_size_bytes / BLOCK_BYTES as u64
    }
}

/// How a data record's block is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadCodec {
    /// The 4,096 bytes as they are.
    Raw = 0,
    /// LZ4 block format, as a pool stores an LZ4 fragment.
    Lz4 = 1,
    /// A zstd frame, as a pool stores a zstd fragment.
    Zstd = 2,
}

/// What one record says about blocks `lbn .. lbn + count` of the volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordBody {
    /// The blocks read as zeros (unmapped, trimmed or written with zeros).
    Zero,
    /// One block (`count` is 1) not sent before in this stream: its bytes, encoded.
    Data {
        /// How `bytes` encode the block.
        codec: PayloadCodec,
        /// The encoded block.
        bytes: Vec<u8>,
    },
    /// The blocks hold what blocks `source_lbn .. source_lbn + count` of this volume
    /// hold, all sent earlier in this stream (each distinct block is sent once).
    Ref {
        /// The first block the content was sent as.
        source_lbn: u64,
    },
    /// The blocks hold what blocks `source_lbn .. source_lbn + count` of the base
    /// hold (an incremental stream only): bytes the receiver has, never sent.
    BaseRef {
        /// The first block of the base.
        source_lbn: u64,
    },
    /// Digests of blocks the sender is about to send (a negotiated stream, before
    /// any block record): the receiver answers which ones it holds.
    Offer {
        /// The digests, in the order the answer's bits follow.
        digests: Vec<[u8; OFFER_DIGEST_BYTES]>,
    },
    /// The last offer: the receiver answers now.
    OffersEnd {
        /// Digests offered in all.
        offered: u64,
    },
    /// One block (`count` 1) holding the bytes of an offered digest the receiver
    /// answered it holds (a negotiated stream): never sent.
    PoolRef {
        /// The digest.
        digest: [u8; OFFER_DIGEST_BYTES],
    },
    /// The source snapshot (record 0 of a stream with flag bit 2): the receiver
    /// makes a snapshot of this name and identity of the volume it received.
    Snapshot {
        /// Its identity, the same in every pool (never 0).
        guid: u64,
        /// Its name within its volume (`SNAP` of `VOLUME@SNAP`).
        name: String,
    },
    /// The stream ends here; the counts of what came before, checked by the receiver.
    End {
        /// Data records before this one.
        data_records: u64,
        /// Blocks carried by reference records.
        ref_blocks: u64,
        /// Blocks carried by base reference records.
        base_ref_blocks: u64,
        /// Blocks carried by pool reference records.
        pool_ref_blocks: u64,
        /// Blocks carried by zero records.
        zero_blocks: u64,
    },
}

/// One record: where it is in the stream, which blocks it covers, and what they hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The record's number in the stream, from 0: the receiver's progress is counted
    /// in records, and a record out of place is refused.
    pub position: u64,
    /// The first block the record covers (0 for the end record).
    pub lbn: u64,
    /// Blocks covered (1 for data, 0 for the end record).
    pub count: u32,
    /// What they hold.
    pub body: RecordBody,
}

const KIND_ZERO: u8 = 1;
const KIND_DATA: u8 = 2;
const KIND_REF: u8 = 3;
const KIND_END: u8 = 4;
const KIND_BASE_REF: u8 = 5;
const KIND_OFFER: u8 = 6;
const KIND_POOL_REF: u8 = 7;
const KIND_OFFERS_END: u8 = 8;
const KIND_SNAPSHOT: u8 = 9;

/// The head of a record, decoded from its first 32 bytes before its payload is read
/// (its length is checked against [`PAYLOAD_BYTES_MAX`] here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHead {
    kind: u8,
    codec: u8,
    /// Bytes of payload that follow the head.
    pub payload_bytes: u32,
    position: u64,
    lbn: u64,
    count: u32,
    crc: u32,
}

impl Record {
    /// The record's bytes (head and payload); its checksum covers the stream key,
    /// so a record of another stream fails it.
    pub fn encode(&self, stream_key: &[u8; 32], out: &mut Vec<u8>) {
        let mut payload = [0u8; END_PAYLOAD_BYTES];
        let offers: Vec<u8>;
        let snapshot: Vec<u8>;
        let (kind, codec, payload): (u8, u8, &[u8]) = match &self.body {
            RecordBody::Snapshot { guid, name } => {
                snapshot = [&guid.to_le_bytes()[..], name.as_bytes()].concat();
                (KIND_SNAPSHOT, 0, &snapshot)
            }
            RecordBody::Offer { digests } => {
                offers = digests.concat();
                (KIND_OFFER, 0, &offers)
            }
            RecordBody::OffersEnd { offered } => {
                Writer::new(&mut payload).u64(*offered);
                (KIND_OFFERS_END, 0, payload.get(..8).unwrap_or(&[]))
            }
            RecordBody::PoolRef { digest } => (KIND_POOL_REF, 0, &digest[..]),
            RecordBody::Zero => (KIND_ZERO, 0, &[]),
            RecordBody::Data { codec, bytes } => (KIND_DATA, *codec as u8, bytes),
            RecordBody::Ref { source_lbn } | RecordBody::BaseRef { source_lbn } => {
                let mut w = Writer::new(&mut payload);
                w.u64(*source_lbn);
                let kind = if matches!(self.body, RecordBody::Ref { .. }) {
                    KIND_REF
                } else {
                    KIND_BASE_REF
                };
                (kind, 0, payload.get(..REF_PAYLOAD_BYTES).unwrap_or(&[]))
            }
            RecordBody::End {
                data_records,
                ref_blocks,
                base_ref_blocks,
                pool_ref_blocks,
                zero_blocks,
            } => {
                let mut w = Writer::new(&mut payload);
                w.u64(*data_records);
                w.u64(*ref_blocks);
                w.u64(*base_ref_blocks);
                w.u64(*pool_ref_blocks);
                w.u64(*zero_blocks);
                (KIND_END, 0, &payload[..])
            }
        };
        debug_assert!(
            payload.len() <= PAYLOAD_BYTES_MAX,
            "a payload past its limit"
        );
        let mut head = [0u8; RECORD_HEAD_BYTES];
        let mut w = Writer::new(&mut head);
        w.u8(kind);
        w.u8(codec);
        w.u16(0);
        w.u32(payload.len() as u32);
        w.u64(self.position);
        w.u64(self.lbn);
        w.u32(self.count);
        let crc = record_crc(stream_key, &head, payload);
        if let Some(dst) = head.get_mut(RECORD_CRC_OFFSET..) {
            dst.copy_from_slice(&crc.to_le_bytes());
        }
        out.extend_from_slice(&head);
        out.extend_from_slice(payload);
    }
}

fn record_crc(stream_key: &[u8; 32], head: &[u8; RECORD_HEAD_BYTES], payload: &[u8]) -> u32 {
    let crc = crc32c::crc32c(stream_key);
    let crc = crc32c::crc32c_append(crc, head.get(..RECORD_CRC_OFFSET).unwrap_or(head));
    let crc = crc32c::crc32c_append(crc, &[0; 4]);
    crc32c::crc32c_append(crc, payload)
}

impl RecordHead {
    /// Decode a record's head: its kind and payload length are checked here, so a
    /// reader never takes a damaged length for the size of what follows.
    pub fn decode(bytes: &[u8; RECORD_HEAD_BYTES]) -> Result<RecordHead, FormatError> {
        let mut r = Reader::new(WHAT_RECORD, bytes);
        let head = RecordHead {
            kind: r.u8()?,
            codec: r.u8()?,
            payload_bytes: {
                r.u16()?;
                r.u32()?
            },
            position: r.u64()?,
            lbn: r.u64()?,
            count: r.u32()?,
            crc: r.u32()?,
        };
        let allowed = match head.kind {
            KIND_ZERO => 0..=0,
            KIND_DATA => 1..=PAYLOAD_BYTES_MAX,
            KIND_REF | KIND_BASE_REF => REF_PAYLOAD_BYTES..=REF_PAYLOAD_BYTES,
            KIND_END => END_PAYLOAD_BYTES..=END_PAYLOAD_BYTES,
            KIND_OFFER => OFFER_DIGEST_BYTES..=PAYLOAD_BYTES_MAX,
            KIND_POOL_REF => OFFER_DIGEST_BYTES..=OFFER_DIGEST_BYTES,
            KIND_OFFERS_END => 8..=8,
            KIND_SNAPSHOT => {
                SNAPSHOT_GUID_BYTES + 1..=SNAPSHOT_GUID_BYTES + crate::catalog::MAX_NAME_BYTES
            }
            kind => {
                // A damaged kind byte is told apart from a new kind by the checksum,
                // which the caller has not read yet: both are refused here.
                return Err(invalid(
                    WHAT_RECORD,
                    format!(
                        "unknown record kind {kind} (position field {})",
                        head.position
                    ),
                ));
            }
        };
        if !allowed.contains(&(head.payload_bytes as usize)) {
            return Err(invalid(
                WHAT_RECORD,
                format!(
                    "record kind {} with a payload of {} bytes",
                    head.kind, head.payload_bytes
                ),
            ));
        }
        Ok(head)
    }

    /// Check the record's checksum over its head and `payload`, then its fields, and
    /// return the record. `header` bounds its blocks.
    pub fn finish(
        &self,
        head_bytes: &[u8; RECORD_HEAD_BYTES],
        payload: &[u8],
        header: &StreamHeader,
    ) -> Result<Record, FormatError> {
        let got = record_crc(&header.stream_key, head_bytes, payload);
        if got != self.crc {
            return Err(FormatError::ChecksumMismatch {
                what: WHAT_RECORD,
                got,
                expected: self.crc,
            });
        }
        let body = match self.kind {
            KIND_ZERO => RecordBody::Zero,
            KIND_DATA => RecordBody::Data {
                codec: match self.codec {
                    0 if payload.len() == BLOCK_BYTES => PayloadCodec::Raw,
                    1 if payload.len() < BLOCK_BYTES => PayloadCodec::Lz4,
                    2 if payload.len() < BLOCK_BYTES => PayloadCodec::Zstd,
                    codec => {
                        return Err(invalid(
                            WHAT_RECORD,
                            format!("data record with codec {codec} and {} bytes", payload.len()),
                        ))
                    }
                },
                bytes: payload.to_vec(),
            },
            KIND_REF => RecordBody::Ref {
                source_lbn: Reader::new(WHAT_RECORD, payload).u64()?,
            },
            KIND_BASE_REF => RecordBody::BaseRef {
                source_lbn: Reader::new(WHAT_RECORD, payload).u64()?,
            },
            KIND_OFFER => {
                if !payload.len().is_multiple_of(OFFER_DIGEST_BYTES) {
                    return Err(invalid(
                        WHAT_RECORD,
                        format!("an offer of {} bytes, not whole digests", payload.len()),
                    ));
                }
                RecordBody::Offer {
                    digests: payload
                        .chunks_exact(OFFER_DIGEST_BYTES)
                        .map(|c| {
                            let mut d = [0u8; OFFER_DIGEST_BYTES];
                            d.copy_from_slice(c);
                            d
                        })
                        .collect(),
                }
            }
            KIND_OFFERS_END => RecordBody::OffersEnd {
                offered: Reader::new(WHAT_RECORD, payload).u64()?,
            },
            KIND_POOL_REF => {
                let mut digest = [0u8; OFFER_DIGEST_BYTES];
                digest.copy_from_slice(payload);
                RecordBody::PoolRef { digest }
            }
            KIND_SNAPSHOT => {
                let guid = Reader::new(WHAT_RECORD, payload).u64()?;
                let name = payload
                    .get(SNAPSHOT_GUID_BYTES..)
                    .and_then(|n| std::str::from_utf8(n).ok())
                    .filter(|n| crate::catalog::validate_name(n).is_ok() && !n.contains('@'))
                    .ok_or_else(|| {
                        invalid(WHAT_RECORD, "a snapshot record's name is not a name".into())
                    })?;
                RecordBody::Snapshot {
                    guid,
                    name: name.to_string(),
                }
            }
            _ => {
                let mut r = Reader::new(WHAT_RECORD, payload);
                RecordBody::End {
                    data_records: r.u64()?,
                    ref_blocks: r.u64()?,
                    base_ref_blocks: r.u64()?,
                    pool_ref_blocks: r.u64()?,
                    zero_blocks: r.u64()?,
                }
            }
        };
        let record = Record {
            position: self.position,
            lbn: self.lbn,
            count: self.count,
            body,
        };
        record.check_bounds(header)?;
        Ok(record)
    }
}

impl Record {
    /// The record's blocks lie inside the volume; a data record covers one block, an
    /// end record none, a reference a source wholly before its own blocks, a base
    /// reference (incremental streams only) a source inside the base.
    fn check_bounds(&self, header: &StreamHeader) -> Result<(), FormatError> {
        let count = u64::from(self.count);
        let end = self.lbn.checked_add(count);
        let bad = |reason: String| Err(invalid(WHAT_RECORD, reason));
        let negotiation_only = matches!(
            self.body,
            RecordBody::Offer { .. } | RecordBody::OffersEnd { .. } | RecordBody::PoolRef { .. }
        );
        if let RecordBody::Snapshot { guid, .. } = &self.body {
            // The one place it may be: record 0 of a stream that says it has one.
            if !header.snapshot || self.position != 0 || self.lbn != 0 || count != 0 {
                return bad(format!(
                    "a snapshot record at position {} (block {}, count {count}) in a stream \
                     {} a snapshot",
                    self.position,
                    self.lbn,
                    if header.snapshot { "of" } else { "not of" }
                ));
            }
            if *guid == 0 {
                return bad("a snapshot of identity 0".into());
            }
            return Ok(());
        }
        if header.snapshot && self.position == 0 {
            return bad("record 0 of a snapshot's stream is not its snapshot record".into());
        }
        if negotiation_only && !header.negotiated {
            return bad(format!(
                "record {} belongs to a negotiated stream, and this one is not",
                self.position
            ));
        }
        match &self.body {
            RecordBody::Offer { digests } if self.lbn != 0 || count != digests.len() as u64 => {
                bad(format!("an offer at block {} count {count}", self.lbn))
            }
            RecordBody::Offer { .. } => Ok(()),
            RecordBody::OffersEnd { .. } if self.lbn != 0 || count != 0 => {
                bad(format!("the offers' end at block {} count {count}", self.lbn))
            }
            RecordBody::OffersEnd { .. } => Ok(()),
            RecordBody::PoolRef { .. } if count != 1 => {
                bad(format!("a pool reference of {count} blocks (one a record)"))
            }
            RecordBody::End { .. } if self.lbn != 0 || count != 0 => {
                bad(format!("end record at block {} count {count}", self.lbn))
            }
            RecordBody::End { .. } => Ok(()),
            RecordBody::Data { .. } if count != 1 => {
                bad(format!("data record of {count} blocks (one a record)"))
            }
            _ if count == 0 => bad(format!("record {} covers no block", self.position)),
            _ if end.is_none_or(|end| end > header.volume_blocks()) => bad(format!(
                "blocks {}..+{count} past the volume's {} blocks",
                self.lbn,
                header.volume_blocks()
            )),
            RecordBody::Ref { source_lbn }
                if source_lbn.checked_add(count).is_none_or(|end| end > self.lbn) =>
            {
                bad(format!(
                    "blocks {}..+{count} refer to blocks {source_lbn}..+{count}, not all before them",
                    self.lbn
                ))
            }
            RecordBody::BaseRef { source_lbn } => match header.base {
                None => bad(format!(
                    "record {} refers to a base, in a full stream",
                    self.position
                )),
                Some(base)
                    if source_lbn
                        .checked_add(count)
                        .is_none_or(|end| end > base.size_bytes / BLOCK_BYTES as u64) =>
                {
                    bad(format!(
                        "blocks {}..+{count} refer to base blocks {source_lbn}..+{count}, \
                         past the base's {} blocks",
                        self.lbn,
                        base.size_bytes / BLOCK_BYTES as u64
                    ))
                }
                Some(_) => Ok(()),
            },
            _ => Ok(()),
        }
    }
}

/// The receiver's answer to a negotiated stream's offers: bit `i` (byte `i / 8`,
/// bit `i % 8`) set when it holds the bytes of the `i`th digest offered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// Digests answered (the number offered).
    pub count: u64,
    /// The bits, `count.div_ceil(8)` bytes.
    pub bitmap: Vec<u8>,
}

const WHAT_ANSWER: &str = "negotiation answer";

impl Answer {
    /// Head and bitmap; the crc covers the head (crc taken as zero) and the bitmap.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; ANSWER_HEAD_BYTES];
        let mut w = Writer::new(&mut out);
        w.u64(ANSWER_MAGIC);
        w.u64(self.count);
        out.extend_from_slice(&self.bitmap);
        let crc = crate::checksum_with_hole(&out, 16);
        if let Some(dst) = out.get_mut(16..20) {
            dst.copy_from_slice(&crc.to_le_bytes());
        }
        out
    }

    /// Check the head of an answer to `offered` digests; returns the bitmap's length.
    pub fn bitmap_bytes(
        head: &[u8; ANSWER_HEAD_BYTES],
        offered: u64,
    ) -> Result<usize, FormatError> {
        let mut r = Reader::new(WHAT_ANSWER, head);
        let magic = r.u64()?;
        if magic != ANSWER_MAGIC {
            return Err(FormatError::BadMagic {
                what: WHAT_ANSWER,
                found: magic,
            });
        }
        let count = r.u64()?;
        if count != offered {
            return Err(invalid(
                WHAT_ANSWER,
                format!("answers {count} digests, {offered} were offered"),
            ));
        }
        usize::try_from(count.div_ceil(8))
            .map_err(|_| invalid(WHAT_ANSWER, format!("{count} digests")))
    }

    /// Check the crc over the head and `bitmap`, and return the answer.
    pub fn decode(head: &[u8; ANSWER_HEAD_BYTES], bitmap: &[u8]) -> Result<Answer, FormatError> {
        let mut bytes = head.to_vec();
        bytes.extend_from_slice(bitmap);
        crate::verify_checksum(WHAT_ANSWER, &bytes, 16)?;
        let count = Reader::new(WHAT_ANSWER, head.get(8..16).unwrap_or(&[])).u64()?;
        Ok(Answer {
            count,
            bitmap: bitmap.to_vec(),
        })
    }

    /// Whether the `i`th digest is held.
    pub fn holds(&self, i: u64) -> bool {
        let byte = usize::try_from(i / 8).ok().and_then(|b| self.bitmap.get(b));
        byte.is_some_and(|b| b & (1 << (i % 8)) != 0)
    }
}

fn invalid(what: &'static str, reason: String) -> FormatError {
    FormatError::Invalid { what, reason }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "tests fail loudly by design"
)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header() -> StreamHeader {
        StreamHeader {
            volume_size_bytes: 1 << 30,
            source_pool_id: 0x1234,
            stream_key: [7; 32],
            base: Some(BaseId {
                name: BaseId::pad_name("base0").unwrap(),
                size_bytes: 1 << 29,
                content_digest: [9; 32],
                guid: None,
            }),
            negotiated: false,
            source_map_digest: 42,
            snapshot: false,
        }
    }

    /// A snapshot's stream incremental from an older snapshot, named by identity.
    fn snapshot_header() -> StreamHeader {
        let mut h = header();
        h.snapshot = true;
        h.base = Some(BaseId {
            name: BaseId::pad_name("vm1@s1").unwrap(),
            size_bytes: 1 << 29,
            content_digest: [0; 32],
            guid: Some(0xfeed_beef),
        });
        h
    }

    #[test]
    fn a_snapshot_stream_carries_its_identity_and_its_base_s() {
        let h = snapshot_header();
        let bytes = h.encode();
        let decoded = StreamHeader::decode(&bytes).unwrap();
        assert_eq!(decoded, h);
        assert_eq!(decoded.base.unwrap().name_str(), Some("vm1@s1"));
        for i in 0..HEADER_BYTES {
            let mut bad = bytes;
            bad[i] ^= 0x10;
            assert!(StreamHeader::decode(&bad).is_err(), "byte {i}");
        }
        // A full stream may not name a base snapshot.
        let mut full = h.encode();
        full[16] &= !(FLAG_INCREMENTAL as u8);
        full[72..184].fill(0);
        crate::seal_checksum(&mut full, HEADER_CRC_OFFSET);
        assert!(StreamHeader::decode(&full).is_err());

        let snapshot = Record {
            position: 0,
            lbn: 0,
            count: 0,
            body: RecordBody::Snapshot {
                guid: 0x1234_5678_9abc_def0,
                name: "s2".into(),
            },
        };
        let mut bytes = Vec::new();
        snapshot.encode(&h.stream_key, &mut bytes);
        assert_eq!(decode(&bytes, &h).unwrap(), snapshot);
        // Only as record 0 of a stream that says it has one, with a name and an identity.
        assert!(decode(&bytes, &header()).is_err());
        let refused = [(1, "s2", 1), (0, "s2", 0), (0, "a@b", 1), (0, "-x", 1)];
        for (position, name, guid) in refused {
            let mut bytes = Vec::new();
            Record {
                position,
                lbn: 0,
                count: 0,
                body: RecordBody::Snapshot {
                    guid,
                    name: name.into(),
                },
            }
            .encode(&h.stream_key, &mut bytes);
            assert!(decode(&bytes, &h).is_err(), "{position} {name} {guid}");
        }
        // Record 0 of a snapshot's stream must be the snapshot record.
        let mut bytes = Vec::new();
        Record {
            position: 0,
            lbn: 0,
            count: 1,
            body: RecordBody::Zero,
        }
        .encode(&h.stream_key, &mut bytes);
        assert!(decode(&bytes, &h).is_err());
        assert!(decode(&bytes, &header()).is_ok());
    }

    fn decode(bytes: &[u8], header: &StreamHeader) -> Result<Record, FormatError> {
        let head_bytes: [u8; RECORD_HEAD_BYTES] = bytes[..RECORD_HEAD_BYTES].try_into().unwrap();
        let head = RecordHead::decode(&head_bytes)?;
        let payload = &bytes[RECORD_HEAD_BYTES..];
        assert_eq!(payload.len(), head.payload_bytes as usize);
        head.finish(&head_bytes, payload, header)
    }

    #[test]
    fn header_round_trips_and_refuses_damage() {
        let h = header();
        let bytes = h.encode();
        assert_eq!(StreamHeader::decode(&bytes).unwrap(), h);
        let full = StreamHeader { base: None, ..h };
        assert_eq!(StreamHeader::decode(&full.encode()).unwrap(), full);
        for i in 0..HEADER_BYTES {
            let mut bad = bytes;
            bad[i] ^= 0x10;
            assert!(StreamHeader::decode(&bad).is_err(), "byte {i}");
        }
        assert!(matches!(
            StreamHeader::decode(&bytes[..100]),
            Err(FormatError::Truncated { .. })
        ));
    }

    #[test]
    fn records_round_trip() {
        let h = header();
        let records = [
            Record {
                position: 0,
                lbn: 0,
                count: 100,
                body: RecordBody::Zero,
            },
            Record {
                position: 1,
                lbn: 100,
                count: 1,
                body: RecordBody::Data {
                    codec: PayloadCodec::Raw,
                    bytes: vec![5; BLOCK_BYTES],
                },
            },
            Record {
                position: 2,
                lbn: 101,
                count: 1,
                body: RecordBody::Data {
                    codec: PayloadCodec::Lz4,
                    bytes: vec![1, 2, 3],
                },
            },
            Record {
                position: 3,
                lbn: 300,
                count: 2,
                body: RecordBody::Ref { source_lbn: 100 },
            },
            Record {
                position: 4,
                lbn: 400,
                count: 3,
                body: RecordBody::BaseRef { source_lbn: 1000 },
            },
            Record {
                position: 5,
                lbn: 0,
                count: 0,
                body: RecordBody::End {
                    data_records: 2,
                    ref_blocks: 2,
                    base_ref_blocks: 3,
                    pool_ref_blocks: 0,
                    zero_blocks: 100,
                },
            },
        ];
        for record in records {
            let mut bytes = Vec::new();
            record.encode(&h.stream_key, &mut bytes);
            assert_eq!(decode(&bytes, &h).unwrap(), record);
        }
    }

    #[test]
    fn a_record_of_another_stream_fails_its_checksum() {
        let h = header();
        let mut bytes = Vec::new();
        Record {
            position: 0,
            lbn: 0,
            count: 1,
            body: RecordBody::Zero,
        }
        .encode(&[8; 32], &mut bytes);
        assert!(matches!(
            decode(&bytes, &h),
            Err(FormatError::ChecksumMismatch { .. })
        ));
    }

    #[test]
    fn out_of_bounds_records_are_refused() {
        let h = header();
        let blocks = h.volume_blocks();
        let bad = [
            (blocks, 1, RecordBody::Zero),
            (blocks - 1, 2, RecordBody::Zero),
            (u64::MAX, 2, RecordBody::Zero),
            (5, 0, RecordBody::Zero),
            (5, 2, RecordBody::Ref { source_lbn: 4 }),
            (5, 1, RecordBody::Ref { source_lbn: 5 }),
            (
                5,
                1,
                RecordBody::BaseRef {
                    source_lbn: (1 << 29) / 4096,
                },
            ),
            (
                5,
                2,
                RecordBody::Data {
                    codec: PayloadCodec::Raw,
                    bytes: vec![0; BLOCK_BYTES],
                },
            ),
        ];
        for (lbn, count, body) in bad {
            let mut bytes = Vec::new();
            Record {
                position: 0,
                lbn,
                count,
                body: body.clone(),
            }
            .encode(&h.stream_key, &mut bytes);
            assert!(decode(&bytes, &h).is_err(), "{lbn} {count} {body:?}");
        }
    }

    #[test]
    fn a_base_reference_is_refused_in_a_full_stream() {
        let h = StreamHeader {
            base: None,
            ..header()
        };
        let mut bytes = Vec::new();
        Record {
            position: 0,
            lbn: 0,
            count: 1,
            body: RecordBody::BaseRef { source_lbn: 0 },
        }
        .encode(&h.stream_key, &mut bytes);
        assert!(decode(&bytes, &h).is_err());
    }

    #[test]
    fn negotiation_records_and_the_answer_round_trip() {
        let h = StreamHeader {
            negotiated: true,
            ..header()
        };
        assert_eq!(StreamHeader::decode(&h.encode()).unwrap(), h);
        let records = [
            Record {
                position: 0,
                lbn: 0,
                count: 2,
                body: RecordBody::Offer {
                    digests: vec![[1; 16], [2; 16]],
                },
            },
            Record {
                position: 1,
                lbn: 0,
                count: 0,
                body: RecordBody::OffersEnd { offered: 2 },
            },
            Record {
                position: 2,
                lbn: 9,
                count: 1,
                body: RecordBody::PoolRef { digest: [2; 16] },
            },
        ];
        for record in records {
            let mut bytes = Vec::new();
            record.encode(&h.stream_key, &mut bytes);
            assert_eq!(decode(&bytes, &h).unwrap(), record);
            // Not in a stream without negotiation.
            assert!(decode(&bytes, &header()).is_err());
        }
        let answer = Answer {
            count: 10,
            bitmap: vec![0b0000_0101, 0b10],
        };
        let bytes = answer.encode();
        let head: [u8; ANSWER_HEAD_BYTES] = bytes[..ANSWER_HEAD_BYTES].try_into().unwrap();
        assert_eq!(Answer::bitmap_bytes(&head, 10).unwrap(), 2);
        assert!(Answer::bitmap_bytes(&head, 11).is_err());
        let decoded = Answer::decode(&head, &bytes[ANSWER_HEAD_BYTES..]).unwrap();
        assert_eq!(decoded, answer);
        assert!(decoded.holds(0) && !decoded.holds(1) && decoded.holds(2) && decoded.holds(9));
        let mut bad = bytes.clone();
        bad[21] ^= 1;
        assert!(Answer::decode(&head, &bad[ANSWER_HEAD_BYTES..]).is_err());
    }

    proptest! {
        /// Any flipped bit of a record is refused, never decoded as another record.
        #[test]
        fn a_flipped_bit_is_refused(bit in 0usize..(RECORD_HEAD_BYTES + 16) * 8) {
            let h = header();
            let mut bytes = Vec::new();
            Record {
                position: 3,
                lbn: 17,
                count: 1,
                body: RecordBody::Data { codec: PayloadCodec::Lz4, bytes: vec![0xab; 16] },
            }
            .encode(&h.stream_key, &mut bytes);
            bytes[bit / 8] ^= 1 << (bit % 8);
            let head_bytes: [u8; RECORD_HEAD_BYTES] = bytes[..RECORD_HEAD_BYTES].try_into().unwrap();
            let result = RecordHead::decode(&head_bytes).and_then(|head| {
                let payload = bytes.get(RECORD_HEAD_BYTES..RECORD_HEAD_BYTES + head.payload_bytes as usize)
                    .ok_or(FormatError::Truncated { what: "test", got: 0, need: 0 })?;
                head.finish(&head_bytes, payload, &h)
            });
            prop_assert!(result.is_err());
        }
    }
}
