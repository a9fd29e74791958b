//! Partial blocks: a write that covers only part of a 4 KiB logical block (any
//! byte offset, any length down to one byte) is a read-modify-write of that block
//! through the ordinary write path — zero check, dedup, compression, journal.
//!
//! How a block is held during its read-modify-write (ARCHITECTURE.md, "Partial
//! blocks", says the same):
//! - The caller holds the block's **stripe lock** (`LbnLocks::stripe`) from the read to
//!   the map update. Every write of a block takes it, whole or partial, so two writes
//!   of the same block — two partial ones, or a partial and an aligned one — never
//!   overlap: each starts from what the other left. An aligned write whose stripe has
//!   no partial write in flight finds it free: one uncontended lock per block, which
//!   the aligned path paid before byte granularity too.
//! - Range operations (trim and write-zeroes of whole blocks) take no stripe lock: a
//!   15 GiB trim would take four million. They only ever set an entry to ZERO or
//!   unmapped, under the map page's lock. So the map update that ends a
//!   read-modify-write is conditional: under the page lock, the entry must still be
//!   one that reads as what was read (`reads_alike`). If a range operation changed
//!   it in between, the new block is dropped and the read-modify-write starts again
//!   from the zeros the range operation left.
//! - An object the read-modify-write is reading may lose its last reference to such
//!   a range operation, and its record is cleared: the read fails, the entry has
//!   changed, and the read is tried again on what the range operation left. The
//!   object's slot and bytes are not reused under it: freed ones become reusable only
//!   after a checkpoint, and a checkpoint waits for the gate, which the caller holds
//!   shared throughout. A plain read that loses a race with any write of its block
//!   is tried again the same way, under the block's stripe lock (`read_block`).

use crate::block_map::VolumeState;
use crate::inner::Inner;
use crate::inner::Wait;
use crate::read_path::{read_object_settled, RMW_ATTEMPTS_MAX};
use crate::{EngineError, Result};
use fewerbytes_format::BLOCK_BYTES;

/// Write `src` at byte `within` of block `lbn`, keeping the block's other bytes.
/// Caller holds the gate (shared) and the block's stripe lock; `within + src.len()`
/// is at most one block.
pub(crate) fn write_partial(
    inner: &Inner,
    vol: &VolumeState,
    lbn: u64,
    within: usize,
    src: &[u8],
) -> Result<()> {
    debug_assert!(within + src.len() <= BLOCK_BYTES);
    let mut block = [0u8; BLOCK_BYTES];
    for _ in 0..RMW_ATTEMPTS_MAX {
        let (_, base) = read_object_settled(inner, vol, lbn, &mut block, Wait::Yes)?;
        if let Some(dst) = block.get_mut(within..within + src.len()) {
            dst.copy_from_slice(src);
        }
        if crate::write_path::write_block(inner, vol, lbn, &block, Some(base))? {
            return Ok(());
        }
    }
    Err(EngineError::Refused(format!(
        "read-modify-write of block {lbn} of volume '{}' lost its race {RMW_ATTEMPTS_MAX} times \
         (a bug: only range operations may change a block under its stripe lock)",
        vol.name()
    )))
}
