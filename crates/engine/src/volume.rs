//! `Volume`: a handle on one volume, what frontends read and write through.

use crate::{Extent, Result};

/// A handle on a volume. Cheap to clone; counts as one user while alive.
#[derive(Clone)]
pub struct Volume {}

impl Volume {
    /// The volume's name.
    pub fn name(&self) -> String { todo!() }
    /// Current size in bytes (volumes can be resized while open).
    pub fn size_bytes(&self) -> u64 { todo!() }
    /// Read `buf.len()` bytes at `offset_bytes` (both multiples of 512).
    pub fn read(&self, offset_bytes: u64, buf: &mut [u8]) -> Result<()> { let _ = (offset_bytes, buf); todo!() }
    /// Write `data` at `offset_bytes` (multiples of 512). With `fua`, durable on return.
    pub fn write(&self, offset_bytes: u64, data: &[u8], fua: bool) -> Result<()> { let _ = (offset_bytes, data, fua); todo!() }
    /// Make a range read as zeros, storing nothing.
    pub fn write_zeroes(&self, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<()> { let _ = (offset_bytes, len_bytes, fua); todo!() }
    /// Discard a range: it reads as zeros and frees what only it held.
    pub fn trim(&self, offset_bytes: u64, len_bytes: u64, fua: bool) -> Result<()> { let _ = (offset_bytes, len_bytes, fua); todo!() }
    /// Make every acknowledged write (on any handle of the pool) durable.
    pub fn flush(&self) -> Result<()> { todo!() }
    /// What backs `[offset, offset+len)`: runs of data and of holes (zero/unmapped).
    pub fn extents(&self, offset_bytes: u64, len_bytes: u64) -> Result<Vec<Extent>> { let _ = (offset_bytes, len_bytes); todo!() }
}
