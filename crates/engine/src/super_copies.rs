//! The two super block copies at open: which one the pool opens from, which one is
//! damaged (rewritten by the open's checkpoint, and counted), and the open
//! generation the open takes so that no sector already in the journal ring can be
//! taken for one it writes.
//!
//! Either copy may be damaged: checkpoints free nothing the older copy reaches until
//! a newer checkpoint is durable (deferred frees, `checkpoint.rs`), and the journal
//! keeps every sector since the older copy's replay point (`journal.rs`), so the
//! older copy with its journal holds every flushed write (docs/format.md, "Super
//! block" and "Checkpoints").

use crate::error::within_mut;
use crate::{EngineError, Result};
use fewerbytes_format::journal::decode_sector;
use fewerbytes_format::superblock::SuperBlock;
use fewerbytes_format::{BLOCK_BYTES, SECTOR_BYTES};
use fewerbytes_storage::Storage;

/// What the open found in blocks 0 and 1.
pub(crate) struct SuperCopies {
    /// The valid copy with the highest generation: the one the pool opens from.
    pub(crate) best: SuperBlock,
    /// The copy that failed its checks and why, if one did (copy 1 of a pool never
    /// opened, generation 0, was never written and is not damaged).
    pub(crate) damaged: Option<(u64, String)>,
    /// The other copy, when it is valid too (the older checkpoint).
    pub(crate) older: Option<SuperBlock>,
}

impl SuperCopies {
    /// Read both copies; refuse the pool only when neither is valid.
    pub(crate) fn read(meta: &dyn Storage) -> Result<SuperCopies> {
        let mut best: Option<SuperBlock> = None;
        let mut older: Option<SuperBlock> = None;
        let mut errors = Vec::new();
        for copy in 0..2u64 {
            let mut block = vec![0u8; BLOCK_BYTES];
            meta.read_at(&mut block, copy * BLOCK_BYTES as u64)?;
            match SuperBlock::decode(&block) {
                Ok(sb) if best.as_ref().is_none_or(|b| sb.generation > b.generation) => {
                    older = best.replace(sb);
                }
                Ok(sb) => older = Some(sb),
                Err(e) => errors.push((copy, e.to_string())),
            }
        }
        let Some(best) = best else {
            return Err(EngineError::Corrupt {
                region: "super block",
                block: 0,
                device: "metadata",
                reason: errors
                    .iter()
                    .map(|(copy, e)| format!("copy {copy}: {e}"))
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        };
        let damaged = errors
            .into_iter()
            .find(|(copy, _)| !(*copy == 1 && best.generation == 0));
        if let Some((copy, e)) = &damaged {
            tracing::warn!(
                "{}: super block copy {copy} (block {copy}) is damaged ({e}); opening from \
                 copy {} (generation {}) with the journal since its replay point. The \
                 open's checkpoint rewrites copy {copy}",
                meta.name(),
                1 - copy,
                best.generation,
            );
        }
        Ok(SuperCopies {
            best,
            damaged,
            older,
        })
    }

    /// When the newest copy's checkpoint could not be loaded (`why`: a damaged
    /// page it reaches), the older copy to open from instead: valid, one generation
    /// below (so its pages are whole, deferred frees), and the newest then counts as
    /// damaged (the open's checkpoint rewrites it, the ring is read for the open
    /// generation). None when there is no such copy.
    pub(crate) fn fall_back(&self, device: &str, why: &EngineError) -> Option<SuperCopies> {
        let older = self.older.as_ref()?;
        if older.generation + 1 != self.best.generation {
            return None;
        }
        let copy = self.best.generation % 2;
        tracing::warn!(
            "{device}: the checkpoint of super block copy {copy} (generation {}) does not              load ({why}); opening from copy {} (generation {}) with the journal since its              replay point. The open's checkpoint rewrites copy {copy}",
            self.best.generation,
            1 - copy,
            older.generation
        );
        Some(SuperCopies {
            best: older.clone(),
            damaged: Some((copy, format!("its checkpoint does not load: {why}"))),
            older: None,
        })
    }

    /// The open generation this open's sectors carry: above every sector in the
    /// ring. With both copies valid, the newest copy's plus one (no open after it
    /// made a checkpoint, so no sector carries more). With one damaged, that copy may
    /// have been a later open's checkpoint whose sectors carry a generation above the
    /// surviving copy's (by one, or more if that open itself followed a damaged
    /// copy): the ring is read for the highest, and this open takes one above it.
    pub(crate) fn next_open_gen(
        &self,
        meta: &dyn Storage,
        journal_start_block: u64,
        journal_sectors: u64,
    ) -> Result<u32> {
        let ring = match self.damaged {
            Some(_) => {
                ring_max_open_gen(meta, self.best.nonce, journal_start_block, journal_sectors)?
            }
            None => 0,
        };
        let gen = self.best.open_gen.max(ring);
        gen.checked_add(1)
            .filter(|g| *g < u32::MAX)
            .ok_or_else(|| EngineError::Corrupt {
                region: "journal",
                block: journal_start_block,
                device: "metadata",
                reason: format!("open generation {gen} leaves no room to open again"),
            })
    }
}

/// The highest open generation any valid sector of the ring carries (0 if none):
/// read when a super block copy is damaged, since the lost copy may have been an
/// open whose sectors carry a generation above the surviving copy's.
fn ring_max_open_gen(
    meta: &dyn Storage,
    nonce: u64,
    start_block: u64,
    sectors: u64,
) -> Result<u32> {
    const CHUNK_SECTORS: u64 = 2048;
    let start_bytes = start_block * BLOCK_BYTES as u64;
    let mut buf = vec![0u8; CHUNK_SECTORS as usize * SECTOR_BYTES];
    let mut max = 0;
    let mut at = 0;
    while at < sectors {
        let run = CHUNK_SECTORS.min(sectors - at);
        let chunk = within_mut(
            &mut buf,
            0..run as usize * SECTOR_BYTES,
            "a journal read chunk",
        )?;
        meta.read_at(chunk, start_bytes + at * SECTOR_BYTES as u64)?;
        for sector in chunk.chunks(SECTOR_BYTES) {
            if let Ok((h, _)) = decode_sector(sector, nonce) {
                max = max.max(h.open_gen);
            }
        }
        at += run;
    }
    Ok(max)
}
