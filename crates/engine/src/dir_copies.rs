//! The two copies of a directory page (format version 3, `docs/format.md`,
//! "Version 3: two copies of every directory page"): a checkpoint writes each
//! directory page twice, byte for byte, to two addresses its parent's twinned
//! reference names (`checkpoint.rs`). Reading takes the first copy; when it fails
//! any check (a read error, its checksum, its slot, the reference's crc and
//! generation), the second. A page read from its second copy counts as a metadata
//! copy repaired (`metadata_copies_repaired`), and the caller marks it for
//! rewriting, so the next checkpoint writes both copies anew. Both failing is
//! corruption, reported at the first copy with what was wrong with each.

use crate::inner::Inner;
use crate::page_read::{page_place, read_page_at};
use crate::{EngineError, Result};
use fewerbytes_format::page::{PageHeader, PageKind, PageRef};
use fewerbytes_format::BLOCK_BYTES;

/// Read and verify the directory page `reference` names into `buf` (its payload is
/// `buf` past the header), from its first copy or else its second. Returns its
/// header, and whether it came from the second copy.
pub(crate) fn read_dir_page(
    inner: &Inner,
    buf: &mut [u8; BLOCK_BYTES],
    reference: &PageRef,
    owner: u64,
    index: u64,
) -> Result<(PageHeader, bool)> {
    let kind = PageKind::Directory;
    let first = match read_page_at(inner, buf, kind, reference, reference.address, owner, index) {
        Ok(header) => return Ok((header, false)),
        Err(e) => e,
    };
    if reference.twin == 0 {
        return Err(first);
    }
    match read_page_at(inner, buf, kind, reference, reference.twin, owner, index) {
        Ok(header) => {
            tracing::warn!(
                "directory page {index} (level {}) of table {owner}: its first copy failed \
                 ({first}); read from its second copy, which the next checkpoint rewrites \
                 with a new first copy",
                header.level
            );
            inner.checkpointer.count_copy_repaired();
            Ok((header, true))
        }
        Err(second) => Err(both_failed(inner, reference, first, second)),
    }
}

/// The corruption report when both copies fail: at the first copy's block, with
/// what was wrong with each (the second's names its block).
fn both_failed(
    inner: &Inner,
    reference: &PageRef,
    first: EngineError,
    second: EngineError,
) -> EngineError {
    // The second's error names its own block and device.
    let both = |reason: String| {
        format!("both copies of the directory page are bad: first copy: {reason}; second copy: {second}")
    };
    match first {
        EngineError::Corrupt {
            region,
            block,
            device,
            reason,
        } => EngineError::Corrupt {
            region,
            block,
            device,
            reason: both(reason),
        },
        other => {
            let (_, _, corrupt) = match page_place(inner, PageKind::Directory, reference.address) {
                Ok(place) => place,
                Err(e) => return e,
            };
            corrupt(both(other.to_string()))
        }
    }
}
