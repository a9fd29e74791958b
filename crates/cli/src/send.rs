//! `volume send`: a volume out as a send stream on stdout (docs/stream.md), full or
//! incremental from a base volume both pools hold; `receive.rs` applies it.
//!
//! The stream is made in block order. A block whose map names zeros goes out in a
//! zero run; a block whose stored object was sent before in this stream, or whose
//! bytes were (a keyed BLAKE3 under the stream's key), goes out as a reference to the
//! block it was first sent as; any other block is read and sent once, compressed with
//! the pool's codec when that saves an eighth. An incremental stream covers only the
//! blocks whose map entries differ from the base's (`Volume::changed_since`).
//!
//! Given the same key and the same source, a send makes the same records: that is
//! how `--resume-token` sends only the records after those a receiver holds.

use anyhow::{bail, Context, Result};
use fewerbytes_engine::{BlockSource, Compression, OpenOptions, Pool, Volume, BLOCK_BYTES};
use fewerbytes_format::location::Codec;
use fewerbytes_format::stream::{
    Answer, BaseId, PayloadCodec, Record, RecordBody, StreamHeader, ANSWER_HEAD_BYTES,
    OFFER_DIGESTS_MAX, OFFER_DIGEST_BYTES,
};
use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use crate::control::{served_or_local, with_local_pool_read_only};
use crate::output::Progress;
use crate::size::format_size;
pub use crate::stream_request::SendRequest;

const BLOCK: u64 = BLOCK_BYTES as u64;
/// Blocks whose map entries are read at once, and the largest read: 1 MiB.
const CHUNK_BLOCKS: usize = 256;
/// Bytes of stream buffered before a write to stdout.
const OUT_BUFFER_BYTES: usize = 1 << 20;

/// What a resumed send starts from (`volume receive` prints it on an interruption).
pub struct ResumeToken {
    /// The stream's key.
    pub stream_key: [u8; 32],
    /// The first record the receiver lacks.
    pub position: u64,
}

impl ResumeToken {
    /// `KEYHEX-POSITION`.
    pub fn parse(text: &str) -> Result<ResumeToken> {
        let bad = || {
            anyhow::anyhow!(
                "'{text}' is not a resume token (64 hex digits, '-', a record number; \
                 `volume receive` prints it when a stream is cut short)"
            )
        };
        let (key, position) = text.split_once('-').ok_or_else(bad)?;
        let key = decode_hex32(key).ok_or_else(bad)?;
        let position = position.parse().map_err(|_| bad())?;
        Ok(ResumeToken {
            stream_key: key,
            position,
        })
    }

    /// The token's text.
    pub fn text(stream_key: &[u8; 32], position: u64) -> String {
        format!("{}-{position}", hex(stream_key))
    }
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// 32 bytes from 64 hex digits.
pub fn decode_hex32(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Write volume `name` as a stream to stdout, incremental from `from` if given; with
/// `to`, to the stdin of that shell command (a `volume receive --negotiate-with`),
/// in two-way mode: the blocks its answer says it holds are not sent. A pool a
/// server holds is read by the server, the stream coming over its control socket
/// (`stream_socket`); else this process opens the pool read-only.
pub fn send(
    pool_path: &Path,
    name: &str,
    from: Option<&str>,
    resume: Option<ResumeToken>,
    to: Option<&str>,
) -> Result<()> {
    if to.is_some() && resume.is_some() {
        bail!("a two-way send (--to) cannot be resumed: send it again");
    }
    let stdout = std::io::stdout();
    if to.is_none() && std::io::IsTerminal::is_terminal(&stdout) {
        bail!(
            "stdout is a terminal: a send stream is binary; redirect it to a file or pipe \
             it into `fewerbytes volume receive`"
        );
    }
    if to.is_some() {
        // A receiver that exits early must cost an error here (EPIPE), naming it,
        // not end this process silently by SIGPIPE.
        // SAFETY: setting a signal disposition; no handler runs.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
    }
    let mut receiver = match to {
        Some(command) => Some(
            std::process::Command::new("sh")
                .arg("-c")
                .arg(command)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .with_context(|| format!("could not start the receiver `{command}`"))?,
        ),
        None => None,
    };
    let (sink, answers): (Box<dyn Write + Send>, Option<Box<dyn Read + Send>>) = match &mut receiver
    {
        Some(child) => (
            Box::new(child.stdin.take().context("the receiver's stdin")?),
            Some(Box::new(
                child.stdout.take().context("the receiver's stdout")?,
            )),
        ),
        None => (Box::new(stdout), None),
    };
    let request = SendRequest {
        name: name.to_string(),
        from: from.map(str::to_string),
        resume_token: resume
            .as_ref()
            .map(|t| ResumeToken::text(&t.stream_key, t.position)),
        negotiated: answers.is_some(),
    };
    let result = match served_or_local(pool_path)? {
        Some(client) => crate::stream_socket::send_through(&client, &request, sink, answers),
        None => {
            let sent = with_local_pool_read_only(pool_path, &OpenOptions::default(), |pool| {
                let mut sink = sink;
                let mut answers = answers;
                send_from_pool(
                    pool,
                    &request,
                    &mut sink,
                    answers.as_mut().map(|a| a as &mut dyn Read),
                )
            });
            crate::interrupt::explain(sent, || {
                format!(
                    "the send of volume '{name}' stopped part-way: the receiver got a \
                     cut-short stream (a receive keeps what it applied and prints the \
                     --resume-token that sends the rest)"
                )
            })
        }
    };
    let result = result.map(|summary| eprintln!("{summary}"));
    if let Some(mut child) = receiver {
        // Its stdin is closed (dropped with the sink, or never written on an
        // error): it ends, and its status tells whether it made the volume.
        drop(child.stdin.take());
        let status = child.wait().context("could not wait for the receiver")?;
        // A stop by signal is what the user asked for; the receiver's failure follows.
        let stopped = matches!(&result, Err(e) if crate::interrupt::find(e).is_some());
        if !status.success() && !stopped {
            bail!("the receiver failed ({status}); its error is above");
        }
        return result;
    }
    result
}

/// Write the stream of `request` to `sink` from an open pool (this process's, or a
/// server's); in two-way mode `answers` carries the receiver's answer. Returns the
/// summary line for the person who asked.
pub fn send_from_pool(
    pool: &Arc<Pool>,
    request: &SendRequest,
    sink: &mut dyn Write,
    mut answers: Option<&mut dyn Read>,
) -> Result<String> {
    let name = request.name.as_str();
    let from = request.from.as_deref();
    let resume = request
        .resume_token
        .as_deref()
        .map(ResumeToken::parse)
        .transpose()?;
    if request.negotiated != answers.is_some() {
        bail!("a two-way send needs the receiver's answers, and only it reads them");
    }
    if request.negotiated && resume.is_some() {
        bail!("a two-way send (--to) cannot be resumed: send it again");
    }
    let volume = pool.open_volume(name)?;
    // A snapshot of the source's own volume is named by its short name, as `volume
    // diff --from` names it.
    let of = name.split_once('@').map_or(name, |(of, _)| of);
    let base_name = from.map(|b| pool.base_name(of, b)).transpose()?;
    let base = base_name
        .as_deref()
        .map(|b| pool.open_volume(b))
        .transpose()?;
    let compression = pool.info().compression;
    let source_map_digest = map_digest(&volume, base.as_ref())?;
    let snapshot = match name.split_once('@') {
        Some((_, short)) => Some((snapshot_guid(pool, name)?, short.to_string())),
        None => None,
    };
    let base_id = match (&base, base_name.as_deref()) {
        (Some(base), Some(full)) => {
            // A snapshot is never written: its identity names its content, so the
            // digest (a read of the whole base) is left out and the receiver looks
            // the identity up instead.
            let guid = match full.contains('@') {
                true => Some(snapshot_guid(pool, full)?),
                false => None,
            };
            Some(BaseId {
                name: BaseId::pad_name(full)
                    .with_context(|| format!("base name '{full}' is too long"))?,
                size_bytes: base.size_bytes(),
                content_digest: match guid {
                    Some(_) => [0; 32],
                    None => content_digest(base, "base")?,
                },
                guid,
            })
        }
        _ => None,
    };
    let stream_key = match &resume {
        Some(token) => token.stream_key,
        None => {
            let mut key = [0u8; 32];
            rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut key);
            key
        }
    };
    let header = StreamHeader {
        volume_size_bytes: volume.size_bytes(),
        source_pool_id: pool.id(),
        stream_key,
        base: base_id,
        negotiated: request.negotiated,
        source_map_digest,
        snapshot: snapshot.is_some(),
    };
    let runs = match &base {
        Some(base) => volume.changed_since(base)?,
        None => std::iter::once(0..volume.size_bytes() / BLOCK).collect(),
    };
    let planned_blocks: u64 = runs.iter().map(|r| r.end - r.start).sum();
    let progress = Progress::new(planned_blocks * BLOCK, &format!("send {name}"));
    let mut out = Emitter {
        out: sink,
        buffer: Vec::with_capacity(OUT_BUFFER_BYTES + 2 * BLOCK_BYTES),
        header,
        skip_before: resume.as_ref().map_or(0, |t| t.position),
        position: 0,
        pending: None,
        counts: Counts::default(),
        wire_bytes: 0,
    };
    out.write_raw(&header.encode())?;
    if let Some((guid, name)) = snapshot {
        out.record(0, 0, RecordBody::Snapshot { guid, name })?;
    }
    let in_base = match &base {
        Some(base) => objects_in_base(&volume, &runs, base)?,
        None => HashMap::new(),
    };
    let mut sender = Sender {
        volume: &volume,
        compression,
        first_by_object: HashMap::new(),
        first_by_content: HashMap::new(),
        in_base,
        held_objects: HashMap::new(),
        held_digests: HashSet::new(),
        stream_key,
    };
    if let Some(answers) = &mut answers {
        sender.negotiate(&runs, &mut out, *answers)?;
    }
    for run in runs {
        sender.send_run(run.clone(), &mut out)?;
        progress.advance((run.end - run.start) * BLOCK);
    }
    let counts = out.finish()?;
    let wire_bytes = out.wire_bytes;
    let held = if answers.is_some() {
        format!(", {} the receiver held", counts.pool_ref_blocks)
    } else {
        String::new()
    };
    Ok(progress.summary_line(
        &format!(
            "Sent volume '{name}'{}: {} blocks of data, {} by reference, {} by reference \
             to the base{held}, {} of zeros; {} on the wire",
            base_name
                .map(|b| format!(" (changes since '{b}')"))
                .unwrap_or_default(),
            counts.data_records,
            counts.ref_blocks,
            counts.base_ref_blocks,
            format_size(counts.zero_blocks * BLOCK),
            format_size(wire_bytes)
        ),
        planned_blocks * BLOCK,
    ))
}

/// The records' counts, as the end record carries them.
#[derive(Default, Clone, Copy)]
struct Counts {
    data_records: u64,
    ref_blocks: u64,
    base_ref_blocks: u64,
    pool_ref_blocks: u64,
    zero_blocks: u64,
}

/// A run of zeros or of references not written yet: the next block may extend it.
enum Pending {
    Zero { lbn: u64, count: u32 },
    Ref { lbn: u64, count: u32, source: u64 },
    BaseRef { lbn: u64, count: u32, source: u64 },
}

/// Numbers records, joins runs, and writes what a resumed send does not skip.
struct Emitter<'w> {
    out: &'w mut dyn Write,
    buffer: Vec<u8>,
    header: StreamHeader,
    /// Records before this position are made but not written (`--resume-token`).
    skip_before: u64,
    position: u64,
    pending: Option<Pending>,
    counts: Counts,
    wire_bytes: u64,
}

impl Emitter<'_> {
    fn write_raw(&mut self, bytes: &[u8]) -> Result<()> {
        self.buffer.extend_from_slice(bytes);
        self.wire_bytes += bytes.len() as u64;
        if self.buffer.len() >= OUT_BUFFER_BYTES {
            self.drain()?;
        }
        Ok(())
    }

    fn drain(&mut self) -> Result<()> {
        crate::interrupt::check()?;
        self.out
            .write_all(&self.buffer)
            .context("could not write the stream")?;
        self.buffer.clear();
        Ok(())
    }

    fn record(&mut self, lbn: u64, count: u32, body: RecordBody) -> Result<()> {
        let record = Record {
            position: self.position,
            lbn,
            count,
            body,
        };
        self.position += 1;
        if record.position < self.skip_before {
            return Ok(());
        }
        let mut bytes = Vec::with_capacity(BLOCK_BYTES + 64);
        record.encode(&self.header.stream_key, &mut bytes);
        self.write_raw(&bytes)
    }

    fn flush_pending(&mut self) -> Result<()> {
        match self.pending.take() {
            None => Ok(()),
            Some(Pending::Zero { lbn, count }) => self.record(lbn, count, RecordBody::Zero),
            Some(Pending::Ref { lbn, count, source }) => {
                self.record(lbn, count, RecordBody::Ref { source_lbn: source })
            }
            Some(Pending::BaseRef { lbn, count, source }) => {
                self.record(lbn, count, RecordBody::BaseRef { source_lbn: source })
            }
        }
    }

    fn zero(&mut self, lbn: u64, blocks: u64) -> Result<()> {
        self.counts.zero_blocks += blocks;
        let mut lbn = lbn;
        let mut left = blocks;
        while left > 0 {
            if let Some(Pending::Zero {
                lbn: start,
                count: n,
            }) = &mut self.pending
            {
                if *start + u64::from(*n) == lbn && *n < u32::MAX {
                    let take = left.min(u64::from(u32::MAX - *n));
                    *n += take as u32;
                    lbn += take;
                    left -= take;
                    continue;
                }
            }
            self.flush_pending()?;
            let take = left.min(u64::from(u32::MAX));
            self.pending = Some(Pending::Zero {
                lbn,
                count: take as u32,
            });
            lbn += take;
            left -= take;
        }
        Ok(())
    }

    fn reference(&mut self, lbn: u64, source: u64) -> Result<()> {
        self.counts.ref_blocks += 1;
        if let Some(Pending::Ref {
            lbn: start,
            count,
            source: first,
        }) = &mut self.pending
        {
            let next = u64::from(*count);
            // The source run must lie wholly before the record's first block.
            if *start + next == lbn
                && *first + next == source
                && source < *start
                && *count < u32::MAX
            {
                *count += 1;
                return Ok(());
            }
        }
        self.flush_pending()?;
        self.pending = Some(Pending::Ref {
            lbn,
            count: 1,
            source,
        });
        Ok(())
    }

    fn base_reference(&mut self, lbn: u64, source: u64) -> Result<()> {
        self.counts.base_ref_blocks += 1;
        if let Some(Pending::BaseRef {
            lbn: start,
            count,
            source: first,
        }) = &mut self.pending
        {
            let next = u64::from(*count);
            if *start + next == lbn && *first + next == source && *count < u32::MAX {
                *count += 1;
                return Ok(());
            }
        }
        self.flush_pending()?;
        self.pending = Some(Pending::BaseRef {
            lbn,
            count: 1,
            source,
        });
        Ok(())
    }

    fn pool_reference(&mut self, lbn: u64, digest: [u8; OFFER_DIGEST_BYTES]) -> Result<()> {
        self.counts.pool_ref_blocks += 1;
        self.flush_pending()?;
        self.record(lbn, 1, RecordBody::PoolRef { digest })
    }

    fn data(&mut self, lbn: u64, codec: PayloadCodec, bytes: Vec<u8>) -> Result<()> {
        self.counts.data_records += 1;
        self.flush_pending()?;
        self.record(lbn, 1, RecordBody::Data { codec, bytes })
    }

    fn finish(&mut self) -> Result<Counts> {
        self.flush_pending()?;
        let counts = self.counts;
        self.record(
            0,
            0,
            RecordBody::End {
                data_records: counts.data_records,
                ref_blocks: counts.ref_blocks,
                base_ref_blocks: counts.base_ref_blocks,
                pool_ref_blocks: counts.pool_ref_blocks,
                zero_blocks: counts.zero_blocks,
            },
        )?;
        self.drain()?;
        self.out.flush().context("could not write the stream")?;
        Ok(counts)
    }
}

/// What the stream has sent so far, to send each distinct block once.
struct Sender<'a> {
    volume: &'a Volume,
    compression: Compression,
    /// Stored object → the block it was first sent as: a block naming it needs no read.
    first_by_object: HashMap<u64, u64>,
    /// Keyed BLAKE3 of the bytes → the block first sent with them: two objects of
    /// the same bytes (a pool's index need not have found every duplicate).
    first_by_content: HashMap<[u8; 32], u64>,
    /// Stored object → a block of the base that names it (incremental streams): the
    /// receiver holds those bytes, so they go as a base reference, never sent.
    in_base: HashMap<u64, u64>,
    /// Two-way mode: stored object → its digest, for the objects whose bytes the
    /// receiver answered it holds (sent as pool references, never read again).
    held_objects: HashMap<u64, [u8; OFFER_DIGEST_BYTES]>,
    /// Two-way mode: the digests the receiver holds.
    held_digests: HashSet<[u8; OFFER_DIGEST_BYTES]>,
    stream_key: [u8; 32],
}

impl Sender<'_> {
    fn send_run(&mut self, run: Range<u64>, out: &mut Emitter<'_>) -> Result<()> {
        // Holes first, from the extents (no walk over a thin volume's unwritten
        // blocks); then the data runs block by block.
        for (data, blocks) in extents(self.volume, run)? {
            if !data {
                out.zero(blocks.start, blocks.end - blocks.start)?;
                continue;
            }
            let mut lbn = blocks.start;
            let mut sources = vec![BlockSource::Zero; CHUNK_BLOCKS];
            let mut bytes = vec![0u8; CHUNK_BLOCKS * BLOCK_BYTES];
            while lbn < blocks.end {
                let n = (blocks.end - lbn).min(CHUNK_BLOCKS as u64) as usize;
                let sources = &mut sources[..n];
                self.volume.block_sources(lbn, sources)?;
                let must_read = sources.iter().any(|s| {
                    matches!(s, BlockSource::Stored(o)
                        if !self.first_by_object.contains_key(o)
                            && !self.in_base.contains_key(o)
                            && !self.held_objects.contains_key(o))
                });
                let bytes = &mut bytes[..n * BLOCK_BYTES];
                if must_read {
                    self.volume.read(lbn * BLOCK, bytes).with_context(|| {
                        format!(
                            "could not read volume '{}' at blocks {lbn}..+{n}",
                            self.volume.name()
                        )
                    })?;
                }
                for (i, source) in sources.iter().enumerate() {
                    let at = lbn + i as u64;
                    let block = &bytes[i * BLOCK_BYTES..(i + 1) * BLOCK_BYTES];
                    self.send_block(at, *source, block, out)?;
                }
                lbn += n as u64;
            }
        }
        Ok(())
    }

    fn send_block(
        &mut self,
        lbn: u64,
        source: BlockSource,
        block: &[u8],
        out: &mut Emitter<'_>,
    ) -> Result<()> {
        let object = match source {
            BlockSource::Zero => return out.zero(lbn, 1),
            BlockSource::Stored(object) => object,
        };
        if let Some(at) = self.in_base.get(&object) {
            return out.base_reference(lbn, *at);
        }
        if let Some(first) = self.first_by_object.get(&object) {
            return out.reference(lbn, *first);
        }
        if let Some(digest) = self.held_objects.get(&object) {
            // Later copies refer to this block, as to a block sent.
            self.first_by_object.insert(object, lbn);
            return out.pool_reference(lbn, *digest);
        }
        if block.iter().all(|b| *b == 0) {
            return out.zero(lbn, 1);
        }
        let digest = *blake3::keyed_hash(&self.stream_key, block).as_bytes();
        self.first_by_object.insert(object, lbn);
        if let Some(first) = self.first_by_content.get(&digest) {
            return out.reference(lbn, *first);
        }
        self.first_by_content.insert(digest, lbn);
        let short = short_digest(&digest);
        if self.held_digests.contains(&short) {
            return out.pool_reference(lbn, short);
        }
        let (codec, bytes) = match fewerbytes_engine::compress_block(self.compression, block) {
            Some((Codec::Lz4, bytes)) => (PayloadCodec::Lz4, bytes),
            Some((Codec::Zstd, bytes)) => (PayloadCodec::Zstd, bytes),
            None => (PayloadCodec::Raw, block.to_vec()),
        };
        out.data(lbn, codec, bytes)
    }
}

/// The first 16 bytes of a digest: what an offer and a pool reference carry.
fn short_digest(digest: &[u8; 32]) -> [u8; OFFER_DIGEST_BYTES] {
    let mut out = [0u8; OFFER_DIGEST_BYTES];
    out.copy_from_slice(&digest[..OFFER_DIGEST_BYTES]);
    out
}

impl Sender<'_> {
    /// Two-way mode: offer the digest of every distinct block the stream would send
    /// as data (neither in the base nor zeros), read the receiver's answer, and keep
    /// what it holds. Reads each such block once more than a one-way send.
    fn negotiate(
        &mut self,
        runs: &[Range<u64>],
        out: &mut Emitter<'_>,
        answers: &mut dyn Read,
    ) -> Result<()> {
        let mut offered: Vec<([u8; OFFER_DIGEST_BYTES], u64)> = Vec::new();
        let mut seen_objects: HashSet<u64> = HashSet::new();
        let mut seen_digests: HashSet<[u8; OFFER_DIGEST_BYTES]> = HashSet::new();
        let mut sources = vec![BlockSource::Zero; CHUNK_BLOCKS];
        let mut bytes = vec![0u8; CHUNK_BLOCKS * BLOCK_BYTES];
        for run in runs {
            for (data, blocks) in extents(self.volume, run.clone())? {
                let mut lbn = blocks.start;
                while data && lbn < blocks.end {
                    let n = (blocks.end - lbn).min(CHUNK_BLOCKS as u64) as usize;
                    self.volume.block_sources(lbn, &mut sources[..n])?;
                    let fresh = |s: &BlockSource| {
                        matches!(s, BlockSource::Stored(o)
                            if !seen_objects.contains(o) && !self.in_base.contains_key(o))
                    };
                    if sources[..n].iter().any(fresh) {
                        self.volume
                            .read(lbn * BLOCK, &mut bytes[..n * BLOCK_BYTES])?;
                    }
                    for (i, source) in sources[..n].iter().enumerate() {
                        let BlockSource::Stored(object) = *source else {
                            continue;
                        };
                        if self.in_base.contains_key(&object) || !seen_objects.insert(object) {
                            continue;
                        }
                        let block = &bytes[i * BLOCK_BYTES..(i + 1) * BLOCK_BYTES];
                        if block.iter().all(|b| *b == 0) {
                            continue;
                        }
                        let digest =
                            short_digest(blake3::keyed_hash(&self.stream_key, block).as_bytes());
                        if seen_digests.insert(digest) {
                            offered.push((digest, object));
                        }
                    }
                    lbn += n as u64;
                }
            }
        }
        for batch in offered.chunks(OFFER_DIGESTS_MAX) {
            out.record(
                0,
                batch.len() as u32,
                RecordBody::Offer {
                    digests: batch.iter().map(|(d, _)| *d).collect(),
                },
            )?;
        }
        out.record(
            0,
            0,
            RecordBody::OffersEnd {
                offered: offered.len() as u64,
            },
        )?;
        out.drain()?;
        out.out
            .flush()
            .context("could not write the offers to the receiver")?;
        let mut head = [0u8; ANSWER_HEAD_BYTES];
        answers
            .read_exact(&mut head)
            .context("the receiver sent no answer to the offers (its error is above)")?;
        let len = Answer::bitmap_bytes(&head, offered.len() as u64)
            .map_err(|e| anyhow::anyhow!("the receiver's answer is damaged: {e}"))?;
        let mut bitmap = vec![0u8; len];
        answers
            .read_exact(&mut bitmap)
            .context("the receiver's answer is cut short")?;
        let answer = Answer::decode(&head, &bitmap)
            .map_err(|e| anyhow::anyhow!("the receiver's answer is damaged: {e}"))?;
        for (i, (digest, object)) in offered.iter().enumerate() {
            if answer.holds(i as u64) {
                self.held_objects.insert(*object, *digest);
                self.held_digests.insert(*digest);
            }
        }
        Ok(())
    }
}

/// The identity of snapshot `full_name` (`VOLUME@SNAPSHOT`), from the pool's list of
/// the volume's snapshots.
pub fn snapshot_guid(pool: &Pool, full_name: &str) -> Result<u64> {
    let (of, _) = full_name
        .split_once('@')
        .with_context(|| format!("'{full_name}' is not a snapshot's name"))?;
    let found = pool
        .snapshots(of)?
        .into_iter()
        .find(|s| s.name == full_name)
        .with_context(|| format!("no snapshot '{full_name}'"))?;
    let text = found
        .guid
        .with_context(|| format!("snapshot '{full_name}' has no identity"))?;
    u64::from_str_radix(&text, 16)
        .ok()
        .filter(|g| *g != 0)
        .with_context(|| format!("snapshot '{full_name}' has identity '{text}', not 16 hex digits"))
}

/// For the stored objects the changed `runs` of `volume` name, a block of `base`
/// naming the same object: a walk over both maps, no read; its memory follows the
/// changed blocks, not the base.
fn objects_in_base(
    volume: &Volume,
    runs: &[Range<u64>],
    base: &Volume,
) -> Result<HashMap<u64, u64>> {
    let mut wanted: std::collections::HashSet<u64> = std::collections::HashSet::new();
    let mut sources = vec![BlockSource::Zero; CHUNK_BLOCKS];
    let mut visit = |vol: &Volume, blocks: Range<u64>, f: &mut dyn FnMut(u64, u64)| -> Result<()> {
        for (data, blocks) in extents(vol, blocks)? {
            let mut lbn = blocks.start;
            while data && lbn < blocks.end {
                let n = (blocks.end - lbn).min(CHUNK_BLOCKS as u64) as usize;
                vol.block_sources(lbn, &mut sources[..n])?;
                for (i, s) in sources[..n].iter().enumerate() {
                    if let BlockSource::Stored(object) = s {
                        f(lbn + i as u64, *object);
                    }
                }
                lbn += n as u64;
            }
        }
        Ok(())
    };
    for run in runs {
        visit(volume, run.clone(), &mut |_, object| {
            wanted.insert(object);
        })?;
    }
    let mut found = HashMap::new();
    if !wanted.is_empty() {
        visit(base, 0..base.size_bytes() / BLOCK, &mut |lbn, object| {
            if wanted.contains(&object) {
                found.entry(object).or_insert(lbn);
            }
        })?;
    }
    Ok(found)
}

/// The runs of `blocks` (a block range of `volume`) as data or holes, in order.
fn extents(volume: &Volume, blocks: Range<u64>) -> Result<Vec<(bool, Range<u64>)>> {
    let mut out = Vec::new();
    let mut lbn = blocks.start;
    for extent in volume.extents(blocks.start * BLOCK, (blocks.end - blocks.start) * BLOCK)? {
        let n = extent.len_bytes / BLOCK;
        out.push((extent.data, lbn..lbn + n));
        lbn += n;
    }
    Ok(out)
}

/// A digest of what `volume`'s map (and `base`'s) name: a resumed send refuses a
/// source that changed since the stream began. Object numbers, not bytes: it costs
/// a walk over the maps' data runs, no read.
fn map_digest(volume: &Volume, base: Option<&Volume>) -> Result<u64> {
    let mut hasher = blake3::Hasher::new();
    for vol in std::iter::once(volume).chain(base) {
        hasher.update(&vol.size_bytes().to_le_bytes());
        let mut sources = vec![BlockSource::Zero; CHUNK_BLOCKS];
        for (data, blocks) in extents(vol, 0..vol.size_bytes() / BLOCK)? {
            let mut lbn = blocks.start;
            while data && lbn < blocks.end {
                let n = (blocks.end - lbn).min(CHUNK_BLOCKS as u64) as usize;
                vol.block_sources(lbn, &mut sources[..n])?;
                for (i, s) in sources[..n].iter().enumerate() {
                    if let BlockSource::Stored(object) = s {
                        hasher.update(&(lbn + i as u64).to_le_bytes());
                        hasher.update(&object.to_le_bytes());
                    }
                }
                lbn += n as u64;
            }
        }
    }
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    Ok(u64::from_le_bytes(first))
}

/// The base digest (docs/stream.md): BLAKE3 over the volume's size and, for each
/// block that does not read as zeros, its number and the BLAKE3 of its bytes. The
/// same bytes give the same digest in any pool, whatever its maps and keys; a block
/// whose object was hashed already is not read again.
pub fn content_digest(volume: &Volume, role: &str) -> Result<[u8; 32]> {
    let size_bytes = volume.size_bytes();
    let mut hasher = blake3::Hasher::new();
    hasher.update(&size_bytes.to_le_bytes());
    let mut by_object: HashMap<u64, Option<[u8; 32]>> = HashMap::new();
    let mut sources = vec![BlockSource::Zero; CHUNK_BLOCKS];
    let mut bytes = vec![0u8; CHUNK_BLOCKS * BLOCK_BYTES];
    let progress = Progress::new(size_bytes, &format!("check {role} '{}'", volume.name()));
    for (data, blocks) in extents(volume, 0..size_bytes / BLOCK)? {
        let mut lbn = blocks.start;
        while data && lbn < blocks.end {
            let n = (blocks.end - lbn).min(CHUNK_BLOCKS as u64) as usize;
            volume.block_sources(lbn, &mut sources[..n])?;
            let must_read = sources[..n]
                .iter()
                .any(|s| matches!(s, BlockSource::Stored(o) if !by_object.contains_key(o)));
            let bytes = &mut bytes[..n * BLOCK_BYTES];
            if must_read {
                volume.read(lbn * BLOCK, bytes).with_context(|| {
                    format!(
                        "could not read volume '{}' at blocks {lbn}..+{n}",
                        volume.name()
                    )
                })?;
            }
            for (i, source) in sources[..n].iter().enumerate() {
                let BlockSource::Stored(object) = source else {
                    continue;
                };
                let block = &bytes[i * BLOCK_BYTES..(i + 1) * BLOCK_BYTES];
                let hash = *by_object.entry(*object).or_insert_with(|| {
                    (!block.iter().all(|b| *b == 0)).then(|| *blake3::hash(block).as_bytes())
                });
                if let Some(hash) = hash {
                    hasher.update(&(lbn + i as u64).to_le_bytes());
                    hasher.update(&hash);
                }
            }
            lbn += n as u64;
        }
        progress.advance((blocks.end - blocks.start) * BLOCK);
    }
    progress.finish_quietly();
    Ok(*hasher.finalize().as_bytes())
}
