//! The engine's public vocabulary: how a pool is created and opened, and what it
//! reports. Frontends (NBD, CLI) use only these types and `Pool`/`Volume`.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

fn dense() -> crate::IndexMode {
    crate::IndexMode::Dense
}

/// How to create a pool.
#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    /// The pool's device (file or block device). Holds data, and metadata unless
    /// `metadata_path` is given.
    pub path: PathBuf,
    /// Size for a file that does not exist yet (or is smaller). Ignored for block devices.
    pub size_bytes: Option<u64>,
    /// Separate metadata device: journal, block maps, slab tables, catalog.
    pub metadata_path: Option<PathBuf>,
    /// Size for a metadata file that does not exist yet (default: sized to fit).
    pub metadata_size_bytes: Option<u64>,
    /// Overwrite a device that holds a pool or data in its first MiB.
    pub force: bool,
    /// Allow volume sizes to sum past what the pool can store.
    pub overcommit: bool,
    /// Memory for the dedup index (bounds its window; recorded as the entries its
    /// table holds). Default: 256 MiB, or less when the pool needs fewer entries.
    pub index_memory_bytes: Option<u64>,
    /// Which fingerprints enter the dedup index (`None`: dense, every one).
    pub index_mode: Option<crate::IndexMode>,
    /// How new blocks are compressed (LZ4 by default).
    pub compression: crate::Compression,
    /// Do not discard the data region at creation (a run-time choice: nothing of
    /// it is stored in the pool).
    pub no_discard: bool,
    /// Size the metadata for a data device of this size, so that `pool grow` can take
    /// it up to there later (the page store keeps its size). Default: the device's.
    pub max_size_bytes: Option<u64>,
    /// Page-store slots, when fewer than the geometry's (at least 2): metadata
    /// pages go to data blocks sooner. For tests of that path; `None` for pools.
    pub page_slots: Option<u64>,
}

/// How much of the pool a volume holds back for itself (`reservation.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Provisioning {
    /// Reserves its whole size, and follows it through resizes (the default).
    #[default]
    Thick,
    /// Reserves this many bytes, whatever its size (0: thin, reserves nothing; never
    /// more than its size counts).
    Reserve(u64),
}

impl Provisioning {
    /// Thin: reserves nothing.
    pub const THIN: Provisioning = Provisioning::Reserve(0);
}

/// How to open a pool.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Worker threads for hashing and compression; default: one per CPU.
    pub threads: Option<usize>,
    /// Memory for the dedup index for this open, instead of the window the pool
    /// records (the index is rebuilt at every open, so it may differ each time).
    pub index_memory_bytes: Option<u64>,
    /// Give no freed space back to the devices (no discard) for this open, from the
    /// checkpoint the open itself takes (`serve --no-discard`); nothing is stored.
    pub no_discard: bool,
    /// For tests: the dedup index's background build waits, before its first slab,
    /// for [`crate::Pool::release_index_build`] (or close), so writes can be made
    /// while the index is known to be rebuilding.
    pub hold_index_build: bool,
    /// Where the dedup index is saved at a clean close and loaded from at the next
    /// read-write open (`index_save.rs`); the damaged blocks known are kept beside
    /// it as a hint for the next open, `<...>.damaged` (`damage_hint.rs`). Default:
    /// neither is kept (the command line keeps both beside the pool).
    pub saved_index: SavedIndex,
    /// Take the pool's devices over from a holder that died or was cut off (a pool
    /// on RBD images: the holder is blocklisted and its lock broken, then the pool
    /// opens as usual, replaying the journal). `None`: a device another client holds
    /// is refused, naming it.
    pub take_over: Option<fewerbytes_storage::TakeOver>,
}

/// Where a pool's dedup index is saved between a clean close and the next open.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum SavedIndex {
    /// Not saved: every read-write open rebuilds the index.
    #[default]
    Off,
    /// Beside the pool's file as `<pool>.index` (its real path); for a pool on a
    /// block device, `<state dir>/<nonce>.index` (`FEWERBYTES_STATE_DIR`, default
    /// `/var/lib/fewerbytes`).
    Beside,
    /// In this file.
    At(std::path::PathBuf),
}

/// Where the dedup index's build stands (`stats`, `pool info`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IndexState {
    /// Not built: the pool is opened read-only (nothing asks for advice).
    #[default]
    NotBuilt,
    /// Being rebuilt from the object records in the background (after every
    /// read-write open): writes get the advice of what is in it so far.
    Rebuilding,
    /// Holds every stored block (up to its window).
    Ready,
}

/// The dedup index's build and what it cost the writes made meanwhile.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct IndexStatus {
    /// Built, being rebuilt, or not built.
    pub state: IndexState,
    /// Percent of the slabs the rebuild has scanned (100 when ready).
    pub percent: u8,
    /// Blocks stored new since open while the index was rebuilding: written without
    /// full dedup advice, so some may duplicate a block stored before the open.
    pub blocks_stored_while_rebuilding: u64,
    /// Loaded at open from the index a clean close saved (`index_save.rs`), not
    /// rebuilt.
    #[serde(default)]
    pub loaded: bool,
}

impl std::fmt::Display for IndexStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.state {
            IndexState::Ready if self.loaded => {
                write!(f, "ready (loaded from the index saved at the last close)")
            }
            IndexState::Ready => write!(f, "ready"),
            IndexState::Rebuilding => write!(f, "rebuilding {}%", self.percent),
            IndexState::NotBuilt => write!(f, "not built (opened read-only)"),
        }?;
        if self.blocks_stored_while_rebuilding > 0 {
            write!(
                f,
                "; {} blocks stored without full dedup advice while it rebuilt",
                self.blocks_stored_while_rebuilding
            )?;
        }
        Ok(())
    }
}

/// Operating mode, as vdostats reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Reads and writes.
    Normal,
    /// Writes refused after an I/O failure, until reopened.
    ReadOnly,
    /// Opened read-only ([`crate::Pool::open_read_only`]): an inspection that writes
    /// nothing, not a failure.
    OpenedReadOnly,
}

/// What `pool grow` did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GrowReport {
    /// The data device's length now.
    pub device_bytes: u64,
    /// The data region before.
    pub old_data_bytes: u64,
    /// The data region now.
    pub data_bytes: u64,
    /// Device space past the data region that it did not take: the page store has
    /// no room for the pages of more data.
    pub untaken_bytes: u64,
}

/// What `pool create` made.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolInfo {
    /// The pool's identity (`Pool::id`), as 16 hex digits: what the allow file
    /// records, so a list made for another pool is never used for this one.
    #[serde(default)]
    pub id: String,
    /// The pool path (data device).
    pub path: String,
    /// Separate metadata device, if any.
    pub metadata_path: Option<String>,
    /// Bytes of the data device.
    pub data_device_bytes: u64,
    /// Bytes of the metadata device (same as data when not separate).
    pub metadata_device_bytes: u64,
    /// The space figures, one name each (`capacity.rs`; the same in `PoolStats`).
    #[serde(flatten)]
    pub space: crate::Capacity,
    /// Bytes the metadata regions take (super blocks, journal, page store): with
    /// `data_bytes`, the pool's Size.
    pub metadata_regions_bytes: u64,
    /// Logical bytes thick volumes can address (the data region less the reserve;
    /// 4 times that in a pool made with the former overcommit flag). Not a limit on
    /// thin volumes, which may promise up to the format's maximum (4,096 volumes of
    /// 4 PiB each).
    pub addressable_bytes: u64,
    /// The pool was made with the overcommit flag of earlier versions (its page store
    /// sized for 4 times its data); volumes are thick or thin each on their own now.
    pub overcommit: bool,
    /// Data blocks kept back from every reservation: for trims and deletes, and, in
    /// a pool whose pages may go to data blocks, each slab's headroom for a
    /// checkpoint's pages (`metadata_headroom_bytes`, part of this figure).
    pub reserve_bytes: u64,
    /// Of `reserve_bytes`, the free blocks each slab keeps for a checkpoint's
    /// metadata pages (flags bit 3), which data never takes.
    #[serde(default)]
    pub metadata_headroom_bytes: u64,
    /// Slabs and their size.
    pub slab_count: u32,
    /// Data blocks per slab.
    pub slab_blocks: u32,
    /// Stored objects a slab can hold.
    pub objects_per_slab: u32,
    /// Journal ring size.
    pub journal_bytes: u64,
    /// Fingerprints the index's table holds: each covers one distinct 4 KiB block
    /// (dense), or a hook and the 2^k − 1 blocks found next to it (sparse).
    pub index_entries: u64,
    /// The window: bytes of distinct data the index can remember.
    pub dedup_window_bytes: u64,
    /// RAM the index takes.
    pub index_memory_bytes: u64,
    /// Which fingerprints enter the index in this open.
    #[serde(default = "dense")]
    pub index_mode: crate::IndexMode,
    /// What the super block records, used from the next open when it differs from
    /// this open's (`pool set --index`, `--index-memory` on a served pool): the mode
    /// and the table's entries.
    #[serde(default)]
    pub index_recorded: Option<(crate::IndexMode, u64)>,
    /// The index's build: ready, rebuilding N%, or not built (read-only).
    #[serde(default)]
    pub index: IndexStatus,
    /// Worker threads.
    pub threads: usize,
    /// Operating mode.
    pub mode: Mode,
    /// Format version.
    pub format_version: u32,
    /// How new blocks are compressed (fragments keep the codec they were written with).
    #[serde(default)]
    pub compression: crate::Compression,
    /// The open-by-host marker of the super block, when set (`docs/format.md`).
    #[serde(default)]
    pub open_marker: Option<OpenMarker>,
    /// The scrub's progress and last report (in memory: a restart forgets it).
    #[serde(default)]
    pub scrub: Box<ScrubStatus>,
    /// Damaged metadata copies this open found and read the other copy of: super
    /// block copies (its checkpoint rewrites them) and, since format version 3,
    /// directory pages read from their second copy (the next checkpoint of a
    /// read-write pool rewrites them).
    #[serde(default)]
    pub metadata_copies_repaired: u64,
    /// Blocks this open's journal replay read back to compute their fingerprints
    /// (`NewStored` records: stored new after the last checkpoint).
    #[serde(default)]
    pub replay_blocks_read_back: u64,
    /// Of those, the blocks that did not read back as written (their reads fail as
    /// damaged data, and the scrub names them).
    #[serde(default)]
    pub replay_blocks_damaged: u64,
    /// Volume ranges whose block-map page (or map directory page) failed its checks
    /// at open: refused (EIO) until `check --repair` clears them (`map_damage.rs`;
    /// `stats` and `Pool::damaged_ranges` list them).
    #[serde(default)]
    pub damaged_range_count: u64,
    /// Stored objects known damaged now (`PoolStats::damaged_objects_known`).
    #[serde(default)]
    pub damaged_objects_known: u64,
    /// Of those, the ones the last open knew and this open found still damaged
    /// (`PoolStats::damaged_objects_carried_over`).
    #[serde(default)]
    pub damaged_objects_carried_over: u64,
    /// Block-map pages more than one volume's tree reaches (clones and snapshots
    /// share their source's pages until either writes below them).
    #[serde(default)]
    pub shared_map_pages: u64,
    /// The pool records shared map pages and lineages (format flag bit 7): engines
    /// that do not know the flag refuse it. Cleared again once no volume is a
    /// snapshot or carries another's lineage (a clone does while it exists).
    #[serde(default)]
    pub shared_maps: bool,
}

/// Who has the pool open, or had it open and did not close it: the super block's
/// open-by-host marker. Advice for people, not a lock.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OpenMarker {
    /// Host name of the opener.
    pub host: String,
    /// Boot id of the opener's host (hex; zeros if unknown).
    pub boot_id: String,
    /// Process id of the opener.
    pub pid: u32,
    /// When it opened the pool (seconds since the epoch).
    pub since_unix: u64,
    /// The same instant in ISO 8601, UTC (`2026-12-02T19:45:00Z`), for people.
    #[serde(default)]
    pub since_iso: String,
    /// True: the marker is this process's own (it holds the pool open now). False:
    /// it was found on the device by a read-only open, so its opener did not close
    /// the pool cleanly, or still has it open on another host.
    pub current: bool,
}

/// One volume as `volume list` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeInfo {
    /// Name.
    pub name: String,
    /// Unique id.
    pub id: u64,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Logical blocks mapped to data (not zero, not unmapped), in bytes.
    pub logical_used_bytes: u64,
    /// Blocks written as zeros (stored as nothing), in bytes.
    pub zero_bytes: u64,
    /// Stored bytes that only this volume references (freed by deleting it).
    pub exclusive_stored_bytes: u64,
    /// Handles open (NBD connections).
    pub users: u32,
    /// Reserved: bytes reserved for it (thick: its size).
    #[serde(default)]
    pub reserved_bytes: u64,
    /// Reserved unused: of those, not used yet (reserved less logical used): held
    /// back for it.
    #[serde(default)]
    pub reserved_unused_bytes: u64,
    /// Thin or partly reserved: its reservation is fixed, not its size.
    #[serde(default)]
    pub thin: bool,
    /// Block-map pages in memory: those written (504 entries, 4 KiB each), never
    /// more because the volume is large.
    #[serde(default)]
    pub map_pages: u64,
    /// Bytes of memory the block map takes: the entries of the pages it alone holds
    /// and the chunks of page slots (entries shared in memory with a snapshot or a
    /// clone count in neither: `PoolInfo::shared_map_pages`, 4,032 bytes each).
    #[serde(default)]
    pub map_memory_bytes: u64,
    /// Limited to the TLS identities of the pool's allow list (`volume allow`); a
    /// snapshot, as its volume is now.
    #[serde(default)]
    pub limited: bool,
    /// An import into it began and has not ended: it may hold part of its image,
    /// and `serve` refuses to export it (`volume import --resume` or `--force`).
    #[serde(default)]
    pub incomplete: bool,
    /// Writes to it refused with the no-space error (ENOSPC) since the pool was
    /// opened (0 from a pool opened only to look).
    #[serde(default)]
    pub no_space_refusals: u64,
    /// Ranges whose block-map page failed its checks at open: refused (EIO) until
    /// `check --repair` clears them (`map_damage.rs`).
    #[serde(default)]
    pub damaged_ranges: Vec<crate::DamagedRange>,
    /// For a snapshot, the volume it is a point in time of (its name is
    /// `VOLUME@SNAPSHOT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_of: Option<String>,
    /// When a snapshot was made, in seconds since 1970 (0 for a volume).
    #[serde(default)]
    pub created: u64,
    /// A snapshot's identity, the same in every pool a send stream carried it to
    /// (16 hex digits; none for a volume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guid: Option<String>,
}

/// A range of a volume, by what backs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    /// Length in bytes.
    pub len_bytes: u64,
    /// Backed by stored data.
    pub data: bool,
}

/// A run of a volume's bytes that differs, or not, from another volume's
/// (`Volume::changed_extents`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChangedExtent {
    /// Length in bytes.
    pub len_bytes: u64,
    /// The bytes differ from the base's.
    pub changed: bool,
}

/// What a volume's block map names for one block (`Volume::block_sources`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BlockSource {
    /// Reads as zeros: never written, trimmed, or written with zeros.
    #[default]
    Zero,
    /// A stored object, by its number in the pool: two blocks naming the same
    /// object hold the same bytes (the converse needs their bytes compared).
    Stored(u64),
}

/// One metadata region, as `list-metadata` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Region {
    /// What it holds.
    pub name: String,
    /// `data` or `metadata`.
    pub device: String,
    /// The device's path.
    pub path: String,
    /// First 4 KiB block.
    pub start_block: u64,
    /// Blocks.
    pub blocks: u64,
    /// Bytes.
    pub bytes: u64,
}

/// Per-device I/O, counted at the storage layer.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct DeviceIo {
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Flushes (fsync).
    pub flushes: u64,
    /// Discards the device took (holes punched, BLKDISCARD): freed blocks given back.
    #[serde(default)]
    pub discards: u64,
    /// Bytes given back by those discards.
    #[serde(default)]
    pub discard_bytes: u64,
}

/// Counters of the write path, for a pool or one volume.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct WriteCounters {
    /// Bytes guests wrote (WRITE payloads).
    pub guest_bytes_written: u64,
    /// Bytes guests read.
    pub guest_bytes_read: u64,
    /// 4 KiB blocks written.
    pub blocks_written: u64,
    /// Blocks that were all zeros (stored as nothing).
    pub zero_blocks_written: u64,
    /// Blocks stored by reference to an existing object.
    pub dedup_hits: u64,
    /// Index advice confirmed by the stored fingerprint.
    pub advice_valid: u64,
    /// Index advice refused (fingerprint changed, or object freed or saturated).
    pub advice_stale: u64,
    /// New objects stored compressed.
    pub compressed_writes: u64,
    /// New objects stored whole.
    pub uncompressed_writes: u64,
    /// Bytes trimmed.
    pub trimmed_bytes: u64,
    /// Bytes set to zero by write-zeroes.
    pub write_zeroes_bytes: u64,
    /// Flushes asked for.
    pub flushes: u64,
}

/// Pool statistics (what `stats --json` prints).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolStats {
    /// The pool path.
    pub path: String,
    /// The dedup index's build: ready, rebuilding N%, or not built (read-only).
    #[serde(default)]
    pub index: IndexStatus,
    /// Operating mode.
    pub mode: Mode,
    /// The space figures, one name each (`capacity.rs`; the same in `PoolInfo`).
    #[serde(flatten)]
    pub space: crate::Capacity,
    /// Logical bytes mapped to data across all volumes.
    pub logical_used_bytes: u64,
    /// Blocks mapped to zero across all volumes, in bytes.
    pub zero_bytes: u64,
    /// 1 - data used / logical used, in percent (0 when nothing is used).
    pub saving_percent: f64,
    /// Live stored objects.
    pub objects: u64,
    /// Of those, compressed fragments.
    pub compressed_fragments: u64,
    /// Bytes of live compressed fragments.
    pub compressed_bytes: u64,
    /// Of the compressed fragments, those written with zstd (the rest with LZ4).
    #[serde(default)]
    pub zstd_fragments: u64,
    /// How new blocks are compressed now.
    #[serde(default)]
    pub compression: crate::Compression,
    /// Blocks holding packed fragments.
    pub packed_blocks: u64,
    /// Bytes in packed blocks held by no live fragment.
    pub packing_waste_bytes: u64,
    /// Whole (uncompressed) blocks stored.
    pub whole_blocks: u64,
    /// Packed blocks emptied by compaction (live fragments moved out) since open.
    pub compacted_blocks: u64,
    /// Sum over objects of (references - 1): blocks saved by dedup.
    pub dedup_saved_blocks: u64,
    /// Writes refused with the no-space error (ENOSPC) since open.
    #[serde(default)]
    pub no_space_refusals: u64,
    /// Counters since the pool was opened.
    pub counters: WriteCounters,
    /// Counters since the pool was made: those its last checkpoint kept (the counters
    /// page) plus those since open. Writes after the last checkpoint before a crash
    /// are not in them.
    #[serde(default)]
    pub counters_total: WriteCounters,
    /// Data device I/O since open.
    pub data_device: DeviceIo,
    /// Metadata device I/O since open (same device when not separate).
    pub metadata_device: DeviceIo,
    /// Whether metadata has a device of its own; when not, `metadata_device` repeats
    /// `data_device`'s counters.
    #[serde(default)]
    pub separate_metadata_device: bool,
    /// Metadata bytes written, by region, since open.
    pub metadata_written_by_region: Vec<(String, u64)>,
    /// Checkpoints taken since open.
    pub checkpoints: u64,
    /// Damaged metadata copies this open found and read the other copy of: super
    /// block copies (its checkpoint rewrites them) and, since format version 3,
    /// directory pages read from their second copy (the next checkpoint of a
    /// read-write pool rewrites them).
    #[serde(default)]
    pub metadata_copies_repaired: u64,
    /// Blocks this open's journal replay read back to compute their fingerprints
    /// (`NewStored` records: stored new after the last checkpoint).
    #[serde(default)]
    pub replay_blocks_read_back: u64,
    /// Of those, the blocks that did not read back as written (their reads fail as
    /// damaged data, and the scrub names them).
    #[serde(default)]
    pub replay_blocks_damaged: u64,
    /// Volume ranges whose block-map page (or map directory page) failed its checks
    /// at open: refused (EIO) until `check --repair` clears them (`map_damage.rs`).
    #[serde(default)]
    pub damaged_ranges: Vec<crate::DamagedRange>,
    /// Stored objects a read, the scrub or `check --verify-data` found damaged since
    /// open and not healed yet: a write of their good data heals them (`heal.rs`).
    #[serde(default)]
    pub damaged_objects_known: u64,
    /// Damaged objects healed since open: a write of their good data stored it
    /// afresh, and every volume block naming them reads it.
    #[serde(default)]
    pub damaged_objects_healed: u64,
    /// Of the damaged objects the last open knew (its hint beside the pool,
    /// `damage_hint.rs`), those this open read at open and found still damaged:
    /// known damaged from the start, so a write of their good data heals them.
    #[serde(default)]
    pub damaged_objects_carried_over: u64,
    /// Journal commits since open (group commits).
    pub journal_commits: u64,
    /// Worker threads (and zones).
    pub threads: usize,
    /// Named limits and their values.
    pub limits: Vec<(String, u64)>,
    /// Per volume.
    pub volumes: Vec<VolumeStats>,
    /// The scrub's progress and last report (in memory: a restart forgets it).
    #[serde(default)]
    pub scrub: Box<ScrubStatus>,
}

/// Per-volume statistics.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeStats {
    /// Name.
    pub name: String,
    /// Size.
    pub size_bytes: u64,
    /// Logical bytes mapped to data.
    pub logical_used_bytes: u64,
    /// Bytes mapped to zero.
    pub zero_bytes: u64,
    /// Reserved: bytes reserved for it (thick: its size).
    #[serde(default)]
    pub reserved_bytes: u64,
    /// Reserved unused: of those, not used yet: held back for it.
    #[serde(default)]
    pub reserved_unused_bytes: u64,
    /// Counters since open.
    pub counters: WriteCounters,
    /// Writes to it refused with the no-space error (ENOSPC) since open.
    #[serde(default)]
    pub no_space_refusals: u64,
}

/// Result of a consistency audit.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AuditReport {
    /// Objects checked.
    pub objects_checked: u64,
    /// Map entries checked.
    pub map_entries_checked: u64,
    /// Every inconsistency found, one sentence each.
    pub problems: Vec<String>,
}

/// Where a scrub stands (`Pool::scrub_start`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScrubState {
    /// No scrub since the pool was opened.
    #[default]
    Idle,
    /// Reading and verifying.
    Running,
    /// Stopped by `scrub pause` where it was; `scrub resume` goes on from there.
    Paused,
    /// Finished (or stopped by the pool's close); the report stays until the next start.
    Done,
}

impl std::fmt::Display for ScrubState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ScrubState::Idle => "idle",
            ScrubState::Running => "running",
            ScrubState::Paused => "paused",
            ScrubState::Done => "done",
        })
    }
}

/// One thing a scrub found wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubFinding {
    /// What failed: "super block", a page kind ("map", "counts", "directory", …), or "data".
    pub region: String,
    /// Which one, and why, in words (device, block, object, the check that failed).
    pub what: String,
    /// Each volume byte range that maps a damaged data block, one entry each, named as
    /// every report of damage names it (`volume 'b' bytes 12288..16383 (pool block
    /// 1380)`); for a damaged block-map page, each volume and snapshot whose map
    /// reaches it, with the bytes it maps (`volume 'sv@s' bytes 2064384..4128767`);
    /// empty for other metadata, or when no volume maps it.
    #[serde(default)]
    pub volumes: Vec<String>,
    /// Rewritten from the good copy (the in-memory state, or the other super block copy).
    pub repaired: bool,
}

/// Progress and report of the pool's scrub: every page the current checkpoint
/// reaches, every stored object, and both super block copies, read and verified.
/// Kept in memory only: a restarted server reports `idle`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrubStatus {
    /// Idle, running, paused or done.
    pub state: ScrubState,
    /// Bytes read and verified so far (pages, stored data, super block copies).
    pub bytes_verified: u64,
    /// Bytes to verify, counted when the scrub started.
    pub bytes_total: u64,
    /// Metadata pages verified.
    pub pages_verified: u64,
    /// Stored objects (whole blocks and fragments) verified.
    pub objects_verified: u64,
    /// Failures found.
    pub errors_found: u64,
    /// Of those, repaired.
    pub repaired: u64,
    /// Read rate limit in bytes per second (0: unthrottled).
    pub rate_bytes_per_s: u64,
    /// When it started (ISO 8601, UTC), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started: Option<String>,
    /// When it finished (ISO 8601, UTC), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<String>,
    /// Why it stopped early (the pool closed, a read it could not do), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    /// The first findings ([`SCRUB_FINDINGS_MAX`] at most; `errors_found` counts all).
    #[serde(default)]
    pub findings: Vec<ScrubFinding>,
}

/// Findings a scrub keeps in its report: a drive that returns garbage everywhere
/// must not grow the server's memory; the counts stay exact past it.
pub const SCRUB_FINDINGS_MAX: usize = 100;

impl ScrubStatus {
    /// Failures found and not repaired (damaged data, or metadata that could not be rewritten).
    pub fn unrepaired(&self) -> u64 {
        self.errors_found.saturating_sub(self.repaired)
    }
}

/// What a repair found and did.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RepairReport {
    /// Object records examined (every record in use).
    pub objects_checked: u64,
    /// Map entries examined (every entry naming an object).
    pub map_entries_checked: u64,
    /// Each change made (or, without `apply`, that would be made), one sentence each.
    pub repairs: Vec<String>,
    /// Bytes of volumes whose data was gone and that now read as zeros.
    pub lost_bytes: u64,
    /// Damage a repair does not change (data that fails its fingerprint), one sentence each.
    pub damage_left: Vec<String>,
}
