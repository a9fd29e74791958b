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
use fewerbytes_engine::{OpenOptions, Volume, BLOCK_BYTES};
use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

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
