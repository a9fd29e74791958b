//! On-disk structures of a fewerbytes pool, as specified in `docs/format.md`.
//!
//! Every structure here is a pair: a Rust value and its fixed-width little-endian
//! encoding. Decoding goes through checks in a fixed order (length, magic, version,
//! checksum, pool nonce, own address) and returns a typed [`FormatError`] naming
//! what failed; nothing decoded from a disk is trusted before that.
//!
//! **Architecture invariant:** `format` does no I/O.

#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::indexing_slicing)]

mod bytes;
pub mod catalog;
pub mod counters;
pub mod dir_tree;
pub mod journal;
pub mod location;
pub mod page;
pub mod stream;
pub mod superblock;
pub mod twin_ref;

pub use bytes::{Reader, Writer};

/// Bytes in a block: the allocation unit of data and metadata, the guest's write size.
pub const BLOCK_BYTES: usize = 4096;
/// Bytes in a sector: the smallest write the format relies on being atomic.
pub const SECTOR_BYTES: usize = 512;
/// The format version this code writes (and reads, with [`FORMAT_VERSION_2`] and
/// [`FORMAT_VERSION_1`]): version 2 with two copies of every directory page
/// (`docs/format.md`, "Version 3: two copies of every directory page").
pub const FORMAT_VERSION: u32 = 3;
/// The second format version: page references, count and fingerprint tables,
/// directory trees with one copy of each page. Still read, and upgraded at a pool's
/// first read-write checkpoint (`docs/format.md`, "Upgrade from version 2").
pub const FORMAT_VERSION_2: u32 = 2;
/// The first format version: still read, and upgraded at a pool's first read-write
/// checkpoint (`docs/format.md`, "Upgrade from version 1").
pub const FORMAT_VERSION_1: u32 = 1;

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// Fewer bytes than the structure needs.
    #[error("{what}: truncated ({got} bytes, need {need})")]
    Truncated {
        /// The structure.
        what: &'static str,
        /// Bytes available.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// The magic number is not this structure's.
    #[error("{what}: bad magic {found:#x}")]
    BadMagic {
        /// The structure.
        what: &'static str,
        /// The magic found.
        found: u64,
    },
    /// A version this code does not read.
    #[error("{what}: unsupported version {found} (this build reads {supported})")]
    BadVersion {
        /// The structure.
        what: &'static str,
        /// Version found.
        found: u32,
        /// Version supported.
        supported: u32,
    },
    /// The checksum does not match the content.
    #[error("{what}: checksum mismatch (stored {expected:#010x}, computed {got:#010x})")]
    ChecksumMismatch {
        /// The structure.
        what: &'static str,
        /// Computed over the bytes.
        got: u32,
        /// Stored in the bytes.
        expected: u32,
    },
    /// The block belongs to another pool.
    #[error("{what}: belongs to another pool (nonce {found:#x}, expected {expected:#x})")]
    WrongPool {
        /// The structure.
        what: &'static str,
        /// Nonce found.
        found: u64,
        /// This pool's nonce.
        expected: u64,
    },
    /// The block says it lives somewhere else (a misdirected or stale write).
    #[error("{what}: names address {found}, read from {expected}")]
    WrongAddress {
        /// The structure.
        what: &'static str,
        /// Address recorded in the block.
        found: u64,
        /// Where it was read from.
        expected: u64,
    },
    /// A page that passes its own checks but is not the page its parent references:
    /// a lost write left an older page in its slot, or another page landed there.
    #[error("{what}: not the page its parent references (page crc {found_crc:#010x} generation {found_generation}, the reference holds crc {expected_crc:#010x} generation {expected_generation}): a lost or misdirected write")]
    StalePage {
        /// The structure.
        what: &'static str,
        /// The page's own crc.
        found_crc: u32,
        /// The crc its reference holds.
        expected_crc: u32,
        /// The page's generation (low 32 bits).
        found_generation: u32,
        /// The generation its reference holds.
        expected_generation: u32,
    },
    /// A field holds a value the format does not allow.
    #[error("{what}: {reason}")]
    Invalid {
        /// The structure.
        what: &'static str,
        /// What was wrong.
        reason: String,
    },
}

/// crc32c of `bytes` with the 4 bytes at `crc_offset` taken as zero.
pub fn checksum_with_hole(bytes: &[u8], crc_offset: usize) -> u32 {
    let head = bytes.get(..crc_offset).unwrap_or(bytes);
    let tail = bytes.get(crc_offset + 4..).unwrap_or(&[]);
    let crc = crc32c::crc32c(head);
    let crc = crc32c::crc32c_append(crc, &[0; 4]);
    crc32c::crc32c_append(crc, tail)
}

/// Check the crc stored at `crc_offset` against the content.
pub fn verify_checksum(
    what: &'static str,
    bytes: &[u8],
    crc_offset: usize,
) -> Result<(), FormatError> {
    let mut r = Reader::new(what, bytes);
    r.seek(crc_offset);
    let expected = r.u32()?;
    let got = checksum_with_hole(bytes, crc_offset);
    if got != expected {
        return Err(FormatError::ChecksumMismatch {
            what,
            got,
            expected,
        });
    }
    Ok(())
}

/// Store the crc of `bytes` at `crc_offset`, and return it.
pub fn seal_checksum(bytes: &mut [u8], crc_offset: usize) -> u32 {
    let crc = checksum_with_hole(bytes, crc_offset);
    if let Some(dst) = bytes.get_mut(crc_offset..crc_offset + 4) {
        dst.copy_from_slice(&crc.to_le_bytes());
    }
    crc
}

/// Start decoding a block that begins with a u32 magic followed by its u32 crc:
/// check its length, magic and checksum, and return a reader just past the crc.
pub fn open_block<'a>(
    what: &'static str,
    bytes: &'a [u8],
    len: usize,
    magic: u32,
) -> Result<Reader<'a>, FormatError> {
    if bytes.len() != len {
        return Err(FormatError::Truncated {
            what,
            got: bytes.len(),
            need: len,
        });
    }
    let mut r = Reader::new(what, bytes);
    let found = r.u32()?;
    if found != magic {
        return Err(FormatError::BadMagic {
            what,
            found: u64::from(found),
        });
    }
    verify_checksum(what, bytes, 4)?;
    r.u32()?;
    Ok(r)
}

/// A block of another pool is refused.
pub fn check_nonce(what: &'static str, found: u64, expected: u64) -> Result<(), FormatError> {
    if found != expected {
        return Err(FormatError::WrongPool {
            what,
            found,
            expected,
        });
    }
    Ok(())
}
