//! An in-memory [`Export`] and [`ExportProvider`]: bytes in a `Vec<u8>` and a map
//! of which 4 KiB blocks hold data. For tests, and for `examples/memserve.rs`, so
//! the protocol can be checked with real clients without a pool.
//!
//! Like the engine, a block that becomes all zeros holds no data: it is reported
//! as a hole by `extents`.

use crate::export::{Export, ExportDesc, ExportProvider, EINVAL, ENOSPC};
use parking_lot::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Granularity of the data map (the engine's block size).
pub const MEMORY_BLOCK_BYTES: u64 = 4096;

/// An export held in memory. Shared by every connection that opens it.
pub struct MemoryExport {
    state: RwLock<MemoryState>,
    flushes: AtomicU64,
}

struct MemoryState {
    bytes: Vec<u8>,
    /// Per 4 KiB block: holds nonzero data.
    data: Vec<bool>,
}

impl MemoryExport {
    /// A zero-filled export of `size_bytes` (all holes).
    pub fn new(size_bytes: usize) -> MemoryExport {
        let blocks = size_bytes.div_ceil(MEMORY_BLOCK_BYTES as usize);
        MemoryExport {
            state: RwLock::new(MemoryState {
                bytes: vec![0; size_bytes],
                data: vec![false; blocks],
            }),
            flushes: AtomicU64::new(0),
        }
    }

    /// A copy of `[offset, offset+len)` (clipped to the export).
    pub fn contents(&self, offset: usize, len: usize) -> Vec<u8> {
        let state = self.state.read();
        let end = offset.saturating_add(len).min(state.bytes.len());
        state
            .bytes
            .get(offset.min(end)..end)
            .unwrap_or(&[])
            .to_vec()
    }

    /// Flushes received.
    pub fn flushes(&self) -> u64 {
        self.flushes.load(Ordering::Relaxed)
    }

    /// Change the size (as a volume resize would), keeping what fits.
    pub fn resize(&self, size_bytes: usize) {
        let mut state = self.state.write();
        state.bytes.resize(size_bytes, 0);
        let blocks = size_bytes.div_ceil(MEMORY_BLOCK_BYTES as usize);
        state.data.resize(blocks, false);
        let touched = 0..size_bytes;
        state.refresh(touched.start as u64, touched.len() as u64);
    }

    /// The byte range `[offset, offset+len)` as indices, if inside the export.
    fn range(state: &MemoryState, offset: u64, len: u64) -> Option<std::ops::Range<usize>> {
        let start = usize::try_from(offset).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        (end <= state.bytes.len()).then_some(start..end)
    }
}

impl MemoryState {
    /// Recompute the data map for the blocks `[offset, offset+len)` touches.
    fn refresh(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = offset / MEMORY_BLOCK_BYTES;
        let last = (offset + len - 1) / MEMORY_BLOCK_BYTES;
        for block in first..=last {
            let start = (block * MEMORY_BLOCK_BYTES) as usize;
            let end = (start + MEMORY_BLOCK_BYTES as usize).min(self.bytes.len());
            let nonzero = self
                .bytes
                .get(start..end)
                .is_some_and(|b| b.iter().any(|&x| x != 0));
            if let Some(slot) = self.data.get_mut(block as usize) {
                *slot = nonzero;
            }
        }
    }
}

impl Export for MemoryExport {
    fn size_bytes(&self) -> u64 {
        self.state.read().bytes.len() as u64
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        let state = self.state.read();
        let range = Self::range(&state, offset, buf.len() as u64).ok_or(EINVAL)?;
        buf.copy_from_slice(state.bytes.get(range).ok_or(EINVAL)?);
        Ok(())
    }

    /// Memory never waits for a disk; a write in progress holds the lock only briefly.
    fn read_cached(&self, offset: u64, buf: &mut [u8]) -> bool {
        self.read(offset, buf).is_ok()
    }

    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), u32> {
        let mut state = self.state.write();
        let range = Self::range(&state, offset, data.len() as u64).ok_or(ENOSPC)?;
        state
            .bytes
            .get_mut(range)
            .ok_or(ENOSPC)?
            .copy_from_slice(data);
        state.refresh(offset, data.len() as u64);
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, _fua: bool) -> Result<(), u32> {
        let mut state = self.state.write();
        let range = Self::range(&state, offset, len).ok_or(ENOSPC)?;
        state.bytes.get_mut(range).ok_or(ENOSPC)?.fill(0);
        state.refresh(offset, len);
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), u32> {
        self.write_zeroes(offset, len, fua).map_err(|_| EINVAL)
    }

    fn flush(&self) -> Result<(), u32> {
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>, u32> {
        let state = self.state.read();
        let range = Self::range(&state, offset, len).ok_or(EINVAL)?;
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut pos = range.start as u64;
        let end = range.end as u64;
        while pos < end {
            let block = pos / MEMORY_BLOCK_BYTES;
            let block_end = ((block + 1) * MEMORY_BLOCK_BYTES).min(end);
            let data = state.data.get(block as usize).copied().unwrap_or(false);
            match runs.last_mut() {
                Some(last) if last.1 == data => last.0 += block_end - pos,
                _ => runs.push((block_end - pos, data)),
            }
            pos = block_end;
        }
        Ok(runs)
    }
}

/// A fixed set of named in-memory exports.
pub struct MemoryExports {
    exports: Vec<(ExportDesc, Arc<MemoryExport>)>,
}

impl MemoryExports {
    /// Exports by name; the first is the default for the empty name.
    pub fn new(exports: Vec<(String, Arc<MemoryExport>)>) -> MemoryExports {
        MemoryExports {
            exports: exports
                .into_iter()
                .map(|(name, export)| {
                    let desc = ExportDesc {
                        description: format!("in-memory export '{name}'"),
                        size_bytes: export.size_bytes(),
                        name,
                    };
                    (desc, export)
                })
                .collect(),
        }
    }

    /// The export called `name`.
    pub fn get(&self, name: &str) -> Option<Arc<MemoryExport>> {
        self.exports
            .iter()
            .find(|(d, _)| d.name == name)
            .map(|(_, e)| Arc::clone(e))
    }
}

impl ExportProvider for MemoryExports {
    fn list(&self) -> Vec<ExportDesc> {
        self.exports
            .iter()
            .map(|(d, e)| ExportDesc {
                size_bytes: e.size_bytes(),
                ..d.clone()
            })
            .collect()
    }

    fn default_name(&self) -> Option<String> {
        self.exports.first().map(|(d, _)| d.name.clone())
    }

    fn open(&self, name: &str) -> Result<Arc<dyn Export>, String> {
        match self.get(name) {
            Some(export) => Ok(export),
            None => Err(format!("no export named '{name}'")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_map_follows_writes_and_zeroing() {
        let m = MemoryExport::new(5 * 4096);
        assert_eq!(m.extents(0, 5 * 4096), Ok(vec![(5 * 4096, false)]));
        m.write(4096 + 512, &[1; 512], false).expect("write");
        assert_eq!(
            m.extents(0, 5 * 4096),
            Ok(vec![(4096, false), (4096, true), (3 * 4096, false)])
        );
        assert_eq!(m.extents(4608, 1024), Ok(vec![(1024, true)]));
        assert_eq!(m.extents(7680, 1024), Ok(vec![(512, true), (512, false)]));
        m.write_zeroes(4096, 4096, false).expect("zero");
        assert_eq!(m.extents(0, 5 * 4096), Ok(vec![(5 * 4096, false)]));
        assert_eq!(m.write(5 * 4096, &[1; 512], false), Err(ENOSPC));
        assert_eq!(m.extents(4096, 5 * 4096), Err(EINVAL));
    }
}
