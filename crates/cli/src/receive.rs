//! `volume receive`: a send stream (docs/stream.md) from stdin into a new volume.
//!
//! The volume is made under a partial name, `NAME:receiving` (a full stream: a new
//! volume of the stream's size; an incremental one: a clone of the base, after its
//! size and content digest matched the stream's), and renamed to NAME only after the
//! end record checked out: no half-made volume is ever visible under NAME. Progress
//! lives in a small file beside the pool, `<pool>.receive.NAME.json` (for a pool that
//! is not a file, in the state directory): the stream's header and the first record
//! not yet durable. It is rewritten (written aside, synced, renamed over) only after
//! a pool flush made every record before it durable, so a crash or a cut stream
//! leaves a record count that is true; records are absolute (each writes its own
//! blocks), so those applied again after it are harmless. `--resume` reads the same
//! stream again, or a resumed send's, skipping the records already held.

use anyhow::{anyhow, bail, Context, Result};
use fewerbytes_engine::{BlockSource, OpenOptions, Pool, Provisioning, Volume, BLOCK_BYTES};
use fewerbytes_format::location::Codec;
use fewerbytes_format::stream::{
    Answer, PayloadCodec, Record, RecordBody, RecordHead, StreamHeader, HEADER_BYTES,
    OFFER_DIGEST_BYTES, RECORD_HEAD_BYTES,
};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::control::{served_or_local, with_local_pool};
use crate::homes;
use crate::send::{content_digest, hex, ResumeToken};
use crate::size::format_size;
pub use crate::stream_request::ReceiveRequest;

const BLOCK: u64 = BLOCK_BYTES as u64;
/// The suffix of the partial volume's name.
pub const PARTIAL_SUFFIX: &str = ":receiving";
/// Stream bytes applied between two durable progress records: what a crash may
/// make a resumed receive apply again (a pool flush and a small file each).
const SAVE_EVERY_BYTES: u64 = 64 << 20;
/// Blocks a reference record copies per read and write (1 MiB).
const REF_CHUNK_BLOCKS: u64 = 256;

/// The progress file: which stream, and how far it is durable.
#[derive(Serialize, Deserialize, Clone)]
struct Saved {
    /// The stream's header, hex: a resumed receive takes only this stream.
    header: String,
    /// The partial volume's name.
    partial: String,
    /// The first record not yet durable.
    next_position: u64,
    /// The first block the next record may cover (records go in block order).
    next_lbn: u64,
    /// Counts of the records before `next_position`, checked by the end record.
    data_records: u64,
    ref_blocks: u64,
    base_ref_blocks: u64,
    #[serde(default)]
    pool_ref_blocks: u64,
    zero_blocks: u64,
    /// The local base of an incremental stream: base references read it, and a
    /// resume checks it again.
    base: Option<String>,
    /// The stream updates the existing volume NAME (its base is one of NAME's
    /// snapshots): at the end NAME is rolled to the partial volume, not made.
    #[serde(default)]
    onto: bool,
    /// The snapshot the stream carries (record 0): made of NAME at the end.
    #[serde(default)]
    snapshot: Option<SavedSnapshot>,
}

/// A snapshot a stream carries: its name within the volume and its identity.
#[derive(Serialize, Deserialize, Clone)]
struct SavedSnapshot {
    name: String,
    guid: u64,
}

/// Where a receive into `name` keeps its progress.
fn progress_path(pool_path: &Path, name: &str) -> Result<PathBuf> {
    let suffix = format!(".receive.{name}.json");
    Ok(match homes::state_file(pool_path, &suffix)? {
        Some(path) => path,
        None => homes::with_suffix(pool_path, &suffix),
    })
}

fn read_saved(path: &Path) -> Result<Option<Saved>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(serde_json::from_slice(&bytes).with_context(|| {
            format!(
                "the receive progress file {} does not parse",
                path.display()
            )
        })?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("could not read {}", path.display())),
    }
}

/// Write the progress file durably: beside itself, synced, renamed over, the
/// directory synced.
fn write_saved(pool_path: &Path, path: &Path, saved: &Saved) -> Result<()> {
    homes::make_home(pool_path, path)?;
    let aside = homes::with_suffix(path, ".new");
    let mut file = std::fs::File::create(&aside)
        .with_context(|| format!("could not write {}", aside.display()))?;
    file.write_all(&serde_json::to_vec(saved)?)?;
    file.sync_all()?;
    std::fs::rename(&aside, path).with_context(|| {
        format!(
            "could not rename {} over {}",
            aside.display(),
            path.display()
        )
    })?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// The partial volume's name for a receive into `name`.
fn partial_name(name: &str) -> Result<String> {
    fewerbytes_format::catalog::validate_name(name).map_err(|e| anyhow!(e))?;
    let partial = format!("{name}{PARTIAL_SUFFIX}");
    if partial.len() > fewerbytes_format::catalog::MAX_NAME_BYTES {
        bail!(
            "volume name '{name}' is too long to receive into: the partial volume \
             '{partial}' must fit {} bytes",
            fewerbytes_format::catalog::MAX_NAME_BYTES
        );
    }
    Ok(partial)
}

/// Receive a stream from stdin into a new volume: through the server's control
/// socket when a server holds the pool (`stream_socket`), else in this process.
pub fn receive(pool_path: &Path, request: &ReceiveRequest) -> Result<()> {
    if !request.abandon && std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        bail!(
            "stdin is a terminal: `volume receive` reads a send stream; redirect it from \
             a file or pipe `fewerbytes volume send` into it"
        );
    }
    let summary = match served_or_local(pool_path)? {
        Some(client) => crate::stream_socket::receive_through(&client, request)?,
        None => with_local_pool(pool_path, &OpenOptions::default(), |pool| {
            receive_into_pool(
                pool,
                pool_path,
                request,
                &mut std::io::stdin().lock(),
                &mut std::io::stdout(),
            )
        })?,
    };
    eprintln!("{summary}");
    Ok(())
}

/// Receive the stream read from `input` into a new volume of an open pool (this
/// process's, or a server's, `pool_path` the path it was opened by); in two-way mode
/// the answer goes to `answer_out`. Returns the summary line.
pub fn receive_into_pool(
    pool: &Arc<Pool>,
    pool_path: &Path,
    request: &ReceiveRequest,
    input: &mut dyn Read,
    answer_out: &mut dyn Write,
) -> Result<String> {
    let name = request.name.as_str();
    let from = request.from.as_deref();
    let (resume, abandon) = (request.resume, request.abandon);
    let provisioning = request.provisioning;
    let negotiate_with = &request.negotiate_with;
    let partial = partial_name(name)?;
    let saved_path = progress_path(pool_path, name)?;
    let saved = read_saved(&saved_path)?;
    {
        let exists = |n: &str| pool.volume_sizes().iter().any(|(v, _)| v == n);
        if abandon {
            if exists(&partial) {
                pool.delete_volume(&partial, false)?;
            }
            if saved.is_some() {
                std::fs::remove_file(&saved_path)
                    .with_context(|| format!("could not remove {}", saved_path.display()))?;
            }
            return Ok(format!("Interrupted receive of '{name}' discarded."));
        }
        if !resume && (saved.is_some() || exists(&partial)) {
            bail!(
                "an interrupted receive of '{name}' is waiting (partial volume '{partial}'): \
                 continue it with `volume receive {name} --resume`, or discard it with \
                 `volume receive {name} --abandon`"
            );
        }
        if resume && saved.is_none() {
            bail!("no interrupted receive of '{name}' to resume");
        }
        // Dedup against what the pool held before the open, as an import does.
        pool.wait_index_built();
        let mut input = StreamInput {
            reader: BufReader::with_capacity(1 << 20, input),
            offset_bytes: 0,
        };
        let header_bytes = input.header()?;
        let header = StreamHeader::decode(&header_bytes)
            .map_err(|e| anyhow!("not a fewerbytes send stream: {e}"))?;
        if header.negotiated && saved.is_some() {
            bail!(
                "a two-way stream cannot resume an interrupted receive: discard it with \
                 `volume receive {name} --abandon`, then send again"
            );
        }
        let saved = match saved {
            Some(saved) if saved.header != hex(&header_bytes) => bail!(
                "this stream is not the one the interrupted receive of '{name}' began with \
                 (another stream key): feed it the same stream, or a send resumed with \
                 --resume-token {}",
                ResumeToken::text(&stream_key_of(&saved)?, saved.next_position)
            ),
            Some(saved) if exists(&saved.partial) => {
                // The base is read by base references: it must still be the sender's.
                check_base(pool, &header, saved.base.as_deref(), name)?;
                if !saved.onto && exists(name) {
                    bail!("a volume named '{name}' was made since the receive began");
                }
                saved
            }
            // The progress file was written before the volume was made, or the
            // volume was deleted since: begin again.
            _ => {
                let base = check_base(pool, &header, from, name)?;
                let onto = exists(name);
                if onto {
                    check_onto(pool, name, base.as_deref(), request.force)?;
                }
                let saved = Saved {
                    header: hex(&header_bytes),
                    partial: partial.clone(),
                    next_position: 0,
                    next_lbn: 0,
                    data_records: 0,
                    ref_blocks: 0,
                    base_ref_blocks: 0,
                    pool_ref_blocks: 0,
                    zero_blocks: 0,
                    base: base.clone(),
                    onto,
                    snapshot: None,
                };
                // The progress file first: a crash before the volume exists leaves a
                // file that a resume begins again from (and --abandon removes).
                write_saved(pool_path, &saved_path, &saved)?;
                if let Err(e) = make_partial(pool, &header, &partial, base.as_deref(), provisioning)
                {
                    if exists(&partial) {
                        let _ = pool.delete_volume(&partial, true);
                    }
                    let _ = std::fs::remove_file(&saved_path);
                    return Err(e);
                }
                saved
            }
        };
        let volume = pool.open_volume(&saved.partial)?;
        let base_volume = saved
            .base
            .as_deref()
            .map(|b| pool.open_volume(b))
            .transpose()?;
        let negotiation = if header.negotiated {
            let candidates = negotiate_with
                .iter()
                .map(|v| {
                    pool.open_volume(v)
                        .with_context(|| format!("--negotiate-with names volume '{v}'"))
                })
                .collect::<Result<Vec<_>>>();
            match candidates {
                Ok(candidates) => Some(Negotiation {
                    candidates,
                    offered: Vec::new(),
                    table: HashMap::new(),
                    answered: false,
                }),
                Err(e) => {
                    drop(volume);
                    let _ = pool.delete_volume(&partial, true);
                    let _ = std::fs::remove_file(&saved_path);
                    return Err(e);
                }
            }
        } else {
            None
        };
        let mut apply = Apply {
            name,
            pool,
            pool_path,
            saved_path: &saved_path,
            volume: &volume,
            base: base_volume.as_ref(),
            negotiation,
            answer_out,
            header,
            incremental: header.base.is_some(),
            saved,
            applied_since_save: 0,
        };
        let result = apply.run(&mut input);
        let saved = apply.saved.clone();
        drop(apply);
        drop(volume);
        drop(base_volume);
        match result {
            Err(e) if header.negotiated => {
                // Its records depend on the answer: a two-way receive is not resumed.
                let _ = pool.delete_volume(&partial, true);
                let _ = std::fs::remove_file(&saved_path);
                Err(e.context(format!(
                    "the two-way receive of '{name}' stopped and was discarded; send again"
                )))
            }
            Ok(()) => {
                let made = finish(pool, name, &partial, &saved)?;
                std::fs::remove_file(&saved_path)
                    .with_context(|| format!("could not remove {}", saved_path.display()))?;
                Ok(format!(
                    "Received volume '{name}'{made}: {} ({} blocks of data, {} by reference, \
                     {} by reference to the base), {} of stream.",
                    format_size(header.volume_size_bytes),
                    saved.data_records,
                    saved.ref_blocks,
                    saved.base_ref_blocks,
                    format_size(input.offset_bytes)
                ))
            }
            Err(e) => Err(e.context(format!(
                "the receive of '{name}' stopped; the partial volume '{partial}' holds \
                 records 0..{} durably. Continue with `volume receive {name} --resume` fed \
                 the same stream, or fed `volume send VOLUME --resume-token {}` (with the \
                 same --from); discard it with `volume receive {name} --abandon`",
                saved.next_position,
                ResumeToken::text(&header.stream_key, saved.next_position)
            ))),
        }
    }
}

fn stream_key_of(saved: &Saved) -> Result<[u8; 32]> {
    let bytes: Vec<u8> = (0..saved.header.len() / 2)
        .map(|i| u8::from_str_radix(saved.header.get(2 * i..2 * i + 2).unwrap_or("zz"), 16))
        .collect::<Result<_, _>>()
        .map_err(|_| anyhow!("the receive progress file's header is not hex"))?;
    let header = StreamHeader::decode(&bytes)
        .map_err(|e| anyhow!("the receive progress file's header: {e}"))?;
    Ok(header.stream_key)
}

/// For an incremental stream, the local base, refused unless it is the sender's:
/// `from` (a short name is NAME's snapshot when NAME exists, as `volume diff` takes
/// it), else the snapshot of NAME with the stream's base identity, else the name the
/// stream carries. A base named by identity must be a snapshot of that identity (a
/// lookup, no read); another base must match the stream's size and content digest.
fn check_base(
    pool: &Arc<Pool>,
    header: &StreamHeader,
    from: Option<&str>,
    name: &str,
) -> Result<Option<String>> {
    let Some(base) = &header.base else {
        return Ok(None);
    };
    let carried = base
        .name_str()
        .ok_or_else(|| anyhow!("the stream's base has no name"))?;
    let name_exists = pool.volume_sizes().iter().any(|(v, _)| v == name);
    let base_name = match (from, base.guid) {
        (Some(from), _) if name_exists => pool.base_name(name, from)?,
        (Some(from), _) => from.to_string(),
        (None, Some(guid)) if name_exists => pool
            .snapshots(name)?
            .into_iter()
            .find(|s| s.guid.as_deref() == Some(&format!("{guid:016x}")))
            .map_or_else(|| carried.to_string(), |s| s.name),
        (None, _) => carried.to_string(),
    };
    let volume = match pool.open_volume(&base_name) {
        Ok(volume) => volume,
        Err(_) => bail!(
            "the stream is incremental from {}, which this pool does not hold: receive a \
             full stream first (or name the base here with --from)",
            match base.guid {
                Some(guid) => format!("snapshot '{carried}' (identity {guid:016x})"),
                None => format!("volume '{base_name}'"),
            }
        ),
    };
    if volume.size_bytes() != base.size_bytes {
        bail!(
            "the stream is incremental from a base of {} bytes, but volume '{base_name}' \
             holds {} bytes: it is not the sender's base",
            base.size_bytes,
            volume.size_bytes()
        );
    }
    if let Some(guid) = base.guid {
        if !base_name.contains('@') {
            bail!(
                "the stream is incremental from snapshot '{carried}' (identity {guid:016x}), \
                 and '{base_name}' is a volume, not a snapshot of that identity"
            );
        }
        let here = crate::send::snapshot_guid(pool, &base_name)?;
        if here != guid {
            bail!(
                "snapshot '{base_name}' is not the sender's base: its identity is {here:016x} \
                 here, {guid:016x} in the stream (another snapshot of the same name)"
            );
        }
        return Ok(Some(base_name));
    }
    let digest = content_digest(&volume, "base")?;
    if digest != base.content_digest {
        bail!(
            "volume '{base_name}' differs from the sender's base (content digest {}… here, \
             {}… in the stream): it was written since, or is another volume",
            hex(&digest[..8]),
            hex(&base.content_digest[..8])
        );
    }
    Ok(Some(base_name))
}

/// A receive into an existing volume NAME updates it in place, as `zfs receive`
/// does: only from a stream whose base is one of NAME's snapshots, and only when
/// NAME was not written since that snapshot (unless `force`: what was written since
/// is discarded).
fn check_onto(pool: &Arc<Pool>, name: &str, base: Option<&str>, force: bool) -> Result<()> {
    let Some(base) = base.filter(|b| b.split_once('@').is_some_and(|(of, _)| of == name)) else {
        bail!(
            "a volume named '{name}' already exists: receive into a new name (an \
             incremental stream from one of its snapshots updates it in place)"
        );
    };
    if force {
        return Ok(());
    }
    let size_bytes = |n: &str| pool.open_volume(n).map(|v| v.size_bytes());
    let written = size_bytes(name)? != size_bytes(base)?
        || pool.changed_extents(name, base)?.iter().any(|e| e.changed);
    if written {
        bail!(
            "volume '{name}' was written since its snapshot '{base}', the stream's base: \
             receive with --force to discard what was written since"
        );
    }
    Ok(())
}

/// The end of a receive whose records all checked out: the partial volume becomes
/// NAME (renamed, or NAME rolled to it and it deleted, when the stream updates NAME
/// in place), then the stream's snapshot of NAME is made with the sender's
/// identity. Returns what it made, for the summary.
fn finish(pool: &Arc<Pool>, name: &str, partial: &str, saved: &Saved) -> Result<String> {
    if saved.onto {
        pool.rollback_volume(name, partial)
            .with_context(|| format!("could not update volume '{name}' to what it received"))?;
        pool.delete_volume(partial, false)?;
    } else {
        pool.rename_volume(partial, name)?;
    }
    let mut made = String::new();
    if saved.onto {
        made.push_str(" (updated in place)");
    }
    if let Some(snapshot) = &saved.snapshot {
        pool.snapshot_volume_as(name, &snapshot.name, snapshot.guid)
            .with_context(|| {
                format!(
                    "volume '{name}' holds what it received, but its snapshot '{}' could not \
                     be made",
                    snapshot.name
                )
            })?;
        made.push_str(&format!(
            " and its snapshot '{name}@{}' (identity {:016x})",
            snapshot.name, snapshot.guid
        ));
    }
    Ok(made)
}

/// Make the partial volume: a new volume for a full stream; for an incremental one,
/// a clone of the base, resized to the stream's size; each reserving as asked (thick
/// by default, as `volume create` and `volume clone`).
fn make_partial(
    pool: &Arc<Pool>,
    header: &StreamHeader,
    partial: &str,
    base: Option<&str>,
    provisioning: Provisioning,
) -> Result<()> {
    let Some(base) = base else {
        pool.create_volume_with(partial, header.volume_size_bytes, provisioning)
            .with_context(|| format!("could not create the partial volume '{partial}'"))?;
        return Ok(());
    };
    pool.clone_volume_with(base, partial, provisioning)
        .with_context(|| format!("could not clone '{base}' to '{partial}'"))?;
    if pool.open_volume(partial)?.size_bytes() != header.volume_size_bytes {
        pool.resize_volume(partial, header.volume_size_bytes, true)?;
    }
    Ok(())
}

/// The stream on stdin, and how far it has been read.
struct StreamInput<R: Read> {
    reader: R,
    offset_bytes: u64,
}

impl<R: Read> StreamInput<R> {
    /// Fill `buf`; `Ok(false)` at a clean end of input before the first byte.
    fn fill(&mut self, buf: &mut [u8], what: &str) -> Result<bool> {
        let mut got = 0;
        while got < buf.len() {
            let n = match self.reader.read(&mut buf[got..]) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e).context("could not read the stream"),
            };
            if n == 0 {
                if got == 0 {
                    return Ok(false);
                }
                bail!(
                    "the stream is truncated: it ends {} bytes into {what} (stream byte {})",
                    got,
                    self.offset_bytes + got as u64
                );
            }
            got += n;
        }
        self.offset_bytes += buf.len() as u64;
        Ok(true)
    }

    fn header(&mut self) -> Result<[u8; HEADER_BYTES]> {
        let mut bytes = [0u8; HEADER_BYTES];
        if !self.fill(&mut bytes, "its header")? {
            bail!("the stream is empty: its input held no bytes");
        }
        Ok(bytes)
    }

    /// The next record, checked; `None` at the end of input.
    fn record(&mut self, header: &StreamHeader, expected: u64) -> Result<Option<Record>> {
        let at = self.offset_bytes;
        let mut head_bytes = [0u8; RECORD_HEAD_BYTES];
        if !self.fill(&mut head_bytes, "a record's head")? {
            return Ok(None);
        }
        let damaged = |e: fewerbytes_format::FormatError| {
            anyhow!("the stream is damaged: the record at stream byte {at} (record {expected} expected there): {e}")
        };
        let head = RecordHead::decode(&head_bytes).map_err(damaged)?;
        let mut payload = vec![0u8; head.payload_bytes as usize];
        if !payload.is_empty() && !self.fill(&mut payload, "a record's payload")? {
            bail!(
                "the stream is truncated: it ends after the head of the record at stream byte {at}"
            );
        }
        Ok(Some(
            head.finish(&head_bytes, &payload, header)
                .map_err(damaged)?,
        ))
    }
}

/// Two-way mode: the candidate volumes, the digests offered, and for each offered
/// digest a candidate holds, where.
struct Negotiation {
    candidates: Vec<Volume>,
    offered: Vec<[u8; OFFER_DIGEST_BYTES]>,
    table: HashMap<[u8; OFFER_DIGEST_BYTES], (usize, u64)>,
    answered: bool,
}

/// Blocks the answer's table reads at once (1 MiB).
const TABLE_CHUNK_BLOCKS: usize = 256;

impl Negotiation {
    /// Hash the candidates' stored blocks under the stream key (each object once),
    /// keep those offered, and write the answer to stdout.
    fn answer(&mut self, stream_key: &[u8; 32], out: &mut dyn Write) -> Result<()> {
        let wanted: HashSet<[u8; OFFER_DIGEST_BYTES]> = self.offered.iter().copied().collect();
        let mut sources = vec![BlockSource::Zero; TABLE_CHUNK_BLOCKS];
        let mut bytes = vec![0u8; TABLE_CHUNK_BLOCKS * BLOCK_BYTES];
        for (index, volume) in self.candidates.iter().enumerate() {
            let mut seen: HashSet<u64> = HashSet::new();
            for run in data_runs(volume)? {
                let mut lbn = run.start;
                while lbn < run.end {
                    let n = (run.end - lbn).min(TABLE_CHUNK_BLOCKS as u64) as usize;
                    volume.block_sources(lbn, &mut sources[..n])?;
                    volume.read(lbn * BLOCK, &mut bytes[..n * BLOCK_BYTES])?;
                    for (i, source) in sources[..n].iter().enumerate() {
                        let BlockSource::Stored(object) = *source else {
                            continue;
                        };
                        if !seen.insert(object) {
                            continue;
                        }
                        let block = &bytes[i * BLOCK_BYTES..(i + 1) * BLOCK_BYTES];
                        let full = blake3::keyed_hash(stream_key, block);
                        let mut digest = [0u8; OFFER_DIGEST_BYTES];
                        digest.copy_from_slice(&full.as_bytes()[..OFFER_DIGEST_BYTES]);
                        if wanted.contains(&digest) {
                            self.table.entry(digest).or_insert((index, lbn + i as u64));
                        }
                    }
                    lbn += n as u64;
                }
            }
        }
        let count = self.offered.len() as u64;
        let mut bitmap = vec![0u8; self.offered.len().div_ceil(8)];
        for (i, digest) in self.offered.iter().enumerate() {
            if self.table.contains_key(digest) {
                if let Some(byte) = bitmap.get_mut(i / 8) {
                    *byte |= 1 << (i % 8);
                }
            }
        }
        let answer = Answer { count, bitmap };
        out.write_all(&answer.encode())
            .and_then(|()| out.flush())
            .context("could not write the answer to the sender")?;
        self.answered = true;
        Ok(())
    }
}

/// The block ranges of `volume` that hold data, in order.
fn data_runs(volume: &Volume) -> Result<Vec<std::ops::Range<u64>>> {
    let mut out = Vec::new();
    let mut lbn = 0;
    for extent in volume.extents(0, volume.size_bytes())? {
        let n = extent.len_bytes / BLOCK;
        if extent.data {
            out.push(lbn..lbn + n);
        }
        lbn += n;
    }
    Ok(out)
}

/// Applying records to the partial volume, and keeping the progress file true.
struct Apply<'a> {
    /// The volume received into (NAME).
    name: &'a str,
    pool: &'a Arc<Pool>,
    pool_path: &'a Path,
    saved_path: &'a Path,
    volume: &'a Volume,
    /// The base of an incremental stream, which base references read.
    base: Option<&'a Volume>,
    /// Two-way mode: the offers, the answer, and where the held blocks are.
    negotiation: Option<Negotiation>,
    /// Where the answer goes (stdout, or the control connection).
    answer_out: &'a mut dyn Write,
    header: StreamHeader,
    /// A clone of the base: zero runs must be written (a new volume reads zeros).
    incremental: bool,
    saved: Saved,
    applied_since_save: u64,
}

impl Apply<'_> {
    fn run<R: Read>(&mut self, input: &mut StreamInput<R>) -> Result<()> {
        let result = self.apply_all(input);
        if result.is_err() {
            // What was applied before the failure is made durable, so a resume
            // starts there.
            if let Err(e) = self.save() {
                tracing::warn!("could not record the receive's progress: {e:#}");
            }
        }
        result
    }

    fn apply_all<R: Read>(&mut self, input: &mut StreamInput<R>) -> Result<()> {
        loop {
            crate::interrupt::check()?;
            let Some(record) = input.record(&self.header, self.saved.next_position)? else {
                bail!(
                    "the stream is truncated: it ends after record {} (stream byte {}) without \
                     its end record",
                    self.saved.next_position.saturating_sub(1),
                    input.offset_bytes
                );
            };
            if record.position < self.saved.next_position {
                // Held already (a resume fed the stream from its start).
                continue;
            }
            if record.position > self.saved.next_position {
                bail!(
                    "the stream skips records {}..{}: a resumed send must start at or before \
                     record {}",
                    self.saved.next_position,
                    record.position,
                    self.saved.next_position
                );
            }
            if let RecordBody::Snapshot { guid, name } = &record.body {
                let full = format!("{}@{name}", self.name);
                if self.saved.onto
                    && self
                        .pool
                        .snapshots(self.name)?
                        .iter()
                        .any(|s| s.name == full)
                {
                    bail!("volume '{}' has a snapshot '{full}' already", self.name);
                }
                self.saved.snapshot = Some(SavedSnapshot {
                    name: name.clone(),
                    guid: *guid,
                });
                self.saved.next_position += 1;
                continue;
            }
            if self.negotiate(&record)? {
                self.saved.next_position += 1;
                continue;
            }
            if let RecordBody::End {
                data_records,
                ref_blocks,
                base_ref_blocks,
                pool_ref_blocks,
                zero_blocks,
            } = record.body
            {
                let s = &self.saved;
                let theirs = (
                    data_records,
                    ref_blocks,
                    base_ref_blocks,
                    pool_ref_blocks,
                    zero_blocks,
                );
                let ours = (
                    s.data_records,
                    s.ref_blocks,
                    s.base_ref_blocks,
                    s.pool_ref_blocks,
                    s.zero_blocks,
                );
                if theirs != ours {
                    bail!(
                        "the stream is damaged: its end record counts (data records, blocks \
                         by reference, to the base, held, zeros) {theirs:?}, but {ours:?} came \
                         before it"
                    );
                }
                let mut extra = [0u8; 1];
                if input.fill(&mut extra, "past the end record")? {
                    bail!(
                        "the stream is damaged: bytes follow its end record (stream byte {})",
                        input.offset_bytes - 1
                    );
                }
                self.pool
                    .flush()
                    .context("could not flush the pool after the receive")?;
                return Ok(());
            }
            if record.lbn < self.saved.next_lbn {
                bail!(
                    "the stream is damaged: record {} covers block {}, before block {} where \
                     the record before it ended",
                    record.position,
                    record.lbn,
                    self.saved.next_lbn
                );
            }
            let bytes = self.apply(&record)?;
            match record.body {
                RecordBody::Zero => self.saved.zero_blocks += u64::from(record.count),
                RecordBody::Data { .. } => self.saved.data_records += 1,
                RecordBody::Ref { .. } => self.saved.ref_blocks += u64::from(record.count),
                RecordBody::BaseRef { .. } => self.saved.base_ref_blocks += u64::from(record.count),
                RecordBody::PoolRef { .. } => self.saved.pool_ref_blocks += 1,
                RecordBody::Offer { .. } | RecordBody::OffersEnd { .. } => {}
                RecordBody::End { .. } | RecordBody::Snapshot { .. } => {}
            }
            self.saved.next_position += 1;
            self.saved.next_lbn = record.lbn + u64::from(record.count);
            self.applied_since_save += bytes;
            if self.applied_since_save >= SAVE_EVERY_BYTES {
                self.save()?;
            }
        }
    }

    /// Apply one record; returns the bytes it wrote, for the pacing of saves.
    fn apply(&self, record: &Record) -> Result<u64> {
        let offset = record.lbn * BLOCK;
        let len = u64::from(record.count) * BLOCK;
        let name = self.volume.name();
        let at = |what: &str| format!("could not {what} volume '{name}' at byte {offset}");
        match &record.body {
            RecordBody::Zero => {
                if self.incremental {
                    self.volume
                        .trim(offset, len, false)
                        .with_context(|| at("trim"))?;
                }
                Ok(0)
            }
            RecordBody::Data { codec, bytes } => {
                let mut block = vec![0u8; BLOCK_BYTES];
                let codec = match codec {
                    PayloadCodec::Raw => None,
                    PayloadCodec::Lz4 => Some(Codec::Lz4),
                    PayloadCodec::Zstd => Some(Codec::Zstd),
                };
                match codec {
                    None => block.copy_from_slice(bytes),
                    Some(codec) => fewerbytes_engine::decompress_block(codec, bytes, &mut block)
                        .map_err(|e| {
                            anyhow!(
                                "the stream is damaged: record {} (block {}) does not decode: {e}",
                                record.position,
                                record.lbn
                            )
                        })?,
                }
                self.volume
                    .write(offset, &block, false)
                    .with_context(|| at("write"))?;
                Ok(BLOCK)
            }
            RecordBody::Ref { source_lbn } | RecordBody::BaseRef { source_lbn } => {
                // A reference reads the volume being received; a base reference the
                // base (which the header check guarantees exists for one).
                let from = match (&record.body, self.base) {
                    (RecordBody::BaseRef { .. }, Some(base)) => base,
                    (RecordBody::BaseRef { .. }, None) => bail!(
                        "the stream is damaged: record {} refers to a base, in a full stream",
                        record.position
                    ),
                    _ => self.volume,
                };
                let mut done = 0u64;
                let count = u64::from(record.count);
                let mut buf = vec![0u8; (REF_CHUNK_BLOCKS * BLOCK) as usize];
                while done < count {
                    let n = (count - done).min(REF_CHUNK_BLOCKS);
                    let chunk = &mut buf[..(n * BLOCK) as usize];
                    from.read((source_lbn + done) * BLOCK, chunk)
                        .with_context(|| at("read the source of a reference in"))?;
                    self.volume
                        .write(offset + done * BLOCK, chunk, false)
                        .with_context(|| at("write"))?;
                    done += n;
                }
                Ok(len)
            }
            RecordBody::PoolRef { digest } => {
                let held = self.negotiation.as_ref().and_then(|n| {
                    let (volume, lbn) = n.table.get(digest)?;
                    Some((n.candidates.get(*volume)?, *lbn))
                });
                let Some((from, source_lbn)) = held else {
                    bail!(
                        "the stream is damaged: record {} refers to a block this pool did not \
                         answer it holds",
                        record.position
                    );
                };
                let mut block = vec![0u8; BLOCK_BYTES];
                from.read(source_lbn * BLOCK, &mut block)
                    .with_context(|| at("read a held block for"))?;
                self.volume
                    .write(offset, &block, false)
                    .with_context(|| at("write"))?;
                Ok(BLOCK)
            }
            RecordBody::End { .. }
            | RecordBody::Offer { .. }
            | RecordBody::OffersEnd { .. }
            | RecordBody::Snapshot { .. } => Ok(0),
        }
    }

    /// Two-way mode: take an offer, or answer at the offers' end (true: the record
    /// was one of those). Refuses offers in the wrong place and blocks before the
    /// answer.
    fn negotiate(&mut self, record: &Record) -> Result<bool> {
        let stream_key = self.header.stream_key;
        let Some(negotiation) = &mut self.negotiation else {
            return Ok(false);
        };
        match &record.body {
            RecordBody::Offer { digests } if !negotiation.answered => {
                negotiation.offered.extend_from_slice(digests);
                Ok(true)
            }
            RecordBody::OffersEnd { offered } if !negotiation.answered => {
                if *offered != negotiation.offered.len() as u64 {
                    bail!(
                        "the stream is damaged: its offers' end counts {offered} digests, {} \
                         came before it",
                        negotiation.offered.len()
                    );
                }
                negotiation.answer(&stream_key, &mut *self.answer_out)?;
                Ok(true)
            }
            RecordBody::Offer { .. } | RecordBody::OffersEnd { .. } => bail!(
                "the stream is damaged: record {} offers digests after the answer",
                record.position
            ),
            _ if !negotiation.answered => bail!(
                "the stream is damaged: record {} carries blocks before the offers' end",
                record.position
            ),
            _ => Ok(false),
        }
    }

    /// Make every applied record durable, then say so in the progress file.
    fn save(&mut self) -> Result<()> {
        self.pool
            .flush()
            .context("could not flush the pool to record the receive's progress")?;
        write_saved(self.pool_path, self.saved_path, &self.saved)?;
        self.applied_since_save = 0;
        Ok(())
    }
}
