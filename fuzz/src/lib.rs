//! What the fuzz targets share: an in-memory sparse device, the encoding of a pool
//! image as a fuzz input, checksum re-sealing (so mutations get past the crcs and
//! reach the checks behind them), and an NBD server the targets talk to over a
//! unix socket.
//!
//! Built only by `scripts/fuzz.sh` (with coverage instrumentation) and by
//! `cargo build` for the seed generator; `cargo test --workspace` never sees it.

use fewerbytes_format::journal::SECTOR_MAGIC;
use fewerbytes_format::page::PAGE_MAGIC;
use fewerbytes_format::superblock::{DATA_LABEL_MAGIC, SUPER_MAGIC};
use fewerbytes_format::{seal_checksum, BLOCK_BYTES, SECTOR_BYTES};
use fewerbytes_storage::{check_bounds, IoCounters, IoOp, Storage, StorageError};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Largest device a pool-image input may declare: big enough for the smallest pool
/// (64 MiB) with room for a mutated length, small enough that a journal or page
/// scan over the whole device stays quick.
pub const IMAGE_DEVICE_BYTES_MAX: u64 = 256 << 20;

/// Offset of the crc in a super block and in a data label.
const SUPER_CRC_OFFSET: usize = 12;
/// Offset of the crc in a page and in a journal sector.
const BLOCK_CRC_OFFSET: usize = 4;

/// An in-memory device holding only the blocks that were written: a 64 MiB pool
/// costs what its metadata costs, so one open per fuzz execution stays cheap.
/// Unwritten blocks read as zeros.
pub struct SparseStorage {
    name: String,
    len_bytes: u64,
    blocks: Mutex<BTreeMap<u64, Box<[u8; BLOCK_BYTES]>>>,
    counters: IoCounters,
}

impl SparseStorage {
    /// An all-zero device of `len_bytes`.
    pub fn new(name: &str, len_bytes: u64) -> SparseStorage {
        SparseStorage {
            name: name.to_string(),
            len_bytes,
            blocks: Mutex::new(BTreeMap::new()),
            counters: IoCounters::default(),
        }
    }

    /// The blocks holding anything but zeros, in order.
    pub fn nonzero_blocks(&self) -> Vec<(u64, Box<[u8; BLOCK_BYTES]>)> {
        let blocks = self.blocks.lock().unwrap_or_else(|e| e.into_inner());
        blocks
            .iter()
            .filter(|(_, b)| b.iter().any(|&x| x != 0))
            .map(|(&n, b)| (n, b.clone()))
            .collect()
    }

    fn for_each_block(
        &self,
        offset_bytes: u64,
        len: usize,
        mut f: impl FnMut(&mut BTreeMap<u64, Box<[u8; BLOCK_BYTES]>>, u64, usize, usize, usize),
    ) {
        let mut blocks = self.blocks.lock().unwrap_or_else(|e| e.into_inner());
        let mut done = 0usize;
        while done < len {
            let pos = offset_bytes + done as u64;
            let block = pos / BLOCK_BYTES as u64;
            let within = (pos % BLOCK_BYTES as u64) as usize;
            let n = (BLOCK_BYTES - within).min(len - done);
            f(&mut blocks, block, within, done, n);
            done += n;
        }
    }
}

impl Storage for SparseStorage {
    fn read_at(&self, buf: &mut [u8], offset_bytes: u64) -> Result<(), StorageError> {
        check_bounds(
            &self.name,
            IoOp::Read,
            offset_bytes,
            buf.len() as u64,
            self.len_bytes,
        )?;
        self.counters.count_read(buf.len());
        self.for_each_block(offset_bytes, buf.len(), |blocks, block, within, done, n| {
            let dst = &mut buf[done..done + n];
            match blocks.get(&block) {
                Some(b) => dst.copy_from_slice(&b[within..within + n]),
                None => dst.fill(0),
            }
        });
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset_bytes: u64) -> Result<(), StorageError> {
        check_bounds(
            &self.name,
            IoOp::Write,
            offset_bytes,
            buf.len() as u64,
            self.len_bytes,
        )?;
        self.counters.count_write(buf.len());
        self.for_each_block(offset_bytes, buf.len(), |blocks, block, within, done, n| {
            let b = blocks
                .entry(block)
                .or_insert_with(|| Box::new([0u8; BLOCK_BYTES]));
            b[within..within + n].copy_from_slice(&buf[done..done + n]);
        });
        Ok(())
    }

    fn flush(&self) -> Result<(), StorageError> {
        self.counters.count_flush();
        Ok(())
    }

    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn counters(&self) -> &IoCounters {
        &self.counters
    }
}

/// A pool image as a fuzz input: a flags byte, the device length in 4 KiB blocks
/// (u32 LE), then any number of `(block number u32 LE, 4096 bytes)` records; a short
/// last record is zero-padded. Blocks not named are zeros, so a 64 MiB pool is a
/// few tens of KiB of input.
pub struct PoolImage {
    /// `IMAGE_RESEAL` and the like.
    pub flags: u8,
    /// Device length.
    pub device_bytes: u64,
    /// The named blocks.
    pub blocks: Vec<(u64, Box<[u8; BLOCK_BYTES]>)>,
}

/// Image flag: recompute the crc of every super block, page and journal sector
/// before opening, so mutations reach the checks past the checksum.
pub const IMAGE_RESEAL: u8 = 1;
/// Image flag: after a successful open, read the start of every volume.
pub const IMAGE_READ_VOLUMES: u8 = 2;

const IMAGE_HEADER_BYTES: usize = 5;
const IMAGE_RECORD_BYTES: usize = 4 + BLOCK_BYTES;

impl PoolImage {
    /// Parse a fuzz input (never fails: whatever is there is an image).
    pub fn parse(data: &[u8]) -> PoolImage {
        let flags = data.first().copied().unwrap_or(0);
        let mut len = [0u8; 4];
        for (d, s) in len.iter_mut().zip(data.iter().skip(1)) {
            *d = *s;
        }
        let device_bytes =
            (u64::from(u32::from_le_bytes(len)) * BLOCK_BYTES as u64).min(IMAGE_DEVICE_BYTES_MAX);
        let mut blocks = Vec::new();
        for record in data
            .get(IMAGE_HEADER_BYTES..)
            .unwrap_or(&[])
            .chunks(IMAGE_RECORD_BYTES)
        {
            if record.len() < 4 {
                break;
            }
            let n = u64::from(u32::from_le_bytes([
                record[0], record[1], record[2], record[3],
            ]));
            let mut block = Box::new([0u8; BLOCK_BYTES]);
            block[..record.len() - 4].copy_from_slice(&record[4..]);
            blocks.push((n, block));
        }
        PoolImage {
            flags,
            device_bytes,
            blocks,
        }
    }

    /// The fuzz input for this image.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![self.flags];
        out.extend_from_slice(&((self.device_bytes / BLOCK_BYTES as u64) as u32).to_le_bytes());
        for (n, block) in &self.blocks {
            out.extend_from_slice(&(*n as u32).to_le_bytes());
            out.extend_from_slice(&block[..]);
        }
        out
    }

    /// A device holding this image (blocks past its end are dropped).
    pub fn to_storage(&self, name: &str) -> SparseStorage {
        let storage = SparseStorage::new(name, self.device_bytes);
        for (n, block) in &self.blocks {
            let mut block = block.clone();
            if self.flags & IMAGE_RESEAL != 0 {
                reseal_block(&mut block);
            }
            let _ = storage.write_at(&block[..], n * BLOCK_BYTES as u64);
        }
        storage
    }
}

/// Recompute the crc of whatever a 4 KiB block holds, judged by its magic: a super
/// block or data label, a page, or journal sectors.
pub fn reseal_block(block: &mut [u8; BLOCK_BYTES]) {
    let magic64 = u64::from_le_bytes(block[..8].try_into().unwrap_or([0; 8]));
    if magic64 == SUPER_MAGIC || magic64 == DATA_LABEL_MAGIC {
        seal_checksum(block, SUPER_CRC_OFFSET);
        return;
    }
    if u32_at(block, 0) == PAGE_MAGIC {
        seal_checksum(block, BLOCK_CRC_OFFSET);
        return;
    }
    for sector in block.chunks_mut(SECTOR_BYTES) {
        if u32_at(sector, 0) == SECTOR_MAGIC {
            seal_checksum(sector, BLOCK_CRC_OFFSET);
        }
    }
}

/// The little-endian u32 at `offset` (0 past the end).
pub fn u32_at(bytes: &[u8], offset: usize) -> u32 {
    bytes
        .get(offset..offset + 4)
        .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// The little-endian u64 at `offset` (0 past the end).
pub fn u64_at(bytes: &[u8], offset: usize) -> u64 {
    bytes
        .get(offset..offset + 8)
        .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
}

pub mod nbd;

/// One allocation larger than this aborts a fuzz target: a pool image is at most
/// `IMAGE_DEVICE_BYTES_MAX`, an NBD request at most 32 MiB, and libFuzzer's own
/// `-malloc_limit_mb` needs a sanitizer runtime we do not link (see docs/testing.md).
/// A length field that sizes a buffer before it is checked shows up here.
pub const ALLOCATION_BYTES_MAX: usize = 64 << 20;

/// The system allocator, refusing any single allocation over `ALLOCATION_BYTES_MAX`.
pub struct BoundedAllocator;

impl BoundedAllocator {
    #[cold]
    fn too_big(size: usize) -> ! {
        // Small allocations from here on are served (they are under the limit), so
        // the message can name where the big one came from.
        let trace = std::backtrace::Backtrace::force_capture();
        eprintln!("\nfuzz: allocation of {size} bytes (limit {ALLOCATION_BYTES_MAX}) at\n{trace}");
        std::process::abort();
    }
}

// SAFETY: every call is passed to `System` unchanged, or aborts before allocating.
unsafe impl std::alloc::GlobalAlloc for BoundedAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() > ALLOCATION_BYTES_MAX {
            Self::too_big(layout.size());
        }
        // SAFETY: the caller's contract for `alloc` is `System`'s.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() > ALLOCATION_BYTES_MAX {
            Self::too_big(layout.size());
        }
        // SAFETY: as above.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOCATION_BYTES_MAX {
            Self::too_big(new_size);
        }
        // SAFETY: as above.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: as above.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: BoundedAllocator = BoundedAllocator;
