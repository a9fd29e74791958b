//! The super block (two copies, blocks 0 and 1 of the metadata device) and the
//! data-device label (block 0 of a separate data device).
//!
//! A checkpoint writes the super block copy `generation % 2`; opening reads both
//! and takes the valid one with the highest generation, so a torn super-block
//! write leaves the previous checkpoint in force.

use crate::dir_tree::{MAX_DATA_REGION_BLOCKS, MAX_TREE_PAGES};
use crate::page::{
    PageRef, FINGERPRINTS_PER_PAGE, OBJECTS_PER_PAGE, PAGE_PAYLOAD_BYTES, PAGE_REF_BYTES,
};
use crate::{
    seal_checksum, verify_checksum, FormatError, Reader, Writer, BLOCK_BYTES, FORMAT_VERSION,
    FORMAT_VERSION_1, FORMAT_VERSION_2, SECTOR_BYTES,
};

/// "fewrbyts" as a little-endian u64.
pub const SUPER_MAGIC: u64 = u64::from_le_bytes(*b"fewrbyts");
/// "fbdatalb".
pub const DATA_LABEL_MAGIC: u64 = u64::from_le_bytes(*b"fbdatalb");
/// Catalog page slots a version-1 super block can name (the most of either version).
pub const MAX_CATALOG_PAGES: usize = 256;
/// Where a version-2 super block's catalog references start.
const CATALOG_REFS_OFFSET_V2: usize = 384;
/// Catalog page references a version-2 super block can hold.
pub const MAX_CATALOG_PAGES_V2: usize = (BLOCK_BYTES - CATALOG_REFS_OFFSET_V2) / PAGE_REF_BYTES;
const _: () = assert!(
    MAX_CATALOG_PAGES_V2 == 232 && MAX_CATALOG_PAGES_V2 <= MAX_CATALOG_PAGES,
    "docs/format.md's v2 super block holds 232 catalog references"
);
/// Longest host name the open-by-host marker records.
pub const MAX_HOST_BYTES: usize = 64;
/// The data device label's version (unchanged by format version 2).
pub const DATA_LABEL_VERSION: u32 = 1;
/// Longest metadata-device path a data label records.
pub const MAX_PATH_BYTES: usize = 1024;
const CRC_OFFSET: usize = 12;

/// Fewest dedup index entries a pool is given, however small.
pub const INDEX_ENTRIES_MIN: u64 = 1024;

/// Most dedup index entries a pool may record: one per object slot (the index never
/// holds more fingerprints than there are stored objects), or `INDEX_ENTRIES_MIN`.
/// Opening sizes the index from this field, so it must be bounded by the geometry.
pub fn index_entries_max(slab_count: u32, objects_per_slab: u32) -> u64 {
    (u64::from(slab_count) * u64::from(objects_per_slab)).max(INDEX_ENTRIES_MIN)
}

/// Largest slab (blocks) a super block may name: 256 MiB. Opening sizes per-slab
/// tables from it.
pub const SLAB_BLOCKS_MAX: u32 = 1 << 16;
/// Most object slots per data block a slab may have (before rounding up to whole
/// object pages): compressed fragments share blocks, but opening sizes each slab's
/// object table from `objects_per_slab`, so it must be bounded by the slab.
pub const OBJECTS_PER_BLOCK_MAX: u32 = 4;

/// Largest checkpoint generation and journal sequence a super block may hold: far
/// past any pool's lifetime (a sector a nanosecond for 290 years), and the room above
/// it lets the engine count on without overflow.
pub const COUNTER_MAX: u64 = (1 << 63) - 1;

/// Flag: data and metadata are on separate devices.
pub const FLAG_SEPARATE_METADATA: u32 = 1;
/// Flag: the pool may promise more logical space than it can store.
pub const FLAG_OVERCOMMIT: u32 = 2;
/// Flag (version 2): the pool was upgraded from version 1.
pub const FLAG_UPGRADED_FROM_V1: u32 = 4;
/// Flag (version 2): page references may name data-region blocks (address bit 63):
/// set by `pool create`, and by the first checkpoint that places a page there in a
/// pool made before. Without it a data-region address is corruption.
pub const FLAG_DATA_REGION_PAGES: u32 = 8;
/// Flag (version 2): fragments may be compressed with a codec other than LZ4 (zstd).
/// Set when the pool's compression becomes zstd and never cleared, so a reader that
/// knows only LZ4 refuses the pool instead of finding fragments it cannot decode.
pub const FLAG_CODECS: u32 = 16;
/// Flag (version 2): journal sectors written in this super block's open generation
/// carry their index in their commit and are covered by parity sectors
/// (`journal.rs`). Set by `pool create` and by the checkpoint each read-write open
/// takes before it writes a sector, so a reader that does not know parity sectors
/// refuses the pool instead of taking the first one for the journal's end.
pub const FLAG_JOURNAL_COMMITS: u32 = 32;
/// Flag (version 3), bit 7: a block-map page may be reached from several volumes'
/// trees (clones, snapshots and rollbacks share pages), map pages name their
/// volume's lineage as owner, and the catalog is a lineage stream
/// (`catalog::CATALOG_MAGIC_V3_LINEAGE`). Set by each checkpoint whose catalog
/// carries lineages (a snapshot, or a clone of this version, exists) and cleared
/// by one whose catalog does not, so a pool that never had either stays readable
/// by engines that do not know the bit.
pub const FLAG_SHARED_MAPS: u32 = 128;
/// Flag (version 3), bit 6: journal sectors written in this super block's open
/// generation may hold `NewStored` records (`journal::Record::NewStored`: a block
/// stored new and mapped, its fingerprint recomputed from the data at replay). Set,
/// like [`FLAG_JOURNAL_COMMITS`], by the checkpoint each read-write open takes before
/// it writes a sector, so a reader that does not know the record refuses the pool.
pub const FLAG_SLIM_RECORDS: u32 = 64;
/// The flags this version knows; a version-2 super block with any other is refused.
const FLAGS_KNOWN_V2: u32 = FLAG_SHARED_MAPS
    | FLAG_SLIM_RECORDS
    | FLAG_SEPARATE_METADATA
    | FLAG_OVERCOMMIT
    | FLAG_UPGRADED_FROM_V1
    | FLAG_CODECS
    | FLAG_DATA_REGION_PAGES
    | FLAG_JOURNAL_COMMITS;

/// `compression` (offset 148): LZ4. Pools made before the field hold 0, also LZ4.
pub const COMPRESSION_LZ4: u8 = 1;
/// `compression` (offset 148): zstd at `compression_level`.
pub const COMPRESSION_ZSTD: u8 = 2;
/// `compression` (offset 148): none; every new block is stored whole.
pub const COMPRESSION_NONE: u8 = 3;
/// Lowest zstd level a super block may record (zstd's fast levels are negative).
pub const ZSTD_LEVEL_MIN: i8 = -7;
/// Highest zstd level a super block may record (zstd's maximum).
pub const ZSTD_LEVEL_MAX: i8 = 22;

/// `index_mode` (offset 212, version 2): pools made before the field hold 0, dense.
pub const INDEX_MODE_UNSET: u8 = 0;
/// `index_mode`: every stored block's fingerprint enters the index.
pub const INDEX_MODE_DENSE: u8 = 1;
/// `index_mode`: only *hooks*, 1 in 2^`index_sample_shift` fingerprints (chosen by
/// fingerprint bits), enter the index; the rest are found next to a hook's hit.
pub const INDEX_MODE_SPARSE: u8 = 2;
/// Largest `index_sample_shift` a sparse pool may record (1 in 65,536 sampled).
pub const INDEX_SAMPLE_SHIFT_MAX: u8 = 16;

/// The open-by-host marker (version 2): who has the pool open. Set by the checkpoint
/// an open takes, cleared by the one a clean close takes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Holder {
    /// Process id; 0 when no holder.
    pub pid: u32,
    /// When it opened the pool (seconds since the epoch); 0: no holder.
    pub open_unix: u64,
    /// The host's boot id (16 bytes; zeros if unknown).
    pub boot_id: [u8; 16],
    /// The host's name (at most [`MAX_HOST_BYTES`] bytes, no NUL).
    pub host: String,
}

impl Holder {
    /// Whether someone holds the pool open (or stopped without closing it).
    pub fn is_set(&self) -> bool {
        self.open_unix != 0
    }
}

/// The pool's root of trust.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SuperBlock {
    /// Format version (1, 2 or 3; 3 has version 2's layout); encoding writes this
    /// version's layout.
    pub version: u32,
    /// Random pool identity, in every metadata block.
    pub nonce: u64,
    /// Checkpoint generation; copy `generation % 2` holds it.
    pub generation: u64,
    /// Incremented at every open; journal sectors carry it.
    pub open_gen: u32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Key of the keyed BLAKE3 fingerprint.
    pub fingerprint_key: [u8; 32],
    /// Byte offset of the data region on the data device.
    pub data_offset_bytes: u64,
    /// 4 KiB blocks in the data region.
    pub data_blocks: u64,
    /// Data blocks per slab.
    pub slab_blocks: u32,
    /// Object slots per slab.
    pub objects_per_slab: u32,
    /// Number of slabs.
    pub slab_count: u32,
    /// First block of the journal ring on the metadata device.
    pub journal_start_block: u64,
    /// Sectors in the journal ring.
    pub journal_sectors: u64,
    /// First block of the page store on the metadata device.
    pub pages_start_block: u64,
    /// Slots (4 KiB pages) in the page store.
    pub page_slots: u64,
    /// First journal sector sequence to replay (records after the checkpoint).
    pub journal_replay_seq: u64,
    /// Bytes of the catalog stream.
    pub catalog_bytes: u32,
    /// Total bytes of the metadata device (= data device when not separate).
    pub metadata_device_bytes: u64,
    /// Total bytes of the data device.
    pub data_device_bytes: u64,
    /// Data blocks held back for trim and delete on an overcommitted pool.
    pub reserve_blocks: u64,
    /// Entries in the dedup index (its memory bound).
    pub index_entries: u64,
    /// Creation time, seconds since the epoch.
    pub created_unix: u64,
    /// How new blocks are compressed (`COMPRESSION_*`; 0 in pools made before the
    /// field: LZ4). Each fragment records its own codec, so reads never depend on it.
    pub compression: u8,
    /// The zstd level with `COMPRESSION_ZSTD` (0: zstd's default); 0 otherwise.
    pub compression_level: i8,
    /// How the dedup index samples fingerprints (`INDEX_MODE_*`; version 2, offset
    /// 212; 0 in pools made before the field and in version 1: dense).
    pub index_mode: u8,
    /// With `INDEX_MODE_SPARSE`, log2 of the sampling: 1 in 2^this fingerprints is a
    /// hook (1 to `INDEX_SAMPLE_SHIFT_MAX`); 0 otherwise.
    pub index_sample_shift: u8,
    /// The catalog pages, in order (version 1: slots only).
    pub catalog: Vec<PageRef>,
    /// The counters page (version 2; none written yet).
    pub counters: PageRef,
    /// The open-by-host marker (version 2).
    pub holder: Holder,
    /// The generation whose checkpoint upgraded the pool from version 1 (0: none).
    pub upgraded_generation: u64,
}

impl SuperBlock {
    /// Encode into one block.
    pub fn encode(&self, out: &mut [u8; BLOCK_BYTES]) {
        out.fill(0);
        let mut w = Writer::new(out);
        w.u64(SUPER_MAGIC);
        w.u32(self.version);
        w.u32(0); // crc
        w.u64(self.nonce);
        w.u64(self.generation);
        w.u32(self.open_gen);
        w.u32(self.flags);
        w.put(&self.fingerprint_key);
        w.u64(self.data_offset_bytes);
        w.u64(self.data_blocks);
        w.u32(self.slab_blocks);
        w.u32(self.objects_per_slab);
        w.u32(self.slab_count);
        w.u32(self.catalog.len() as u32);
        w.u64(self.journal_start_block);
        w.u64(self.journal_sectors);
        w.u64(self.pages_start_block);
        w.u64(self.page_slots);
        w.u64(self.journal_replay_seq);
        w.u32(self.catalog_bytes);
        w.u8(self.compression);
        w.u8(self.compression_level as u8);
        w.u16(0);
        w.u64(self.metadata_device_bytes);
        w.u64(self.data_device_bytes);
        w.u64(self.reserve_blocks);
        w.u64(self.index_entries);
        w.u64(self.created_unix);
        debug_assert!(
            w.pos() <= 192,
            "super block fields overlap the catalog slots"
        );
        if self.version == FORMAT_VERSION_1 {
            w.seek(256);
            for r in &self.catalog {
                w.u32(r.address as u32);
            }
        } else {
            w.seek(192);
            self.counters.encode(&mut w);
            w.u32(self.holder.pid);
            w.u8(self.index_mode);
            w.u8(self.index_sample_shift);
            w.u16(0);
            w.u64(self.holder.open_unix);
            w.put(&self.holder.boot_id);
            w.u64(self.upgraded_generation);
            w.u64(0);
            let host = self.holder.host.as_bytes();
            w.put(host.get(..MAX_HOST_BYTES).unwrap_or(host));
            w.seek(CATALOG_REFS_OFFSET_V2);
            for r in &self.catalog {
                r.encode(&mut w);
            }
        }
        seal_checksum(out, CRC_OFFSET);
    }

    /// Decode and verify one copy read from block `block`.
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let what = "super block";
        let (version, mut r) = open_header(
            what,
            bytes,
            SUPER_MAGIC,
            &[FORMAT_VERSION_1, FORMAT_VERSION_2, FORMAT_VERSION],
        )?;
        let max_catalog_pages = if version == FORMAT_VERSION_1 {
            MAX_CATALOG_PAGES
        } else {
            MAX_CATALOG_PAGES_V2
        };
        let nonce = r.u64()?;
        let generation = r.u64()?;
        let open_gen = r.u32()?;
        let flags = r.u32()?;
        let fingerprint_key = r.bytes32()?;
        let data_offset_bytes = r.u64()?;
        let data_blocks = r.u64()?;
        let slab_blocks = r.u32()?;
        let objects_per_slab = r.u32()?;
        let slab_count = r.u32()?;
        let catalog_pages = r.u32()? as usize;
        let journal_start_block = r.u64()?;
        let journal_sectors = r.u64()?;
        let pages_start_block = r.u64()?;
        let page_slots = r.u64()?;
        let journal_replay_seq = r.u64()?;
        let catalog_bytes = r.u32()?;
        let compression = r.u8()?;
        let compression_level = r.u8()? as i8;
        r.u16()?;
        let metadata_device_bytes = r.u64()?;
        let data_device_bytes = r.u64()?;
        let reserve_blocks = r.u64()?;
        let index_entries = r.u64()?;
        let created_unix = r.u64()?;
        // The next open writes open_gen + 1, the next checkpoint generation + 1, and
        // the journal counts on from journal_replay_seq.
        if open_gen == u32::MAX || generation > COUNTER_MAX || journal_replay_seq > COUNTER_MAX {
            return Err(FormatError::Invalid {
                what,
                reason: format!(
                    "counters out of range (open_gen {open_gen}, generation {generation}, \
                     journal_replay_seq {journal_replay_seq})"
                ),
            });
        }
        if catalog_pages > max_catalog_pages {
            return Err(FormatError::Invalid {
                what,
                reason: format!("{catalog_pages} catalog pages (max {max_catalog_pages})"),
            });
        }
        if version != FORMAT_VERSION_1 && flags & !FLAGS_KNOWN_V2 != 0 {
            return Err(FormatError::Invalid {
                what,
                reason: format!(
                    "flags {flags:#x} include features this version does not know \
                     (bit 3: metadata pages in the data region)"
                ),
            });
        }
        if version == FORMAT_VERSION_2 && flags & (FLAG_SHARED_MAPS | FLAG_SLIM_RECORDS) != 0 {
            return Err(FormatError::Invalid {
                what,
                reason: format!(
                    "a version-2 super block with flags {flags:#x}: bit 6 (slim journal \
                     records) and bit 7 (shared map pages) are version 3's"
                ),
            });
        }
        check_compression(what, compression, compression_level)?;
        if slab_blocks == 0
            || objects_per_slab == 0
            || journal_sectors == 0
            || slab_count == 0
            || data_blocks == 0
        {
            return Err(FormatError::Invalid {
                what,
                reason: "zero-sized geometry".into(),
            });
        }
        if u64::from(slab_count) * u64::from(slab_blocks) < data_blocks {
            return Err(FormatError::Invalid {
                what,
                reason: "slabs do not cover the data blocks".into(),
            });
        }
        check_regions(
            what,
            &Regions {
                flags,
                data_offset_bytes,
                data_blocks,
                slab_blocks,
                objects_per_slab,
                slab_count,
                catalog_pages,
                catalog_bytes,
                journal_start_block,
                journal_sectors,
                pages_start_block,
                page_slots,
                metadata_device_bytes,
                data_device_bytes,
            },
        )?;
        if index_entries > index_entries_max(slab_count, objects_per_slab) {
            return Err(FormatError::Invalid {
                what,
                reason: format!(
                    "{index_entries} dedup index entries for {} object slots",
                    u64::from(slab_count) * u64::from(objects_per_slab)
                ),
            });
        }
        let mut catalog = Vec::with_capacity(catalog_pages);
        let mut counters = PageRef::NONE;
        let mut holder = Holder::default();
        let mut upgraded_generation = 0;
        let (mut index_mode, mut index_sample_shift) = (INDEX_MODE_UNSET, 0);
        if version == FORMAT_VERSION_1 {
            r.seek(256);
            for _ in 0..catalog_pages {
                catalog.push(PageRef::slot_only(r.u32()?));
            }
        } else {
            r.seek(192);
            counters = PageRef::decode(&mut r)?;
            holder.pid = r.u32()?;
            index_mode = r.u8()?;
            index_sample_shift = r.u8()?;
            let index_reserved = r.u16()?;
            check_index_mode(what, index_mode, index_sample_shift, index_reserved)?;
            holder.open_unix = r.u64()?;
            holder.boot_id.copy_from_slice(r.take(16)?);
            upgraded_generation = r.u64()?;
            r.u64()?;
            holder.host = decode_host(what, r.take(MAX_HOST_BYTES)?)?;
            r.seek(CATALOG_REFS_OFFSET_V2);
            for _ in 0..catalog_pages {
                catalog.push(PageRef::decode(&mut r)?);
            }
        }
        Ok(SuperBlock {
            version,
            nonce,
            generation,
            open_gen,
            flags,
            fingerprint_key,
            data_offset_bytes,
            data_blocks,
            slab_blocks,
            objects_per_slab,
            slab_count,
            journal_start_block,
            journal_sectors,
            pages_start_block,
            page_slots,
            journal_replay_seq,
            catalog_bytes,
            metadata_device_bytes,
            data_device_bytes,
            reserve_blocks,
            index_entries,
            created_unix,
            compression,
            compression_level,
            index_mode,
            index_sample_shift,
            catalog,
            counters,
            holder,
            upgraded_generation,
        })
    }
}

/// The index mode (offset 212): a known mode, a sample shift only when sparse (and
/// one in range then), and bytes 214–215 zero.
fn check_index_mode(
    what: &'static str,
    mode: u8,
    shift: u8,
    reserved: u16,
) -> Result<(), FormatError> {
    let valid = reserved == 0
        && match mode {
            INDEX_MODE_UNSET | INDEX_MODE_DENSE => shift == 0,
            INDEX_MODE_SPARSE => (1..=INDEX_SAMPLE_SHIFT_MAX).contains(&shift),
            _ => false,
        };
    if valid {
        return Ok(());
    }
    Err(FormatError::Invalid {
        what,
        reason: format!(
            "index mode {mode} with sample shift {shift} and reserved bytes {reserved:#x} \
             (modes: 0 unset, 1 dense, 2 sparse with a shift of 1 to \
             {INDEX_SAMPLE_SHIFT_MAX}; bytes 214-215 zero)"
        ),
    })
}

/// The compression field: a known codec, and a level only with zstd.
fn check_compression(what: &'static str, codec: u8, level: i8) -> Result<(), FormatError> {
    let valid = match codec {
        0 | COMPRESSION_LZ4 | COMPRESSION_NONE => level == 0,
        COMPRESSION_ZSTD => (ZSTD_LEVEL_MIN..=ZSTD_LEVEL_MAX).contains(&level),
        _ => false,
    };
    if valid {
        Ok(())
    } else {
        Err(FormatError::Invalid {
            what,
            reason: format!("unknown compression {codec} (level {level})"),
        })
    }
}

/// The marker's host name: UTF-8 up to the first zero, and only zeros after it.
fn decode_host(what: &'static str, raw: &[u8]) -> Result<String, FormatError> {
    let len = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
    let (name, padding) = raw.split_at(len);
    if padding.iter().any(|b| *b != 0) {
        return Err(FormatError::Invalid {
            what,
            reason: "host name of the open-by-host marker is not zero-padded".into(),
        });
    }
    String::from_utf8(name.to_vec()).map_err(|_| FormatError::Invalid {
        what,
        reason: "host name of the open-by-host marker is not UTF-8".into(),
    })
}

/// The geometry fields of a super block, checked together by [`check_regions`].
struct Regions {
    flags: u32,
    data_offset_bytes: u64,
    data_blocks: u64,
    slab_blocks: u32,
    objects_per_slab: u32,
    slab_count: u32,
    catalog_pages: usize,
    catalog_bytes: u32,
    journal_start_block: u64,
    journal_sectors: u64,
    pages_start_block: u64,
    page_slots: u64,
    metadata_device_bytes: u64,
    data_device_bytes: u64,
}

/// The layout rules of `docs/format.md` ("Devices and regions"): every region lies
/// inside the device size recorded beside it, no two overlap, the slabs are exactly
/// those the data region needs, and the catalog fits its pages. Everything the engine
/// sizes or addresses from these fields is then bounded by the recorded device sizes,
/// and no product or sum of them overflows.
fn check_regions(what: &'static str, g: &Regions) -> Result<(), FormatError> {
    let invalid = |reason: String| FormatError::Invalid { what, reason };
    let block = BLOCK_BYTES as u64;
    if g.slab_blocks > SLAB_BLOCKS_MAX {
        return Err(invalid(format!(
            "slabs of {} blocks (max {SLAB_BLOCKS_MAX})",
            g.slab_blocks
        )));
    }
    let objects_max = (u64::from(g.slab_blocks) * u64::from(OBJECTS_PER_BLOCK_MAX))
        .div_ceil(OBJECTS_PER_PAGE as u64)
        * OBJECTS_PER_PAGE as u64;
    if u64::from(g.objects_per_slab) > objects_max {
        return Err(invalid(format!(
            "{} objects per slab of {} blocks (max {objects_max})",
            g.objects_per_slab, g.slab_blocks
        )));
    }
    if !(g.objects_per_slab as usize).is_multiple_of(OBJECTS_PER_PAGE) {
        return Err(invalid(format!(
            "{} objects per slab is not whole pages of {OBJECTS_PER_PAGE}",
            g.objects_per_slab
        )));
    }
    if u64::from(g.slab_count) != g.data_blocks.div_ceil(u64::from(g.slab_blocks)) {
        return Err(invalid(format!(
            "{} slabs of {} blocks for {} data blocks",
            g.slab_count, g.slab_blocks, g.data_blocks
        )));
    }
    if g.data_blocks > MAX_DATA_REGION_BLOCKS {
        return Err(invalid(format!(
            "a data region of {} blocks (max {MAX_DATA_REGION_BLOCKS}: fragment \
             addresses are 48 bits)",
            g.data_blocks
        )));
    }
    let table_pages = u64::from(g.slab_count)
        * u64::from(g.objects_per_slab).div_ceil(FINGERPRINTS_PER_PAGE as u64);
    if table_pages > MAX_TREE_PAGES {
        return Err(invalid(format!(
            "{table_pages} fingerprint pages (a directory tree reaches {MAX_TREE_PAGES})"
        )));
    }
    if u64::from(g.catalog_bytes) > (g.catalog_pages * PAGE_PAYLOAD_BYTES) as u64 {
        return Err(invalid(format!(
            "a catalog of {} bytes in {} pages",
            g.catalog_bytes, g.catalog_pages
        )));
    }
    // Half-open byte ranges of each region on its device.
    let range =
        |name: &str, start: Option<u64>, len: Option<u64>, device_bytes: u64| match (start, len) {
            (Some(s), Some(l)) if s.checked_add(l).is_some_and(|e| e <= device_bytes) => {
                Ok((s, s + l))
            }
            _ => Err(invalid(format!(
                "the {name} does not fit its device of {device_bytes} bytes"
            ))),
        };
    let supers = (0, 2 * block);
    let journal = range(
        "journal",
        g.journal_start_block.checked_mul(block),
        g.journal_sectors.checked_mul(SECTOR_BYTES as u64),
        g.metadata_device_bytes,
    )?;
    let pages = range(
        "page store",
        g.pages_start_block.checked_mul(block),
        g.page_slots.checked_mul(block),
        g.metadata_device_bytes,
    )?;
    let data = range(
        "data region",
        Some(g.data_offset_bytes),
        g.data_blocks.checked_mul(block),
        g.data_device_bytes,
    )?;
    let overlap = |a: (u64, u64), b: (u64, u64)| a.0 < b.1 && b.0 < a.1;
    let mut pairs = vec![
        ("super blocks", supers, "journal", journal),
        ("super blocks", supers, "page store", pages),
        ("journal", journal, "page store", pages),
    ];
    if g.flags & FLAG_SEPARATE_METADATA == 0 {
        pairs.push(("super blocks", supers, "data region", data));
        pairs.push(("journal", journal, "data region", data));
        pairs.push(("page store", pages, "data region", data));
    } else {
        // Blocks 0 and 1: the label, and the place of its second copy.
        pairs.push(("data device label", (0, 2 * block), "data region", data));
    }
    for (a_name, a, b_name, b) in pairs {
        if overlap(a, b) {
            return Err(invalid(format!(
                "the {a_name} (bytes {}..{}) overlap the {b_name} (bytes {}..{})",
                a.0, a.1, b.0, b.1
            )));
        }
    }
    Ok(())
}

/// Block 0 of a separate data device: which pool it belongs to and where its
/// metadata device is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataLabel {
    /// The pool's nonce.
    pub nonce: u64,
    /// Path of the metadata device, as given at creation (canonical).
    pub metadata_path: String,
}

impl DataLabel {
    /// Encode into one block.
    pub fn encode(&self, out: &mut [u8; BLOCK_BYTES]) {
        out.fill(0);
        let mut w = Writer::new(out);
        w.u64(DATA_LABEL_MAGIC);
        w.u32(DATA_LABEL_VERSION);
        w.u32(0);
        w.u64(self.nonce);
        let path = self.metadata_path.as_bytes();
        let n = path.len().min(MAX_PATH_BYTES);
        w.u32(n as u32);
        w.put(path.get(..n).unwrap_or(path));
        seal_checksum(out, CRC_OFFSET);
    }

    /// Decode and verify.
    pub fn decode(bytes: &[u8]) -> Result<Self, FormatError> {
        let what = "data device label";
        let (_, mut r) = open_header(what, bytes, DATA_LABEL_MAGIC, &[DATA_LABEL_VERSION])?;
        let nonce = r.u64()?;
        let n = r.u32()? as usize;
        if n > MAX_PATH_BYTES {
            return Err(FormatError::Invalid {
                what,
                reason: format!("path of {n} bytes"),
            });
        }
        let metadata_path =
            String::from_utf8(r.take(n)?.to_vec()).map_err(|_| FormatError::Invalid {
                what,
                reason: "path is not UTF-8".into(),
            })?;
        Ok(DataLabel {
            nonce,
            metadata_path,
        })
    }
}

/// Check the header both block-0 structures share (u64 magic, u32 version, one of
/// `versions`, u32 crc over the block) and return the version and a reader just past it.
fn open_header<'a>(
    what: &'static str,
    bytes: &'a [u8],
    magic: u64,
    versions: &[u32],
) -> Result<(u32, Reader<'a>), FormatError> {
    if bytes.len() != BLOCK_BYTES {
        return Err(FormatError::Truncated {
            what,
            got: bytes.len(),
            need: BLOCK_BYTES,
        });
    }
    let mut r = Reader::new(what, bytes);
    let found = r.u64()?;
    if found != magic {
        return Err(FormatError::BadMagic { what, found });
    }
    let version = r.u32()?;
    if !versions.contains(&version) {
        return Err(FormatError::BadVersion {
            what,
            found: version,
            supported: versions.iter().copied().max().unwrap_or(FORMAT_VERSION),
        });
    }
    verify_checksum(what, bytes, CRC_OFFSET)?;
    r.u32()?;
    Ok((version, r))
}

/// What block 0 of a device holds, as far as a quick look tells.
pub fn magic_of(bytes: &[u8]) -> Option<u64> {
    Reader::new("block 0", bytes).u64().ok()
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "tests fail loudly by design"
)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> SuperBlock {
        SuperBlock {
            version: FORMAT_VERSION,
            nonce: 1,
            generation: 2,
            open_gen: 3,
            flags: FLAG_OVERCOMMIT,
            fingerprint_key: [7; 32],
            data_offset_bytes: 1 << 20,
            data_blocks: 1000,
            slab_blocks: 512,
            objects_per_slab: 1512,
            slab_count: 2,
            journal_start_block: 2,
            journal_sectors: 800,
            pages_start_block: 102,
            page_slots: 50,
            journal_replay_seq: 17,
            catalog_bytes: 300,
            metadata_device_bytes: 1 << 30,
            data_device_bytes: 1 << 30,
            reserve_blocks: 4,
            index_entries: 3024,
            created_unix: 1_700_000_000,
            compression: COMPRESSION_ZSTD,
            compression_level: -3,
            index_mode: INDEX_MODE_SPARSE,
            index_sample_shift: 4,
            catalog: vec![
                PageRef {
                    address: 3,
                    crc: 0x1234_5678,
                    generation: 2,
                    twin: 0,
                },
                PageRef {
                    address: 4,
                    crc: 0x9abc_def0,
                    generation: 1,
                    twin: 0,
                },
            ],
            counters: PageRef::NONE,
            holder: Holder {
                pid: 4242,
                open_unix: 1_700_000_100,
                boot_id: [9; 16],
                host: "pve-node-1".into(),
            },
            upgraded_generation: 0,
        }
    }

    fn sample_v1() -> SuperBlock {
        SuperBlock {
            version: FORMAT_VERSION_1,
            compression: 0,
            compression_level: 0,
            index_mode: INDEX_MODE_UNSET,
            index_sample_shift: 0,
            catalog: vec![PageRef::slot_only(3), PageRef::slot_only(4)],
            holder: Holder::default(),
            ..sample()
        }
    }

    #[test]
    fn version_2_super_blocks_still_decode_and_a_later_version_is_refused() {
        let v2 = SuperBlock {
            version: FORMAT_VERSION_2,
            ..sample()
        };
        let mut block = [0u8; BLOCK_BYTES];
        v2.encode(&mut block);
        assert_eq!(SuperBlock::decode(&block).unwrap(), v2);
        let v4 = SuperBlock {
            version: FORMAT_VERSION + 1,
            ..sample()
        };
        v4.encode(&mut block);
        assert!(matches!(
            SuperBlock::decode(&block),
            Err(FormatError::BadVersion { found: 4, .. })
        ));
    }

    #[test]
    fn version_1_super_blocks_still_decode() {
        let mut block = [0u8; BLOCK_BYTES];
        sample_v1().encode(&mut block);
        assert_eq!(SuperBlock::decode(&block).unwrap(), sample_v1());
    }

    #[test]
    fn unknown_flags_are_refused_in_version_2_and_data_region_pages_read() {
        let spilled = decode_with(|sb| sb.flags |= FLAG_DATA_REGION_PAGES);
        assert!(spilled.is_ok(), "{spilled:?}");
        assert_invalid(decode_with(|sb| sb.flags |= 1 << 20), "flags 0x100002");
        let upgraded = decode_with(|sb| sb.flags |= FLAG_UPGRADED_FROM_V1);
        assert!(upgraded.is_ok(), "{upgraded:?}");
    }

    #[test]
    fn slim_records_and_shared_maps_are_version_3_flags() {
        for bit in [FLAG_SLIM_RECORDS, FLAG_SHARED_MAPS] {
            let v3 = decode_with(|sb| sb.flags |= bit);
            assert!(v3.is_ok_and(|sb| sb.flags & bit != 0));
            let v2 = decode_with(|sb| {
                sb.version = FORMAT_VERSION_2;
                sb.flags |= bit;
            });
            assert_invalid(v2, "are version 3's");
        }
    }

    #[test]
    fn compression_is_a_known_codec_with_a_level_only_for_zstd() {
        assert_invalid(
            decode_with(|sb| sb.compression = 4),
            "unknown compression 4",
        );
        assert_invalid(
            decode_with(|sb| {
                sb.compression = COMPRESSION_LZ4;
                sb.compression_level = 1;
            }),
            "unknown compression 1 (level 1)",
        );
        assert_invalid(
            decode_with(|sb| sb.compression_level = ZSTD_LEVEL_MAX + 1),
            "unknown compression 2",
        );
        let lz4 = decode_with(|sb| {
            sb.compression = 0;
            sb.compression_level = 0;
        });
        assert!(lz4.is_ok(), "{lz4:?}");
    }

    #[test]
    fn the_index_mode_is_known_with_a_shift_only_when_sparse() {
        // Round trip of each mode (the sample is sparse, 1 in 16), at bytes 212-213.
        let mut block = [0u8; BLOCK_BYTES];
        sample().encode(&mut block);
        assert_eq!(
            (block[212], block[213], block[214], block[215]),
            (2, 4, 0, 0)
        );
        for (mode, shift) in [
            (INDEX_MODE_UNSET, 0),
            (INDEX_MODE_DENSE, 0),
            (INDEX_MODE_SPARSE, 1),
            (INDEX_MODE_SPARSE, INDEX_SAMPLE_SHIFT_MAX),
        ] {
            let sb = decode_with(|sb| (sb.index_mode, sb.index_sample_shift) = (mode, shift));
            let sb = sb.unwrap();
            assert_eq!((sb.index_mode, sb.index_sample_shift), (mode, shift));
        }
        for (mode, shift) in [
            (3, 0),
            (255, 4),
            (INDEX_MODE_DENSE, 4),
            (INDEX_MODE_UNSET, 1),
            (INDEX_MODE_SPARSE, 0),
            (INDEX_MODE_SPARSE, INDEX_SAMPLE_SHIFT_MAX + 1),
        ] {
            assert_invalid(
                decode_with(|sb| (sb.index_mode, sb.index_sample_shift) = (mode, shift)),
                &format!("index mode {mode} with sample shift {shift}"),
            );
        }
        let mut bad = block;
        bad[214] = 1;
        crate::seal_checksum(&mut bad, CRC_OFFSET);
        assert!(SuperBlock::decode(&bad).is_err(), "byte 214 must be zero");
    }

    #[test]
    fn the_holder_s_host_name_must_be_zero_padded_utf8() {
        let mut block = [0u8; BLOCK_BYTES];
        sample().encode(&mut block);
        block[256 + 20] = b'x'; // past the name's terminating zero
        crate::seal_checksum(&mut block, CRC_OFFSET);
        assert!(SuperBlock::decode(&block).is_err());
    }

    #[test]
    fn super_block_round_trips_and_rejects_flips() {
        let mut block = [0u8; BLOCK_BYTES];
        sample().encode(&mut block);
        assert_eq!(SuperBlock::decode(&block).unwrap(), sample());
        for byte in [0usize, 13, 20, 100, 193, 257, 390] {
            let mut bad = block;
            bad[byte] ^= 0x10;
            assert!(
                SuperBlock::decode(&bad).is_err(),
                "flip at byte {byte} undetected"
            );
        }
    }

    fn decode_with(change: impl FnOnce(&mut SuperBlock)) -> Result<SuperBlock, FormatError> {
        let mut sb = sample();
        change(&mut sb);
        let mut block = [0u8; BLOCK_BYTES];
        sb.encode(&mut block);
        SuperBlock::decode(&block)
    }

    fn assert_invalid(result: Result<SuperBlock, FormatError>, says: &str) {
        match result {
            Err(FormatError::Invalid { reason, .. }) => {
                assert!(reason.contains(says), "{reason:?} should say {says:?}")
            }
            other => panic!("expected Invalid saying {says:?}, got {other:?}"),
        }
    }

    #[test]
    fn page_store_past_the_end_of_u64_is_refused() {
        // Found by the pool_open fuzzer: a super block whose page store starts near
        // 2^64 bytes decoded fine, and opening the pool panicked multiplying its
        // first block by 4096 (a wrapped offset in a release build).
        assert_invalid(
            decode_with(|sb| sb.pages_start_block = 1 << 60),
            "the page store does not fit",
        );
        assert_invalid(
            decode_with(|sb| sb.page_slots = u64::MAX),
            "the page store does not fit",
        );
    }

    #[test]
    fn index_larger_than_the_object_slots_is_refused() {
        // Found by the pool_open fuzzer: opening sized the dedup index from this
        // field unchecked, and a damaged value asked for 2^57 bytes (an abort).
        assert_invalid(
            decode_with(|sb| sb.index_entries = 1 << 54),
            "18014398509481984 dedup index entries for 3024 object slots",
        );
        let small = decode_with(|sb| sb.index_entries = INDEX_ENTRIES_MIN);
        assert!(small.is_ok(), "{small:?}");
    }

    #[test]
    fn regions_must_fit_their_devices_and_not_overlap() {
        assert_invalid(
            decode_with(|sb| sb.journal_sectors = u64::MAX / 2),
            "the journal does not fit",
        );
        assert_invalid(
            decode_with(|sb| sb.data_device_bytes = 1 << 20),
            "the data region does not fit",
        );
        assert_invalid(
            decode_with(|sb| sb.pages_start_block = 50),
            "the journal (bytes 8192..417792) overlap the page store",
        );
        assert_invalid(
            decode_with(|sb| sb.journal_start_block = 1),
            "the super blocks (bytes 0..8192) overlap the journal",
        );
        assert_invalid(
            decode_with(|sb| sb.data_offset_bytes = 110 * BLOCK_BYTES as u64),
            "overlap the data region",
        );
        // With a separate metadata device the data region is on another device.
        let separate = decode_with(|sb| {
            sb.flags |= FLAG_SEPARATE_METADATA;
            sb.data_offset_bytes = 110 * BLOCK_BYTES as u64;
        });
        assert!(separate.is_ok(), "{separate:?}");
        assert_invalid(
            decode_with(|sb| {
                sb.flags |= FLAG_SEPARATE_METADATA;
                sb.data_offset_bytes = BLOCK_BYTES as u64;
            }),
            "the data device label (bytes 0..8192) overlap the data region",
        );
    }

    #[test]
    fn exhausted_counters_are_refused() {
        // Found by the pool_open fuzzer: open_gen u32::MAX decoded fine, and opening
        // panicked computing the next open generation (and would wrap to 0 in a
        // release build, where journal sectors of generation 0 exist).
        assert_invalid(
            decode_with(|sb| sb.open_gen = u32::MAX),
            "counters out of range (open_gen 4294967295",
        );
        assert_invalid(
            decode_with(|sb| sb.generation = u64::MAX),
            "generation 18446744073709551615",
        );
        assert_invalid(
            decode_with(|sb| sb.journal_replay_seq = COUNTER_MAX + 1),
            "journal_replay_seq 9223372036854775808",
        );
        let last = decode_with(|sb| sb.open_gen = u32::MAX - 1);
        assert!(last.is_ok(), "{last:?}");
    }

    #[test]
    fn slab_tables_are_bounded_by_the_slab() {
        // Found by the pool_open fuzzer: objects_per_slab was checked only to be
        // nonzero, and opening sized every slab's object table from it (a 256 MiB
        // allocation per slab for a value near 2^32).
        assert_invalid(
            decode_with(|sb| sb.objects_per_slab = 4_294_967_244),
            "4294967244 objects per slab of 512 blocks (max 2100)",
        );
        assert_invalid(
            decode_with(|sb| {
                sb.slab_blocks = SLAB_BLOCKS_MAX + 1;
                sb.slab_count = 1;
            }),
            "slabs of 65537 blocks (max 65536)",
        );
    }

    #[test]
    fn slabs_and_catalog_must_match_what_they_hold() {
        assert_invalid(
            decode_with(|sb| sb.slab_count = u32::MAX),
            "slabs of 512 blocks for 1000 data blocks",
        );
        assert_invalid(
            decode_with(|sb| sb.objects_per_slab = 1000),
            "not whole pages",
        );
        assert_invalid(
            decode_with(|sb| sb.catalog_bytes = u32::MAX),
            "a catalog of 4294967295 bytes in 2 pages",
        );
    }

    #[test]
    fn data_label_round_trips() {
        let label = DataLabel {
            nonce: 9,
            metadata_path: "/tmp/m.pool".into(),
        };
        let mut block = [0u8; BLOCK_BYTES];
        label.encode(&mut block);
        assert_eq!(DataLabel::decode(&block).unwrap(), label);
    }
}
