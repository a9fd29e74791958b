//! The known damaged objects (`heal.rs`) kept beside the pool as a hint, so a write
//! of good data heals after a restart, or after an offline `check --verify-data` or
//! scrub, as it does in the open that found the damage.
//!
//! The file sits where the saved index does (`index_save.rs`): `<pool>.damaged`
//! beside the pool's file, `<state dir>/<nonce>.damaged` for a pool on a block
//! device, `<path>.damaged` beside a saved index named by path; no saved index, no
//! hint. It is written through `companion.rs` (a new file of a random name, renamed
//! over it) about once a second while the set changes, and at close; a set that
//! empties removes it. It is not part of the pool: no format change, and losing it
//! loses only the hint.
//!
//! It is only a hint. A read-write open reads it (at most [`DAMAGED_OBJECTS_MAX`]
//! entries, so at most that many 4 KiB reads) and reads again every object it
//! names whose record still holds the named fingerprint; only an object whose read
//! fails again is known damaged. A stale or forged file can cost those reads and
//! nothing else. A file naming another pool, owned by another user (not root), or
//! that group or others may write, is not read, and a warning says why.
//!
//! Layout (text, one entry a line): `fewerbytes damaged objects 1`, `pool
//! <nonce, 16 hex digits>`, then `<object id> <fingerprint, 64 hex digits>
//! <reason>` per object.

use crate::fingerprint::Fingerprint;
use crate::heal::DAMAGED_OBJECTS_MAX;
use crate::inner::Inner;
use crate::inner::Wait;
use crate::EngineError;
use fewerbytes_format::location::ObjectId;
use fewerbytes_format::BLOCK_BYTES;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const HEADER: &str = "fewerbytes damaged objects 1";
/// The hint is written at most this often while the set keeps changing.
const SAVE_INTERVAL: Duration = Duration::from_secs(1);
/// A reason longer than this is cut: the file stays bounded by the set's limit.
const REASON_CHARS_MAX: usize = 200;
/// Bytes read of a hint at most: a full set's lines and the header.
const HINT_BYTES_MAX: u64 = (DAMAGED_OBJECTS_MAX as u64 + 2) * (20 + 1 + 64 + 1 + 4 * 200 + 1);

/// Where the hint is kept, and what of the set it holds.
#[derive(Default)]
pub(crate) struct HintState {
    path: Option<PathBuf>,
    /// The set's change count the file holds; `u64::MAX`: a file from an earlier
    /// open that this open has not written yet.
    saved: u64,
    last: Option<Instant>,
}

/// The hint's path beside the saved index `index` (`<...>.index` or any other name).
pub(crate) fn path_for(index: &Path) -> PathBuf {
    let mut name = index.as_os_str().to_owned();
    if index.extension().is_some_and(|e| e == "index") {
        name = index.with_extension("").into_os_string();
    }
    name.push(".damaged");
    PathBuf::from(name)
}

/// At a read-write (or repair) open, after the journal's replay and before any
/// write: read the hint at `path` and know again each object it names that still
/// fails its read. The hint is then this open's to rewrite.
pub(crate) fn load(inner: &Inner, path: PathBuf) {
    let damaged = inner.depot.damaged();
    let entries = match read(&path, inner.geometry.nonce()) {
        Ok(Some(entries)) => entries,
        Ok(None) => Vec::new(),
        Err(why) => {
            tracing::warn!(
                "the damaged-block hint {} is not used: {why}",
                path.display()
            );
            Vec::new()
        }
    };
    let existed = std::fs::symlink_metadata(&path).is_ok();
    let mut buf = vec![0u8; BLOCK_BYTES];
    for (o, fp) in &entries {
        if still_damaged(inner, ObjectId(*o), fp, &mut buf) {
            damaged.count_carried_over();
        }
    }
    if !entries.is_empty() {
        tracing::info!(
            "{} of the {} damaged blocks the last open knew are still damaged",
            damaged.carried_over(),
            entries.len()
        );
    }
    let mut state = damaged.hint.lock();
    state.path = Some(path);
    state.saved = if existed { u64::MAX } else { damaged.changes() };
}

/// Whether object `o`, named by the hint with `fp`, still fails its read (the read
/// path then knows it damaged). An object freed or holding other data is not read.
fn still_damaged(inner: &Inner, o: ObjectId, fp: &Fingerprint, buf: &mut [u8]) -> bool {
    if !inner.depot.valid_object(o) {
        return false;
    }
    let (s, i) = inner.depot.split_object(o);
    let rec = inner.depot.slab(s).lock().rec(i);
    if rec.refcount == 0 || rec.fingerprint != *fp {
        return false;
    }
    match crate::read_path::read_object(inner, o, buf, Wait::Yes) {
        Err(EngineError::Corrupt { .. }) => inner.depot.damaged().contains(o),
        _ => false,
    }
}

/// The hint's entries: `None` when there is no file.
fn read(path: &Path, nonce: u64) -> Result<Option<Vec<(u64, Fingerprint)>>, String> {
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let meta = file.metadata().map_err(|e| e.to_string())?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me && meta.uid() != 0 {
        return Err(format!(
            "it belongs to uid {}, not to this user (uid {me}) or root",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!(
            "group or others may write it (mode {:o})",
            meta.mode() & 0o777
        ));
    }
    let mut text = String::new();
    file.take(HINT_BYTES_MAX)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    parse(&text, nonce).map(Some)
}

fn parse(text: &str, nonce: u64) -> Result<Vec<(u64, Fingerprint)>, String> {
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        return Err("not a damaged-block hint (bad first line)".into());
    }
    let pool = lines.next().and_then(|l| l.strip_prefix("pool "));
    let pool = pool.and_then(|p| u64::from_str_radix(p, 16).ok());
    if pool != Some(nonce) {
        return Err(format!(
            "it names another pool (this pool's id is {nonce:016x})"
        ));
    }
    let mut entries = Vec::new();
    for (n, line) in lines.enumerate() {
        if n >= DAMAGED_OBJECTS_MAX {
            return Err(format!("it names more than {DAMAGED_OBJECTS_MAX} objects"));
        }
        let mut words = line.splitn(3, ' ');
        let object = words.next().and_then(|w| w.parse::<u64>().ok());
        let fp = words.next().and_then(fingerprint_of);
        let (Some(object), Some(fp)) = (object, fp) else {
            return Err(format!(
                "line {} is not `<object> <fingerprint> <reason>`",
                n + 3
            ));
        };
        entries.push((object, fp));
    }
    Ok(entries)
}

fn fingerprint_of(hex: &str) -> Option<Fingerprint> {
    let bytes = hex.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut fp = [0u8; 32];
    for (out, pair) in fp.iter_mut().zip(bytes.chunks_exact(2)) {
        let pair = std::str::from_utf8(pair).ok()?;
        *out = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(fp)
}

/// Write the hint if the set changed since it was last written: with `now`, at
/// once (the close); else not within [`SAVE_INTERVAL`] of the last write. A
/// failure is logged: the hint is only a hint.
pub(crate) fn save(inner: &Inner, now: bool) {
    let damaged = inner.depot.damaged();
    let mut state = damaged.hint.lock();
    let Some(path) = state.path.clone() else {
        return;
    };
    let changes = damaged.changes();
    if changes == state.saved || (!now && state.last.is_some_and(|t| t.elapsed() < SAVE_INTERVAL)) {
        return;
    }
    state.last = Some(Instant::now());
    let entries = damaged.entries();
    let written = if entries.is_empty() {
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    } else {
        let mut text = format!("{HEADER}\npool {:016x}\n", inner.geometry.nonce());
        for (o, fp, reason) in entries {
            let hex: String = fp.iter().map(|b| format!("{b:02x}")).collect();
            let reason: String = reason
                .chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .take(REASON_CHARS_MAX)
                .collect();
            text.push_str(&format!("{o} {hex} {reason}\n"));
        }
        // The state directory of a pool on a block device may not exist yet.
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        dir.map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| crate::companion::replace_file(&path, text.as_bytes()))
    };
    match written {
        Ok(()) => state.saved = changes,
        Err(e) => tracing::warn!(
            "could not write the damaged-block hint {}: {e}; a restart forgets which \
             blocks are damaged until a read or the scrub finds them again",
            path.display()
        ),
    }
}
