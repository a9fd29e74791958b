//! The pool: create, open and close; its public face, which hands volume operations
//! to `volume_ops.rs`, statistics to `stats.rs` and repair to `repair.rs`.
//!
//! Concurrency: request threads hold the *gate* shared while they change state;
//! a checkpoint snapshot and volume operations (create, delete, resize, clone)
//! hold it exclusively for the moment they need an exact image. Below the gate,
//! state is split by zone: block-map pages (logical), slabs and packers
//! (physical), index shards (hash), each behind its own lock.

use crate::counters::Counters;
use crate::devices::Devices;
use crate::geometry::PoolGeometry;
use crate::geometry::{human_bytes, Geometry, SLAB_BLOCKS};
use crate::journal::Journal;
use crate::open_repair::OpenRepair;
use crate::packer::Zones;
use crate::slab_depot::SlabDepot;
use crate::super_copies::SuperCopies;
use crate::volumes::Volumes;
use crate::{api::*, EngineError, Result, Volume};
use fewerbytes_format::page::PageRef;
use fewerbytes_format::superblock::{
    index_entries_max, magic_of, DataLabel, Holder, SuperBlock, DATA_LABEL_MAGIC,
    FLAG_DATA_REGION_PAGES, FLAG_OVERCOMMIT, FLAG_SEPARATE_METADATA, INDEX_ENTRIES_MIN,
    SUPER_MAGIC,
};
use fewerbytes_format::{BLOCK_BYTES, FORMAT_VERSION};
use fewerbytes_storage::{open_device, DeviceOptions, DeviceUri, FileStorage, Storage};
use parking_lot::Mutex;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::checkpointer::Checkpointer;
use crate::codec::{Compression, PoolCodec};
use crate::compactor::Compactor;
use crate::inner::Inner;
use crate::lbn_locks::LbnLocks;
use fewerbytes_format::superblock::FLAG_CODECS;

/// How an open treats the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpenMode {
    /// Replay, checkpoint (upgrading a version-1 pool), serve reads and writes.
    ReadWrite,
    /// Load and replay in memory; write nothing, ever.
    ReadOnly,
    /// As `ReadWrite`, but a count the block maps contradict is restored
    /// (`check --repair`, `repair.rs`).
    Repair,
}

/// An open pool. Shared by `Arc`; the final checkpoint is taken by `close` or when
/// the last handle drops.
pub struct Pool {
    inner: Arc<Inner>,
    commit_thread: Mutex<Option<JoinHandle<()>>>,
    compact_thread: Mutex<Option<JoinHandle<()>>>,
    /// The scrub's thread while one runs (or finished and not yet joined).
    scrub_thread: Mutex<Option<JoinHandle<()>>>,
    /// The dedup index's build (`index_build.rs`), in a read-write open.
    index_thread: Mutex<Option<JoinHandle<()>>>,
}

fn random_u64() -> u64 {
    rand::random::<u64>() | 1
}

fn first_mib_in_use(dev: &dyn Storage) -> Result<Option<String>> {
    let len = dev.len_bytes().min(1 << 20) as usize;
    let mut buf = vec![0u8; len];
    dev.read_at(&mut buf, 0)?;
    match magic_of(&buf) {
        Some(SUPER_MAGIC) => return Ok(Some(format!("{} holds a fewerbytes pool", dev.name()))),
        Some(DATA_LABEL_MAGIC) => {
            return Ok(Some(format!(
                "{} is the data device of a fewerbytes pool",
                dev.name()
            )))
        }
        _ => {}
    }
    if buf.iter().any(|b| *b != 0) {
        return Ok(Some(format!("{} holds data in its first MiB", dev.name())));
    }
    Ok(None)
}

/// The device `name` names (a path or a URI, `DeviceUri`), opened read-write and
/// exclusive through the storage crate's one factory (taken over from a dead
/// holder when `opts` asks).
fn open_named(name: &Path, opts: &OpenOptions) -> Result<Arc<dyn Storage>> {
    let uri = DeviceUri::from_path(name)?;
    let options = DeviceOptions {
        take_over: opts.take_over,
        ..DeviceOptions::default()
    };
    Ok(open_device(&uri, &options)?)
}

/// The device a new pool is made on. A regular file is created or grown to `size`
/// (sparse); a block device or an RBD image is taken as it is, and its size checked by
/// the caller.
fn open_or_create(uri: &DeviceUri, size: Option<u64>) -> Result<Arc<dyn Storage>> {
    match (uri, size) {
        (DeviceUri::File(path), Some(s)) => Ok(Arc::new(FileStorage::create(path, s)?)),
        (DeviceUri::File(path), None) if !path.exists() => Err(EngineError::Refused(format!(
            "{} does not exist; give --size to create it",
            path.display()
        ))),
        _ => Ok(open_device(uri, &DeviceOptions::default())?),
    }
}

/// What to do when a device is smaller than the size asked for.
fn too_small(uri: &DeviceUri, has_bytes: u64, asked_bytes: u64) -> EngineError {
    let hint = match uri {
        DeviceUri::Rbd { .. } => format!(
            " (an RBD image is used at its size: grow it first with `rbd resize --size {}M {}`, \
             or leave --size out)",
            asked_bytes.div_ceil(1 << 20),
            rbd_spec(uri)
        ),
        DeviceUri::File(_) => String::new(),
    };
    EngineError::Refused(format!(
        "{uri} holds {}, less than the {} asked for{hint}",
        human_bytes(has_bytes),
        human_bytes(asked_bytes)
    ))
}

/// `POOL/IMAGE` (and `--cluster`) as the `rbd` command names an image.
fn rbd_spec(uri: &DeviceUri) -> String {
    match uri {
        DeviceUri::Rbd {
            pool,
            image,
            cluster: Some(cluster),
        } => format!("--cluster {cluster} {pool}/{image}"),
        DeviceUri::Rbd { pool, image, .. } => format!("{pool}/{image}"),
        DeviceUri::File(path) => path.display().to_string(),
    }
}

/// The name a data device's label records for the metadata device: a file's real
/// path (so the pool opens from any working directory), a URI as its canonical text.
fn label_name(uri: &DeviceUri) -> String {
    match uri {
        DeviceUri::File(path) => std::fs::canonicalize(path)
            .unwrap_or_else(|_| path.clone())
            .display()
            .to_string(),
        DeviceUri::Rbd { .. } => uri.to_string(),
    }
}

impl Pool {
    /// What the pool's threads share (a `Volume` handle works through it).
    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Format the device(s) as a new pool.
    pub fn create(opts: &CreateOptions) -> Result<PoolInfo> {
        if let Some(size) = opts.size_bytes {
            if size < crate::geometry::MIN_POOL_BYTES {
                return Err(EngineError::Refused(format!(
                    "a pool of {} is too small to be useful: the minimum is {}",
                    human_bytes(size),
                    human_bytes(crate::geometry::MIN_POOL_BYTES)
                )));
            }
        }
        let data_uri = DeviceUri::from_path(&opts.path)?;
        let data = open_or_create(&data_uri, opts.size_bytes)?;
        if let Some(asked) = opts.size_bytes.filter(|s| data.len_bytes() < *s) {
            return Err(too_small(&data_uri, data.len_bytes(), asked));
        }
        let meta_uri = opts
            .metadata_path
            .as_deref()
            .map(DeviceUri::from_path)
            .transpose()?;
        let meta = match &meta_uri {
            Some(uri) => {
                let data_blocks = data.len_bytes() / BLOCK_BYTES as u64;
                let planned =
                    data_blocks.max(opts.max_size_bytes.unwrap_or(0) / BLOCK_BYTES as u64);
                let need =
                    Geometry::metadata_blocks_needed(planned, opts.overcommit) * BLOCK_BYTES as u64;
                let size = match (uri, opts.metadata_size_bytes) {
                    (_, Some(size)) => size,
                    (DeviceUri::File(_), None) => need.div_ceil(1 << 20) << 20,
                    // An image is used at its size; the geometry says if it is too small.
                    (DeviceUri::Rbd { .. }, None) => 0,
                };
                let meta = open_or_create(uri, Some(size))?;
                if uri.file_path().is_none() && meta.len_bytes() < size {
                    return Err(too_small(uri, meta.len_bytes(), size));
                }
                Some(meta)
            }
            None => None,
        };
        let meta_path = meta_uri.as_ref().map(label_name);
        Self::format(data, meta, meta_path, opts)?;
        let pool = Self::open(&opts.path, &OpenOptions::default())?;
        if !opts.no_discard {
            pool.inner.discard_data_region();
        }
        let info = pool.info();
        pool.close()?;
        Ok(info)
    }

    /// Format devices already opened (files, or test devices).
    pub fn format(
        data: Arc<dyn Storage>,
        meta: Option<Arc<dyn Storage>>,
        meta_path: Option<String>,
        opts: &CreateOptions,
    ) -> Result<()> {
        if !opts.force {
            for dev in std::iter::once(&data).chain(meta.iter()) {
                if let Some(why) = first_mib_in_use(dev.as_ref())? {
                    return Err(EngineError::Refused(format!(
                        "{why}; use --force to overwrite it"
                    )));
                }
            }
        }
        let data_blocks_dev = data.len_bytes() / BLOCK_BYTES as u64;
        let meta_blocks_dev = meta.as_ref().map(|m| m.len_bytes() / BLOCK_BYTES as u64);
        let max_blocks = opts.max_size_bytes.unwrap_or(0) / BLOCK_BYTES as u64;
        let mut geo = Geometry::compute_growable(
            data_blocks_dev,
            meta_blocks_dev,
            opts.overcommit,
            max_blocks,
        )?;
        if let Some(slots) = opts.page_slots {
            // Fewer slots leave the rest of the region unused; never more than it has.
            geo.page_slots = slots.clamp(2, geo.page_slots);
        }
        let nonce = random_u64();
        let mut key = [0u8; 32];
        for chunk in key.chunks_mut(8) {
            chunk.copy_from_slice(&rand::random::<u64>().to_le_bytes());
        }
        let index_mode = opts.index_mode.unwrap_or(crate::IndexMode::Dense);
        let index_entries = index_entries_for(
            opts.index_memory_bytes,
            index_mode,
            geo.data_blocks,
            index_entries_max(geo.slab_count, geo.objects_per_slab),
        );
        let (index_mode, index_sample_shift) = index_mode.to_super();
        let flags = if meta.is_some() {
            FLAG_SEPARATE_METADATA
        } else {
            0
        } | if opts.overcommit { FLAG_OVERCOMMIT } else { 0 }
            | if matches!(opts.compression, Compression::Zstd { .. }) {
                FLAG_CODECS
            } else {
                0
            }
            // Pages past the page store's free slots go to data blocks.
            | FLAG_DATA_REGION_PAGES;
        let (compression, compression_level) = opts.compression.to_super();
        let meta_dev = meta.clone().unwrap_or_else(|| data.clone());
        let sb = SuperBlock {
            version: FORMAT_VERSION,
            nonce,
            generation: 0,
            open_gen: 0,
            flags,
            fingerprint_key: key,
            data_offset_bytes: geo.data_offset_bytes,
            data_blocks: geo.data_blocks,
            slab_blocks: SLAB_BLOCKS,
            objects_per_slab: geo.objects_per_slab,
            slab_count: geo.slab_count,
            journal_start_block: geo.journal_start_block,
            journal_sectors: geo.journal_blocks
                * (BLOCK_BYTES / fewerbytes_format::SECTOR_BYTES) as u64,
            pages_start_block: geo.pages_start_block,
            page_slots: geo.page_slots,
            journal_replay_seq: 0,
            catalog_bytes: 0,
            metadata_device_bytes: meta_dev.len_bytes(),
            data_device_bytes: data.len_bytes(),
            reserve_blocks: crate::geometry::reserve_blocks_for(geo.data_blocks),
            index_entries,
            created_unix: crate::load::now_unix(),
            compression,
            compression_level,
            index_mode,
            index_sample_shift,
            catalog: Vec::new(),
            counters: PageRef::NONE,
            holder: Holder::default(),
            upgraded_generation: 0,
        };
        // Clear the first journal block and the first MiB of the data device's label area,
        // so no stale sector of an earlier pool can be mistaken for ours (the nonce differs anyway).
        let journal_bytes = (geo.journal_blocks * BLOCK_BYTES as u64).min(64 * BLOCK_BYTES as u64);
        meta_dev.write_at(
            &vec![0u8; journal_bytes as usize],
            geo.journal_start_block * BLOCK_BYTES as u64,
        )?;
        if let (Some(_), Some(path)) = (&meta, &meta_path) {
            let label = DataLabel {
                nonce,
                metadata_path: path.clone(),
            };
            // Two copies, so that losing one block does not lose the pool.
            Self::write_label(data.as_ref(), &label, 0)?;
            Self::write_label(data.as_ref(), &label, 1)?;
        }
        // Generation 0 names an empty catalog (no pages): the first open writes generation 1.
        let mut block = [0u8; BLOCK_BYTES];
        sb.encode(&mut block);
        meta_dev.write_at(&block, 0)?;
        let mut other = [0u8; BLOCK_BYTES];
        other.fill(0);
        meta_dev.write_at(&other, BLOCK_BYTES as u64)?;
        meta_dev.flush()?;
        Ok(())
    }

    /// Open a pool (exclusive), replaying its journal.
    ///
    /// Block 0 says what the device is: a super block (copy 0) or a data device's
    /// label. If it says neither, block 1 is asked (super block copy 1, or the
    /// label's second copy): losing one block must not lose the pool. The damaged
    /// copy is rewritten: a super block copy by the checkpoint every open takes (it
    /// writes the copy the opened one is not), a label here.
    pub fn open(path: &Path, opts: &OpenOptions) -> Result<Arc<Pool>> {
        Self::open_path(path, opts, OpenMode::ReadWrite)
    }

    /// Open a pool read-only, as [`Pool::open_devices_read_only`]: nothing is written
    /// (no checkpoint, no upgrade of a version-1 pool, no repair of a damaged label).
    pub fn open_read_only(path: &Path, opts: &OpenOptions) -> Result<Arc<Pool>> {
        Self::open_path(path, opts, OpenMode::ReadOnly)
    }

    /// Open a pool to repair it (`Pool::repair`): as [`Pool::open`], but a count the
    /// block maps contradict in a way an open refuses is restored (`repair.rs`).
    pub fn open_for_repair(path: &Path, opts: &OpenOptions) -> Result<Arc<Pool>> {
        Self::open_path(path, opts, OpenMode::Repair)
    }

    fn open_path(path: &Path, opts: &OpenOptions, mode: OpenMode) -> Result<Arc<Pool>> {
        let data = open_named(path, opts)?;
        let mut blocks = [vec![0u8; BLOCK_BYTES], vec![0u8; BLOCK_BYTES]];
        for (copy, block) in blocks.iter_mut().enumerate() {
            let offset = (copy * BLOCK_BYTES) as u64;
            if offset + BLOCK_BYTES as u64 <= data.len_bytes() {
                data.read_at(block, offset)?;
            }
        }
        let [first, second] = &blocks;
        let kind = magic_of(first)
            .filter(|m| *m == SUPER_MAGIC || *m == DATA_LABEL_MAGIC)
            .or_else(|| magic_of(second));
        match kind {
            Some(SUPER_MAGIC) => Self::open_devices_as(data, None, opts, mode),
            Some(DATA_LABEL_MAGIC) => {
                let labels = [DataLabel::decode(first), DataLabel::decode(second)];
                let (label, damaged) = match labels {
                    [Ok(label), Ok(_)] => (label, None),
                    [Ok(label), Err(e)] if magic_of(second) == Some(DATA_LABEL_MAGIC) => {
                        (label, Some((1u64, e)))
                    }
                    // A pool made before the label had a second copy.
                    [Ok(label), Err(_)] => (label, None),
                    [Err(e), Ok(label)] => (label, Some((0u64, e))),
                    [Err(e), Err(_)] => {
                        return Err(EngineError::Corrupt {
                            region: "data device label",
                            block: 0,
                            device: "data",
                            reason: e.to_string(),
                        })
                    }
                };
                if let Some((copy, e)) = &damaged {
                    tracing::warn!(
                        "{}: data device label copy {copy} is damaged ({e}); using copy {}",
                        path.display(),
                        1 - copy
                    );
                }
                let meta = open_named(Path::new(&label.metadata_path), opts)?;
                let pool = Self::open_devices_as(
                    data.clone(),
                    Some((meta, label.metadata_path.clone())),
                    opts,
                    mode,
                )?;
                if pool.inner.geometry.nonce() != label.nonce {
                    return Err(EngineError::Refused(format!(
                        "{} belongs to another pool than the metadata device {}",
                        path.display(),
                        label.metadata_path
                    )));
                }
                if let Some((copy, _)) = damaged.filter(|_| mode != OpenMode::ReadOnly) {
                    Self::write_label(data.as_ref(), &label, copy)?;
                    tracing::warn!(
                        "{}: data device label copy {copy} rewritten",
                        path.display()
                    );
                }
                Ok(pool)
            }
            _ => Err(EngineError::Refused(format!(
                "{} is not a fewerbytes pool (create one with `fewerbytes pool create`)",
                path.display()
            ))),
        }
    }

    /// The id of the pool on the device `name` names (a path or a URI): the nonce its
    /// creation drew, as [`Pool::id`] gives it, read from the super block or the data
    /// device's label in its first two blocks. The pool is not opened: the device is
    /// read without a lock, so this works while a server holds the pool (the CLI finds
    /// an RBD pool's control socket and allow list by it). Either copy will do (the
    /// nonce is in both); a copy being rewritten fails its checksum and the other is
    /// read.
    pub fn read_id(name: &Path) -> Result<u64> {
        let uri = DeviceUri::from_path(name)?;
        let device = open_device(
            &uri,
            &DeviceOptions {
                read_only: true,
                ..DeviceOptions::default()
            },
        )?;
        let mut why = String::from("the device is shorter than one block");
        for copy in 0..2u64 {
            let offset = copy * BLOCK_BYTES as u64;
            if offset + BLOCK_BYTES as u64 > device.len_bytes() {
                break;
            }
            let mut block = vec![0u8; BLOCK_BYTES];
            device.read_at(&mut block, offset)?;
            let decoded = match magic_of(&block) {
                Some(DATA_LABEL_MAGIC) => DataLabel::decode(&block).map(|l| l.nonce),
                _ => SuperBlock::decode(&block).map(|sb| sb.nonce),
            };
            match decoded {
                Ok(nonce) => return Ok(nonce),
                Err(e) => why = e.to_string(),
            }
        }
        Err(EngineError::Refused(format!(
            "{uri} is not a fewerbytes pool (create one with `fewerbytes pool create`): {why}"
        )))
    }

    /// Write label copy `copy` (block 0 or 1) of a separate data device, durably.
    fn write_label(data: &dyn Storage, label: &DataLabel, copy: u64) -> Result<()> {
        let mut block = [0u8; BLOCK_BYTES];
        label.encode(&mut block);
        data.write_at(&block, copy * BLOCK_BYTES as u64)?;
        data.flush()?;
        Ok(())
    }

    /// Refuse devices shorter than the super block's geometry: a truncated pool file
    /// would otherwise open, pass `check`, and fail only at its first read past the end.
    fn check_lengths(
        sb: &SuperBlock,
        data: &dyn Storage,
        meta: &dyn Storage,
        separate: bool,
    ) -> Result<()> {
        let block = BLOCK_BYTES as u64;
        let corrupt = |what: &str| EngineError::Corrupt {
            region: "super block",
            block: sb.generation % 2,
            device: "metadata",
            reason: format!("its geometry overflows: {what}"),
        };
        let journal_end = sb
            .journal_start_block
            .checked_add(sb.journal_sectors.div_ceil(8))
            .ok_or_else(|| corrupt("journal end"))?;
        let pages_end = sb
            .pages_start_block
            .checked_add(sb.page_slots)
            .ok_or_else(|| corrupt("page store end"))?;
        let meta_needed = journal_end
            .max(pages_end)
            .max(2)
            .checked_mul(block)
            .ok_or_else(|| corrupt("metadata length"))?;
        let data_needed = sb
            .data_blocks
            .checked_mul(block)
            .and_then(|b| b.checked_add(sb.data_offset_bytes))
            .ok_or_else(|| corrupt("data region end"))?;
        let needs = if separate {
            vec![(data, "data", data_needed), (meta, "metadata", meta_needed)]
        } else {
            vec![(data, "data", data_needed.max(meta_needed))]
        };
        for (dev, role, needed_bytes) in needs {
            if dev.len_bytes() < needed_bytes {
                return Err(EngineError::Truncated {
                    device: dev.name().to_string(),
                    role,
                    len_bytes: dev.len_bytes(),
                    needed_bytes,
                });
            }
        }
        Ok(())
    }

    /// Open a pool on devices already opened (files, or test devices).
    pub fn open_devices(
        data: Arc<dyn Storage>,
        meta: Option<(Arc<dyn Storage>, String)>,
        opts: &OpenOptions,
    ) -> Result<Arc<Pool>> {
        Self::open_devices_as(data, meta, opts, OpenMode::ReadWrite)
    }

    /// Open a pool read-only: its checkpoint is loaded and its journal replayed in
    /// memory, and nothing is ever written (no checkpoint, no upgrade of a version-1
    /// pool, no open-by-host marker). Writes fail with `EngineError::ReadOnly`.
    pub fn open_devices_read_only(
        data: Arc<dyn Storage>,
        meta: Option<(Arc<dyn Storage>, String)>,
        opts: &OpenOptions,
    ) -> Result<Arc<Pool>> {
        Self::open_devices_as(data, meta, opts, OpenMode::ReadOnly)
    }

    /// [`Pool::open_for_repair`] on devices already opened.
    pub fn open_devices_for_repair(
        data: Arc<dyn Storage>,
        meta: Option<(Arc<dyn Storage>, String)>,
        opts: &OpenOptions,
    ) -> Result<Arc<Pool>> {
        Self::open_devices_as(data, meta, opts, OpenMode::Repair)
    }

    fn open_devices_as(
        data: Arc<dyn Storage>,
        meta: Option<(Arc<dyn Storage>, String)>,
        opts: &OpenOptions,
        mode: OpenMode,
    ) -> Result<Arc<Pool>> {
        let (meta_dev, meta_path) = match meta {
            Some((m, p)) => (m, Some(p)),
            None => (data.clone(), None),
        };
        let copies = SuperCopies::read(meta_dev.as_ref())?;
        let meta = meta_path.map(|p| (meta_dev.clone(), p));
        let load = |copies: &SuperCopies, tolerate: bool| {
            Self::load_inner(&data, &meta, &meta_dev, opts, mode, copies, tolerate)
        };
        let inner = match load(&copies, false) {
            // The newest checkpoint's pages are damaged: the older copy reaches its
            // own whole pages (deferred frees) and the journal since its replay point.
            // When it cannot stand in (no such copy, or it fails too: a page both
            // share), a damaged block-map page costs only the range it maps: the
            // newest copy opens with that range marked damaged (`map_damage.rs`).
            Err(e @ EngineError::Corrupt { .. }) => {
                let older = match copies.fall_back(meta_dev.name(), &e) {
                    Some(older) => match load(&older, false) {
                        Ok(inner) => Some(inner),
                        Err(again) => {
                            tracing::warn!(
                                "{}: the older super block copy does not open either: {again}",
                                meta_dev.name()
                            );
                            None
                        }
                    },
                    None => None,
                };
                match older {
                    Some(inner) => inner,
                    // Damage beyond map pages reports the first corruption found; a
                    // refusal of the open past map damage (a version-1 pool's upgrade)
                    // says itself what to do.
                    None => load(&copies, true).map_err(|again| match again {
                        EngineError::Corrupt { .. } => e,
                        other => other,
                    })?,
                }
            }
            other => other?,
        };
        let thread_inner = inner.clone();
        let handle = std::thread::Builder::new()
            .name("fewerbytes-commit".into())
            .spawn(move || crate::checkpoint::commit_loop(&thread_inner))
            .map_err(|e| EngineError::Refused(format!("cannot start the commit thread: {e}")))?;
        let compact_inner = inner.clone();
        let compactor = std::thread::Builder::new()
            .name("fewerbytes-compact".into())
            .spawn(move || crate::compact::compact_loop(&compact_inner))
            .map_err(|e| {
                EngineError::Refused(format!("cannot start the compaction thread: {e}"))
            })?;
        // The pool serves now; the index is built beside it (never for a read-only
        // open: nothing it does asks for advice), unless the open loaded it.
        let index_thread = if !inner.index_build.needs_build() {
            None
        } else {
            let build_inner = inner.clone();
            Some(
                std::thread::Builder::new()
                    .name("fewerbytes-index".into())
                    .spawn(move || {
                        crate::index_build::run(
                            &build_inner.index_build,
                            &build_inner.depot,
                            build_inner.geometry.objects_per_slab(),
                            build_inner.devices.meta().name(),
                        )
                    })
                    .map_err(|e| {
                        EngineError::Refused(format!("cannot start the index build thread: {e}"))
                    })?,
            )
        };
        Ok(Arc::new(Pool {
            inner,
            commit_thread: Mutex::new(Some(handle)),
            compact_thread: Mutex::new(Some(compactor)),
            scrub_thread: Mutex::new(None),
            index_thread: Mutex::new(index_thread),
        }))
    }

    /// Build the pool's parts from `copies.best` and load it (checkpoint, journal,
    /// the open's checkpoint).
    fn load_inner(
        data: &Arc<dyn Storage>,
        meta: &Option<(Arc<dyn Storage>, String)>,
        meta_dev: &Arc<dyn Storage>,
        opts: &OpenOptions,
        mode: OpenMode,
        copies: &SuperCopies,
        tolerate_map_damage: bool,
    ) -> Result<Arc<Inner>> {
        let separate = meta.is_some();
        let sb = copies.best.clone();
        if (sb.flags & FLAG_SEPARATE_METADATA != 0) != separate {
            return Err(EngineError::Refused(
                "the pool's metadata layout does not match the devices given".into(),
            ));
        }
        Self::check_lengths(&sb, data.as_ref(), meta_dev.as_ref(), separate)?;
        let threads = opts
            .threads
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            })
            .clamp(1, 64);
        let geometry = PoolGeometry::from_super(&sb);
        let nonce = geometry.nonce();
        let checkpointer = Checkpointer::new(sb.clone(), geometry.page_slots());
        let open_gen = copies.next_open_gen(
            meta_dev.as_ref(),
            geometry.journal_start_block(),
            geometry.journal_sectors(),
        )?;
        let journal = Arc::new(Journal::new(
            geometry.nonce(),
            geometry.journal_start_block(),
            geometry.journal_sectors(),
            sb.journal_replay_seq,
            open_gen,
        ));
        let inner = Arc::new(Inner {
            devices: Devices::new(
                data.clone(),
                meta.clone(),
                mode == OpenMode::ReadOnly,
                journal.clone(),
            ),
            depot: SlabDepot::new(
                &geometry,
                checkpointer.dirty_pages(),
                opts.index_memory_bytes,
                crate::grow::max_slabs(&geometry),
            ),
            zones: Zones::new(threads, sb.slab_count),
            codec: PoolCodec::new(Compression::from_super(
                sb.compression,
                sb.compression_level,
            )?),
            journal,
            geometry,
            volumes: Volumes::new(),
            locks: LbnLocks::new(),
            counters: Counters::default(),
            compactor: Compactor::new(),
            scrubber: crate::scrubber::Scrubber::new(),
            index_build: crate::index_build::IndexBuild::new(
                mode != OpenMode::ReadOnly,
                opts.hold_index_build,
                (mode == OpenMode::ReadWrite)
                    .then(|| crate::index_save::resolve(&opts.saved_index, meta_dev.name(), nonce))
                    .flatten(),
            ),
            checkpointer,
            repair: OpenRepair::new(mode == OpenMode::Repair),
        });
        if opts.no_discard {
            // Before the open's checkpoint, which retires the slots of the pages it
            // rewrites.
            inner.devices.data().set_discard_enabled(false);
            inner.devices.meta().set_discard_enabled(false);
        }
        crate::load::load(&inner, &sb, copies.older.as_ref(), tolerate_map_damage)?;
        if mode != OpenMode::ReadOnly {
            let index = crate::index_save::resolve(&opts.saved_index, meta_dev.name(), nonce);
            if let Some(index) = index {
                crate::damage_hint::load(&inner, crate::damage_hint::path_for(&index));
            }
        }
        if let Some((copy, _)) = &copies.damaged {
            if !inner.devices.opened_read_only() {
                // The open's checkpoint (generation + 1) went to the damaged copy.
                inner.checkpointer.count_copy_repaired();
                tracing::warn!(
                    "{}: super block copy {copy} rewritten from copy {}",
                    inner.devices.meta().name(),
                    1 - copy
                );
            }
        }
        Ok(inner)
    }

    /// The pool's identity: the random nonce its creation drew, recorded in the super
    /// block and carried by every metadata block. It never changes for the pool's
    /// life; a pool made anew at the same path has another. A copy of the pool's bytes
    /// has the same (it is the same pool).
    pub fn id(&self) -> u64 {
        self.inner.geometry.nonce()
    }

    /// Geometry and settings.
    pub fn info(&self) -> PoolInfo {
        let i = &self.inner;
        let g = &i.geometry;
        let sb = i.checkpointer.super_block().clone();
        let block = BLOCK_BYTES as u64;
        PoolInfo {
            id: format!("{:016x}", self.id()),
            scrub: Box::new(i.scrubber.status()),
            path: i.devices.data_path(),
            metadata_path: i.devices.meta_path(),
            data_device_bytes: g.data_device_bytes(),
            metadata_device_bytes: g.metadata_device_bytes(),
            space: crate::capacity::capacity(i),
            metadata_regions_bytes: g.metadata_blocks() * block,
            addressable_bytes: g.addressable_blocks() * block,
            overcommit: g.overcommit(),
            reserve_bytes: g.reserve_blocks() * block,
            metadata_headroom_bytes: i.depot.metadata_headroom_blocks() * block,
            slab_count: g.slab_count(),
            slab_blocks: g.slab_blocks(),
            objects_per_slab: g.objects_per_slab(),
            journal_bytes: g.journal_sectors() * fewerbytes_format::SECTOR_BYTES as u64,
            index_entries: i.depot.index().entries(),
            dedup_window_bytes: i.depot.index().capacity() * block,
            index_memory_bytes: i.depot.index().memory_bytes(),
            index_mode: i.depot.index().mode(),
            index_recorded: {
                let recorded = (
                    crate::IndexMode::from_super(sb.index_mode, sb.index_sample_shift),
                    sb.index_entries,
                );
                let index = i.depot.index();
                (recorded.0 != index.mode()
                    || crate::index::DedupIndex::entries_of_table_for(recorded.1)
                        != index.entries())
                .then_some(recorded)
            },
            index: crate::stats::index_status(i),
            threads: i.zones.threads(),
            mode: self.mode(),
            format_version: sb.version,
            compression: i.codec.get(),
            open_marker: sb.holder.is_set().then(|| OpenMarker {
                host: sb.holder.host.clone(),
                boot_id: sb
                    .holder
                    .boot_id
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect(),
                pid: sb.holder.pid,
                since_unix: sb.holder.open_unix,
                since_iso: crate::scrubber::iso8601(sb.holder.open_unix),
                current: !i.devices.opened_read_only(),
            }),
            metadata_copies_repaired: i.checkpointer.copies_repaired(),
            replay_blocks_read_back: i.journal.replayed_blocks().0,
            replay_blocks_damaged: i.journal.replayed_blocks().1,
            damaged_range_count: crate::map_damage::pool_ranges(i).len() as u64,
            damaged_objects_known: i.depot.damaged().known(),
            damaged_objects_carried_over: i.depot.damaged().carried_over(),
            shared_map_pages: i.volumes.shares().shared_pages(),
            shared_maps: sb.flags & fewerbytes_format::superblock::FLAG_SHARED_MAPS != 0,
        }
    }

    /// Every damaged range of every volume (`map_damage.rs`): refused (EIO) until
    /// `check --repair` clears them.
    pub fn damaged_ranges(&self) -> Vec<crate::DamagedRange> {
        crate::map_damage::pool_ranges(&self.inner)
    }

    /// Statistics.
    pub fn stats(&self) -> PoolStats {
        crate::stats::pool_stats(&self.inner, self.info(), self.mode())
    }

    /// Every on-disk region.
    pub fn regions(&self) -> Vec<Region> {
        crate::stats::regions(&self.inner)
    }

    /// Reference-count audit: references from all maps against stored counts, and
    /// block holders against live objects.
    ///
    /// Writes pause only while the state is copied (the referenced object ids, each
    /// slab's live records and block holders); the comparison runs after.
    pub fn audit(&self) -> AuditReport {
        crate::stats::audit(&self.inner)
    }

    /// Check the pool and, with `options.apply`, repair it: see `repair.rs`.
    /// `progress` is called now and then with the phase, work done and work in all.
    pub fn repair(
        &self,
        options: &crate::RepairOptions,
        progress: &dyn Fn(crate::RepairPhase, u64, u64),
    ) -> Result<crate::RepairReport> {
        crate::repair::repair(&self.inner, options, progress)
    }

    /// Test hook: the object `lbn` of `volume` maps to, if any.
    #[doc(hidden)]
    pub fn object_of(&self, volume: &str, lbn: u64) -> Result<Option<u64>> {
        crate::repair::object_of(&self.inner, volume, lbn)
    }

    /// Test hook: set object `object`'s reference count to `count`, nothing else,
    /// and checkpoint.
    #[doc(hidden)]
    pub fn damage_reference_count(&self, object: u64, count: u32) -> Result<()> {
        crate::repair::damage_reference_count(&self.inner, object, count)
    }

    /// Test hook: set entry `lbn` of `volume` to `object` (`None`: unmapped) without
    /// changing any reference count, and checkpoint.
    #[doc(hidden)]
    pub fn damage_map_entry(&self, volume: &str, lbn: u64, object: Option<u64>) -> Result<()> {
        crate::repair::damage_map_entry(&self.inner, volume, lbn, object)
    }

    /// Why the pool is latched read-only (the first failure), if it is.
    pub fn latched_reason(&self) -> Option<String> {
        // A pool opened read-only writes nothing, so it never latches: its memory is
        // what its devices hold.
        if self.inner.devices.opened_read_only() {
            return None;
        }
        self.inner.devices.latched()
    }

    /// Call `listener` once when the pool latches read-only (at once if it already
    /// has), with the reason and whether another client took the devices over
    /// ([`Latched::fenced`](crate::Latched)). A pool opened read-only calls it only
    /// when a device is taken over.
    pub fn on_latch(&self, listener: crate::LatchListener) {
        self.inner.devices.on_latch(listener);
    }

    /// Normal, latched read-only, or opened read-only.
    pub fn mode(&self) -> Mode {
        if self.inner.devices.opened_read_only() {
            Mode::OpenedReadOnly
        } else if self.inner.devices.latched().is_some() {
            Mode::ReadOnly
        } else {
            Mode::Normal
        }
    }

    /// Names and sizes of all volumes, cheaply (no per-block work): for frontends
    /// that list exports on every connection.
    pub fn volume_sizes(&self) -> Vec<(String, u64)> {
        let mut sizes = crate::volume_ops::sizes(&self.inner);
        sizes.retain(|(name, _)| crate::internal::refuse_internal(name).is_ok());
        sizes
    }

    /// All volumes, with their usage (walks every block map: for management, not per request).
    pub fn list_volumes(&self) -> Vec<VolumeInfo> {
        let mut volumes = crate::volume_ops::list(&self.inner);
        volumes.retain(|v| !crate::internal::is_internal_name(&v.name));
        volumes
    }

    /// The calls that reach internal volumes, which every other call answers as
    /// unknown (`internal.rs`).
    pub fn internal(self: &Arc<Self>) -> crate::InternalVolumes<'_> {
        crate::InternalVolumes::new(self)
    }

    /// Create a thick volume (it reserves its size); refused when the pool cannot
    /// honour the reservation.
    pub fn create_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo> {
        self.create_volume_with(name, size_bytes, Provisioning::Thick)
    }

    /// Create a volume reserving as `p` says; refused when the pool cannot honour
    /// the reservation (never when thin).
    pub fn create_volume_with(
        &self,
        name: &str,
        size_bytes: u64,
        p: Provisioning,
    ) -> Result<VolumeInfo> {
        crate::volume_ops::create(&self.inner, name, size_bytes, p)
    }

    /// Delete a volume; refused while handles are open unless `force`.
    pub fn delete_volume(&self, name: &str, force: bool) -> Result<()> {
        crate::internal::refuse_internal(name)?;
        crate::volume_ops::delete(&self.inner, name, force)
    }

    /// Grow a volume (or shrink with `allow_shrink`).
    pub fn resize_volume(
        &self,
        name: &str,
        size_bytes: u64,
        allow_shrink: bool,
    ) -> Result<VolumeInfo> {
        crate::internal::refuse_internal(name)?;
        crate::volume_ops::resize(&self.inner, name, size_bytes, allow_shrink)
    }

    /// Clone a volume: shares every block by reference. The clone is thick (see
    /// [`Self::clone_volume_with`]).
    pub fn clone_volume(&self, src: &str, dst: &str) -> Result<VolumeInfo> {
        self.clone_volume_with(src, dst, Provisioning::Thick)
    }

    /// Clone a volume reserving as `p` says. The clone maps what its source maps,
    /// so it has used that much of its reservation already (`reservation.rs`).
    pub fn clone_volume_with(&self, src: &str, dst: &str, p: Provisioning) -> Result<VolumeInfo> {
        crate::internal::refuse_internal(src)?;
        crate::volume_ops::clone(&self.inner, src, dst, p)
    }

    /// Roll volume `name` back to `from` (a snapshot: any other volume, usually a
    /// clone taken earlier): `name` then holds what `from` holds, at its size. One
    /// durable step (a crash leaves one or the other); refused while `name` is open.
    pub fn rollback_volume(&self, name: &str, from: &str) -> Result<VolumeInfo> {
        crate::internal::refuse_internal(name)?;
        crate::internal::refuse_internal(from)?;
        crate::volume_ops::rollback(&self.inner, name, from, None)
    }

    /// Take snapshot `snapshot` of volume `name` (`name@snapshot` from then on): a
    /// read-only point in time sharing every map page of the volume, so it costs the
    /// same at any size; durable on return (`volume_ops::snapshot`).
    pub fn snapshot_volume(&self, name: &str, snapshot: &str) -> Result<VolumeInfo> {
        crate::internal::refuse_internal(name)?;
        crate::volume_ops::snapshot(&self.inner, name, snapshot, None)
    }

    /// [`Self::snapshot_volume`] with the identity `guid` (a snapshot received from
    /// a send stream keeps the sender's; 0 is refused).
    pub fn snapshot_volume_as(&self, name: &str, snapshot: &str, guid: u64) -> Result<VolumeInfo> {
        if guid == 0 {
            return Err(EngineError::Refused(
                "a snapshot's identity is never 0".into(),
            ));
        }
        crate::internal::refuse_internal(name)?;
        crate::volume_ops::snapshot(&self.inner, name, snapshot, Some(guid))
    }

    /// The snapshots of volume `name`, oldest first.
    pub fn snapshots(&self, name: &str) -> Result<Vec<VolumeInfo>> {
        crate::internal::refuse_internal(name)?;
        crate::volume_ops::snapshots(&self.inner, name)
    }

    /// Map pages more than one volume's tree reaches (clones and snapshots share
    /// them).
    pub fn shared_map_pages(&self) -> u64 {
        self.inner.volumes.shares().shared_pages()
    }

    /// The full name of the base volume `name` is compared with when `from` is
    /// given: its snapshot `name@from` when it has one, else `from`.
    pub fn base_name(&self, name: &str, from: &str) -> Result<String> {
        crate::internal::refuse_internal(name)?;
        crate::internal::refuse_internal(from)?;
        let i = &self.inner;
        let base = i.volumes.base_of(name, from)?;
        Ok(i.volumes.full_name(&base))
    }

    /// The runs of volume `name`, whole, that differ from `from` (its snapshot
    /// `name@from` when it has one, else the volume or snapshot `from` names;
    /// changed or not, in order): [`Volume::changed_extents`] by names, for
    /// `volume diff`.
    pub fn changed_extents(&self, name: &str, from: &str) -> Result<Vec<ChangedExtent>> {
        crate::internal::refuse_internal(name)?;
        crate::internal::refuse_internal(from)?;
        let i = &self.inner;
        let _gate = i.locks.shared();
        let (vol, old) = (i.volumes.by_name(name)?, i.volumes.base_of(name, from)?);
        let end = vol.size_blocks() * BLOCK_BYTES as u64;
        Ok(crate::map_diff::changed_extents(&vol, &old, 0, end))
    }

    /// Change what a volume reserves (`volume set`): refused, with nothing changed,
    /// when the pool cannot honour it. Durable on return, as every volume change.
    pub fn set_provisioning(&self, name: &str, p: Provisioning) -> Result<VolumeInfo> {
        crate::internal::refuse_internal(name)?;
        crate::volume_ops::set_provisioning(&self.inner, name, p)
    }

    /// Limit a volume to the TLS identities of the pool's allow list, or lift the
    /// limit; the catalog records it (a volume flag), so a server that cannot read
    /// the list still knows to keep the volume closed. Durable on return.
    pub fn set_volume_limited(&self, name: &str, limited: bool) -> Result<VolumeInfo> {
        crate::internal::refuse_internal(name)?;
        crate::volume_ops::set_limited(&self.inner, name, limited)
    }

    /// Whether volume `name` is limited (`None`: no such volume); cheap, for every
    /// client's access check. A snapshot `VOLUME@SNAP` is limited exactly as VOLUME is
    /// now, whenever either the snapshot or the limit was made.
    pub fn volume_limited(&self, name: &str) -> Option<bool> {
        crate::internal::refuse_internal(name).ok()?;
        let volumes = &self.inner.volumes;
        let found = volumes.by_name(name).ok()?;
        match name.split_once('@') {
            Some((of, _)) => volumes.by_name(of).ok().map(|v| v.limited()),
            None => Some(found.limited()),
        }
    }

    /// Mark a volume incomplete while an import writes it, or complete again; the
    /// catalog records it (a volume flag), so an import killed part-way leaves its
    /// volume marked, and a server refuses to export it. Durable on return.
    pub fn set_volume_incomplete(&self, name: &str, incomplete: bool) -> Result<VolumeInfo> {
        crate::internal::refuse_internal(name)?;
        crate::volume_ops::set_incomplete(&self.inner, name, incomplete)
    }

    /// Whether volume `name` is marked incomplete (`None`: no such volume); cheap,
    /// for every export a client opens.
    pub fn volume_incomplete(&self, name: &str) -> Option<bool> {
        self.inner
            .volumes
            .by_name(name)
            .ok()
            .map(|v| v.incomplete())
    }

    /// Rename a volume. Nothing moves: the catalog names it anew, made durable by a
    /// checkpoint taken with the gate held, as every volume operation is, so a crash
    /// leaves the old name or the new one, never both. A volume with open handles
    /// (NBD clients) is refused: they attached it by the old name.
    pub fn rename_volume(&self, name: &str, new_name: &str) -> Result<VolumeInfo> {
        crate::internal::refuse_internal(name)?;
        crate::volume_ops::rename(&self.inner, name, new_name)
    }

    /// Open a handle on a volume.
    pub fn open_volume(self: &Arc<Self>, name: &str) -> Result<Volume> {
        crate::internal::refuse_internal(name)?;
        let vol = self.inner.volumes.by_name(name)?;
        Ok(Volume::new(self.clone(), vol))
    }

    /// Compress new blocks with `compression` from now on; stored fragments keep the
    /// codec they were written with (each location records its own). Made durable
    /// by a checkpoint before the first block is compressed with it, so the super
    /// block's flag that keeps LZ4-only readers out (`FLAG_CODECS`) is on the device
    /// before any zstd fragment is.
    pub fn set_compression(&self, compression: Compression) -> Result<()> {
        let i = &self.inner;
        i.devices.ensure_writable()?;
        let _ck = i.checkpointer.serialize();
        let gate = i.locks.exclusive();
        {
            let mut sb = i.checkpointer.super_block();
            (sb.compression, sb.compression_level) = compression.to_super();
            if matches!(compression, Compression::Zstd { .. }) {
                sb.flags |= FLAG_CODECS;
            }
        }
        crate::checkpoint::checkpoint_locked(i, gate, true)?;
        i.codec.set(compression);
        Ok(())
    }

    /// Record the dedup index's mode and/or memory (`pool set --index`,
    /// `--index-memory`) in the super block, by a checkpoint. The index is built at
    /// open, from the object records: the new setting is used from the next open
    /// ([`PoolInfo::index_recorded`] shows it until then). Without a new memory the
    /// entries recorded are kept (a new mode with the same memory: the same table,
    /// over 2^k times the window, or back). Returns the entries recorded.
    pub fn set_index(
        &self,
        mode: Option<crate::IndexMode>,
        memory_bytes: Option<u64>,
    ) -> Result<u64> {
        let i = &self.inner;
        if mode.is_none() && memory_bytes.is_none() {
            return Err(EngineError::Refused(
                "pool set --index or --index-memory: nothing to change".into(),
            ));
        }
        i.devices.ensure_writable()?;
        let _ck = i.checkpointer.serialize();
        let gate = i.locks.exclusive();
        let entries = {
            let mut sb = i.checkpointer.super_block();
            let recorded = crate::IndexMode::from_super(sb.index_mode, sb.index_sample_shift);
            let mode = mode.unwrap_or(recorded);
            let max = index_entries_max(sb.slab_count, sb.objects_per_slab);
            let entries = match memory_bytes {
                Some(bytes) => index_entries_for(Some(bytes), mode, sb.data_blocks, max),
                // The same table, capped to what the pool's objects need in `mode`.
                None => sb
                    .index_entries
                    .min((max >> mode.sample_shift()).max(INDEX_ENTRIES_MIN)),
            };
            sb.index_entries = entries;
            (sb.index_mode, sb.index_sample_shift) = mode.to_super();
            entries
        };
        crate::checkpoint::checkpoint_locked(i, gate, true)?;
        Ok(entries)
    }

    /// Turn discards of freed space on (the default) or off for as long as the pool
    /// is open (`serve --no-discard`); nothing is stored. Both devices: freed data
    /// blocks on the data device, freed page-store slots on the metadata device.
    pub fn set_discard_enabled(&self, enabled: bool) {
        self.inner.devices.data().set_discard_enabled(enabled);
        self.inner.devices.meta().set_discard_enabled(enabled);
    }

    /// Run a compaction round over every slab now (the pool also runs one in the
    /// background after fragments are freed). Returns the packed blocks emptied.
    pub fn compact(&self) -> Result<u64> {
        crate::compact::compact_all(&self.inner)
    }

    /// Take the space the data device gained (`pool grow`, online): the data region
    /// grows as far as the page store can describe, recorded by a checkpoint.
    pub fn grow(&self) -> Result<GrowReport> {
        crate::grow::grow(&self.inner)
    }

    /// Start a scrub (`scrub.rs`): every page the current checkpoint reaches, every
    /// stored object and both super block copies, read and verified on a thread of
    /// its own at `rate_bytes_per_s` (0: unthrottled); damaged pages are rewritten
    /// from memory. Refused while one runs or is paused. Its progress is
    /// [`Pool::scrub_status`] (and `stats`, `pool info`).
    pub fn scrub_start(&self, rate_bytes_per_s: u64) -> Result<ScrubStatus> {
        let i = &self.inner;
        let mut thread = self.scrub_thread.lock();
        i.scrubber.begin(rate_bytes_per_s)?;
        if let Some(h) = thread.take() {
            // The last scrub's thread, finished (its state was done).
            let _ = h.join();
        }
        let scrub_inner = self.inner.clone();
        let spawned = std::thread::Builder::new()
            .name("fewerbytes-scrub".into())
            .spawn(move || crate::scrub::scrub(&scrub_inner));
        match spawned {
            Ok(h) => *thread = Some(h),
            Err(e) => {
                let why = format!("cannot start the scrub thread: {e}");
                i.scrubber.finish(Some(why.clone()));
                return Err(EngineError::Refused(why));
            }
        }
        Ok(i.scrubber.status())
    }

    /// Pause the running scrub where it is.
    pub fn scrub_pause(&self) -> Result<ScrubStatus> {
        self.inner.scrubber.pause()?;
        Ok(self.inner.scrubber.status())
    }

    /// Resume a paused scrub.
    pub fn scrub_resume(&self) -> Result<ScrubStatus> {
        self.inner.scrubber.resume()?;
        Ok(self.inner.scrubber.status())
    }

    /// Where the dedup index's build stands.
    pub fn index_status(&self) -> IndexStatus {
        crate::stats::index_status(&self.inner)
    }

    /// Wait until the dedup index is built (a batch writer that wants every dedup
    /// hit, as `volume import`; a server never waits: it serves at once).
    pub fn wait_index_built(&self) {
        self.inner.index_build.wait();
    }

    /// Let an index build held by [`OpenOptions::hold_index_build`] run.
    pub fn release_index_build(&self) {
        self.inner.index_build.release();
    }

    /// The scrub's progress and last report (in memory: a reopened pool says idle).
    pub fn scrub_status(&self) -> ScrubStatus {
        self.inner.scrubber.status()
    }

    /// Make every acknowledged write durable.
    pub fn flush(&self) -> Result<()> {
        let i = &self.inner;
        crate::counters::add(&i.counters.flushes, 1);
        let target = i.journal.appended();
        if let Some(why) = i.journal.failure() {
            return Err(EngineError::ReadOnly(why));
        }
        i.journal.wait_durable(target)
    }

    /// Final checkpoint and release of the devices' commit thread.
    pub fn close(self: Arc<Self>) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&self) -> Result<()> {
        let i = &self.inner;
        if i.devices.close() {
            return Ok(());
        }
        i.compactor.wake();
        if let Some(h) = self.compact_thread.lock().take() {
            let _ = h.join();
        }
        i.scrubber.wake();
        if let Some(h) = self.scrub_thread.lock().take() {
            let _ = h.join();
        }
        i.index_build.stop();
        if let Some(h) = self.index_thread.lock().take() {
            let _ = h.join();
        }
        let result = if i.devices.opened_read_only() {
            Ok(())
        } else if let Some(why) = i.devices.latched() {
            Err(EngineError::ClosedLatched(why))
        } else {
            // A clean close clears the open-by-host marker.
            i.checkpointer.super_block().holder = Holder::default();
            let closed = crate::checkpoint::checkpoint(i);
            if closed.is_ok() {
                crate::index_save::save(i);
            }
            closed
        };
        // The damaged blocks this open knew, for the next (a latched pool's too).
        crate::damage_hint::save(i, true);
        i.journal.shutdown();
        if let Some(h) = self.commit_thread.lock().take() {
            let _ = h.join();
        }
        result
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::error!("closing the pool failed: {e}");
        }
    }
}

/// The entries `pool create` and `pool set --index-memory` record: the table
/// `memory_bytes` holds (default [`crate::index::INDEX_MEMORY_DEFAULT_BYTES`], and then
/// no more than the data region's blocks need), never more than the pool's object
/// slots need in `mode` — more could never be used, and the super block refuses
/// more than the slots (opening sizes the index from this field).
pub(crate) fn index_entries_for(
    memory_bytes: Option<u64>,
    mode: crate::IndexMode,
    data_blocks: u64,
    entries_max: u64,
) -> u64 {
    use crate::index::{DedupIndex, INDEX_MEMORY_DEFAULT_BYTES};
    let shift = mode.sample_shift();
    let entries = match memory_bytes {
        Some(bytes) => DedupIndex::window_for_memory(bytes).max(INDEX_ENTRIES_MIN),
        None => (data_blocks >> shift)
            .max(1)
            .min(DedupIndex::window_for_memory(INDEX_MEMORY_DEFAULT_BYTES)),
    };
    entries.min((entries_max >> shift).max(INDEX_ENTRIES_MIN))
}
