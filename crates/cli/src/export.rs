//! `volume export`: a volume out as a raw image.
//!
//! The image is split into 1 MiB chunks taken in turn by a few threads. Export to a
//! file is sparse: ranges the volume holds as holes (`Volume::extents`) are skipped,
//! and the file is sized to the volume at the end. Export to an output that cannot
//! seek (a pipe, a terminal, `-` for stdout) is written in order, holes as zeros, by
//! one thread. While a server holds the pool, export is refused in favour of NBD.
//!
//! Damaged blocks (a read the engine answers with damage, `fewerbytes_engine::
//! read_damage`) never leave a partial image behind. A file is written to a new file
//! beside it and renamed over it only when the whole volume was read; a block device
//! or a stream, which cannot be put back, is written only after a first pass has read
//! every stored block of the volume. Damage found refuses the export, naming each
//! damaged block (`volume 'vm1' bytes 409600..413695 (pool block 10340)`), unless
//! `--skip-damaged`: then zeros stand in for each damaged block, each is named on
//! stderr at the end, and the exit status is [`DAMAGE_FOUND`] all the same.

use anyhow::{bail, Context, Result};
use fewerbytes_engine::{read_damage, volume_range, DamagedAt, OpenOptions, Volume, BLOCK_BYTES};
use std::fs::{File, OpenOptions as FileOpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::control::with_local_pool_read_only;
use crate::output::Progress;
use crate::size::format_size;
use crate::transfer::first_error::FirstError;
use crate::transfer::{device_len, refuse_if_served, Direction, CHUNK_BYTES, TRANSFER_THREADS};

/// The exit status of an export that found damaged blocks: refused (nothing written),
/// or, with `--skip-damaged`, done with zeros in their place (the stderr says which).
/// The same as `check`'s "damage left".
pub const DAMAGE_FOUND: u8 = crate::exit_codes::DAMAGE_LEFT;

const BLOCK: u64 = BLOCK_BYTES as u64;

/// What an export writes to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    /// A regular file: holes skipped, sized at the end.
    Sparse,
    /// A block device: holes written as zeros, in place.
    Device,
    /// A pipe, terminal or other output that cannot seek: every byte, in order.
    Stream,
}

/// The damaged blocks an export met: volume byte offset and where the block is stored.
#[derive(Default)]
struct Damage(Mutex<Vec<(u64, DamagedAt)>>);

impl Damage {
    fn record(&self, offset: u64, at: DamagedAt) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((offset, at));
    }

    /// The first damaged block, for the example of what clears it.
    fn first<'a>(&self, volume: &'a str) -> Option<(&'a str, u64, u64)> {
        let found = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let offset = found.iter().map(|(offset, _)| *offset).min()?;
        Some((volume, offset, BLOCK))
    }

    /// Each damaged block, by volume offset, named as every report of damage names it.
    fn lines(&self, volume: &str) -> Vec<String> {
        let mut found = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        found.sort_by_key(|(offset, _)| *offset);
        found.dedup_by_key(|(offset, _)| *offset);
        found
            .into_iter()
            .map(|(offset, at)| volume_range(volume, offset, BLOCK, at))
            .collect()
    }
}

/// What clears damaged blocks, for every message that names them (export, check,
/// scrub): the real command for `example` (volume, offset, length), else with
/// placeholders. Writing the good data back heals the stored block itself (every
/// volume naming it reads good, `engine/src/heal.rs`), once the server has found it
/// damaged; trimming or other data only drops this volume's reference.
pub fn how_to_clear(example: Option<(&str, u64, u64)>) -> String {
    let (volume, offset, len) = match example {
        Some((volume, offset, len)) => (volume.to_string(), offset.to_string(), len.to_string()),
        None => ("VOLUME".into(), "OFFSET".into(), "LENGTH".into()),
    };
    let uri = format!("'nbd+unix:///{volume}?socket=SOCKET'");
    format!(
        "writing the good data back over NBD heals a damaged block in every volume that \
         maps it, once the server has found it damaged (a read of it, or `fewerbytes scrub` \
         since the server started): while `fewerbytes serve` serves the pool, `qemu-io -f \
         raw -c 'write -s GOOD {offset} {len}' {uri}` (GOOD: a file of those bytes' good \
         data), or `nbdcopy` of a whole good image to {uri}; with no good copy, trimming \
         the range (`qemu-io -f raw -c 'discard {offset} {len}' {uri}`) or writing other \
         data clears it in that volume only (its data there is lost; other volumes that \
         map the block still read an error)"
    )
}

/// Export volume `name` to `file` (`-` is stdout). A regular file that holds bytes
/// is replaced only with `force`; damaged blocks are zeros only with `skip_damaged`.
pub fn export(
    pool_path: &Path,
    name: &str,
    file: &Path,
    force: bool,
    skip_damaged: bool,
) -> Result<ExitCode> {
    let file = if file == Path::new("-") {
        Path::new("/dev/stdout")
    } else {
        file
    };
    refuse_if_served(pool_path, name, file, Direction::Export)?;
    let existing = std::fs::metadata(file).ok();
    // The summary must not land in the image when the image is stdout.
    let to_stdout = existing.as_ref().is_some_and(is_stdout);
    if let Some(existing) = &existing {
        // An empty file (from mktemp, say) and stdout redirected to a file are targets
        // the user made for this export.
        if existing.is_file() && existing.len() > 0 && !to_stdout && !force {
            bail!(
                "{} exists ({}); pass --force to replace it with volume '{name}'",
                file.display(),
                format_size(existing.len())
            );
        }
    }
    let kind = match &existing {
        None => Target::Sparse,
        Some(m) if m.file_type().is_file() => Target::Sparse,
        Some(m) if m.file_type().is_block_device() => Target::Device,
        Some(_) => Target::Stream,
    };
    // A file is written beside itself and renamed over; stdout redirected to a file
    // is already open in the shell, so it is written in place, as a device is.
    let staged = kind == Target::Sparse && !to_stdout;
    // Through a symbolic link, the file it names is the one replaced.
    let real;
    let file = match std::fs::canonicalize(file) {
        Ok(path) if staged => {
            real = path;
            real.as_path()
        }
        _ => file,
    };
    crate::interrupt::install_for_command()?;
    let exported = with_local_pool_read_only(pool_path, &OpenOptions::default(), |pool| {
        let volume = pool.open_volume(name)?;
        let volume_bytes = volume.size_bytes();
        let damage = Damage::default();
        if !staged && !skip_damaged {
            // Nothing written can be taken back: read every stored block first.
            let progress = Progress::new(volume_bytes, &format!("verify {name}"));
            copy_chunks(&volume, None, volume_bytes, &progress, &damage)?;
            progress.finish_on_stderr(&format!("Verified volume '{name}'"), volume_bytes);
            let lines = damage.lines(name);
            if !lines.is_empty() {
                return Ok(refuse(name, file, &lines, &damage));
            }
        }
        let mut staging = None;
        let target = if staged {
            let (path, target) = crate::access::create_staging(file)?;
            staging = Some(Staging(Some(path)));
            target
        } else {
            FileOpenOptions::new()
                .write(true)
                .open(file)
                .with_context(|| format!("could not open {} for writing", file.display()))?
        };
        match kind {
            // A regular file can have holes: empty it, write only data, size it at the end.
            Target::Sparse => target
                .set_len(0)
                .with_context(|| format!("could not truncate {}", file.display()))?,
            // A block device cannot: its holes are written as zeros.
            Target::Device => {
                let device_bytes = device_len(&target)?;
                if device_bytes < volume_bytes {
                    bail!(
                        "{} ({device_bytes} bytes) is smaller than volume '{name}' ({volume_bytes} bytes)",
                        file.display()
                    );
                }
            }
            Target::Stream => {}
        }
        let progress = Progress::new(volume_bytes, &format!("export {name}"));
        let stored = AtomicU64::new(0);
        if kind == Target::Stream {
            export_stream(&volume, &target, volume_bytes, &progress, &stored, &damage)?;
        } else {
            let sink = Sink {
                file: &target,
                sparse: kind == Target::Sparse,
                stored: &stored,
            };
            copy_chunks(&volume, Some(&sink), volume_bytes, &progress, &damage)?;
            if kind == Target::Sparse {
                target
                    .set_len(volume_bytes)
                    .with_context(|| format!("could not size {} to the volume", file.display()))?;
            }
            target
                .sync_all()
                .with_context(|| format!("could not sync {}", file.display()))?;
        }
        let lines = damage.lines(name);
        if !lines.is_empty() && !skip_damaged {
            // Only a staged file gets here (the rest were verified first): it goes.
            drop(staging);
            return Ok(refuse(name, file, &lines, &damage));
        }
        if let Some(mut staging) = staging {
            staging.replace(file, existing.as_ref())?;
        }
        let stored_bytes = stored.load(Ordering::SeqCst);
        let summary = format!(
            "Exported volume '{name}' ({}) to {} ({} of data, the rest {})",
            format_size(volume_bytes),
            file.display(),
            format_size(stored_bytes),
            if kind == Target::Sparse {
                "holes"
            } else {
                "zeros"
            }
        );
        // The rate is over the bytes written: a sparse file's holes cost no writing.
        let written_bytes = if kind == Target::Sparse {
            stored_bytes
        } else {
            volume_bytes
        };
        if to_stdout {
            progress.finish_on_stderr(&summary, written_bytes);
        } else {
            progress.finish(&summary, written_bytes);
        }
        if lines.is_empty() {
            return Ok(ExitCode::SUCCESS);
        }
        eprintln!(
            "fewerbytes: warning: volume '{name}' has {} damaged block(s), written to {} as \
             zeros:",
            lines.len(),
            file.display()
        );
        for line in &lines {
            eprintln!("  {line}");
        }
        eprintln!("{}", how_to_clear(damage.first(name)));
        Ok(ExitCode::from(DAMAGE_FOUND))
    });
    crate::interrupt::explain(exported, || match (staged, &existing) {
        (true, None) => format!(
            "the export of volume '{name}' stopped; {} was not made (its partial copy \
             was removed)",
            file.display()
        ),
        (true, Some(_)) => format!(
            "the export of volume '{name}' stopped; {} is as it was before (the partial \
             copy was removed)",
            file.display()
        ),
        (false, _) => format!(
            "the export of volume '{name}' stopped; {} holds part of the volume at most",
            file.display()
        ),
    })
}

/// Say why an export with damaged blocks wrote nothing; its exit status.
fn refuse(name: &str, file: &Path, lines: &[String], damage: &Damage) -> ExitCode {
    eprintln!(
        "fewerbytes: error: volume '{name}' has {} damaged block(s) (stored data that \
         fails its fingerprint); nothing was written to {}:",
        lines.len(),
        file.display()
    );
    for line in lines {
        eprintln!("  {line}");
    }
    eprintln!(
        "`fewerbytes volume export --skip-damaged` writes zeros in their place; {}",
        how_to_clear(damage.first(name))
    );
    ExitCode::from(DAMAGE_FOUND)
}

/// The new file an export writes beside its destination; removed unless it replaced it.
struct Staging(Option<PathBuf>);

impl Staging {
    /// Rename the staged file over `file`, with the mode `file` had (else the mode a new
    /// file gets under the umask), and sync the directory.
    fn replace(&mut self, file: &Path, existing: Option<&std::fs::Metadata>) -> Result<()> {
        let Some(path) = self.0.as_ref() else {
            bail!(
                "broken invariant: the staged export of {} is gone",
                file.display()
            );
        };
        let mode = match existing {
            Some(meta) => meta.mode() & 0o7777,
            None => 0o666 & !current_umask(),
        };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("could not set the mode of {}", path.display()))?;
        std::fs::rename(path, file).with_context(|| {
            format!("could not rename {} to {}", path.display(), file.display())
        })?;
        self.0 = None;
        let dir = match file.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("could not sync {}", dir.display()))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The process's umask (set back at once).
fn current_umask() -> u32 {
    // SAFETY: umask has no preconditions; it is set back to what it was.
    unsafe {
        let mask = libc::umask(0o022);
        libc::umask(mask);
        mask as u32
    }
}

/// Whether `metadata` is of the file this process's stdout writes to.
fn is_stdout(metadata: &std::fs::Metadata) -> bool {
    std::fs::metadata("/dev/stdout")
        .is_ok_and(|out| out.dev() == metadata.dev() && out.ino() == metadata.ino())
}

/// Read `buf.len()` bytes of the volume at `offset` (whole blocks). A block whose read
/// says it is damaged reads as zeros and is recorded in `damage`; any other error is
/// returned.
fn read_or_zero(volume: &Volume, offset: u64, buf: &mut [u8], damage: &Damage) -> Result<()> {
    let failed = match volume.read(offset, buf) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    if read_damage(&failed).is_none() {
        return Err(failed).with_context(|| {
            format!(
                "could not read volume '{}' at offset {offset}",
                volume.name()
            )
        });
    }
    // Which blocks: each read alone.
    for (n, block) in buf.chunks_mut(BLOCK_BYTES).enumerate() {
        let at = offset + n as u64 * BLOCK;
        if let Err(e) = volume.read(at, block) {
            let Some(damaged) = read_damage(&e) else {
                return Err(e).with_context(|| {
                    format!(
                        "could not read {}",
                        volume_range(&volume.name(), at, BLOCK, DamagedAt::Unknown)
                    )
                });
            };
            block.fill(0);
            damage.record(at, damaged);
        }
    }
    Ok(())
}

/// Write the whole volume to `target` in order (it cannot seek): data as read,
/// holes as zeros.
fn export_stream(
    volume: &Volume,
    target: &File,
    volume_bytes: u64,
    progress: &Progress,
    stored: &AtomicU64,
    damage: &Damage,
) -> Result<()> {
    let mut buffer = vec![0u8; CHUNK_BYTES as usize];
    let mut out = target;
    let mut offset = 0u64;
    while offset < volume_bytes {
        crate::interrupt::check()?;
        let len = CHUNK_BYTES.min(volume_bytes - offset);
        let chunk = &mut buffer[..len as usize];
        let data_bytes: u64 = volume
            .extents(offset, len)
            .with_context(|| {
                format!(
                    "could not map volume '{}' at offset {offset}",
                    volume.name()
                )
            })?
            .iter()
            .filter(|e| e.data)
            .map(|e| e.len_bytes)
            .sum();
        read_or_zero(volume, offset, chunk, damage)?;
        out.write_all(chunk)
            .with_context(|| format!("could not write the image at offset {offset}"))?;
        stored.fetch_add(data_bytes.min(len), Ordering::SeqCst);
        progress.advance(len);
        offset += len;
    }
    out.flush().context("could not flush the image")?;
    Ok(())
}

/// Where chunks go: a file that can seek.
struct Sink<'a> {
    file: &'a File,
    /// Holes are skipped (a regular file), not written as zeros (a device).
    sparse: bool,
    /// Bytes of data written.
    stored: &'a AtomicU64,
}

/// Read every chunk of the volume with a few threads, writing each to `sink` at its
/// place (none: only read, to find damage).
fn copy_chunks(
    volume: &Volume,
    sink: Option<&Sink>,
    volume_bytes: u64,
    progress: &Progress,
    damage: &Damage,
) -> Result<()> {
    let next_chunk = AtomicU64::new(0);
    let first_error = FirstError::default();
    std::thread::scope(|scope| {
        for _ in 0..TRANSFER_THREADS {
            scope.spawn(|| {
                let result = copy_chunks_worker(
                    volume,
                    sink,
                    volume_bytes,
                    &next_chunk,
                    &first_error,
                    progress,
                    damage,
                );
                first_error.record(result);
            });
        }
    });
    first_error.into_result()
}

fn copy_chunks_worker(
    volume: &Volume,
    sink: Option<&Sink>,
    volume_bytes: u64,
    next_chunk: &AtomicU64,
    first_error: &FirstError,
    progress: &Progress,
    damage: &Damage,
) -> Result<()> {
    let mut buffer = vec![0u8; CHUNK_BYTES as usize];
    while !first_error.is_set() {
        crate::interrupt::check()?;
        let chunk_offset = next_chunk.fetch_add(1, Ordering::SeqCst) * CHUNK_BYTES;
        if chunk_offset >= volume_bytes {
            return Ok(());
        }
        let chunk_len = CHUNK_BYTES.min(volume_bytes - chunk_offset);
        let extents = volume.extents(chunk_offset, chunk_len).with_context(|| {
            format!(
                "could not map volume '{}' at offset {chunk_offset}",
                volume.name()
            )
        })?;
        let mut offset = chunk_offset;
        let chunk_end = chunk_offset + chunk_len;
        for extent in extents {
            let len = extent.len_bytes.min(chunk_end - offset);
            let start = (offset - chunk_offset) as usize;
            let slice = &mut buffer[start..start + len as usize];
            if extent.data {
                copy_range(volume, sink, offset, slice, damage)?;
            } else if let Some(sink) = sink.filter(|s| !s.sparse) {
                slice.fill(0);
                sink.file.write_all_at(slice, offset)?;
            }
            offset += len;
            if offset >= chunk_end {
                break;
            }
        }
        if offset < chunk_end {
            // The extents fell short of the range asked for: copy the rest as data
            // rather than guess it is a hole.
            let start = (offset - chunk_offset) as usize;
            let slice = &mut buffer[start..chunk_len as usize];
            copy_range(volume, sink, offset, slice, damage)?;
        }
        progress.advance(chunk_len);
    }
    Ok(())
}

/// Copy `buf.len()` bytes of the volume at `offset` to the same place in `sink`.
fn copy_range(
    volume: &Volume,
    sink: Option<&Sink>,
    offset: u64,
    buf: &mut [u8],
    damage: &Damage,
) -> Result<()> {
    read_or_zero(volume, offset, buf, damage)?;
    if let Some(sink) = sink {
        sink.file
            .write_all_at(buf, offset)
            .with_context(|| format!("could not write the image at offset {offset}"))?;
        sink.stored.fetch_add(buf.len() as u64, Ordering::SeqCst);
    }
    Ok(())
}
