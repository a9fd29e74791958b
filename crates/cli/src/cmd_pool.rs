//! `pool create`, `pool info` and `pool set`: making a pool, showing what it can
//! hold, changing its settings.

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use fewerbytes_engine::{iso8601, Compression, CreateOptions, IndexMode, Mode, Pool, PoolInfo};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::control::{inspect_pool, with_pool, Answer, Request};
use crate::output::print_json;
use crate::size::{format_size, parse_size_arg};

/// `fewerbytes pool …`
#[derive(Subcommand)]
pub enum PoolCommand {
    /// Format a file, block device or RBD image as a new pool (PATH here, not --pool).
    Create(CreateArgs),
    /// Geometry, settings and the pool's space: Size, Used and its parts, Available,
    /// Reservable, Reserved, Promised.
    Info {
        /// Print PoolInfo as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Take the space the pool's device gained (`truncate -s` of a file, `losetup -c`
    /// of a loop device, `lvextend`, `rbd resize` of an RBD image) into the data
    /// region; while served too.
    Grow {
        /// Print what was done as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Change a setting of the pool (through its server if it is served).
    #[command(group(clap::ArgGroup::new("setting").required(true).multiple(true)))]
    Set {
        /// How new blocks are compressed from now on: lz4, zstd, zstd:LEVEL (-7 to
        /// 22) or none. Blocks already stored keep their codec.
        #[arg(long, value_name = "CODEC", group = "setting")]
        compression: Option<Compression>,
        /// Which blocks enter the dedup index, from the next open: dense (every
        /// one) or sparse (1 in 16, the rest found next to them: 16 times the window
        /// for the same memory, for data written again in runs).
        #[arg(long, value_name = "MODE", group = "setting")]
        index: Option<IndexMode>,
        /// Memory for the dedup index, from the next open (its table; the window is
        /// 16 times larger when sparse).
        #[arg(long, value_parser = parse_size_arg, value_name = "S", group = "setting")]
        index_memory: Option<u64>,
    },
}

/// `pool create`.
#[derive(clap::Args)]
pub struct CreateArgs {
    /// The file, block device or RBD image to format: a path, file:///PATH, or
    /// rbd:POOL/IMAGE[@CLUSTER] (an existing image, used at its size). A file is
    /// created, sparse, if missing.
    path: PathBuf,
    /// Size of the file to create or extend (512, 4K, 64M, 10G, 1T; binary units).
    #[arg(long, value_parser = parse_size_arg, value_name = "S")]
    size: Option<u64>,
    /// A separate device for every metadata region (a path, file:///PATH or
    /// rbd:POOL/IMAGE[@CLUSTER]); the pool device then holds only data.
    #[arg(long, value_name = "DEVICE")]
    metadata_device: Option<PathBuf>,
    /// Size of the metadata file to create (default: sized to fit); only with
    /// --metadata-device (without one, the metadata shares the pool device).
    #[arg(long, value_parser = parse_size_arg, value_name = "S", requires = "metadata_device")]
    metadata_size: Option<u64>,
    /// Overwrite a device that already holds a pool or data in its first MiB.
    #[arg(long)]
    force: bool,
    /// Deprecated, and ignored: volumes are thick or thin each on their own now
    /// (`volume create --thin`, `volume clone --thin`, `volume set`).
    #[arg(long, hide = true)]
    overcommit: bool,
    /// Memory for the dedup index; bounds how much distinct data it remembers
    /// (default: 256 MiB, or what the whole pool needs if less).
    #[arg(long, value_parser = parse_size_arg, value_name = "S")]
    index_memory: Option<u64>,
    /// Which blocks enter the dedup index: dense (every one: any second copy in the
    /// window is found) or sparse (1 in 16, the rest found next to them: 16 times
    /// the window for data written again in runs, as clones of a template).
    #[arg(long, value_name = "MODE", default_value = "dense")]
    index: IndexMode,
    /// How new blocks are compressed: lz4 (fast), zstd (level 3: fewer bytes for
    /// more CPU), zstd:LEVEL (-7 to 22) or none.
    #[arg(long, value_name = "CODEC", default_value = "lz4")]
    compression: Compression,
    /// Do not discard the new pool's data region (by default it is given back to the
    /// device, as mkfs does: a hole punched in a file, BLKDISCARD on a block device).
    #[arg(long)]
    no_discard: bool,
    /// Size the metadata so that `pool grow` can later take the device up to this
    /// size (the metadata regions keep their size when the data region grows; by
    /// default they are sized for the device as it is).
    #[arg(long, value_parser = parse_size_arg, value_name = "S")]
    max_size: Option<u64>,
}

/// Run a `pool` subcommand.
pub fn run(command: PoolCommand, pool_path: &Path) -> Result<ExitCode> {
    match command {
        PoolCommand::Create(args) => create(args),
        PoolCommand::Info { json } => info(pool_path, json),
        PoolCommand::Grow { json } => grow(pool_path, json),
        PoolCommand::Set {
            compression,
            index,
            index_memory,
        } => set(pool_path, compression, index, index_memory),
    }
}

fn create(mut args: CreateArgs) -> Result<ExitCode> {
    args.path = crate::homes::pool_name(args.path)?;
    args.metadata_device = args
        .metadata_device
        .map(crate::homes::pool_name)
        .transpose()?;
    if !crate::homes::is_elsewhere(&args.path) && !args.path.exists() && args.size.is_none() {
        bail!(
            "{} does not exist; give --size to create it as a file (e.g. --size 16G)",
            args.path.display()
        );
    }
    if args.overcommit {
        eprintln!(
            "warning: --overcommit is deprecated and does nothing: every volume is thick \
             (reserves its size) or thin on its own now; make thin volumes and clones with \
             `volume create --thin`, `volume clone --thin`, or `volume set NAME --thin`"
        );
    }
    let options = CreateOptions {
        path: args.path.clone(),
        size_bytes: args.size,
        metadata_path: args.metadata_device.clone(),
        metadata_size_bytes: args.metadata_size,
        force: args.force,
        overcommit: false,
        index_memory_bytes: args.index_memory,
        index_mode: Some(args.index),
        compression: args.compression,
        no_discard: args.no_discard,
        max_size_bytes: args.max_size,
        page_slots: None,
    };
    let info = Pool::create(&options)
        .with_context(|| format!("could not create a pool on {}", args.path.display()))?;
    println!("{}", created_sentence(&info));
    if let Some(files) = owner_only_files(&args) {
        println!("{files} readable and writable by its owner only (mode 0600).");
    }
    Ok(ExitCode::SUCCESS)
}

/// The regular files `pool create` made its owner's only (the storage layer does, as it
/// formats them): "The pool file X (and metadata file Y) is", for its last line. A
/// block device keeps the mode udev gives it.
fn owner_only_files(args: &CreateArgs) -> Option<String> {
    let is_file = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.file_type().is_file());
    let meta = args.metadata_device.as_deref().filter(|p| is_file(p));
    match (is_file(&args.path), meta) {
        (true, Some(meta)) => Some(format!(
            "The pool file {} and metadata file {} are",
            args.path.display(),
            meta.display()
        )),
        (true, None) => Some(format!("The pool file {} is", args.path.display())),
        (false, Some(meta)) => Some(format!("The metadata file {} is", meta.display())),
        (false, None) => None,
    }
}

/// What `pool create` prints, like lvcreate's "can address" line.
pub fn created_sentence(info: &PoolInfo) -> String {
    let devices = match &info.metadata_path {
        None => format!(
            "{} device, can address {} of thick volumes; metadata {}",
            format_size(info.data_device_bytes),
            format_size(info.addressable_bytes),
            format_size(info.metadata_regions_bytes)
        ),
        Some(metadata_path) => format!(
            "{} data device, can address {} of thick volumes; metadata {} on {} ({} device)",
            format_size(info.data_device_bytes),
            format_size(info.addressable_bytes),
            format_size(info.metadata_regions_bytes),
            metadata_path,
            format_size(info.metadata_device_bytes)
        ),
    };
    format!(
        "Pool {} created: {devices}; dedup window {} (index {} of memory, {}); compression \
         {}; volumes are thick unless made with --thin, and {} is kept for trims and deletes.",
        info.path,
        format_size(info.dedup_window_bytes),
        format_size(info.index_memory_bytes),
        info.index_mode,
        info.compression,
        format_size(
            info.reserve_bytes
                .saturating_sub(info.metadata_headroom_bytes)
        )
    )
}

fn grow(pool_path: &Path, json: bool) -> Result<ExitCode> {
    let report = with_pool(pool_path, |pool| match pool.call(&Request::GrowPool)? {
        Answer::Grown(report) => Ok(report),
        other => bail!("unexpected answer to pool grow: {other:?}"),
    })?;
    if json {
        print_json(&report)?;
        return Ok(ExitCode::SUCCESS);
    }
    if report.data_bytes == report.old_data_bytes {
        println!(
            "Pool {} not grown: its data region ({}) already takes its device ({}).",
            pool_path.display(),
            format_size(report.data_bytes),
            format_size(report.device_bytes)
        );
    } else {
        println!(
            "Pool {} grown: data region {} -> {} (device {}).",
            pool_path.display(),
            format_size(report.old_data_bytes),
            format_size(report.data_bytes),
            format_size(report.device_bytes)
        );
    }
    if report.untaken_bytes > 0 {
        println!(
            "{} of the device is left untaken: the metadata page store has no room for \
             the pages of more data (`pool create --max-size` plans for growth).",
            format_size(report.untaken_bytes)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn set(
    pool_path: &Path,
    compression: Option<Compression>,
    index: Option<IndexMode>,
    index_memory: Option<u64>,
) -> Result<ExitCode> {
    let call = |request: Request| {
        with_pool(pool_path, |pool| match pool.call(&request)? {
            Answer::PoolInfo(info) => Ok(*info),
            other => bail!("unexpected answer to pool set: {other:?}"),
        })
    };
    if let Some(compression) = compression {
        let info = call(Request::SetCompression { compression })?;
        println!(
            "Pool {}: new blocks are compressed with {}; stored blocks keep their codec.",
            info.path, info.compression
        );
    }
    if index.is_some() || index_memory.is_some() {
        let info = call(Request::SetIndex {
            mode: index,
            memory_bytes: index_memory,
        })?;
        println!(
            "Pool {}: dedup index {}, from the next open (the index is built at open).",
            info.path,
            recorded_index(&info)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The index the super block records, as `pool set` and `pool info` say it: the mode,
/// its entries and the window they cover.
fn recorded_index(info: &PoolInfo) -> String {
    let (mode, entries) = info
        .index_recorded
        .unwrap_or((info.index_mode, info.index_entries));
    format!(
        "{mode}, {entries} entries (a window of {})",
        format_size((entries << mode.sample_shift()) * fewerbytes_engine::BLOCK_BYTES as u64)
    )
}

fn info(pool_path: &Path, json: bool) -> Result<ExitCode> {
    let info = inspect_pool(pool_path, |pool| match pool.call(&Request::PoolInfo)? {
        Answer::PoolInfo(info) => Ok(*info),
        other => bail!("unexpected answer to pool info: {other:?}"),
    })?;
    if json {
        print_json(&info)?;
    } else {
        print_info(&info);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_info(info: &PoolInfo) {
    let space = &info.space;
    let lines: Vec<(&str, String)> = vec![
        ("Pool", info.path.clone()),
        ("Pool id", info.id.clone()),
        ("Data device", format_size(info.data_device_bytes)),
        (
            "Metadata device",
            match &info.metadata_path {
                Some(path) => format!("{path} ({})", format_size(info.metadata_device_bytes)),
                None => "the data device".to_string(),
            },
        ),
        (
            "Size",
            format!(
                "{} (data region {}, metadata regions {})",
                format_size(space.size_bytes),
                format_size(space.data_bytes),
                format_size(info.metadata_regions_bytes)
            ),
        ),
        (
            "Used",
            format!(
                "{} (stored {}, metadata {}, reserved unused {}, kept free {})",
                format_size(space.used_bytes),
                format_size(space.stored_bytes),
                format_size(space.metadata_bytes),
                format_size(space.reserved_unused_bytes),
                format_size(space.kept_bytes)
            ),
        ),
        (
            "Available",
            format!(
                "{} (what a write no reservation covers can still take)",
                format_size(space.available_bytes)
            ),
        ),
        (
            "Reservable",
            format!(
                "{} (the largest new reservation: a new thick volume's size)",
                format_size(space.reservable_bytes)
            ),
        ),
        (
            "Reserved",
            format!(
                "{} ({} not yet used, held back from other volumes)",
                format_size(space.reserved_bytes),
                format_size(space.reserved_unused_bytes)
            ),
        ),
        (
            "Promised",
            format!(
                "{} (volume sizes added up)",
                format_size(space.promised_bytes)
            ),
        ),
        (
            "Kept for trims",
            format!(
                "{} (no reservation takes it, nor a thin write while volumes hold space \
                 back)",
                format_size(
                    info.reserve_bytes
                        .saturating_sub(info.metadata_headroom_bytes)
                )
            ),
        ),
        (
            "Kept for metadata",
            format!(
                "{} (free space the pages of reserved data and the next checkpoint may \
                 need past the page store; no reservation or thin write takes it), and \
                 {} that each slab keeps for a checkpoint's pages",
                format_size(space.metadata_kept_bytes),
                format_size(info.metadata_headroom_bytes)
            ),
        ),
        (
            "Slabs",
            format!(
                "{} x {} blocks ({} objects each)",
                info.slab_count, info.slab_blocks, info.objects_per_slab
            ),
        ),
        ("Journal", format_size(info.journal_bytes)),
        ("Compression", info.compression.to_string()),
        (
            "Dedup window",
            format!(
                "{} ({} index, {} entries, {} of memory){}",
                format_size(info.dedup_window_bytes),
                info.index_mode,
                info.index_entries,
                format_size(info.index_memory_bytes),
                match info.index_recorded {
                    Some(_) => format!(
                        "; the pool records {}, which an open without `serve \
                         --index-memory` builds",
                        recorded_index(info)
                    ),
                    None => String::new(),
                }
            ),
        ),
        ("Index", info.index.to_string()),
        ("Threads", info.threads.to_string()),
        (
            "Mode",
            match info.mode {
                Mode::Normal => "normal".to_string(),
                Mode::ReadOnly => "read-only (reopen to clear)".to_string(),
                Mode::OpenedReadOnly => {
                    "not served; opened read-only to show this (nothing written)".to_string()
                }
            },
        ),
        ("Format version", info.format_version.to_string()),
        (
            "Damaged ranges",
            crate::cmd_stats::damaged_summary(info.damaged_range_count),
        ),
        (
            "Damaged blocks",
            format!(
                "{} known (writing their good data back heals them), {} of them carried \
                 over from the last open",
                info.damaged_objects_known, info.damaged_objects_carried_over
            ),
        ),
        ("Scrub", crate::cmd_scrub::summary(&info.scrub)),
        (
            "Open by",
            match &info.open_marker {
                None => "nobody (closed cleanly)".to_string(),
                Some(m) if m.current => format!(
                    "held by host '{}' pid {} since {}",
                    m.host,
                    m.pid,
                    iso8601(m.since_unix)
                ),
                Some(m) => format!(
                    "last opened by host '{}' pid {} at {} (boot id {}) and not \
                     closed cleanly: it stopped without closing, or that host still has it open",
                    m.host,
                    m.pid,
                    iso8601(m.since_unix),
                    m.boot_id
                ),
            },
        ),
    ];
    let width = lines.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    for (key, value) in lines {
        println!("{:<width$} {value}", format!("{key}:"));
    }
}
