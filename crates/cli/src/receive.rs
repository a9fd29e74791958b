//! `volume receive`: a send stream (docs/stream.md) from stdin into a new volume.
//!
//! The volume is made as an internal volume (`%receive.NAME`, `internal.rs` of the
//! engine: no client can list, open or write it): a full stream's a new volume of
//! the stream's size, an incremental one's a clone of a frozen copy of the base
//! (`%receivebase.NAME`, taken when the receive begins, after its size and identity
//! or content digest matched the stream's), which base references read too. It
//! becomes NAME only after the end record checked out, so no half-made volume is
//! ever visible under NAME; an in-place update rolls NAME to it in one engine step
//! that refuses NAME written since the receive's base (or, forced, since it began).
//! Progress lives in a small file beside the pool (`progress.rs`): the stream's
//! header and the first record not yet durable. It is rewritten only after a pool
//! flush made every record before it durable, so a crash or a cut stream leaves a
//! record count that is true; records are absolute (each writes its own blocks), so
//! those applied again after it are harmless. `--resume` reads the same stream
//! again, or a resumed send's, skipping the records already held.

mod progress;

use anyhow::{anyhow, bail, Context, Result};
use fewerbytes_engine::{BlockSource, OpenOptions, Pool, Provisioning, Volume, BLOCK_BYTES};
use fewerbytes_format::location::Codec;
use fewerbytes_format::stream::{
    Answer, PayloadCodec, Record, RecordBody, RecordHead, StreamHeader, HEADER_BYTES,
    OFFER_DIGEST_BYTES, RECORD_HEAD_BYTES,
};
use std::collections::{HashMap, HashSet};
use std::io::{BufReader, Read, Write};
use std::path::Path;
use std::sync::Arc;

use crate::control::{served_or_local, with_local_pool};
use crate::send::{content_digest, hex, ResumeToken};
use crate::size::format_size;
pub use crate::stream_request::ReceiveRequest;
use progress::{progress_path, read_saved, write_saved, Names, Saved, SavedSnapshot};

const BLOCK: u64 = BLOCK_BYTES as u64;
/// The suffix of the partial volume's name an earlier version made (a user name):
/// resumed only when the progress file names it.
pub const PARTIAL_SUFFIX: &str = ":receiving";
/// Stream bytes applied between two durable progress records: what a crash may
/// make a resumed receive apply again (a pool flush and a small file each).
const SAVE_EVERY_BYTES: u64 = 64 << 20;
/// Blocks a reference record copies per read and write (1 MiB).
const REF_CHUNK_BLOCKS: u64 = 256;
/// The most digests a two-way receive takes as offers. Each costs about 72 bytes
/// while the receive runs (16 in the list of offers, a set entry of 16 and a table
/// entry of 32, with the hash tables' slack): 4 Mi offers, 16 GiB of distinct
/// blocks, keep a server's receive under ~300 MiB. A larger volume goes one-way.
const OFFERS_MAX: u64 = 4 << 20;

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

/// What a receive works on: the pool, its path, the request, and where progress goes.
struct Target<'a> {
    pool: &'a Arc<Pool>,
    pool_path: &'a Path,
    request: &'a ReceiveRequest,
    names: Names,
    saved_path: std::path::PathBuf,
}

impl Target<'_> {
    fn name(&self) -> &str {
        self.request.name.as_str()
    }

    /// Whether user volume `name` exists.
    fn exists(&self, name: &str) -> bool {
        self.pool.volume_sizes().iter().any(|(v, _)| v == name)
    }

    /// Delete the internal volumes a receive into NAME makes (leftovers of one whose
    /// progress file is gone, or of one discarded), and `partial` when an earlier
    /// version's progress file names it.
    fn discard_volumes(&self, partial: Option<&str>) -> Result<()> {
        let internal = self.pool.internal();
        let names = &self.names;
        let ours = [&names.partial, &names.frozen_base, &names.frozen_target].map(|n| n.as_str());
        for volume in partial.into_iter().chain(ours) {
            if internal.exists(volume) {
                internal
                    .delete(volume, false)
                    .with_context(|| format!("could not delete the receive's volume '{volume}'"))?;
            }
        }
        Ok(())
    }

    /// Drop an interrupted receive: its volumes and its progress file.
    fn abandon(&self, saved: Option<&Saved>) -> Result<String> {
        self.discard_volumes(saved.map(|s| s.partial.as_str()))?;
        if saved.is_some() {
            std::fs::remove_file(&self.saved_path)
                .with_context(|| format!("could not remove {}", self.saved_path.display()))?;
        }
        Ok(format!(
            "Interrupted receive of '{}' discarded.",
            self.name()
        ))
    }
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
    let target = Target {
        pool,
        pool_path,
        request,
        names: Names::of(name)?,
        saved_path: progress_path(pool_path, name)?,
    };
    let saved = read_saved(&target.saved_path, name, &target.names)?;
    if request.abandon {
        return target.abandon(saved.as_ref());
    }
    if !request.resume && saved.is_some() {
        bail!(
            "an interrupted receive of '{name}' is waiting: continue it with `volume \
             receive {name} --resume`, or discard it with `volume receive {name} --abandon`"
        );
    }
    if request.resume && saved.is_none() {
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
        Some(saved) if pool.internal().exists(&saved.partial) => {
            resume_checks(&target, &header, saved)?
        }
        // The progress file was written before the volumes were made: begin again.
        _ => begin(&target, &header, &header_bytes)?,
    };
    let (result, saved) = apply_stream(&target, header, saved, &mut input, answer_out);
    match result {
        Err(e) if header.negotiated => {
            // Its records depend on the answer: a two-way receive is not resumed.
            let _ = target.abandon(Some(&saved));
            Err(e.context(format!(
                "the two-way receive of '{name}' stopped and was discarded; send again"
            )))
        }
        Ok(()) => {
            let made = finish(&target, &saved)?;
            std::fs::remove_file(&target.saved_path)
                .with_context(|| format!("could not remove {}", target.saved_path.display()))?;
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
            "the receive of '{name}' stopped; records 0..{} are held durably. Continue \
             with `volume receive {name} --resume` fed the same stream, or fed `volume \
             send VOLUME --resume-token {}` (with the same --from); discard it with \
             `volume receive {name} --abandon`",
            saved.next_position,
            ResumeToken::text(&header.stream_key, saved.next_position)
        ))),
    }
}

/// Open the volumes a receive reads and writes, and apply the stream's records.
/// Returns how it ended and the progress as it then stands.
fn apply_stream<R: Read>(
    target: &Target,
    header: StreamHeader,
    saved: Saved,
    input: &mut StreamInput<R>,
    answer_out: &mut dyn Write,
) -> (Result<()>, Saved) {
    let internal = target.pool.internal();
    let opened = (|| {
        let volume = internal.open(&saved.partial)?;
        let base = saved
            .frozen_base
            .as_deref()
            .map(|b| internal.open(b))
            .transpose()?;
        let negotiation = match header.negotiated {
            true => Some(Negotiation::open(
                target.pool,
                &target.request.negotiate_with,
            )?),
            false => None,
        };
        Ok::<_, anyhow::Error>((volume, base, negotiation))
    })();
    let (volume, base, negotiation) = match opened {
        Ok(opened) => opened,
        Err(e) => return (Err(e), saved),
    };
    let mut apply = Apply {
        name: target.name(),
        pool: target.pool,
        pool_path: target.pool_path,
        saved_path: &target.saved_path,
        volume: &volume,
        base: base.as_ref(),
        negotiation,
        answer_out,
        header,
        incremental: header.base.is_some(),
        saved,
        applied_since_save: 0,
    };
    let result = apply.run(input);
    (result, apply.saved)
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

/// A fresh receive: the progress file first (a crash before the volumes exist
/// leaves a file that a resume begins again from, and --abandon removes), then the
/// frozen copy of the base, checked against the stream, the in-place checks, and
/// the partial volume. Anything made is deleted again when a step is refused.
fn begin(target: &Target, header: &StreamHeader, header_bytes: &[u8]) -> Result<Saved> {
    let name = target.name();
    target.discard_volumes(None)?;
    let base = resolve_base(target.pool, header, target.request.from.as_deref(), name)?;
    let onto = target.exists(name);
    let names = &target.names;
    let saved = Saved {
        header: hex(header_bytes),
        partial: names.partial.as_str().to_string(),
        next_position: 0,
        next_lbn: 0,
        data_records: 0,
        ref_blocks: 0,
        base_ref_blocks: 0,
        pool_ref_blocks: 0,
        zero_blocks: 0,
        base: base.as_ref().map(|b| b.name.clone()),
        frozen_base: base
            .as_ref()
            .map(|_| names.frozen_base.as_str().to_string()),
        frozen_target: (onto && target.request.force)
            .then(|| names.frozen_target.as_str().to_string()),
        onto,
        snapshot: None,
    };
    write_saved(target.pool_path, &target.saved_path, &saved)?;
    let made = (|| {
        let internal = target.pool.internal();
        if let Some(base) = &base {
            internal
                .clone(&base.name, &names.frozen_base, Provisioning::THIN)
                .with_context(|| {
                    format!("could not take a frozen copy of the base '{}'", base.name)
                })?;
            base.verify(target.pool, header, names.frozen_base.as_str())?;
        }
        if onto {
            check_onto(
                target.pool,
                name,
                saved.base.as_deref(),
                target.request.force,
            )?;
            if target.request.force {
                internal.clone(name, &names.frozen_target, Provisioning::THIN)?;
            }
        }
        make_partial(
            target.pool,
            header,
            &names.partial,
            saved.frozen_base.as_deref(),
            target.request.provisioning,
        )
    })();
    if let Err(e) = made {
        let _ = target.discard_volumes(None);
        let _ = std::fs::remove_file(&target.saved_path);
        return Err(e);
    }
    Ok(saved)
}

/// A resumed receive: the base its references read is still the sender's, NAME
/// was not made meanwhile, and an in-place target was not written since the point
/// the final step will hold it to (with `--force`: that point moves to now).
fn resume_checks(target: &Target, header: &StreamHeader, mut saved: Saved) -> Result<Saved> {
    let name = target.name();
    let internal = target.pool.internal();
    match saved.frozen_base.as_deref() {
        Some(frozen) if !internal.exists(frozen) => bail!(
            "the frozen copy of the base of the interrupted receive of '{name}' is gone: \
             discard it with `volume receive {name} --abandon` and receive again"
        ),
        Some(_) => {}
        None => {
            // An earlier version's receive read the live base: it must still be
            // the sender's, and from now on a frozen copy of it is read.
            if let Some(base) = resolve_base(target.pool, header, saved.base.as_deref(), name)? {
                let frozen = target.names.frozen_base.as_str().to_string();
                saved.frozen_base = Some(frozen.clone());
                write_saved(target.pool_path, &target.saved_path, &saved)?;
                internal.clone(&base.name, &target.names.frozen_base, Provisioning::THIN)?;
                base.verify(target.pool, header, &frozen)?;
            }
        }
    }
    if !saved.onto && target.exists(name) {
        bail!("a volume named '{name}' was made since the receive began");
    }
    if saved.onto && target.request.force {
        let frozen = &target.names.frozen_target;
        if internal.exists(frozen.as_str()) {
            internal.delete(frozen.as_str(), false)?;
        }
        saved.frozen_target = Some(frozen.as_str().to_string());
        write_saved(target.pool_path, &target.saved_path, &saved)?;
        internal.clone(name, frozen, Provisioning::THIN)?;
    } else if saved.onto && internal.written_since(name, unchanged_since(&saved)?)? {
        bail!(written_since_message(name, &saved));
    }
    Ok(saved)
}

/// The volume an in-place target must read alike at the final step: its copy taken
/// when a forced receive began, else the base's frozen copy (NAME's snapshot, which
/// NAME matched when the receive began), else (an earlier version's file) the base.
fn unchanged_since(saved: &Saved) -> Result<&str> {
    saved
        .frozen_target
        .as_deref()
        .or(saved.frozen_base.as_deref())
        .or(saved.base.as_deref())
        .ok_or_else(|| anyhow!("an in-place receive's progress file names no base"))
}

fn written_since_message(name: &str, saved: &Saved) -> String {
    let since = match (&saved.frozen_target, &saved.base) {
        (None, Some(base)) => format!("since its snapshot '{base}', the stream's base"),
        _ => "since the receive began".to_string(),
    };
    format!(
        "volume '{name}' was written {since}, so the receive did not update it (what was \
         written is kept; the received records wait). Discard them with `volume receive \
         {name} --abandon`, or apply them over what was written with `volume receive \
         {name} --resume --force` fed the same stream"
    )
}

/// How a local base is shown to be the sender's.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Proof {
    /// Named by the user (`--from`, or a snapshot of the in-place target NAME): a
    /// snapshot by its identity, a volume by its content digest.
    Named,
    /// Found by the name the stream carries: only its content digest proves it (an
    /// identity alone is a guess any stream can carry).
    Content,
}

/// The local base of an incremental stream, before it is checked.
struct LocalBase {
    name: String,
    proof: Proof,
}

/// For an incremental stream, the local base: `from` (a short name is NAME's
/// snapshot when NAME exists, as `volume diff` takes it), else the snapshot of NAME
/// with the stream's base identity, else the name the stream carries; and the one
/// it exists. Refused when the pool lacks it.
fn resolve_base(
    pool: &Arc<Pool>,
    header: &StreamHeader,
    from: Option<&str>,
    name: &str,
) -> Result<Option<LocalBase>> {
    let Some(base) = &header.base else {
        return Ok(None);
    };
    let carried = base
        .name_str()
        .ok_or_else(|| anyhow!("the stream's base has no name"))?;
    let name_exists = pool.volume_sizes().iter().any(|(v, _)| v == name);
    let own_snapshot = |guid: u64| -> Result<Option<String>> {
        Ok(pool
            .snapshots(name)?
            .into_iter()
            .find(|s| s.guid.as_deref() == Some(&format!("{guid:016x}")))
            .map(|s| s.name))
    };
    // A snapshot of NAME, the volume the user named, is named by the user too.
    let of_target = name_exists && carried.split_once('@').is_some_and(|(of, _)| of == name);
    let carried_proof = match of_target {
        true => Proof::Named,
        false => Proof::Content,
    };
    let (base_name, proof) = match (from, base.guid) {
        (Some(from), _) if name_exists => (pool.base_name(name, from)?, Proof::Named),
        (Some(from), _) => (from.to_string(), Proof::Named),
        (None, Some(guid)) if name_exists => match own_snapshot(guid)? {
            Some(own) => (own, Proof::Named),
            None => (carried.to_string(), carried_proof),
        },
        (None, _) => (carried.to_string(), carried_proof),
    };
    if pool.open_volume(&base_name).is_err() {
        bail!(
            "the stream is incremental from {}, which this pool does not hold: receive a \
             full stream first (or name the base here with --from)",
            match base.guid {
                Some(guid) => format!("snapshot '{carried}' (identity {guid:016x})"),
                None => format!("volume '{base_name}'"),
            }
        );
    }
    Ok(Some(LocalBase {
        name: base_name,
        proof,
    }))
}

impl LocalBase {
    /// Refuse the base unless it is the sender's: the stream's size, and its
    /// identity (a snapshot the user named) or its content digest, read from
    /// `frozen`, the copy base references will read.
    fn verify(&self, pool: &Arc<Pool>, header: &StreamHeader, frozen: &str) -> Result<()> {
        let Some(base) = &header.base else {
            return Ok(());
        };
        let base_name = &self.name;
        let volume = pool.internal().open(frozen)?;
        if volume.size_bytes() != base.size_bytes {
            bail!(
                "the stream is incremental from a base of {} bytes, but volume \
                 '{base_name}' holds {} bytes: it is not the sender's base",
                base.size_bytes,
                volume.size_bytes()
            );
        }
        match (base.guid, self.proof) {
            (Some(guid), Proof::Named) => {
                if !base_name.contains('@') {
                    bail!(
                        "the stream is incremental from snapshot '{}' (identity \
                         {guid:016x}), and '{base_name}' is a volume, not a snapshot of \
                         that identity",
                        base.name_str().unwrap_or("?")
                    );
                }
                let here = crate::send::snapshot_guid(pool, base_name)?;
                if here != guid {
                    bail!(
                        "snapshot '{base_name}' is not the sender's base: its identity is \
                         {here:016x} here, {guid:016x} in the stream (another snapshot of \
                         the same name)"
                    );
                }
                Ok(())
            }
            (Some(guid), Proof::Content) => bail!(
                "the stream is incremental from snapshot '{base_name}' (identity \
                 {guid:016x}), and nothing named it here: a base found by the identity a \
                 stream carries is not taken on its word. Name it with --from {base_name} \
                 if it is the sender's base"
            ),
            (None, _) => {
                let digest = content_digest(&volume, "base")?;
                if digest != base.content_digest {
                    bail!(
                        "volume '{base_name}' differs from the sender's base (content \
                         digest {}… here, {}… in the stream): it was written since, or is \
                         another volume",
                        hex(&digest[..8]),
                        hex(&base.content_digest[..8])
                    );
                }
                Ok(())
            }
        }
    }
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
    if pool.internal().written_since(name, base)? {
        bail!(
            "volume '{name}' was written since its snapshot '{base}', the stream's base: \
             receive with --force to discard what was written since"
        );
    }
    Ok(())
}

/// The end of a receive whose records all checked out: the partial volume becomes
/// NAME (renamed; or, when the stream updates NAME in place, NAME rolled to it in
/// one step refused when NAME was written since `unchanged_since`, and the partial
/// deleted), the frozen copies are deleted, then the stream's snapshot of NAME is
/// made with the sender's identity. Returns what it made, for the summary.
fn finish(target: &Target, saved: &Saved) -> Result<String> {
    let (pool, name, partial) = (target.pool, target.name(), saved.partial.as_str());
    let internal = pool.internal();
    if saved.onto {
        internal
            .rollback(name, partial, Some(unchanged_since(saved)?))
            .with_context(|| written_since_message(name, saved))?;
        internal.delete(partial, false)?;
    } else {
        internal.rename(partial, name)?;
    }
    target.discard_volumes(None)?;
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
/// a clone of the base's frozen copy, resized to the stream's size; each reserving
/// as asked (thick by default, as `volume create` and `volume clone`).
fn make_partial(
    pool: &Arc<Pool>,
    header: &StreamHeader,
    partial: &fewerbytes_engine::InternalName,
    frozen_base: Option<&str>,
    provisioning: Provisioning,
) -> Result<()> {
    let internal = pool.internal();
    let Some(base) = frozen_base else {
        internal
            .create(partial, header.volume_size_bytes, provisioning)
            .context("could not create the partial volume")?;
        return Ok(());
    };
    internal
        .clone(base, partial, provisioning)
        .context("could not clone the base to the partial volume")?;
    if internal.open(partial.as_str())?.size_bytes() != header.volume_size_bytes {
        internal.resize(partial.as_str(), header.volume_size_bytes)?;
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
    /// The candidates `--negotiate-with` names, opened for the answer.
    fn open(pool: &Arc<Pool>, names: &[String]) -> Result<Self> {
        let candidates = names
            .iter()
            .map(|v| {
                pool.open_volume(v)
                    .with_context(|| format!("--negotiate-with names volume '{v}'"))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            candidates,
            offered: Vec::new(),
            table: HashMap::new(),
            answered: false,
        })
    }

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
                        let digest = offer_digest(stream_key, block);
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

/// What an offer carries for `block`: its keyed hash under the stream key, cut short.
fn offer_digest(stream_key: &[u8; 32], block: &[u8]) -> [u8; OFFER_DIGEST_BYTES] {
    let full = blake3::keyed_hash(stream_key, block);
    let mut digest = [0u8; OFFER_DIGEST_BYTES];
    digest.copy_from_slice(&full.as_bytes()[..OFFER_DIGEST_BYTES]);
    digest
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
                // Durable, and said so: a final step refused resumes at the end record.
                return self.save();
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
                // The candidate is a live volume: what it holds now must still be
                // what was offered, or the sender's block is not what is copied.
                if offer_digest(&self.header.stream_key, &block) != *digest {
                    bail!(
                        "volume '{}' was written since this pool answered the offers: its                          block {source_lbn} no longer holds the block record {} refers to",
                        from.name(),
                        record.position
                    );
                }
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
                // A sender offers each distinct block once: never more than the
                // volume's blocks, nor than the receive keeps in memory.
                let blocks = self.header.volume_size_bytes / BLOCK;
                let limit = blocks.min(OFFERS_MAX);
                let total = (negotiation.offered.len() + digests.len()) as u64;
                if total > limit {
                    bail!(
                        "the sender offers more than {limit} digests (record {}): at most one \
                         a block of the {blocks}-block volume, and {OFFERS_MAX} at most, the \
                         memory a two-way receive may take; send this volume one-way \
                         (without --negotiate-with)",
                        record.position
                    );
                }
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
