//! `volume import` and `volume export`: raw images in and out of a volume.
//!
//! Both split the image into 1 MiB chunks taken in turn by a few threads, so hashing
//! and compression (done by the engine on the writer's thread and its workers) keep
//! more than one core busy. Import skips the chunks a sparse file holds as holes
//! (`SEEK_DATA`), writing zeros there only over a volume that held data. Export to a file is sparse: ranges the volume holds as
//! holes (`Volume::extents`) are skipped, and the file is sized to the volume at the
//! end. Export to an output that cannot seek (a pipe, a terminal, `-` for stdout) is
//! written in order, holes as zeros, by one thread. While a server holds the pool,
//! both are refused in favour of NBD.

use self::first_error::FirstError;
use anyhow::{anyhow, bail, Context, Result};
use fewerbytes_engine::{OpenOptions, Volume, BLOCK_BYTES};
use std::fs::{File, OpenOptions as FileOpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::control::{with_local_pool, with_local_pool_read_only, Answer, ControlClient, Request};
use crate::image_format;
use crate::output::Progress;
use crate::size::{format_size, round_up};

/// Threads moving chunks at once. Four keeps two cores busy while one thread waits
/// on a read or a journal commit; more only adds memory (one chunk buffer each).
const TRANSFER_THREADS: usize = 4;
/// Bytes per chunk: large enough that per-request overhead vanishes, small enough
/// that four buffers are nothing next to the engine's caches.
const CHUNK_BYTES: u64 = 1 << 20;
/// Volumes are addressed in 512-byte sectors; a partial last sector is zero-padded.
const SECTOR_BYTES: u64 = 512;

/// Which way bytes go, for the refusal sentence.
#[derive(Clone, Copy)]
enum Direction {
    Import,
    Export,
}

/// Import `file` into volume `name`, creating the volume if it does not exist. A
/// volume that holds data is overwritten only with `force`.
pub fn import(pool_path: &Path, name: &str, file: &Path, force: bool) -> Result<()> {
    refuse_if_served(pool_path, name, file, Direction::Import)?;
    let source = File::open(file).with_context(|| format!("could not open {}", file.display()))?;
    let image_bytes =
        device_len(&source).with_context(|| format!("could not size {}", file.display()))?;
    if image_bytes == 0 {
        bail!("{} is empty: there is nothing to import", file.display());
    }
    if let Some(format) = image_format::detect(&source, image_bytes)
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
    with_local_pool(pool_path, &OpenOptions::default(), |pool| {
        // An import is a batch job: it waits for the index the open rebuilds in the
        // background, so every block stored before the open is found.
        pool.wait_index_built();
        // A volume that maps nothing reads as zeros everywhere: the image's holes need
        // no writes. Otherwise (--force) they are written as zeros.
        let mut fresh = true;
        match pool.list_volumes().into_iter().find(|v| v.name == name) {
            Some(volume) if volume.logical_used_bytes > 0 && !force => bail!(
                "volume '{name}' already holds {} of data, which the import would \
                 overwrite; pass --force to overwrite it, or import into a new volume",
                format_size(volume.logical_used_bytes)
            ),
            None => {
                let size_bytes = round_up(image_bytes, BLOCK_BYTES as u64);
                pool.create_volume(name, size_bytes)
                    .with_context(|| format!("could not create volume '{name}' for the image"))?;
                println!("Volume '{name}' created: {}.", format_size(size_bytes));
            }
            Some(volume) if volume.size_bytes < image_bytes => bail!(
                "volume '{name}' ({} bytes) is smaller than {} ({} bytes); \
                 resize it first with `fewerbytes volume resize {name} --size {}`",
                volume.size_bytes,
                file.display(),
                image_bytes,
                round_up(image_bytes, BLOCK_BYTES as u64)
            ),
            Some(volume) => fresh = volume.logical_used_bytes == 0,
        }
        let progress = Progress::new(image_bytes, &format!("import {name}"));
        let read_bytes = AtomicU64::new(0);
        {
            // The handle counts as a user of the volume: it lives only while writing.
            let volume = pool.open_volume(name)?;
            let next_chunk = AtomicU64::new(0);
            let first_error = FirstError::default();
            std::thread::scope(|scope| {
                for _ in 0..TRANSFER_THREADS {
                    scope.spawn(|| {
                        let result = import_chunks(
                            &ImportSource {
                                file: &source,
                                image_bytes,
                                volume_is_zero: fresh,
                            },
                            &volume,
                            &next_chunk,
                            &first_error,
                            &progress,
                            &read_bytes,
                        );
                        first_error.record(result);
                    });
                }
            });
            first_error.into_result()?;
        }
        pool.flush()
            .context("could not flush the pool after the import")?;
        // The rate is over the bytes read: holes cost no reading.
        let read_bytes = read_bytes.load(Ordering::SeqCst);
        progress.finish(
            &format!(
                "Imported {} into volume '{name}' (a {} image, {} of it holes)",
                file.display(),
                format_size(image_bytes),
                format_size(image_bytes - read_bytes.min(image_bytes))
            ),
            read_bytes,
        );
        Ok(())
    })
}

/// The image an import reads.
struct ImportSource<'a> {
    file: &'a File,
    image_bytes: u64,
    /// The volume reads as zeros everywhere, so holes need no writes.
    volume_is_zero: bool,
}

fn import_chunks(
    source: &ImportSource,
    volume: &Volume,
    next_chunk: &AtomicU64,
    first_error: &FirstError,
    progress: &Progress,
    read_bytes: &AtomicU64,
) -> Result<()> {
    let mut buffer = vec![0u8; CHUNK_BYTES as usize];
    let image_bytes = source.image_bytes;
    while !first_error.is_set() {
        let offset = next_chunk.fetch_add(1, Ordering::SeqCst) * CHUNK_BYTES;
        if offset >= image_bytes {
            return Ok(());
        }
        let len = CHUNK_BYTES.min(image_bytes - offset);
        if is_hole(source.file, offset, len) {
            if !source.volume_is_zero {
                volume
                    .write_zeroes(offset, round_up(len, SECTOR_BYTES), false)
                    .with_context(|| {
                        format!(
                            "could not zero volume '{}' at offset {offset}",
                            volume.name()
                        )
                    })?;
            }
            progress.advance(len);
            continue;
        }
        let padded = round_up(len, SECTOR_BYTES) as usize;
        let chunk = &mut buffer[..padded];
        source
            .file
            .read_exact_at(&mut chunk[..len as usize], offset)
            .with_context(|| format!("could not read the image at offset {offset}"))?;
        read_bytes.fetch_add(len, Ordering::Relaxed);
        chunk[len as usize..].fill(0);
        volume.write(offset, chunk, false).with_context(|| {
            format!(
                "could not write volume '{}' at offset {offset}",
                volume.name()
            )
        })?;
        progress.advance(len);
    }
    Ok(())
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

/// Export volume `name` to `file` (`-` is stdout). A regular file that holds bytes
/// is replaced only with `force`.
pub fn export(pool_path: &Path, name: &str, file: &Path, force: bool) -> Result<()> {
    let file = if file == Path::new("-") {
        Path::new("/dev/stdout")
    } else {
        file
    };
    refuse_if_served(pool_path, name, file, Direction::Export)?;
    if let Ok(existing) = std::fs::metadata(file) {
        // An empty file (from mktemp, say) and stdout redirected to a file are targets
        // the user made for this export.
        if existing.is_file() && existing.len() > 0 && !is_stdout(&existing) && !force {
            bail!(
                "{} exists ({}); pass --force to replace it with volume '{name}'",
                file.display(),
                format_size(existing.len())
            );
        }
    }
    with_local_pool_read_only(pool_path, &OpenOptions::default(), |pool| {
        let volume = pool.open_volume(name)?;
        let volume_bytes = volume.size_bytes();
        let target = FileOpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(file)
            .with_context(|| format!("could not open {} for writing", file.display()))?;
        let metadata = target.metadata()?;
        let kind = if metadata.file_type().is_file() {
            Target::Sparse
        } else if metadata.file_type().is_block_device() {
            Target::Device
        } else {
            Target::Stream
        };
        // The summary must not land in the image when the image is stdout.
        let to_stdout = is_stdout(&metadata);
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
            export_stream(&volume, &target, volume_bytes, &progress, &stored)?;
        } else {
            let next_chunk = AtomicU64::new(0);
            let first_error = FirstError::default();
            std::thread::scope(|scope| {
                for _ in 0..TRANSFER_THREADS {
                    scope.spawn(|| {
                        let result = export_chunks(
                            &volume,
                            &target,
                            volume_bytes,
                            kind == Target::Sparse,
                            &next_chunk,
                            &first_error,
                            &progress,
                            &stored,
                        );
                        first_error.record(result);
                    });
                }
            });
            first_error.into_result()?;
            if kind == Target::Sparse {
                target
                    .set_len(volume_bytes)
                    .with_context(|| format!("could not size {} to the volume", file.display()))?;
            }
            target
                .sync_all()
                .with_context(|| format!("could not sync {}", file.display()))?;
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
        Ok(())
    })
}

/// Whether `metadata` is of the file this process's stdout writes to.
fn is_stdout(metadata: &std::fs::Metadata) -> bool {
    std::fs::metadata("/dev/stdout")
        .is_ok_and(|out| out.dev() == metadata.dev() && out.ino() == metadata.ino())
}

/// Write the whole volume to `target` in order (it cannot seek): data as read,
/// holes as zeros.
fn export_stream(
    volume: &Volume,
    target: &File,
    volume_bytes: u64,
    progress: &Progress,
    stored: &AtomicU64,
) -> Result<()> {
    let mut buffer = vec![0u8; CHUNK_BYTES as usize];
    let mut out = target;
    let mut offset = 0u64;
    while offset < volume_bytes {
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
        volume.read(offset, chunk).with_context(|| {
            format!(
                "could not read volume '{}' at offset {offset}",
                volume.name()
            )
        })?;
        out.write_all(chunk)
            .with_context(|| format!("could not write the image at offset {offset}"))?;
        stored.fetch_add(data_bytes.min(len), Ordering::SeqCst);
        progress.advance(len);
        offset += len;
    }
    out.flush().context("could not flush the image")?;
    Ok(())
}

#[expect(
    clippy::too_many_arguments,
    reason = "one worker's shared state, passed by reference"
)]
fn export_chunks(
    volume: &Volume,
    target: &File,
    volume_bytes: u64,
    sparse: bool,
    next_chunk: &AtomicU64,
    first_error: &FirstError,
    progress: &Progress,
    stored: &AtomicU64,
) -> Result<()> {
    let mut buffer = vec![0u8; CHUNK_BYTES as usize];
    while !first_error.is_set() {
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
            if extent.data {
                copy_range(volume, target, offset, len, &mut buffer, chunk_offset)?;
                stored.fetch_add(len, Ordering::SeqCst);
            } else if !sparse {
                let zeros = &mut buffer[..len as usize];
                zeros.fill(0);
                target.write_all_at(zeros, offset)?;
            }
            offset += len;
            if offset >= chunk_end {
                break;
            }
        }
        if offset < chunk_end {
            // The extents fell short of the range asked for: copy the rest as data
            // rather than guess it is a hole.
            copy_range(
                volume,
                target,
                offset,
                chunk_end - offset,
                &mut buffer,
                chunk_offset,
            )?;
        }
        progress.advance(chunk_len);
    }
    Ok(())
}

/// Copy `[offset, offset + len)` of the volume to the same place in `target`, through
/// `buffer` (one chunk, which the range lies within, starting at `chunk_offset`).
fn copy_range(
    volume: &Volume,
    target: &File,
    offset: u64,
    len: u64,
    buffer: &mut [u8],
    chunk_offset: u64,
) -> Result<()> {
    let start = (offset - chunk_offset) as usize;
    let slice = &mut buffer[start..start + len as usize];
    volume.read(offset, slice).with_context(|| {
        format!(
            "could not read volume '{}' at offset {offset}",
            volume.name()
        )
    })?;
    target
        .write_all_at(slice, offset)
        .with_context(|| format!("could not write the image at offset {offset}"))?;
    Ok(())
}

/// Bytes in a file or block device (a block device's metadata length is 0).
fn device_len(file: &File) -> Result<u64> {
    let metadata = file.metadata()?;
    if metadata.file_type().is_file() {
        return Ok(metadata.len());
    }
    let mut handle = file.try_clone()?;
    Ok(handle.seek(SeekFrom::End(0))?)
}

fn refuse_if_served(pool_path: &Path, name: &str, file: &Path, direction: Direction) -> Result<()> {
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
mod first_error {
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
