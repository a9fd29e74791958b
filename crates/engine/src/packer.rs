//! The packer: compressed fragments appended byte-contiguously to a stream of data
//! blocks, so the space a fragment takes is its compressed length.
//!
//! Each zone has one packer with one open block in memory. A fragment that does
//! not fit in what is left of the open block continues in the next block, which
//! must be the physically next one (the map records only where a fragment starts
//! and its length); when that block is taken, the tail of the open block is left
//! as packing waste. A full block is written at once; a partial one is written
//! sector by sector at commit, so a flush costs at most one rewritten sector.

use crate::pool::Inner;
use crate::slab::{ObjRec, Slab};
use crate::{EngineError, Result};
use fewerbytes_format::location::{Codec, Location, ObjectId};
use fewerbytes_format::{BLOCK_BYTES, SECTOR_BYTES};

/// The open block of a packer.
pub struct OpenBlock {
    /// Slab it is in.
    pub slab: u32,
    /// Block index within the slab.
    pub block: u32,
    /// Its bytes so far.
    pub buf: Box<[u8; BLOCK_BYTES]>,
    /// Bytes filled.
    pub fill: usize,
    /// Bytes already written to the device.
    pub written: usize,
}

/// One zone's packer.
#[derive(Default)]
pub struct Packer {
    /// The open block, if any.
    pub open: Option<OpenBlock>,
}

impl Inner {
    /// Global data block number of a slab's block.
    pub(crate) fn pbn(&self, slab: u32, block: u32) -> u64 {
        u64::from(slab) * u64::from(crate::geometry::SLAB_BLOCKS) + u64::from(block)
    }

    fn write_open_block(&self, open: &mut OpenBlock, upto: usize) -> Result<()> {
        let from = open.written / SECTOR_BYTES * SECTOR_BYTES;
        let to = upto.div_ceil(SECTOR_BYTES) * SECTOR_BYTES;
        if to <= from {
            return Ok(());
        }
        let offset = self.data_offset_bytes
            + self.pbn(open.slab, open.block) * BLOCK_BYTES as u64
            + from as u64;
        let result = self
            .data
            .write_at(open.buf.get(from..to).unwrap_or(&[]), offset);
        self.check_io(result)?;
        open.written = upto;
        Ok(())
    }

    /// Close the open block: write what is unwritten and drop the packer's hold.
    fn close_block(&self, zone: usize, mut open: OpenBlock) -> Result<()> {
        let fill = open.fill;
        let written = self.write_open_block(&mut open, fill);
        let mut slab = self.slab(open.slab).lock();
        slab.open_blocks
            .retain(|&(b, z)| !(b == open.block && z == zone));
        slab.drop_block(open.block);
        written
    }

    /// Open a fresh block in a slab with room for a fragment (block and object).
    fn open_block(&self, zone: usize) -> Result<OpenBlock> {
        for s in self.slab_order(zone) {
            let mut slab = self.slab(s).lock();
            if slab.free_objects() == 0 || slab.free_objects() <= slab.free_blocks() / 2 {
                // Objects are the scarcer resource here; keep them for whole blocks.
                if slab.free_objects() == 0 {
                    continue;
                }
            }
            if let Some(block) = slab.alloc_block() {
                slab.hold_block(block);
                slab.open_blocks.push((block, zone));
                return Ok(OpenBlock {
                    slab: s,
                    block,
                    buf: Box::new([0; BLOCK_BYTES]),
                    fill: 0,
                    written: 0,
                });
            }
        }
        Err(EngineError::NoSpace("no free data blocks left".into()))
    }

    /// Store a compressed fragment; returns its object (with one reference) and location.
    pub(crate) fn pack(
        &self,
        zone: usize,
        bytes: &[u8],
        fingerprint: &[u8; 32],
    ) -> Result<(ObjectId, Location)> {
        let len = bytes.len();
        debug_assert!(len > 0 && len < BLOCK_BYTES);
        let mut packer = self.packer(zone).lock();
        for _attempt in 0..4 {
            let mut open = match packer.open.take() {
                Some(o) => o,
                None => self.open_block(zone)?,
            };
            let mut slab = self.slab(open.slab).lock();
            let Some(object) = slab.alloc_object() else {
                drop(slab);
                self.close_block(zone, open)?;
                continue;
            };
            let start = open.fill;
            let spans = start + len > BLOCK_BYTES;
            if spans && !slab.alloc_block_at(open.block + 1) {
                slab.unalloc_object(object);
                drop(slab);
                self.close_block(zone, open)?;
                continue;
            }
            let addr_bytes = self.pbn(open.slab, open.block) * BLOCK_BYTES as u64 + start as u64;
            let location = Location::Fragment {
                addr_bytes,
                len_bytes: len as u16,
                codec: Codec::Lz4,
            };
            slab.hold_block(open.block);
            if let Some(rec) = slab.rec_mut(object) {
                *rec = ObjRec {
                    location: location.encode(),
                    refcount: 1,
                    fingerprint: *fingerprint,
                };
            }
            let object_id = ObjectId(
                u64::from(open.slab) * u64::from(self.objects_per_slab) + u64::from(object),
            );
            let first = (BLOCK_BYTES - start).min(len);
            if let Some(dst) = open.buf.get_mut(start..start + first) {
                dst.copy_from_slice(bytes.get(..first).unwrap_or(&[]));
            }
            open.fill = start + first;
            if spans {
                let next = open.block + 1;
                slab.hold_block(next); // the fragment's hold
                slab.hold_block(next); // the packer's hold on its new open block
                slab.open_blocks.push((next, zone));
                let slab_index = open.slab;
                drop(slab);
                self.close_block(zone, open)?;
                let mut buf = Box::new([0u8; BLOCK_BYTES]);
                let rest = len - first;
                if let Some(dst) = buf.get_mut(..rest) {
                    dst.copy_from_slice(bytes.get(first..).unwrap_or(&[]));
                }
                packer.open = Some(OpenBlock {
                    slab: slab_index,
                    block: next,
                    buf,
                    fill: rest,
                    written: 0,
                });
            } else if open.fill == BLOCK_BYTES {
                drop(slab);
                self.close_block(zone, open)?;
            } else {
                drop(slab);
                packer.open = Some(open);
            }
            return Ok((object_id, location));
        }
        Err(EngineError::NoSpace(
            "no room for a compressed fragment".into(),
        ))
    }

    /// Write the unwritten part of every open block (before a commit's data sync).
    pub(crate) fn flush_packers(&self) -> Result<()> {
        for zone in 0..self.zone_count() {
            let mut packer = self.packer(zone).lock();
            if let Some(open) = packer.open.as_mut() {
                let fill = open.fill;
                self.write_open_block(open, fill)?;
            }
        }
        Ok(())
    }

    /// Copy bytes of block `(slab, block)` at `[from, to)` from an open packer block
    /// into `out`, if a packer still holds that block open. Returns whether it did.
    pub(crate) fn read_open_block(
        &self,
        zone: usize,
        slab: u32,
        block: u32,
        from: usize,
        out: &mut [u8],
    ) -> bool {
        let packer = self.packer(zone).lock();
        match &packer.open {
            Some(open) if open.slab == slab && open.block == block => {
                if let Some(src) = open.buf.get(from..from + out.len()) {
                    out.copy_from_slice(src);
                }
                true
            }
            _ => false,
        }
    }

    /// The zone whose packer has `(slab, block)` open, if any.
    pub(crate) fn open_zone(slab: &Slab, block: u32) -> Option<usize> {
        slab.open_blocks
            .iter()
            .find(|(b, _)| *b == block)
            .map(|(_, z)| *z)
    }
}
