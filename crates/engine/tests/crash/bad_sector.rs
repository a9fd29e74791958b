//! "One bad sector" faults: at some crash points, one byte of one live journal sector
//! of the crashed image is overwritten before the open, as a drive whose sector rotted
//! would return it. Parity rebuilds it, so every guarantee of a crash still holds; a
//! flip replay took for the journal's end would lose flushed writes and fail the model.

use fewerbytes_engine::storage::Image;
use fewerbytes_format::journal::decode_sector;
use fewerbytes_format::superblock::SuperBlock;
use fewerbytes_format::{BLOCK_BYTES, SECTOR_BYTES};

/// One crash point in this many also has a bad journal sector.
pub(crate) const BAD_SECTOR_EVERY: u64 = 3;

/// The newest valid super block copy of a metadata image.
fn newest_super_block(image: &Image) -> Option<SuperBlock> {
    (0..2u64)
        .filter_map(|c| {
            let mut block = vec![0u8; BLOCK_BYTES];
            image.read(&mut block, c * BLOCK_BYTES as u64);
            SuperBlock::decode(&block).ok()
        })
        .max_by_key(|sb| sb.generation)
}

/// Byte offsets of the live journal sectors of a metadata image: from the replay
/// point, while each carries its sequence number and the open generation.
fn live_sectors(image: &Image, sb: &SuperBlock) -> Vec<u64> {
    let start = sb.journal_start_block * BLOCK_BYTES as u64;
    let mut live = Vec::new();
    let mut sector = [0u8; SECTOR_BYTES];
    for seq in sb.journal_replay_seq..sb.journal_replay_seq + sb.journal_sectors {
        let at = start + (seq % sb.journal_sectors) * SECTOR_BYTES as u64;
        image.read(&mut sector, at);
        let whole = match decode_sector(&sector, sb.nonce) {
            Ok((h, _)) => h.seq == seq && h.open_gen == sb.open_gen,
            Err(_) => {
                sector[..4] == *b"FBJP"
                    && sector[8..16] == seq.to_le_bytes()
                    && sector[16..20] == sb.open_gen.to_le_bytes()
            }
        };
        if !whole {
            break;
        }
        live.push(at);
    }
    live
}

/// Overwrite one byte of one live journal sector of `meta` (chosen by `pick`), if it
/// has any; says which, for a failure's message.
pub(crate) fn rot_one(meta: &mut Image, pick: u64) -> Option<String> {
    let sb = newest_super_block(meta)?;
    let live = live_sectors(meta, &sb);
    if live.is_empty() {
        return None;
    }
    let n = (pick % live.len() as u64) as usize;
    let byte = (pick >> 20) % SECTOR_BYTES as u64;
    let at = live[n] + byte;
    let mut old = [0u8; 1];
    meta.read(&mut old, at);
    meta.write(&[!old[0]], at);
    Some(format!(
        "byte {byte} of live journal sector {n} of {} inverted",
        live.len()
    ))
}
