//! The dedup index saved at a clean close and loaded at the next open, so a restart
//! does not rebuild it (`index_build.rs` walks every stored object: seconds per
//! 10 GiB stored, and the writes meanwhile get partial advice).
//!
//! The saved table is a file outside the pool ([`SavedIndex`]): by default beside
//! the pool's file (`<pool>.index`), or for a pool on a block device in the state
//! directory under the pool's nonce. It holds the table exactly as it was after
//! the close's final checkpoint, and names the pool (its nonce) and that
//! checkpoint's generation. An open loads it only when all of these hold, and
//! otherwise rebuilds the index as it would without one, saying why:
//! - the nonce and the generation of the super block the open read are the file's,
//!   and the journal held nothing to replay (the pool was closed, not killed);
//! - the table's shape (buckets, objects, group and sample bits; the open's
//!   `--index-memory`) is the open's;
//! - the header, each shard and the end marker are whole and their crc32c hold.
//!
//! The file is removed once loaded, and written anew by the next clean close: the
//! open's own checkpoint moves the generation on, so it could never match again,
//! and a process killed later leaves no file behind to doubt. A table that was not
//! ready at the close (its build stopped) is not saved.
//!
//! Whatever the file holds, advice is verified against the object records
//! (`SlabDepot::take_duplicate`): a wrong table could cost dedup, never data.
//!
//! Layout, little-endian: a header of magic `FBINDEX1`, nonce, generation, the six
//! shape words, the shard count, the lossy flag (u64 each) and the crc32c of those
//! 88 bytes; then per shard its held, dropped and walk state, the number of runs of
//! [`SAVED_RUN_WORDS`] words (4 KiB) it saves, and each such run that is not all
//! zeros as its number and its words (u64 each, in increasing order), followed by
//! the crc32c of the shard's bytes; then `FBIDXEND`. An empty table is a few KiB,
//! and loading one touches no memory (the runs of zeros are never written).

use crate::api::SavedIndex;
use crate::index::{DedupIndex, INDEX_SHARDS, SAVED_RUN_WORDS};
use crate::inner::Inner;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"FBINDEX1";
const END: &[u8; 8] = b"FBIDXEND";
/// Header bytes the crc covers: magic, nonce, generation, shape (6), shards, lossy.
const HEADER_BYTES: usize = 8 * 11;
/// Where files kept for a pool that has no directory of its own (a block device, an
/// RBD image) go, unless `FEWERBYTES_STATE_DIR` names another (empty: this one). The
/// command line keeps such pools' allow lists there too.
pub const STATE_DIR: &str = "/var/lib/fewerbytes";

/// The state directory: `FEWERBYTES_STATE_DIR`, else [`STATE_DIR`].
pub fn state_dir() -> PathBuf {
    std::env::var_os("FEWERBYTES_STATE_DIR")
        .filter(|dir| !dir.is_empty())
        .map_or_else(|| PathBuf::from(STATE_DIR), PathBuf::from)
}

/// The saved index's path for a read-write open of the pool whose super block lives
/// on `meta_name` (a path, for a pool on files or block devices) with `nonce`.
pub(crate) fn resolve(at: &SavedIndex, meta_name: &str, nonce: u64) -> Option<PathBuf> {
    match at {
        SavedIndex::Off => None,
        SavedIndex::At(path) => Some(path.clone()),
        SavedIndex::Beside => {
            let pool = Path::new(meta_name);
            if std::fs::metadata(pool).is_ok_and(|m| m.is_file()) {
                let real = std::fs::canonicalize(pool).unwrap_or_else(|_| pool.to_path_buf());
                let mut name = real.into_os_string();
                name.push(".index");
                Some(PathBuf::from(name))
            } else {
                Some(state_dir().join(format!("{nonce:016x}.index")))
            }
        }
    }
}

/// At a clean close, after its final checkpoint: save the index if it is ready, else
/// remove a stale file. A failure is logged, never the close's: the next open
/// rebuilds the index.
pub(crate) fn save(inner: &Inner) {
    let Some(path) = inner.index_build.saved_path() else {
        return;
    };
    if inner.index_build.state() != crate::index_build::BuildState::Ready {
        remove(path, "the index was not ready at the close");
        return;
    }
    let generation = inner.checkpointer.super_block().generation;
    let started = std::time::Instant::now();
    match write(
        inner.depot.index(),
        path,
        inner.geometry.nonce(),
        generation,
    ) {
        Ok(bytes) => tracing::info!(
            "dedup index saved to {} ({} MiB in {:.2} s)",
            path.display(),
            bytes >> 20,
            started.elapsed().as_secs_f64()
        ),
        Err(e) => {
            tracing::warn!(
                "could not save the dedup index to {}: {e}; the next open rebuilds it",
                path.display()
            );
        }
    }
}

fn remove(path: &Path, why: &str) {
    match std::fs::remove_file(path) {
        Ok(()) => tracing::info!("removed the saved dedup index {}: {why}", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("could not remove {}: {e}", path.display()),
    }
}

/// Write the table to a new file beside `path` (`companion.rs`), made durable, then
/// renamed over it.
fn write(index: &DedupIndex, path: &Path, nonce: u64, generation: u64) -> std::io::Result<u64> {
    // The state directory of a pool on a block device may not exist yet.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    // A new file of a name no one can take beforehand, its owner's alone.
    let (tmp, file) = crate::companion::create_staging(path)?;
    let written = (|| {
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let mut header = Vec::with_capacity(HEADER_BYTES + 4);
        header.extend_from_slice(MAGIC);
        let lossy = u64::from(index.lossy());
        let words = [nonce, generation]
            .into_iter()
            .chain(index.shape())
            .chain([INDEX_SHARDS as u64, lossy]);
        for w in words {
            header.extend_from_slice(&w.to_le_bytes());
        }
        let crc = crc32c::crc32c(&header);
        header.extend_from_slice(&crc.to_le_bytes());
        out.write_all(&header)?;
        let mut bytes = header.len() as u64;
        let mut buf = Vec::new();
        index.each_shard(|state, words| {
            buf.clear();
            let runs: Vec<(u64, &[u64])> = (0u64..)
                .zip(words.chunks(SAVED_RUN_WORDS))
                .filter(|(_, run)| run.iter().any(|&w| w != 0))
                .collect();
            for w in state.iter().chain([&(runs.len() as u64)]) {
                buf.extend_from_slice(&w.to_le_bytes());
            }
            for (number, run) in runs {
                buf.extend_from_slice(&number.to_le_bytes());
                for w in run {
                    buf.extend_from_slice(&w.to_le_bytes());
                }
            }
            let crc = crc32c::crc32c(&buf);
            buf.extend_from_slice(&crc.to_le_bytes());
            bytes += buf.len() as u64;
            out.write_all(&buf)
        })?;
        out.write_all(END)?;
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok(bytes + END.len() as u64)
    })();
    let bytes = match written {
        Ok(bytes) => bytes,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir)?.sync_all()?;
    }
    Ok(bytes)
}

/// At a read-write open whose journal held nothing to replay, before any write and
/// before the index build starts: load the saved table if it is this state's
/// (`generation`: the super block the open read). True when loaded; the index is
/// then ready, and the file removed.
pub(crate) fn load(inner: &Inner, generation: u64) -> bool {
    let Some(path) = inner.index_build.saved_path() else {
        return false;
    };
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return false,
        Err(e) => {
            tracing::warn!(
                "could not read the saved dedup index {}: {e}",
                path.display()
            );
            return false;
        }
    };
    let started = std::time::Instant::now();
    let index = inner.depot.index();
    match read(index, file, inner.geometry.nonce(), generation) {
        Ok(()) => {
            tracing::info!(
                "dedup index loaded from {} in {:.2} s",
                path.display(),
                started.elapsed().as_secs_f64()
            );
            remove(path, "loaded (the next clean close saves it again)");
            true
        }
        Err(why) => {
            // Shards restored before the fault go: the build starts from empty.
            index.clear();
            tracing::warn!(
                "the saved dedup index {} is not used ({why}): rebuilding it",
                path.display()
            );
            remove(path, "not used");
            false
        }
    }
}

/// A little-endian u64 from 8 bytes (`chunks_exact(8)` gives no other length).
fn word(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes.try_into().unwrap_or([0; 8]))
}

/// The first `N` little-endian u64 of `bytes`.
fn words_of<const N: usize>(bytes: &[u8]) -> [u64; N] {
    let mut out = [0u64; N];
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
        *o = word(c);
    }
    out
}

fn read(index: &DedupIndex, file: File, nonce: u64, generation: u64) -> Result<(), String> {
    let mut input = BufReader::with_capacity(1 << 20, file);
    let mut header = [0u8; HEADER_BYTES + 4];
    input
        .read_exact(&mut header)
        .map_err(|e| format!("its header: {e}"))?;
    let (covered, crc) = header.split_at(HEADER_BYTES);
    if covered.get(..8) != Some(MAGIC.as_slice()) {
        return Err("not a saved index (bad magic)".into());
    }
    if crc32c::crc32c(covered).to_le_bytes() != crc {
        return Err("its header's checksum does not match".into());
    }
    let words: Vec<u64> = covered.chunks_exact(8).skip(1).map(word).collect();
    let [saved_nonce, saved_generation, shape @ .., shards, lossy] = words.as_slice() else {
        return Err("its header is short".into());
    };
    if *saved_nonce != nonce {
        return Err(format!(
            "it is another pool's (nonce {saved_nonce:016x}, this pool's {nonce:016x})"
        ));
    }
    if *saved_generation != generation {
        return Err(format!(
            "it was saved at checkpoint {saved_generation}, and the pool was opened at \
             checkpoint {generation}"
        ));
    }
    let ours = index.shape();
    if shape != ours.as_slice() || *shards != INDEX_SHARDS as u64 {
        return Err(format!(
            "its table's shape {shape:?} × {shards} shards is not this open's {ours:?} × \
             {INDEX_SHARDS} (another --index-memory?)"
        ));
    }
    let words_per_shard = ours[5];
    let all_runs = words_per_shard.div_ceil(SAVED_RUN_WORDS as u64);
    let mut head = [0u8; 32];
    let mut runs: Vec<(u64, Vec<u64>)> = Vec::new();
    let mut run_bytes = vec![0u8; SAVED_RUN_WORDS * 8];
    for k in 0..INDEX_SHARDS {
        input
            .read_exact(&mut head)
            .map_err(|e| format!("shard {k}: {e}"))?;
        let mut crc = crc32c::crc32c(&head);
        let [held, dropped, rng, count] = words_of::<4>(&head);
        if count > all_runs {
            return Err(format!(
                "shard {k} says {count} runs, and a shard has {all_runs}"
            ));
        }
        runs.clear();
        let mut last = None;
        for _ in 0..count {
            let mut number = [0u8; 8];
            input
                .read_exact(&mut number)
                .map_err(|e| format!("shard {k}: {e}"))?;
            crc = crc32c::crc32c_append(crc, &number);
            let number = u64::from_le_bytes(number);
            // In order, each once, inside the shard.
            if number >= all_runs || last.is_some_and(|l| number <= l) {
                return Err(format!(
                    "shard {k} names run {number} out of order or place"
                ));
            }
            last = Some(number);
            let len = (words_per_shard - number * SAVED_RUN_WORDS as u64)
                .min(SAVED_RUN_WORDS as u64) as usize;
            let bytes = run_bytes.get_mut(..len * 8).unwrap_or_default();
            input
                .read_exact(bytes)
                .map_err(|e| format!("shard {k}: {e}"))?;
            crc = crc32c::crc32c_append(crc, bytes);
            runs.push((number, bytes.chunks_exact(8).map(word).collect()));
        }
        let mut stored = [0u8; 4];
        input
            .read_exact(&mut stored)
            .map_err(|e| format!("shard {k}: {e}"))?;
        if crc.to_le_bytes() != stored {
            return Err(format!("shard {k}'s checksum does not match"));
        }
        let pages = runs.iter().map(|(n, w)| (*n, w.as_slice()));
        if !index.restore_shard(k, [held, dropped, rng], pages) {
            return Err(format!("shard {k} does not fit the table"));
        }
    }
    let mut end = [0u8; 8];
    input
        .read_exact(&mut end)
        .map_err(|e| format!("its end: {e}"))?;
    if &end != END {
        return Err("its end marker is missing".into());
    }
    if input.read(&mut [0u8; 1]).map_err(|e| e.to_string())? != 0 {
        return Err("bytes follow its end marker".into());
    }
    if *lossy != 0 {
        index.set_lossy();
    }
    Ok(())
}
