//! Block-map entries and stored-object locations: the two 64-bit words the
//! write path moves around.

use crate::FormatError;

/// What one logical block of a volume maps to (a block-map entry, 8 bytes on disk).
///
/// Encoding: `0` unmapped (never written, or trimmed), `1` zero (written as zeros,
/// nothing stored), `n ≥ 2` stored object `n - 2`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MapEntry {
    /// Never written or trimmed: reads as zeros, reported as a hole.
    Unmapped,
    /// Written with zeros: reads as zeros, nothing stored.
    Zero,
    /// Backed by a stored object.
    Object(ObjectId),
}

/// Index of a stored object (slab × objects-per-slab + index in slab).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectId(pub u64);

impl MapEntry {
    /// The 64-bit encoding.
    pub fn encode(self) -> u64 {
        match self {
            MapEntry::Unmapped => 0,
            MapEntry::Zero => 1,
            MapEntry::Object(ObjectId(id)) => id + 2,
        }
    }
    /// Decode a 64-bit word.
    pub fn decode(raw: u64) -> Self {
        match raw {
            0 => MapEntry::Unmapped,
            1 => MapEntry::Zero,
            n => MapEntry::Object(ObjectId(n - 2)),
        }
    }
    /// The object, if any.
    pub fn object(self) -> Option<ObjectId> {
        match self {
            MapEntry::Object(o) => Some(o),
            _ => None,
        }
    }
}

/// The compressor a fragment was written with. Recorded so a pool can gain codecs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// LZ4 block format (`lz4_flex::block`), no size prefix.
    Lz4 = 1,
    /// A zstd frame (RFC 8878) without checksum, dictionary or content size.
    Zstd = 2,
}

/// Where a stored object's bytes are.
///
/// Encoding (u64): bit 63 clear: a whole 4 KiB block, bits 0–47 its data block
/// number. Bit 63 set: a compressed fragment, bits 0–47 the byte address of its
/// first byte in the data region, bits 48–59 its length in bytes (1–4095), bits
/// 60–62 its codec (1 LZ4, 2 zstd). A fragment may span two consecutive data blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// An uncompressed 4 KiB block.
    Block {
        /// Data block number (data region relative).
        pbn: u64,
    },
    /// A compressed fragment packed byte-contiguously.
    Fragment {
        /// Byte address in the data region.
        addr_bytes: u64,
        /// Compressed length in bytes.
        len_bytes: u16,
        /// How it was compressed.
        codec: Codec,
    },
}

const FRAGMENT_BIT: u64 = 1 << 63;
const ADDR_MASK: u64 = (1 << 48) - 1;
/// The largest data block number a location holds (48 bits).
pub const MAX_PBN: u64 = ADDR_MASK;

impl Location {
    /// The 64-bit encoding.
    pub fn encode(self) -> u64 {
        match self {
            Location::Block { pbn } => pbn & ADDR_MASK,
            Location::Fragment {
                addr_bytes,
                len_bytes,
                codec,
            } => {
                FRAGMENT_BIT
                    | ((codec as u64) << 60)
                    | ((u64::from(len_bytes) & 0xfff) << 48)
                    | (addr_bytes & ADDR_MASK)
            }
        }
    }
    /// Decode; an unknown codec or a zero length is an error.
    pub fn decode(raw: u64) -> Result<Self, FormatError> {
        if raw & FRAGMENT_BIT == 0 {
            if raw & !ADDR_MASK != 0 {
                return Err(FormatError::Invalid {
                    what: "location",
                    reason: format!("reserved bits set in {raw:#x}"),
                });
            }
            return Ok(Location::Block { pbn: raw });
        }
        let codec = match (raw >> 60) & 0x7 {
            1 => Codec::Lz4,
            2 => Codec::Zstd,
            c => {
                return Err(FormatError::Invalid {
                    what: "location",
                    reason: format!("unknown codec {c}"),
                })
            }
        };
        let len_bytes = ((raw >> 48) & 0xfff) as u16;
        if len_bytes == 0 {
            return Err(FormatError::Invalid {
                what: "location",
                reason: "zero-length fragment".into(),
            });
        }
        Ok(Location::Fragment {
            addr_bytes: raw & ADDR_MASK,
            len_bytes,
            codec,
        })
    }
    /// The data blocks this location touches: first block and count (1 or 2).
    pub fn blocks(self) -> (u64, u64) {
        match self {
            Location::Block { pbn } => (pbn, 1),
            Location::Fragment {
                addr_bytes,
                len_bytes,
                ..
            } => {
                let first = addr_bytes / crate::BLOCK_BYTES as u64;
                let last = (addr_bytes + u64::from(len_bytes) - 1) / crate::BLOCK_BYTES as u64;
                (first, last - first + 1)
            }
        }
    }
    /// Bytes this location occupies in the data region.
    pub fn stored_bytes(self) -> u64 {
        match self {
            Location::Block { .. } => crate::BLOCK_BYTES as u64,
            Location::Fragment { len_bytes, .. } => u64::from(len_bytes),
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
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn map_entry_round_trips(raw in any::<u64>()) {
            prop_assert_eq!(MapEntry::decode(raw).encode(), raw);
        }

        #[test]
        fn fragment_round_trips(addr in 0u64..(1 << 48), len in 1u16..4096, zstd in any::<bool>()) {
            let codec = if zstd { Codec::Zstd } else { Codec::Lz4 };
            let loc = Location::Fragment { addr_bytes: addr, len_bytes: len, codec };
            prop_assert_eq!(Location::decode(loc.encode()).ok(), Some(loc));
        }

        #[test]
        fn any_word_decodes_without_panic(raw in any::<u64>()) {
            let _ = Location::decode(raw);
        }
    }

    #[test]
    fn fragment_spanning_a_block_boundary_touches_two_blocks() {
        let loc = Location::Fragment {
            addr_bytes: 4000,
            len_bytes: 200,
            codec: Codec::Lz4,
        };
        assert_eq!(loc.blocks(), (0, 2));
        let loc = Location::Fragment {
            addr_bytes: 4096,
            len_bytes: 4095,
            codec: Codec::Lz4,
        };
        assert_eq!(loc.blocks(), (1, 1));
    }
}
