//! The pool: its devices, its tables, the commit thread, and volume management.
//!
//! Concurrency: request threads hold the *gate* shared while they change state;
//! a checkpoint snapshot and volume operations (create, delete, resize, clone)
//! hold it exclusively for the moment they need an exact image. Below the gate,
//! state is split by zone: block-map pages (logical), slabs and packers
//! (physical), index shards (hash), each behind its own lock.

use crate::block_map::VolumeState;
use crate::counters::Counters;
use crate::devices::Devices;
use crate::geometry::PoolGeometry;
use crate::geometry::{human_bytes, Geometry, SLAB_BLOCKS};
use crate::journal::{read_journal, Journal};
use crate::open_repair::OpenRepair;
use crate::packer::Zones;
use crate::slab_depot::SlabDepot;
use crate::volumes::Volumes;
use crate::{api::*, EngineError, Result, Volume};
use fewerbytes_format::catalog::validate_name;
use fewerbytes_format::dir_tree::MAX_VOLUME_BYTES;
use fewerbytes_format::page::PageRef;
use fewerbytes_format::superblock::{
    index_entries_max, magic_of, DataLabel, Holder, SuperBlock, DATA_LABEL_MAGIC,
    FLAG_DATA_REGION_PAGES, FLAG_OVERCOMMIT, FLAG_SEPARATE_METADATA, INDEX_ENTRIES_MIN,
    SUPER_MAGIC,
};
use fewerbytes_format::{BLOCK_BYTES, FORMAT_VERSION, FORMAT_VERSION_1};
use fewerbytes_storage::{FileStorage, Storage};
use parking_lot::{Mutex, RwLock};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::checkpointer::Checkpointer;
use crate::inner::{Inner, LBN_STRIPES};
use crate::page_store::page_address;

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
    pub(crate) inner: Arc<Inner>,
    commit_thread: Mutex<Option<JoinHandle<()>>>,
    compact_thread: Mutex<Option<JoinHandle<()>>>,
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The open-by-host marker of this process: host name, boot id, pid, now. Each part
/// is best effort (a person reads it); unknown parts stay empty.
fn this_holder() -> Holder {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let mut host_bytes = host
        .len()
        .min(fewerbytes_format::superblock::MAX_HOST_BYTES);
    while !host.is_char_boundary(host_bytes) {
        host_bytes -= 1;
    }
    let mut boot_id = [0u8; 16];
    if let Ok(text) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let hex: Vec<u8> = text
            .trim()
            .chars()
            .filter_map(|c| c.to_digit(16))
            .map(|d| d as u8)
            .collect();
        for (b, pair) in boot_id.iter_mut().zip(hex.chunks(2)) {
            *b = pair.iter().fold(0, |acc, d| acc << 4 | d);
        }
    }
    Holder {
        pid: std::process::id(),
        open_unix: now_unix().max(1),
        boot_id,
        host: host.get(..host_bytes).unwrap_or_default().to_string(),
    }
}

fn describe_holder(h: &Holder) -> String {
    let boot: String = h.boot_id.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "host '{}' (boot id {boot}), pid {}, at {} (unix time)",
        h.host, h.pid, h.open_unix
    )
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

fn open_or_create(path: &Path, size: Option<u64>) -> Result<FileStorage> {
    let exists = path.exists();
    match (exists, size) {
        // A regular file is grown to the size asked for (sparse); a block device is
        // taken as it is and checked by the caller.
        (_, Some(s)) => Ok(FileStorage::create(path, s)?),
        (true, None) => Ok(FileStorage::open(path)?),
        (false, None) => Err(EngineError::Refused(format!(
            "{} does not exist; give --size to create it",
            path.display()
        ))),
    }
}

impl Pool {
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
        let data = open_or_create(&opts.path, opts.size_bytes)?;
        if opts.size_bytes.is_some_and(|s| data.len_bytes() < s) {
            return Err(EngineError::Refused(format!(
                "{} holds {}, less than the {} asked for",
                opts.path.display(),
                human_bytes(data.len_bytes()),
                human_bytes(opts.size_bytes.unwrap_or(0))
            )));
        }
        let meta = match &opts.metadata_path {
            Some(p) => {
                let data_blocks = data.len_bytes() / BLOCK_BYTES as u64;
                let need = Geometry::metadata_blocks_needed(data_blocks, opts.overcommit)
                    * BLOCK_BYTES as u64;
                let size = opts
                    .metadata_size_bytes
                    .unwrap_or(need.div_ceil(1 << 20) << 20);
                Some(open_or_create(p, Some(size))?)
            }
            None => None,
        };
        let data: Arc<dyn Storage> = Arc::new(data);
        let meta: Option<Arc<dyn Storage>> = meta.map(|m| Arc::new(m) as Arc<dyn Storage>);
        let meta_path = opts.metadata_path.as_ref().map(|p| {
            std::fs::canonicalize(p)
                .unwrap_or_else(|_| p.clone())
                .display()
                .to_string()
        });
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
        let mut geo = Geometry::compute(data_blocks_dev, meta_blocks_dev, opts.overcommit)?;
        if let Some(slots) = opts.page_slots {
            // Fewer slots leave the rest of the region unused; never more than it has.
            geo.page_slots = slots.clamp(2, geo.page_slots);
        }
        let nonce = random_u64();
        let mut key = [0u8; 32];
        for chunk in key.chunks_mut(8) {
            chunk.copy_from_slice(&rand::random::<u64>().to_le_bytes());
        }
        // More entries than object slots could never be used, and the super block
        // refuses them (opening sizes the index from this field).
        let index_entries = match opts.index_memory_bytes {
            Some(bytes) => (bytes / crate::index::ENTRY_BYTES).max(INDEX_ENTRIES_MIN),
            None => geo.data_blocks,
        }
        .min(index_entries_max(geo.slab_count, geo.objects_per_slab));
        let flags = if meta.is_some() {
            FLAG_SEPARATE_METADATA
        } else {
            0
        } | if opts.overcommit { FLAG_OVERCOMMIT } else { 0 }
            // Pages past the page store's free slots go to data blocks.
            | FLAG_DATA_REGION_PAGES;
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
            created_unix: now_unix(),
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
        let data = FileStorage::open(path)?;
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
            Some(SUPER_MAGIC) => Self::open_devices_as(Arc::new(data), None, opts, mode),
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
                let meta = FileStorage::open(Path::new(&label.metadata_path))?;
                let data: Arc<dyn Storage> = Arc::new(data);
                let pool = Self::open_devices_as(
                    data.clone(),
                    Some((Arc::new(meta), label.metadata_path.clone())),
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

    /// Write label copy `copy` (block 0 or 1) of a separate data device, durably.
    fn write_label(data: &dyn Storage, label: &DataLabel, copy: u64) -> Result<()> {
        let mut block = [0u8; BLOCK_BYTES];
        label.encode(&mut block);
        data.write_at(&block, copy * BLOCK_BYTES as u64)?;
        data.flush()?;
        Ok(())
    }

    fn read_super(meta: &dyn Storage) -> Result<SuperBlock> {
        let mut best: Option<SuperBlock> = None;
        let mut errors = Vec::new();
        for copy in 0..2u64 {
            let mut block = vec![0u8; BLOCK_BYTES];
            meta.read_at(&mut block, copy * BLOCK_BYTES as u64)?;
            match SuperBlock::decode(&block) {
                Ok(sb) if best.as_ref().is_none_or(|b| sb.generation > b.generation) => {
                    best = Some(sb)
                }
                Ok(_) => {}
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
        for (copy, e) in &errors {
            // Copy 1 of a pool never opened (generation 0) was never written.
            if *copy == 1 && best.generation == 0 {
                continue;
            }
            tracing::warn!(
                "{}: super block copy {copy} is damaged ({e}); opened from copy {} \
                 (generation {}), and the next checkpoint rewrites copy {copy}. If copy \
                 {copy} held a newer checkpoint, changes since generation {} may be \
                 missing: run `fewerbytes check`",
                meta.name(),
                1 - copy,
                best.generation,
                best.generation
            );
        }
        Ok(best)
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
        let separate = meta.is_some();
        let (meta_dev, meta_path) = match meta {
            Some((m, p)) => (m, Some(p)),
            None => (data.clone(), None),
        };
        let sb = Self::read_super(meta_dev.as_ref())?;
        let meta = meta_path.map(|p| (meta_dev.clone(), p));
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
        let zones = threads.min(sb.slab_count as usize).max(1);
        let geometry = PoolGeometry::from_super(&sb);
        let dirty_pages = Arc::new(AtomicU64::new(0));
        let journal = Arc::new(Journal::new(
            geometry.nonce(),
            geometry.journal_start_block(),
            geometry.journal_sectors(),
            sb.journal_replay_seq,
            sb.journal_replay_seq,
            sb.open_gen + 1,
        ));
        let inner = Arc::new(Inner {
            devices: Devices::new(data, meta, mode == OpenMode::ReadOnly, journal.clone()),
            depot: SlabDepot::new(&geometry, &dirty_pages),
            zones: Zones::new(zones),
            journal,
            checkpointer: Checkpointer::new(sb.clone(), geometry.page_slots()),
            geometry,
            gate: RwLock::new(()),
            volumes: Volumes::new(),
            stripes: (0..LBN_STRIPES).map(|_| Mutex::new(())).collect(),
            counters: Counters::default(),
            threads,
            compactor_wake: (Mutex::new(()), parking_lot::Condvar::new()),
            dirty_pages,
            compacted_blocks: AtomicU64::new(0),
            repair: OpenRepair::new(mode == OpenMode::Repair),
        });
        inner.load(&sb)?;
        let thread_inner = inner.clone();
        let handle = std::thread::Builder::new()
            .name("fewerbytes-commit".into())
            .spawn(move || thread_inner.commit_loop())
            .map_err(|e| EngineError::Refused(format!("cannot start the commit thread: {e}")))?;
        let compact_inner = inner.clone();
        let compactor = std::thread::Builder::new()
            .name("fewerbytes-compact".into())
            .spawn(move || compact_inner.compact_loop())
            .map_err(|e| {
                EngineError::Refused(format!("cannot start the compaction thread: {e}"))
            })?;
        Ok(Arc::new(Pool {
            inner,
            commit_thread: Mutex::new(Some(handle)),
            compact_thread: Mutex::new(Some(compactor)),
        }))
    }

    /// Geometry and settings.
    pub fn info(&self) -> PoolInfo {
        let i = &self.inner;
        let g = &i.geometry;
        let sb = i.checkpointer.super_block().clone();
        let block = BLOCK_BYTES as u64;
        PoolInfo {
            path: i.devices.data_path(),
            metadata_path: i.devices.meta_path(),
            data_device_bytes: g.data_device_bytes(),
            metadata_device_bytes: g.metadata_device_bytes(),
            data_bytes: g.data_blocks() * block,
            metadata_bytes: g.metadata_blocks() * block,
            addressable_bytes: g.addressable_blocks() * block,
            allocated_bytes: i.volumes.allocated_blocks() * block,
            overcommit: g.overcommit(),
            reserve_bytes: g.reserve_blocks() * block,
            slab_count: g.slab_count(),
            slab_blocks: g.slab_blocks(),
            objects_per_slab: g.objects_per_slab(),
            journal_bytes: g.journal_sectors() * fewerbytes_format::SECTOR_BYTES as u64,
            index_entries: i.depot.index().capacity(),
            dedup_window_bytes: i.depot.index().capacity() * block,
            index_memory_bytes: i.depot.index().memory_bytes(),
            threads: i.threads,
            mode: self.mode(),
            format_version: sb.version,
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
                current: !i.devices.opened_read_only(),
            }),
        }
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

    fn volume_info(&self, v: &VolumeState) -> VolumeInfo {
        let block = BLOCK_BYTES as u64;
        let mut exclusive = 0u64;
        let mut own: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
        v.for_each_mapped(|_, e| {
            if let Some(o) = e.object() {
                *own.entry(o.0).or_insert(0) += 1;
            }
        });
        for (o, n) in own {
            let (s, i) = (
                (o / u64::from(self.inner.geometry.objects_per_slab())) as u32,
                (o % u64::from(self.inner.geometry.objects_per_slab())) as u32,
            );
            let rec = self.inner.depot.slab(s).lock().rec(i);
            if rec.refcount == n {
                if let Ok(loc) = fewerbytes_format::location::Location::decode(rec.location) {
                    exclusive += loc.stored_bytes();
                }
            }
        }
        VolumeInfo {
            name: v.name(),
            id: v.id,
            size_bytes: v.size_blocks() * block,
            logical_used_bytes: v.mapped_blocks() * block,
            zero_bytes: v.zero_blocks() * block,
            exclusive_stored_bytes: exclusive,
            users: v.users(),
        }
    }

    /// Names and sizes of all volumes, cheaply (no per-block work): for frontends
    /// that list exports on every connection.
    pub fn volume_sizes(&self) -> Vec<(String, u64)> {
        self.inner.volumes.sizes(BLOCK_BYTES as u64)
    }

    /// All volumes, with their usage (walks every block map: for management, not per request).
    pub fn list_volumes(&self) -> Vec<VolumeInfo> {
        let vols = self.inner.volumes.all();
        vols.iter().map(|v| self.volume_info(v)).collect()
    }

    fn check_capacity(&self, extra_blocks: u64, what: &str) -> Result<()> {
        let i = &self.inner;
        let allocated = i.volumes.allocated_blocks();
        if allocated + extra_blocks > i.geometry.addressable_blocks() {
            let block = BLOCK_BYTES as u64;
            return Err(EngineError::Refused(format!(
                "{what} needs {} but the pool can address {} and volumes already take {} ({} left){}",
                human_bytes(extra_blocks * block),
                human_bytes(i.geometry.addressable_blocks() * block),
                human_bytes(allocated * block),
                human_bytes((i.geometry.addressable_blocks() - allocated.min(i.geometry.addressable_blocks())) * block),
                if i.geometry.overcommit() { "" } else { "; create the pool with --overcommit to promise more than it stores" }
            )));
        }
        Ok(())
    }

    fn size_blocks_of(size_bytes: u64) -> Result<u64> {
        if size_bytes == 0 || !size_bytes.is_multiple_of(BLOCK_BYTES as u64) {
            return Err(EngineError::Refused(format!(
                "a volume size must be a positive multiple of 4096 bytes, not {size_bytes}"
            )));
        }
        if size_bytes > MAX_VOLUME_BYTES {
            return Err(EngineError::Refused(format!(
                "a volume is at most {} (journal records address 2^40 blocks), not {}",
                human_bytes(MAX_VOLUME_BYTES),
                human_bytes(size_bytes)
            )));
        }
        Ok(size_bytes / BLOCK_BYTES as u64)
    }

    /// Create a volume; refused past the pool's addressable size unless overcommitted.
    pub fn create_volume(&self, name: &str, size_bytes: u64) -> Result<VolumeInfo> {
        validate_name(name).map_err(EngineError::Refused)?;
        let size_blocks = Self::size_blocks_of(size_bytes)?;
        let i = &self.inner;
        i.devices.ensure_writable()?;
        let _ck = i.checkpointer.serialize();
        let gate = i.gate.write();
        if i.volumes.exists(name) {
            return Err(EngineError::VolumeExists(name.to_string()));
        }
        self.check_capacity(
            size_blocks,
            &format!("volume '{name}' of {}", human_bytes(size_bytes)),
        )?;
        let vol = i.volumes.make(name, size_blocks)?;
        i.volumes.insert(vol.clone());
        i.checkpoint_locked(gate, true)?;
        Ok(self.volume_info(&vol))
    }

    /// Delete a volume; refused while handles are open unless `force`.
    pub fn delete_volume(&self, name: &str, force: bool) -> Result<()> {
        let i = &self.inner;
        i.devices.ensure_writable()?;
        i.ensure_space()?;
        let _ck = i.checkpointer.serialize();
        let gate = i.gate.write();
        let vol = i.volumes.by_name(name)?;
        let users = vol.users();
        if users > 0 && !force {
            return Err(EngineError::VolumeInUse {
                name: name.to_string(),
                users,
            });
        }
        vol.mark_deleted();
        let mut released = Vec::new();
        vol.for_each_mapped(|_, e| released.extend(e.object()));
        {
            let mut free = Vec::new();
            for page in vol.pages.read().iter() {
                free.extend(page_address(&page.lock().durable));
            }
            free.extend(vol.dirs.lock().slots());
            i.checkpointer.free_after_next(free);
        }
        i.volumes.remove(vol.slot);
        i.depot.release_objects(&i.devices, &released)?;
        i.checkpoint_locked(gate, true)
    }

    /// Grow a volume (or shrink with `allow_shrink`).
    pub fn resize_volume(
        &self,
        name: &str,
        size_bytes: u64,
        allow_shrink: bool,
    ) -> Result<VolumeInfo> {
        let size_blocks = Self::size_blocks_of(size_bytes)?;
        let i = &self.inner;
        i.devices.ensure_writable()?;
        let _ck = i.checkpointer.serialize();
        let gate = i.gate.write();
        let vol = i.volumes.by_name(name)?;
        let old = vol.size_blocks();
        if size_blocks > old {
            self.check_capacity(
                size_blocks - old,
                &format!("growing '{name}' to {}", human_bytes(size_bytes)),
            )?;
        } else if size_blocks < old {
            if !allow_shrink {
                return Err(EngineError::Refused(format!(
                    "shrinking '{name}' from {} to {} discards its data past the new end; pass --shrink to do it",
                    human_bytes(old * BLOCK_BYTES as u64),
                    human_bytes(size_bytes)
                )));
            }
            let mut released = Vec::new();
            {
                let pages = vol.pages.read();
                for lbn in size_blocks..old {
                    let p = (lbn / crate::block_map::ENTRIES_PER_PAGE) as usize;
                    if let Some(page) = pages.get(p) {
                        let mut page = page.lock();
                        if page.entries.is_some() {
                            let old_entry = page.set(
                                (lbn % crate::block_map::ENTRIES_PER_PAGE) as usize,
                                fewerbytes_format::location::MapEntry::Unmapped,
                                &i.dirty_pages,
                            );
                            vol.account(old_entry, fewerbytes_format::location::MapEntry::Unmapped);
                            released.extend(old_entry.object());
                        }
                    }
                }
                let keep = size_blocks.div_ceil(crate::block_map::ENTRIES_PER_PAGE) as usize;
                let mut free = Vec::new();
                for page in pages.iter().skip(keep) {
                    free.extend(page_address(&page.lock().durable));
                }
                i.checkpointer.free_after_next(free);
            }
            i.depot.release_objects(&i.devices, &released)?;
        }
        vol.set_size(size_blocks);
        i.checkpoint_locked(gate, true)?;
        Ok(self.volume_info(&vol))
    }

    /// Clone a volume: shares every block by reference.
    pub fn clone_volume(&self, src: &str, dst: &str) -> Result<VolumeInfo> {
        validate_name(dst).map_err(EngineError::Refused)?;
        let i = &self.inner;
        i.devices.ensure_writable()?;
        let _ck = i.checkpointer.serialize();
        let gate = i.gate.write();
        let source = i.volumes.by_name(src)?;
        if i.volumes.exists(dst) {
            return Err(EngineError::VolumeExists(dst.to_string()));
        }
        let size_blocks = source.size_blocks();
        self.check_capacity(
            size_blocks,
            &format!(
                "clone '{dst}' of {}",
                human_bytes(size_blocks * BLOCK_BYTES as u64)
            ),
        )?;
        let vol = i.volumes.make(dst, size_blocks)?;
        let mut shared = Vec::new();
        {
            let from = source.pages.read();
            let to = vol.pages.read();
            for (p, q) in from.iter().zip(to.iter()) {
                let p = p.lock();
                if let Some(entries) = &p.entries {
                    let mut q = q.lock();
                    q.entries = Some(entries.clone());
                    q.dirty = true;
                    i.dirty_pages.fetch_add(1, Ordering::Relaxed);
                    shared.extend(entries.iter().filter_map(|e| {
                        fewerbytes_format::location::MapEntry::decode(*e).object()
                    }));
                }
            }
        }
        vol.copy_usage(&source);
        i.depot.add_references(&i.devices, &shared)?;
        i.volumes.insert(vol.clone());
        i.checkpoint_locked(gate, true)?;
        Ok(self.volume_info(&vol))
    }

    /// Rename a volume. Nothing moves: the catalog names it anew, made durable by a
    /// checkpoint taken with the gate held, as every volume operation is, so a crash
    /// leaves the old name or the new one, never both. A volume with open handles
    /// (NBD clients) is refused: they attached it by the old name.
    pub fn rename_volume(&self, name: &str, new_name: &str) -> Result<VolumeInfo> {
        validate_name(new_name).map_err(EngineError::Refused)?;
        let i = &self.inner;
        i.devices.ensure_writable()?;
        let _ck = i.checkpointer.serialize();
        let gate = i.gate.write();
        let vol = i.volumes.by_name(name)?;
        if i.volumes.exists(new_name) {
            return Err(EngineError::VolumeExists(new_name.to_string()));
        }
        // A client attached the volume by its old name (its NBD export): a disk is
        // renamed while nothing uses it, as Proxmox renames a stopped VM's disk.
        let users = vol.users();
        if users > 0 {
            return Err(EngineError::Refused(format!(
                "volume '{name}' is open by {users} client(s): disconnect them to rename it"
            )));
        }
        vol.rename(new_name);
        i.checkpoint_locked(gate, true)?;
        Ok(self.volume_info(&vol))
    }

    /// Open a handle on a volume.
    pub fn open_volume(self: &Arc<Self>, name: &str) -> Result<Volume> {
        let vol = self.inner.volumes.by_name(name)?;
        Ok(Volume::new(self.clone(), vol))
    }

    /// Turn discards of freed blocks on the data device on (the default) or off for
    /// as long as the pool is open (`serve --no-discard`); nothing is stored.
    pub fn set_discard_enabled(&self, enabled: bool) {
        self.inner.devices.data().set_discard_enabled(enabled);
    }

    /// Run a compaction round over every slab now (the pool also runs one in the
    /// background after fragments are freed). Returns the packed blocks emptied.
    pub fn compact(&self) -> Result<u64> {
        self.inner.compact_all()
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
        {
            let _guard = i.compactor_wake.0.lock();
            i.compactor_wake.1.notify_all();
        }
        if let Some(h) = self.compact_thread.lock().take() {
            let _ = h.join();
        }
        let result = if i.devices.opened_read_only() {
            Ok(())
        } else if let Some(why) = i.devices.latched() {
            Err(EngineError::ClosedLatched(why))
        } else {
            // A clean close clears the open-by-host marker.
            i.checkpointer.super_block().holder = Holder::default();
            i.checkpoint()
        };
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

impl Inner {
    /// Load the checkpoint, replay the journal, rebuild derived state, and write a
    /// fresh checkpoint in the new open generation.
    fn load(self: &Arc<Self>, sb: &SuperBlock) -> Result<()> {
        if sb.holder.is_set() {
            tracing::warn!(
                "{}: the pool is marked open by {}: that opener did not close it (it \
                 stopped without closing, or another host still has the device open)",
                self.devices.meta().name(),
                describe_holder(&sb.holder)
            );
        }
        if sb.generation > 0 {
            let catalog = self.load_catalog()?;
            self.load_counters()?;
            self.load_objects(&catalog)?;
            self.volumes.set_next_id(catalog.next_volume_id);
            // Volumes are created and grown only within the addressable blocks, and a
            // volume's map is sized from its size: a damaged size must not size it.
            let mut volume_blocks_total = 0u64;
            for record in &catalog.volumes {
                let corrupt = |reason: String| EngineError::Corrupt {
                    region: "catalog",
                    block: 0,
                    device: "metadata",
                    reason,
                };
                if !record.size_bytes.is_multiple_of(BLOCK_BYTES as u64) {
                    return Err(corrupt(format!(
                        "volume '{}' size {} is not whole blocks",
                        record.name, record.size_bytes
                    )));
                }
                volume_blocks_total =
                    volume_blocks_total.saturating_add(record.size_bytes / BLOCK_BYTES as u64);
                if volume_blocks_total > self.geometry.addressable_blocks() {
                    return Err(corrupt(format!(
                        "volume '{}' of {} bytes takes the volumes past the pool's {} addressable bytes",
                        record.name,
                        record.size_bytes,
                        self.geometry.addressable_blocks() * BLOCK_BYTES as u64
                    )));
                }
                let vol = Arc::new(VolumeState::new(
                    record.slot,
                    record.id,
                    record.name.clone(),
                    record.size_bytes / BLOCK_BYTES as u64,
                ));
                self.load_map(record, &vol)?;
                self.volumes.insert(vol);
            }
        }
        let (records, _next) = read_journal(
            self.devices.meta(),
            self.geometry.nonce(),
            self.geometry.journal_start_block(),
            self.geometry.journal_sectors(),
            sb.journal_replay_seq,
            sb.open_gen,
        )?;
        if sb.generation > 0 && !records.is_empty() {
            tracing::info!("replaying {} journal records", records.len());
            self.replay(&records)?;
        }
        self.restore_counts()?;
        self.rebuild()?;
        if self.devices.opened_read_only() {
            self.devices.latch_opened_read_only();
            return Ok(());
        }
        let upgrade = sb.version == FORMAT_VERSION_1;
        if upgrade {
            self.prepare_upgrade()?;
        }
        // A fresh checkpoint in the new open generation retires the replayed journal
        // and records who holds the pool.
        {
            let mut current = self.checkpointer.super_block();
            current.open_gen = sb.open_gen + 1;
            current.holder = this_holder();
        }
        self.checkpoint()?;
        if upgrade {
            // The other super block copy still holds version 1: one more checkpoint
            // overwrites it, so version-1 code refuses the pool by its version rather
            // than open that older checkpoint.
            self.checkpoint()?;
            tracing::info!(
                "{}: upgraded to format version {FORMAT_VERSION}",
                self.devices.meta().name()
            );
        }
        Ok(())
    }
}
