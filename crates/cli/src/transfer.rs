//! `volume import` (and what `volume export`, in `export.rs`, shares with it): raw
//! images in and out of a volume.
//!
//! Both split the image into 1 MiB chunks taken in turn by a few threads, so hashing
//! and compression (done by the engine on the writer's thread and its workers) keep
//! more than one core busy. Import skips the chunks a sparse file holds as holes
//! (`SEEK_DATA`), writing zeros there only over a volume that held data. While a server
//! holds the pool, both are refused in favour of NBD.

use self::first_error::FirstError;
use anyhow::{anyhow, bail, Context, Result};
use fewerbytes_engine::{OpenOptions, Pool, Volume, BLOCK_BYTES};
use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::control::{with_local_pool, Answer, ControlClient, Request};
use crate::image_format;
use crate::output::Progress;
use crate::size::{format_size, round_up};

/// Threads moving chunks at once. Four keeps two cores busy while one thread waits
/// on a read or a journal commit; more only adds memory (one chunk buffer each).
pub(crate) const TRANSFER_THREADS: usize = 4;
/// Bytes per chunk: large enough that per-request overhead vanishes, small enough
/// that four buffers are nothing next to the engine's caches.
pub(crate) const CHUNK_BYTES: u64 = 1 << 20;
/// Volumes are addressed in 512-byte sectors; a partial last sector is zero-padded.
const SECTOR_BYTES: u64 = 512;

/// Which way bytes go, for the refusal sentence.
#[derive(Clone, Copy)]
pub(crate) enum Direction {
    Import,
    Export,
}

/// What `volume import` was asked to do with a volume that exists.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ImportMode {
    /// Into a new volume, or one that holds no data and is not marked incomplete.
    Fresh,
    /// Overwrite whatever the volume holds (`--force`).
    Overwrite,
    /// Continue a cut-short import (`--resume`): write only the chunks the volume
    /// does not hold yet.
    Resume,
}

/// Import `file` into volume `name`, creating the volume if it does not exist. The
/// volume is marked incomplete (durably) before the first write and unmarked after
/// the last flush, so an import stopped any way (a signal, an error, kill -9) leaves
/// it marked, and `serve` refuses it until `--resume` or `--force`.
pub fn import(pool_path: &Path, name: &str, file: &Path, mode: ImportMode) -> Result<()> {
    refuse_if_served(pool_path, name, file, Direction::Import)?;
    let source = File::open(file).with_context(|| format!("could not open {}", file.display()))?;
    let image_bytes =
        device_len(&source).with_context(|| format!("could not size {}", file.display()))?;
    if image_bytes == 0 {
        bail!("{} is empty: there is nothing to import", file.display());
    }
    refuse_image_format(&source, image_bytes, file, name)?;
    crate::interrupt::install_for_command()?;
    with_local_pool(pool_path, &OpenOptions::default(), |pool| {
        // An import is a batch job: it waits for the index the open rebuilds in the
        // background, so every block stored before the open is found.
        pool.wait_index_built();
        let volume_is_zero = prepare_volume(pool, name, file, image_bytes, mode)?;
        pool.set_volume_incomplete(name, true)
            .with_context(|| format!("could not mark volume '{name}' incomplete"))?;
        let source = ImportSource {
            file: &source,
            image_bytes,
            volume_is_zero,
            resume: mode == ImportMode::Resume,
        };
        let progress = Progress::new(image_bytes, &format!("import {name}"));
        let counts = ImportCounts::default();
        if let Err(e) = write_image(pool, name, &source, &progress, &counts) {
            progress.finish_quietly();
            return Err(e.context(format!(
                "the import of {} into volume '{name}' stopped with {} of {} done; the \
                 volume stays marked incomplete (serve refuses it): continue with \
                 `fewerbytes volume import {name} {} --resume`, or take it as it is with \
                 `fewerbytes volume import {name} --force`",
                file.display(),
                format_size(counts.done_bytes.load(Ordering::SeqCst)),
                format_size(image_bytes),
                file.display()
            )));
        }
        pool.flush()
            .context("could not flush the pool after the import")?;
        pool.set_volume_incomplete(name, false)
            .with_context(|| format!("could not mark volume '{name}' complete"))?;
        // The rate is over the bytes read: holes cost no reading.
        let read_bytes = counts.read_bytes.load(Ordering::SeqCst);
        let kept = match mode {
            ImportMode::Resume => format!(
                ", {} of it held already",
                format_size(counts.held_bytes.load(Ordering::SeqCst))
            ),
            _ => String::new(),
        };
        progress.finish(
            &format!(
                "Imported {} into volume '{name}' (a {} image, {} of it holes{kept})",
                file.display(),
                format_size(image_bytes),
                format_size(image_bytes - read_bytes.min(image_bytes))
            ),
            read_bytes,
        );
        Ok(())
    })
}

/// Refuse an image in a format qemu-img converts (imported raw, the volume would
/// hold the file, not its disk).
fn refuse_image_format(source: &File, image_bytes: u64, file: &Path, name: &str) -> Result<()> {
    if let Some(format) = image_format::detect(source, image_bytes)
        .with_context(|| format!("could not read {}", file.display()))?
    {
        bail!(
            "{} is {}, not a raw disk image: imported as raw, the volume would hold the {} \
             file's bytes rather than its disk. Convert it first (`qemu-img convert -f {} -O \
             raw {} disk.raw`, then import disk.raw), or serve the pool and write the \
             volume with `qemu-img convert -n -f {} -O raw {} nbd+unix:///{name}?socket=…`",
            file.display(),
            format.description(),
            format.qemu_name(),
            format.qemu_name(),
            file.display(),
            format.qemu_name(),
            file.display(),
        );
    }
    Ok(())
}

/// Create the volume, or check that the existing one may take the image in `mode`.
/// Returns whether it reads as zeros everywhere (so the image's holes need no writes).
fn prepare_volume(
    pool: &Arc<Pool>,
    name: &str,
    file: &Path,
    image_bytes: u64,
    mode: ImportMode,
) -> Result<bool> {
    let existing = pool.list_volumes().into_iter().find(|v| v.name == name);
    let Some(volume) = existing else {
        if mode == ImportMode::Resume {
            bail!("there is no volume '{name}': no cut-short import into it to resume");
        }
        let size_bytes = round_up(image_bytes, BLOCK_BYTES as u64);
        pool.create_volume(name, size_bytes)
            .with_context(|| format!("could not create volume '{name}' for the image"))?;
        println!("Volume '{name}' created: {}.", format_size(size_bytes));
        return Ok(true);
    };
    match mode {
        ImportMode::Resume if !volume.incomplete => bail!(
            "volume '{name}' is not marked incomplete: no cut-short import into it to \
             resume (pass --force instead of --resume to overwrite it)"
        ),
        ImportMode::Fresh if volume.incomplete => bail!(
            "volume '{name}' is marked incomplete: an import into it was cut short. \
             Continue it with `fewerbytes volume import {name} {} --resume`, overwrite it \
             with --force, or take it as it is with `fewerbytes volume import {name} --force`",
            file.display()
        ),
        ImportMode::Fresh if volume.logical_used_bytes > 0 => bail!(
            "volume '{name}' already holds {} of data, which the import would \
             overwrite; pass --force to overwrite it, or import into a new volume",
            format_size(volume.logical_used_bytes)
        ),
        _ => {}
    }
    if volume.size_bytes < image_bytes {
        bail!(
            "volume '{name}' ({} bytes) is smaller than {} ({} bytes); \
             resize it first with `fewerbytes volume resize {name} --size {}`",
            volume.size_bytes,
            file.display(),
            image_bytes,
            round_up(image_bytes, BLOCK_BYTES as u64)
        );
    }
    Ok(volume.logical_used_bytes == 0)
}

/// `volume import NAME --force` with no file: take a cut-short import's volume as
/// it is (what the import did not write reads as before it, zeros in a new volume).
pub fn take_as_is(pool_path: &Path, name: &str) -> Result<()> {
    if ControlClient::probe(pool_path)?.is_some() {
        bail!(
            "pool {} is being served: stop the server, then take volume '{name}' as it is \
             with `fewerbytes volume import {name} --force`",
            pool_path.display()
        );
    }
    with_local_pool(pool_path, &OpenOptions::default(), |pool| {
        if pool.volume_incomplete(name) != Some(true) {
            bail!(
                "volume '{name}' is not marked incomplete: `volume import {name} --force` \
                 without a FILE only takes a cut-short import as it is; name the image to \
                 import"
            );
        }
        pool.set_volume_incomplete(name, false)
            .with_context(|| format!("could not mark volume '{name}' complete"))?;
        println!(
            "Volume '{name}' taken as it is: no longer marked incomplete (what the \
             cut-short import did not write reads as it did before the import)."
        );
        Ok(())
    })
}

/// Figures the import workers share.
#[derive(Default)]
struct ImportCounts {
    /// Bytes of the image read (not holes).
    read_bytes: AtomicU64,
    /// Bytes of the image done (written, zeroed, skipped as holes or held).
    done_bytes: AtomicU64,
    /// Bytes a resume found the volume held already.
    held_bytes: AtomicU64,
}

/// Write the image with [`TRANSFER_THREADS`] workers; the first error stops them all.
fn write_image(
    pool: &Arc<Pool>,
    name: &str,
    source: &ImportSource,
    progress: &Progress,
    counts: &ImportCounts,
) -> Result<()> {
    // The handle counts as a user of the volume: it lives only while writing.
    let volume = pool.open_volume(name)?;
    let next_chunk = AtomicU64::new(0);
    let first_error = FirstError::default();
    std::thread::scope(|scope| {
        for _ in 0..TRANSFER_THREADS {
            scope.spawn(|| {
                let result =
                    import_chunks(source, &volume, &next_chunk, &first_error, progress, counts);
                first_error.record(result);
            });
        }
    });
    first_error.into_result()
}

/// The image an import reads.
struct ImportSource<'a> {
    file: &'a File,
    image_bytes: u64,
    /// The volume reads as zeros everywhere, so holes need no writes.
    volume_is_zero: bool,
    /// A resume: a chunk the volume holds already is not written again.
    resume: bool,
}

fn import_chunks(
    source: &ImportSource,
    volume: &Volume,
    next_chunk: &AtomicU64,
    first_error: &FirstError,
    progress: &Progress,
    counts: &ImportCounts,
) -> Result<()> {
    let mut buffer = vec![0u8; CHUNK_BYTES as usize];
    let mut held = if source.resume {
        vec![0u8; CHUNK_BYTES as usize]
    } else {
        Vec::new()
    };
    let image_bytes = source.image_bytes;
    while !first_error.is_set() {
        crate::interrupt::check()?;
        let offset = next_chunk.fetch_add(1, Ordering::SeqCst) * CHUNK_BYTES;
        if offset >= image_bytes {
            return Ok(());
        }
        let len = CHUNK_BYTES.min(image_bytes - offset);
        let padded = round_up(len, SECTOR_BYTES) as usize;
        let hole = is_hole(source.file, offset, len);
        let chunk = &mut buffer[..padded];
        if hole {
            chunk.fill(0);
        } else {
            source
                .file
                .read_exact_at(&mut chunk[..len as usize], offset)
                .with_context(|| format!("could not read the image at offset {offset}"))?;
            counts.read_bytes.fetch_add(len, Ordering::Relaxed);
            chunk[len as usize..].fill(0);
        }
        if source.resume && holds(volume, offset, &mut held[..padded], chunk)? {
            counts.held_bytes.fetch_add(len, Ordering::Relaxed);
        } else if hole {
            if !source.volume_is_zero {
                volume
                    .write_zeroes(offset, padded as u64, false)
                    .with_context(|| {
                        format!(
                            "could not zero volume '{}' at offset {offset}",
                            volume.name()
                        )
                    })?;
            }
        } else {
            volume.write(offset, chunk, false).with_context(|| {
                format!(
                    "could not write volume '{}' at offset {offset}",
                    volume.name()
                )
            })?;
        }
        counts.done_bytes.fetch_add(len, Ordering::Relaxed);
        progress.advance(len);
    }
    Ok(())
}

/// Whether the volume holds `chunk` at `offset` already (read into `held`).
fn holds(volume: &Volume, offset: u64, held: &mut [u8], chunk: &[u8]) -> Result<bool> {
    volume.read(offset, held).with_context(|| {
        format!(
            "could not read volume '{}' at offset {offset} to compare it with the image",
            volume.name()
        )
    })?;
    Ok(held == chunk)
}

/// Whether `len` bytes of `file` at `offset` are a hole, by `SEEK_DATA`: the next data
/// lies at or past their end. A file system or device that cannot say (EINVAL) has no
/// holes here, and the range is read.
fn is_hole(file: &File, offset: u64, len: u64) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(start) = libc::off_t::try_from(offset) else {
        return false;
    };
    // SAFETY: lseek on a descriptor this process owns; reads use pread, so moving the
    // file offset affects no other reader.
    let data = unsafe { libc::lseek(file.as_raw_fd(), start, libc::SEEK_DATA) };
    if data < 0 {
        // ENXIO: no data at or after `offset`.
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO);
    }
    u64::try_from(data).is_ok_and(|data| data >= offset + len)
}

/// Bytes in a file or block device (a block device's metadata length is 0).
pub(crate) fn device_len(file: &File) -> Result<u64> {
    let metadata = file.metadata()?;
    if metadata.file_type().is_file() {
        return Ok(metadata.len());
    }
    let mut handle = file.try_clone()?;
    Ok(handle.seek(SeekFrom::End(0))?)
}

pub(crate) fn refuse_if_served(
    pool_path: &Path,
    name: &str,
    file: &Path,
    direction: Direction,
) -> Result<()> {
    let Some(client) = ControlClient::probe(pool_path)? else {
        return Ok(());
    };
    let uri = match client.call(&Request::Endpoints) {
        Ok(Answer::Endpoints(endpoints)) => endpoints.uri(name),
        _ => None,
    }
    .unwrap_or_else(|| format!("nbd://127.0.0.1:10809/{name}"));
    let (verb, command) = match direction {
        Direction::Import => (
            "import into",
            format!(
                "create the volume, then `qemu-img convert -n -f raw -O raw {} '{uri}'`",
                file.display()
            ),
        ),
        Direction::Export => (
            "export from",
            format!(
                "`qemu-img convert -f raw -O raw '{uri}' {}`",
                file.display()
            ),
        ),
    };
    Err(anyhow!(
        "pool {} is being served (control socket {}), so this command cannot {verb} it; \
         use NBD instead: {command}",
        pool_path.display(),
        client.path().display()
    ))
}

/// The first error any worker hit; the others stop at their next chunk.
pub(crate) mod first_error {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    /// Shared between transfer workers.
    #[derive(Default)]
    pub struct FirstError {
        set: AtomicBool,
        error: Mutex<Option<anyhow::Error>>,
    }

    impl FirstError {
        /// Whether some worker failed.
        pub fn is_set(&self) -> bool {
            self.set.load(Ordering::SeqCst)
        }

        /// Keep `result`'s error if it is the first.
        pub fn record(&self, result: anyhow::Result<()>) {
            if let Err(e) = result {
                let mut slot = self
                    .error
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                if slot.is_none() {
                    *slot = Some(e);
                }
                self.set.store(true, Ordering::SeqCst);
            }
        }

        /// The first error, if any.
        pub fn into_result(self) -> anyhow::Result<()> {
            match self
                .error
                .into_inner()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
            {
                Some(e) => Err(e),
                None => Ok(()),
            }
        }
    }
}
