//! Pool geometry: where each region lives, computed once at creation from the
//! device sizes and recorded in the super block.
//!
//! Metadata device: block 0 and 1 super block copies, then the journal ring, then
//! the page store. Data device: the data region (after the metadata regions on a
//! single device; after the label's two copies on a separate data device), cut into slabs.

use crate::{EngineError, Result};
use fewerbytes_format::page::{MAP_ENTRIES_PER_PAGE, OBJECTS_PER_PAGE, SLOTS_PER_DIR_PAGE};
use fewerbytes_format::superblock::{
    SuperBlock, FLAG_DATA_REGION_PAGES, FLAG_OVERCOMMIT, FLAG_SEPARATE_METADATA, MAX_CATALOG_PAGES,
};
use fewerbytes_format::BLOCK_BYTES;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Data blocks per slab (32 MiB). A slab is the unit of physical allocation and
/// owns its object table; it bounds the memory of one allocation bitmap.
pub const SLAB_BLOCKS: u32 = 8192;
/// Object slots per data block. Whole blocks use one each; compressed fragments
/// (about 2 KiB on the seed's mix) fit two or more per block. At 3, objects run out
/// only for data compressing better than 3:1, and then blocks are stored whole.
pub const OBJECTS_PER_BLOCK: u32 = 3;
/// Page-store slots per live page in the sizing of pools made before metadata grew
/// with use ([`page_slots_for`]): copy-on-write checkpoints need a fresh slot for
/// each dirty page.
pub const PAGE_STORE_SLACK_NUM: u64 = 5;
/// See [`PAGE_STORE_SLACK_NUM`].
pub const PAGE_STORE_SLACK_DEN: u64 = 4;
/// Share of the device a new pool's metadata regions (super blocks, journal, page
/// store, and the padding to the data region's alignment) may take, in hundredths:
/// the page store holds what fits beside the journal, and pages past its free slots
/// go to data-region blocks (`checkpoint.rs`), so metadata grows with what is
/// stored, not with what the volumes may address.
pub const METADATA_PERCENT_MAX: u64 = 2;
/// The page store's floor (2 MiB): below about 1 GiB, two percent is less than the
/// journal's floor and this, and a small pool takes them anyway.
pub const PAGE_SLOTS_MIN: u64 = 512;
/// Logical space an overcommitted pool may promise, as a multiple of its data space.
pub const OVERCOMMIT_FACTOR: u64 = 4;
/// Data blocks held back from what volumes may address, per 100 data blocks: a write
/// stores its new block before the old one is freed, and freed blocks return only at
/// the next checkpoint, so overwriting a full thick pool needs room for the writes in
/// flight and the zones' open runs.
pub const RESERVE_PERCENT: u64 = 1;
/// The reserve's floor (2 MiB).
pub const RESERVE_BLOCKS_MIN: u64 = 512;

/// Free blocks of each slab that data may not take, in a pool whose metadata pages
/// may go to data blocks (flags bit 3): a checkpoint writes its pages before it frees
/// the ones they replace, so a full pool still needs room for one checkpoint's
/// pages (128 KiB a slab, 0.4%; a new pool's reserve holds it beside the 1% that
/// thick volumes leave for overwrites, [`reserve_blocks_for`]). The slab depot keeps it.
pub const METADATA_HEADROOM_BLOCKS: u32 = 32;

/// The headroom of a slab of `blocks` blocks (a short last slab keeps less).
pub fn metadata_headroom_of(blocks: u32) -> u32 {
    METADATA_HEADROOM_BLOCKS.min(blocks / 8)
}

/// Blocks held back in a new pool of `data_blocks`: [`RESERVE_PERCENT`] (at least
/// [`RESERVE_BLOCKS_MIN`]) for overwrites, plus the headroom every slab keeps for
/// metadata pages ([`METADATA_HEADROOM_BLOCKS`]), which volumes must
/// not count on either.
pub fn reserve_blocks_for(data_blocks: u64) -> u64 {
    let slab = u64::from(SLAB_BLOCKS);
    let headroom = (data_blocks / slab) * u64::from(metadata_headroom_of(SLAB_BLOCKS))
        + u64::from(metadata_headroom_of((data_blocks % slab) as u32));
    ((data_blocks * RESERVE_PERCENT / 100).max(RESERVE_BLOCKS_MIN) + headroom).min(data_blocks / 4)
}

/// The smallest pool worth making.
pub const MIN_POOL_BYTES: u64 = 64 << 20;
/// Journal ring bounds (blocks).
pub const JOURNAL_BLOCKS_MIN: u64 = 256;
/// See [`JOURNAL_BLOCKS_MIN`].
pub const JOURNAL_BLOCKS_MAX: u64 = 16384;
/// Alignment of the data region on a single device (1 MiB).
pub const DATA_ALIGN_BLOCKS: u64 = 256;

/// Where everything is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// 4 KiB blocks in the data region.
    pub data_blocks: u64,
    /// Byte offset of the data region on the data device.
    pub data_offset_bytes: u64,
    /// Slabs.
    pub slab_count: u32,
    /// Objects per slab (a multiple of the records per page).
    pub objects_per_slab: u32,
    /// Journal ring position and size.
    pub journal_start_block: u64,
    /// Journal ring length in blocks.
    pub journal_blocks: u64,
    /// Page store position and size.
    pub pages_start_block: u64,
    /// Page store slots.
    pub page_slots: u64,
    /// Logical blocks volumes may add up to.
    pub addressable_blocks: u64,
}

/// Objects per slab: enough for `OBJECTS_PER_BLOCK`, rounded up to whole pages.
pub fn objects_per_slab() -> u32 {
    let want = SLAB_BLOCKS * OBJECTS_PER_BLOCK;
    want.div_ceil(OBJECTS_PER_PAGE as u32) * OBJECTS_PER_PAGE as u32
}

fn journal_blocks_for(data_blocks: u64) -> u64 {
    (data_blocks / 128).clamp(JOURNAL_BLOCKS_MIN, JOURNAL_BLOCKS_MAX)
}

/// Page-store slots for a new pool on a device of `device_blocks` whose journal takes
/// `journal_blocks` and whose data region starts at a multiple of
/// [`DATA_ALIGN_BLOCKS`] (none on a separate metadata device: `aligned` false):
/// what is left of [`METADATA_PERCENT_MAX`] of the device, at least
/// [`PAGE_SLOTS_MIN`]. Independent of how much logical space volumes address.
pub fn page_slots_new(device_blocks: u64, journal_blocks: u64, aligned: bool) -> u64 {
    let budget = device_blocks * METADATA_PERCENT_MAX / 100;
    let budget = if aligned {
        budget / DATA_ALIGN_BLOCKS * DATA_ALIGN_BLOCKS
    } else {
        budget
    };
    budget
        .saturating_sub(2 + journal_blocks)
        .max(PAGE_SLOTS_MIN)
}

/// Page-store slots for a pool of `data_blocks` promising `addressable_blocks`, as
/// pools were sized before their metadata grew with use: block maps for every
/// addressable block and object tables for every object, with copy-on-write slack.
/// Kept for the sizes the tests of older pools were made with.
pub fn page_slots_for(data_blocks: u64, addressable_blocks: u64) -> u64 {
    let slabs = data_blocks.div_ceil(u64::from(SLAB_BLOCKS));
    let object_pages = slabs * u64::from(objects_per_slab()) / OBJECTS_PER_PAGE as u64;
    // A volume's map pages round up per volume; allow one spare page per possible volume
    // of the first few hundred.
    let map_pages = addressable_blocks.div_ceil(MAP_ENTRIES_PER_PAGE as u64) + 256;
    let dir_pages = object_pages.div_ceil(SLOTS_PER_DIR_PAGE as u64)
        + map_pages.div_ceil(SLOTS_PER_DIR_PAGE as u64)
        + 256;
    let live = object_pages + map_pages + dir_pages + MAX_CATALOG_PAGES as u64;
    live * PAGE_STORE_SLACK_NUM / PAGE_STORE_SLACK_DEN + 64
}

impl Geometry {
    /// Lay out a pool. `data_device_blocks` is the data device; `metadata_device_blocks`
    /// is `None` when metadata shares it.
    pub fn compute(
        data_device_blocks: u64,
        metadata_device_blocks: Option<u64>,
        overcommit: bool,
    ) -> Result<Self> {
        Geometry::compute_growable(data_device_blocks, metadata_device_blocks, overcommit, 0)
    }

    /// As [`Geometry::compute`], with a page store sized for a data device of
    /// `max_data_device_blocks` (if larger), so that `pool grow` can take the device
    /// up to that size later: the page store keeps its size when the data grows.
    pub fn compute_growable(
        data_device_blocks: u64,
        metadata_device_blocks: Option<u64>,
        overcommit: bool,
        max_data_device_blocks: u64,
    ) -> Result<Self> {
        // The overcommit factor sets what volumes may address, not the metadata:
        // block maps grow as volumes are written.
        let factor = if overcommit { OVERCOMMIT_FACTOR } else { 1 };
        // `--max-size`: the page store takes its share of the larger device (pages
        // past it go to data blocks in any case, flags bit 3).
        let sized_for = data_device_blocks.max(max_data_device_blocks);
        let journal_start_block = 2;
        let geometry = match metadata_device_blocks {
            None => {
                // The journal is sized for the data region, which is at most the
                // device: sizing it for the device first is an upper bound, and the
                // page store takes what is left of the budget.
                let journal_blocks = journal_blocks_for(data_device_blocks);
                let page_slots = page_slots_new(sized_for, journal_blocks, true);
                let meta_end = journal_start_block + journal_blocks + page_slots;
                let data_start = meta_end.div_ceil(DATA_ALIGN_BLOCKS) * DATA_ALIGN_BLOCKS;
                // Saturating: a device smaller than its metadata leaves no data, and
                // the size check after the match refuses it ("too small to be
                // useful") instead of a wrapped size.
                let data_blocks = data_device_blocks.saturating_sub(data_start);
                Geometry::laid_out(
                    data_blocks,
                    data_start,
                    journal_start_block,
                    journal_blocks,
                    page_slots,
                    factor,
                )
            }
            Some(meta_blocks) => {
                let data_start = DATA_ALIGN_BLOCKS; // blocks 0 and 1 hold the label's copies; data from 1 MiB
                                                    // Saturating: a device under 1 MiB holds no data, refused below.
                let data_blocks = data_device_blocks.saturating_sub(data_start);
                let journal_blocks = journal_blocks_for(data_blocks);
                let need = Self::metadata_blocks_needed(data_device_blocks, overcommit);
                if meta_blocks < need {
                    return Err(EngineError::Refused(format!(
                        "the metadata device holds {} but this pool needs at least {} of metadata",
                        human_bytes(meta_blocks * BLOCK_BYTES as u64),
                        human_bytes(need * BLOCK_BYTES as u64)
                    )));
                }
                // A larger metadata device holds a larger page store: fewer pages go
                // to the data device.
                let page_slots = meta_blocks - journal_start_block - journal_blocks;
                Geometry::laid_out(
                    data_blocks,
                    data_start,
                    journal_start_block,
                    journal_blocks,
                    page_slots,
                    factor,
                )
            }
        };
        let slab_count = geometry.data_blocks.div_ceil(u64::from(SLAB_BLOCKS));
        if geometry.data_blocks < u64::from(SLAB_BLOCKS) || slab_count > u64::from(u32::MAX) {
            return Err(EngineError::Refused(format!(
                "the device is too small to be useful: a pool needs at least {}",
                human_bytes(MIN_POOL_BYTES)
            )));
        }
        if geometry.page_slots > u64::from(u32::MAX) {
            return Err(EngineError::Refused(
                "the device is too large for this format version".into(),
            ));
        }
        Ok(Geometry {
            slab_count: slab_count as u32,
            ..geometry
        })
    }

    /// The geometry of regions placed at these blocks (slab count filled in by `compute`).
    fn laid_out(
        data_blocks: u64,
        data_start: u64,
        journal_start_block: u64,
        journal_blocks: u64,
        page_slots: u64,
        factor: u64,
    ) -> Self {
        Geometry {
            data_blocks,
            data_offset_bytes: data_start * BLOCK_BYTES as u64,
            slab_count: 0,
            objects_per_slab: objects_per_slab(),
            journal_start_block,
            journal_blocks,
            pages_start_block: journal_start_block + journal_blocks,
            page_slots,
            addressable_blocks: data_blocks * factor,
        }
    }

    /// Metadata blocks needed on a separate metadata device for this data device:
    /// the super blocks, the journal, and a page store of [`METADATA_PERCENT_MAX`]
    /// of the data device less the journal (at least [`PAGE_SLOTS_MIN`]).
    /// `overcommit` no longer changes it (block maps grow with use); it stays for
    /// the callers.
    pub fn metadata_blocks_needed(data_device_blocks: u64, overcommit: bool) -> u64 {
        let _ = overcommit;
        // Saturating: a sizing hint; `compute` refuses a data device this small.
        let data_blocks = data_device_blocks.saturating_sub(DATA_ALIGN_BLOCKS);
        let journal_blocks = journal_blocks_for(data_blocks);
        2 + journal_blocks + page_slots_new(data_device_blocks, journal_blocks, false)
    }
}

/// BLAKE3 `derive_key` context of the snapshot-identity key (docs/format.md,
/// "Snapshot"): a key of its own, so identities say nothing of fingerprints.
const SNAPSHOT_GUID_CONTEXT: &str = "fewerbytes 2026-12 snapshot identity v1";

/// An open pool's layout and identity as its super block fixed them at format time.
/// Read-only once the pool is open, but for the size of the data region, which
/// `pool grow` extends (`grow.rs`: `grow_to`, under the gate, before the checkpoint
/// that records it); and the one place the engine reads them from: the super block
/// held for checkpoints carries the same fields, but only its changing ones
/// (generation, catalog, replay point, holder) are read there.
#[derive(Debug)]
pub(crate) struct PoolGeometry {
    nonce: u64,
    fingerprint_key: [u8; 32],
    data_device_bytes: AtomicU64,
    metadata_device_bytes: AtomicU64,
    data_offset_bytes: u64,
    data_blocks: AtomicU64,
    slab_blocks: u32,
    objects_per_slab: u32,
    slab_count: AtomicU32,
    journal_start_block: u64,
    journal_sectors: u64,
    pages_start_block: u64,
    page_slots: u64,
    reserve_blocks: u64,
    index_entries: u64,
    index_mode: crate::IndexMode,
    overcommit: bool,
    separate_metadata: bool,
    data_region_pages: bool,
}

impl PoolGeometry {
    /// The geometry a (decoded, length-checked) super block records.
    pub(crate) fn from_super(sb: &SuperBlock) -> Self {
        PoolGeometry {
            nonce: sb.nonce,
            fingerprint_key: sb.fingerprint_key,
            data_device_bytes: AtomicU64::new(sb.data_device_bytes),
            metadata_device_bytes: AtomicU64::new(sb.metadata_device_bytes),
            data_offset_bytes: sb.data_offset_bytes,
            data_blocks: AtomicU64::new(sb.data_blocks),
            slab_blocks: sb.slab_blocks,
            objects_per_slab: sb.objects_per_slab,
            slab_count: AtomicU32::new(sb.slab_count),
            journal_start_block: sb.journal_start_block,
            journal_sectors: sb.journal_sectors,
            pages_start_block: sb.pages_start_block,
            page_slots: sb.page_slots,
            reserve_blocks: sb.reserve_blocks,
            index_entries: sb.index_entries,
            index_mode: crate::IndexMode::from_super(sb.index_mode, sb.index_sample_shift),
            overcommit: sb.flags & FLAG_OVERCOMMIT != 0,
            separate_metadata: sb.flags & FLAG_SEPARATE_METADATA != 0,
            data_region_pages: sb.flags & FLAG_DATA_REGION_PAGES != 0,
        }
    }
    /// The pool's identity in every page header and journal sector.
    pub(crate) fn nonce(&self) -> u64 {
        self.nonce
    }
    /// A new snapshot's identity: the low 64 bits of BLAKE3 keyed by a key derived
    /// from the pool's secret fingerprint key (which no stream, answer or file but
    /// the pool carries) of the pool's nonce and the snapshot's volume id; never 0,
    /// which means none. Keyed, so that knowing the nonce (every stream carries it)
    /// and guessing the small id does not give the identity: a forged stream
    /// naming it as its base cannot be made.
    pub(crate) fn snapshot_guid(&self, id: u64) -> u64 {
        let key = blake3::derive_key(SNAPSHOT_GUID_CONTEXT, &self.fingerprint_key);
        let mut input = [0u8; 16];
        input[..8].copy_from_slice(&self.nonce.to_le_bytes());
        input[8..].copy_from_slice(&id.to_le_bytes());
        let hash = blake3::keyed_hash(&key, &input);
        let mut low = [0u8; 8];
        low.copy_from_slice(&hash.as_bytes()[..8]);
        u64::from_le_bytes(low).max(1)
    }
    /// A block's fingerprint: keyed BLAKE3-256 under the pool's key.
    pub(crate) fn fingerprint(&self, block: &[u8]) -> [u8; 32] {
        *blake3::keyed_hash(&self.fingerprint_key, block).as_bytes()
    }
    /// The fingerprints of many blocks, hashed side by side (`fingerprint.rs`): the
    /// same values as [`PoolGeometry::fingerprint`] of each.
    pub(crate) fn fingerprint_many(&self, blocks: &[&[u8]], out: &mut [[u8; 32]]) {
        crate::fingerprint::keyed_many(&self.fingerprint_key, blocks, out);
    }
    /// The data device's length at format time (or at the last `pool grow`).
    pub(crate) fn data_device_bytes(&self) -> u64 {
        self.data_device_bytes.load(Ordering::Acquire)
    }
    /// The metadata device's length at format time (or at the last `pool grow` of a
    /// single-device pool).
    pub(crate) fn metadata_device_bytes(&self) -> u64 {
        self.metadata_device_bytes.load(Ordering::Acquire)
    }
    /// Byte offset of the data region on the data device.
    pub(crate) fn data_offset_bytes(&self) -> u64 {
        self.data_offset_bytes
    }
    /// 4 KiB blocks in the data region.
    pub(crate) fn data_blocks(&self) -> u64 {
        self.data_blocks.load(Ordering::Acquire)
    }
    /// Data blocks per slab, as recorded.
    pub(crate) fn slab_blocks(&self) -> u32 {
        self.slab_blocks
    }
    /// Object records per slab.
    pub(crate) fn objects_per_slab(&self) -> u32 {
        self.objects_per_slab
    }
    /// Slabs in the data region.
    pub(crate) fn slab_count(&self) -> u32 {
        self.slab_count.load(Ordering::Acquire)
    }
    /// First block of the journal ring on the metadata device.
    pub(crate) fn journal_start_block(&self) -> u64 {
        self.journal_start_block
    }
    /// 512-byte sectors in the journal ring.
    pub(crate) fn journal_sectors(&self) -> u64 {
        self.journal_sectors
    }
    /// First block of the page store on the metadata device.
    pub(crate) fn pages_start_block(&self) -> u64 {
        self.pages_start_block
    }
    /// Slots in the page store.
    pub(crate) fn page_slots(&self) -> u64 {
        self.page_slots
    }
    /// Data blocks kept out of what volumes may address.
    pub(crate) fn reserve_blocks(&self) -> u64 {
        self.reserve_blocks
    }
    /// Entries of the dedup index.
    pub(crate) fn index_entries(&self) -> u64 {
        self.index_entries
    }
    /// Which fingerprints enter the dedup index.
    pub(crate) fn index_mode(&self) -> crate::IndexMode {
        self.index_mode
    }
    /// Volumes may promise more than the pool stores.
    pub(crate) fn overcommit(&self) -> bool {
        self.overcommit
    }
    /// Opened with flags bit 3: metadata pages may lie in data blocks, and data
    /// leaves each slab headroom for them (`slab_depot.rs`). A pool made before
    /// gets the bit at its first such page, and the headroom at its next open.
    pub(crate) fn data_region_pages(&self) -> bool {
        self.data_region_pages
    }
    /// Metadata device blocks the layout takes: super blocks, journal, page store.
    pub(crate) fn metadata_blocks(&self) -> u64 {
        2 + self.journal_sectors / 8 + self.page_slots
    }
    /// Logical blocks thick volumes can address (thin ones promise beyond it, up to
    /// the format's maximum). The reserve stays out of what volumes may address: overwriting a full thick pool stores the new copy before
    /// the old one is freed. Saturating: a reserve past the data region (only a tiny
    /// or damaged pool) leaves nothing addressable, so every write is refused rather
    /// than wrap round.
    pub(crate) fn addressable_blocks(&self) -> u64 {
        self.addressable_for(self.data_blocks())
    }

    /// What volumes may address with a data region of `data_blocks`.
    fn addressable_for(&self, data_blocks: u64) -> u64 {
        let stored = data_blocks.saturating_sub(self.reserve_blocks);
        if self.overcommit {
            stored * OVERCOMMIT_FACTOR
        } else {
            stored
        }
    }

    /// The largest data region, up to `want_blocks`, whose pages the page store can
    /// hold at worst (every object record and map page in use, with the
    /// copy-on-write slack: `page_slots_for`): the page store keeps its size when the
    /// data region grows. At least the current data region.
    pub(crate) fn data_blocks_covered(&self, want_blocks: u64) -> u64 {
        if self.data_region_pages {
            // Pages past the page store go to data blocks (flags bit 3): any size.
            return want_blocks.max(self.data_blocks());
        }
        let fits = |d: u64| page_slots_for(d, self.addressable_for(d)) <= self.page_slots;
        let (mut lo, mut hi) = (self.data_blocks(), want_blocks);
        if hi <= lo || fits(hi) {
            return hi.max(lo);
        }
        // page_slots_for grows with the data region: the last size that fits.
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// The data region is now `data_blocks` in `slab_count` slabs on a data device of
    /// `data_device_bytes` (`grow.rs`, with the gate held and the slab depot already
    /// holding the slabs, so that no reader sees a slab the depot lacks).
    pub(crate) fn grow_to(&self, data_device_bytes: u64, data_blocks: u64, slab_count: u32) {
        self.data_device_bytes
            .store(data_device_bytes, Ordering::Release);
        if !self.separate_metadata {
            self.metadata_device_bytes
                .store(data_device_bytes, Ordering::Release);
        }
        self.data_blocks.store(data_blocks, Ordering::Release);
        self.slab_count.store(slab_count, Ordering::Release);
    }

    /// Whether metadata lives on its own device.
    pub(crate) fn separate_metadata(&self) -> bool {
        self.separate_metadata
    }
}

/// "1.50 GiB".
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS.get(unit).unwrap_or(&"B"))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn single_device_layout_fits_and_does_not_overlap() {
        for gib in [1u64, 8, 16, 1024] {
            let blocks = gib << 18;
            let g = Geometry::compute(blocks, None, false).unwrap();
            assert!(g.pages_start_block + g.page_slots <= g.data_offset_bytes / 4096);
            assert_eq!(g.data_offset_bytes / 4096 + g.data_blocks, blocks);
            // Everything before the data region (super blocks, journal, page store,
            // padding) is at most 2% of the device from 1 GiB up.
            let metadata = blocks - g.data_blocks;
            assert!(
                metadata * 100 <= blocks * METADATA_PERCENT_MAX,
                "{gib} GiB: metadata {metadata} of {blocks} blocks"
            );
        }
    }

    // Regression: an iteration to a fixed point could end on a layout whose page
    // store was too small for the data it left (seen at 1 GiB with --overcommit).
    #[test]
    fn every_size_lays_out_with_and_without_overcommit() {
        for mib in (64u64..4096).step_by(61).chain([1024, 16384, 1 << 20]) {
            for overcommit in [false, true] {
                let blocks = mib << 8;
                let g = Geometry::compute(blocks, None, overcommit)
                    .unwrap_or_else(|e| panic!("{mib} MiB, overcommit {overcommit}: {e}"));
                assert!(g.page_slots >= PAGE_SLOTS_MIN);
                assert!(g.pages_start_block + g.page_slots <= g.data_offset_bytes / 4096);
                assert_eq!(g.data_offset_bytes / 4096 + g.data_blocks, blocks);
                // The metadata no longer depends on what volumes may address.
                let other = Geometry::compute(blocks, None, !overcommit).unwrap();
                assert_eq!(other.page_slots, g.page_slots);
                assert_eq!(other.data_blocks, g.data_blocks);
            }
        }
    }

    #[test]
    fn a_separate_metadata_device_of_the_size_asked_fits() {
        for gib in [1u64, 16, 1024] {
            let blocks = gib << 18;
            let need = Geometry::metadata_blocks_needed(blocks, false);
            assert!(
                need * 100 <= blocks * METADATA_PERCENT_MAX,
                "{gib} GiB: {need}"
            );
            let g = Geometry::compute(blocks, Some(need), false).unwrap();
            assert_eq!(g.pages_start_block + g.page_slots, need);
            assert!(Geometry::compute(blocks, Some(need - 1), false).is_err());
        }
    }

    #[test]
    fn too_small_is_refused_with_the_minimum() {
        let err = Geometry::compute(1000, None, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("64.00 MiB"), "{err}");
    }
}
