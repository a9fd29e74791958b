//! The handshake: fixed newstyle negotiation, option by option, until the
//! client picks an export (`NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`) or leaves.
//!
//! Options answered: EXPORT_NAME, ABORT, LIST, STARTTLS, INFO, GO,
//! STRUCTURED_REPLY, LIST_META_CONTEXT, SET_META_CONTEXT (for `base:allocation`, and
//! `qemu:dirty-bitmap:BASE`: the blocks changed since BASE, another export the client
//! may open, as [`Export::dirty_bitmap`] finds it), EXTENDED_HEADERS. Anything else
//! gets `NBD_REP_ERR_UNSUP` and negotiation continues. Bytes that break the framing
//! (wrong magic, unknown client flags, an option too large to be real) drop the
//! connection.
//!
//! TLS as the spec's "TLS support" section has it: STARTTLS is answered with an ACK,
//! the handshake follows on the same socket, and negotiation starts again inside it
//! (what was agreed in clear is forgotten). On a listener that requires TLS, every
//! other option but ABORT answers `NBD_REP_ERR_TLS_REQD` until then (EXPORT_NAME,
//! which cannot be answered with an error, drops the connection). An export limited
//! to some TLS identities answers any other client as a name that does not exist
//! (`NBD_REP_ERR_UNKNOWN`, same words), so probing cannot find it, and is left out of
//! its `NBD_OPT_LIST`; the real reason is logged at info.

use crate::config::{NEGOTIATION_TIMEOUT, READ_BUFFER_BYTES, REPLY_WRITE_TIMEOUT};
use crate::export::{Bitmap, Export};
use crate::protocol::*;
use crate::shared::Shared;
use crate::stream::{Stream, StreamReader};
use crate::tls::{Peer, TlsMode};
use std::io::{self, BufReader, Read, Write};
use std::sync::Arc;
use std::time::Duration;

/// Largest option payload accepted. Strings are at most 4096 bytes by the spec;
/// 64 KiB leaves room for a SET_META_CONTEXT with many queries. Larger is garbage
/// or an attack, and the connection is dropped.
pub const OPTION_DATA_MAX_BYTES: u32 = 64 << 10;
/// Options one connection may send before it is dropped. Real clients send fewer
/// than ten; the bound keeps a client from negotiating forever.
pub const OPTIONS_PER_CONNECTION_MAX: usize = 1024;

/// What negotiation agreed on: the connection's export and how to talk to it.
pub(crate) struct Session {
    /// The export opened for this connection.
    pub(crate) export: Arc<dyn Export>,
    /// Its canonical name.
    pub(crate) name: String,
    /// Structured replies / extended headers.
    pub(crate) mode: ReplyMode,
    /// The metadata contexts selected for this export.
    pub(crate) contexts: Contexts,
    /// Writes are refused.
    pub(crate) read_only: bool,
}

/// Metadata contexts a connection selected (`NBD_OPT_SET_META_CONTEXT`).
#[derive(Default, Clone)]
pub(crate) struct Contexts {
    /// `base:allocation` (id [`META_CONTEXT_BASE_ALLOCATION_ID`]).
    pub(crate) base_allocation: bool,
    /// `qemu:dirty-bitmap:NAME`, by NAME; the `i`-th has id
    /// [`META_CONTEXT_DIRTY_BITMAP_FIRST_ID`] + `i`.
    pub(crate) bitmaps: Vec<(String, Arc<dyn Bitmap>)>,
}

impl Contexts {
    /// Whether any was selected (block status is allowed).
    pub(crate) fn any(&self) -> bool {
        self.base_allocation || !self.bitmaps.is_empty()
    }
}

/// A connection's way to its client during negotiation: the buffered reader, the
/// stream replies go to, and whether TLS is up. STARTTLS replaces all three.
pub(crate) struct Channel {
    pub(crate) reader: BufReader<StreamReader>,
    pub(crate) stream: Arc<Stream>,
    pub(crate) peer: Peer,
}

impl Channel {
    /// A channel in clear over `stream`, whose reads fail after `deadline` from now.
    pub(crate) fn new(stream: Arc<Stream>, deadline: Option<Duration>) -> Channel {
        let mut inner = StreamReader::new(Arc::clone(&stream));
        inner.set_deadline(deadline);
        Channel {
            reader: BufReader::with_capacity(READ_BUFFER_BYTES, inner),
            stream,
            peer: Peer::Clear,
        }
    }
}

/// Why negotiation ended without an export.
#[derive(Debug, thiserror::Error)]
pub enum NegotiationError {
    /// The socket failed or closed.
    #[error("socket: {0}")]
    Io(#[from] io::Error),
    /// Client flags with bits this server did not offer (the spec: drop the connection).
    #[error("client flags {0:#x} include bits this server did not offer")]
    UnknownClientFlags(u32),
    /// An option that does not start with `IHAVEOPT`.
    #[error("option magic {0:#018x} is not IHAVEOPT")]
    BadOptionMagic(u64),
    /// An option whose data is over [`OPTION_DATA_MAX_BYTES`].
    #[error("option {option} carries {len} bytes, over the {max}-byte limit")]
    OptionTooLarge {
        /// Option code.
        option: u32,
        /// Its data length.
        len: u32,
        /// [`OPTION_DATA_MAX_BYTES`].
        max: u32,
    },
    /// More than [`OPTIONS_PER_CONNECTION_MAX`] options.
    #[error("more than {0} options")]
    TooManyOptions(usize),
    /// `NBD_OPT_EXPORT_NAME` after extended headers were agreed (the spec forbids it).
    #[error("NBD_OPT_EXPORT_NAME after extended headers were negotiated")]
    ExportNameAfterExtendedHeaders,
    /// An option other than STARTTLS on a listener that requires TLS, which cannot be
    /// refused with an error (EXPORT_NAME).
    #[error("NBD_OPT_EXPORT_NAME in clear where TLS is required")]
    TlsRequired,
    /// Bytes after STARTTLS that came before the server's answer: the client must wait
    /// for it, and anything sent in clear cannot be part of the TLS session.
    #[error("bytes sent after NBD_OPT_STARTTLS before its reply")]
    BytesAfterStartTls,
    /// The TLS handshake failed (wrong key, certificate from another CA, garbage, a
    /// client too slow).
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// `NBD_OPT_EXPORT_NAME` for an export that cannot be served; the only answer is to hang up.
    #[error("export '{name}' refused: {reason}")]
    ExportRefused {
        /// The name asked for.
        name: String,
        /// Why.
        reason: String,
    },
}

/// Negotiation state that options change.
#[derive(Default)]
struct Agreed {
    mode: ReplyMode,
    /// Canonical name of the export metadata contexts were selected for, and them.
    contexts: Option<(String, Contexts)>,
}

impl Agreed {
    /// The contexts selected for export `name` (none if they were for another).
    fn contexts_for(&self, name: &str) -> Contexts {
        match &self.contexts {
            Some((export, contexts)) if export == name => contexts.clone(),
            _ => Contexts::default(),
        }
    }
}

/// Run the handshake on `channel` (replaced by its TLS relay after STARTTLS) for
/// connection `id`. `Ok(None)`: the client aborted.
pub(crate) fn negotiate(
    shared: &Shared,
    id: u64,
    mode: TlsMode,
    channel: &mut Channel,
) -> Result<Option<Session>, NegotiationError> {
    let mut writer = &*channel.stream;
    let mut greeting = [0u8; 18];
    greeting[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    greeting[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    greeting[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    writer.write_all(&greeting)?;

    let client_flags = read_u32(&mut channel.reader)?;
    if client_flags & !CLIENT_FLAGS_KNOWN != 0 {
        return Err(NegotiationError::UnknownClientFlags(client_flags));
    }
    let no_zeroes = client_flags & FLAG_C_NO_ZEROES != 0;
    let mut agreed = Agreed::default();

    for _ in 0..OPTIONS_PER_CONNECTION_MAX {
        let (option, data) = read_option(&mut channel.reader)?;
        let stream = Arc::clone(&channel.stream);
        let peer = channel.peer.clone();
        let mut replies = Replies {
            writer: &stream,
            option,
        };
        if shared.is_shutting_down() && option != OPT_ABORT {
            if option == OPT_EXPORT_NAME {
                return Err(NegotiationError::ExportRefused {
                    name: String::from_utf8_lossy(&data).into_owned(),
                    reason: "the server is shutting down".into(),
                });
            }
            replies.error(REP_ERR_SHUTDOWN, "the server is shutting down")?;
            continue;
        }
        if mode == TlsMode::Require && !peer.is_tls() && option != OPT_STARTTLS {
            match option {
                OPT_ABORT => {}
                OPT_EXPORT_NAME => return Err(NegotiationError::TlsRequired),
                _ => {
                    // In clear, the channel's stream is the client's own socket.
                    let peer = channel.stream.peer();
                    tracing::info!(
                        id,
                        %peer,
                        option,
                        "NBD option refused: client in clear where TLS is required"
                    );
                    replies.error(
                        REP_ERR_TLS_REQD,
                        "this server requires TLS: start it with NBD_OPT_STARTTLS \
                         (for example nbds:// URIs, or qemu's tls-creds)",
                    )?;
                    continue;
                }
            }
        }
        match option {
            OPT_STARTTLS if mode != TlsMode::Off && data.is_empty() && !peer.is_tls() => {
                start_tls(shared, id, channel, &mut replies)?;
                // The spec: nothing agreed in clear holds inside TLS.
                agreed = Agreed::default();
            }
            OPT_STARTTLS if mode != TlsMode::Off && data.is_empty() => {
                replies.error(REP_ERR_INVALID, "TLS is already started")?;
            }
            OPT_EXPORT_NAME => {
                return export_name(shared, &peer, &agreed, &data, no_zeroes, &stream).map(Some);
            }
            OPT_ABORT => {
                // The client may already have gone; the spec says to tolerate that.
                let _ = replies.send(REP_ACK, &[]);
                return Ok(None);
            }
            OPT_INFO | OPT_GO => {
                if let Some(session) = info_or_go(shared, &peer, &agreed, &data, &mut replies)? {
                    return Ok(Some(session));
                }
            }
            _ => answer_option(shared, &peer, &mut agreed, &data, &mut replies)?,
        }
    }
    Err(NegotiationError::TooManyOptions(OPTIONS_PER_CONNECTION_MAX))
}

/// Answer STARTTLS, run the handshake, and switch `channel` to the TLS relay's
/// plaintext stream. Any failure ends the connection.
fn start_tls(
    shared: &Shared,
    id: u64,
    channel: &mut Channel,
    replies: &mut Replies<'_>,
) -> Result<(), NegotiationError> {
    let Some(tls) = &shared.config().tls else {
        return Err(NegotiationError::Io(io::Error::other(
            "TLS is not configured",
        )));
    };
    // A client must wait for the answer before its handshake; bytes already here
    // were sent in clear and would be taken as the start of TLS.
    if !channel.reader.buffer().is_empty() {
        return Err(NegotiationError::BytesAfterStartTls);
    }
    replies.send(REP_ACK, &[])?;
    let deadline = channel
        .reader
        .get_ref()
        .deadline()
        .unwrap_or_else(|| std::time::Instant::now() + NEGOTIATION_TIMEOUT);
    let (plain, peer) =
        tls.credentials
            .start(Arc::clone(&channel.stream), deadline, REPLY_WRITE_TIMEOUT)?;
    let plain = Arc::new(plain);
    plain.set_read_timeout(Some(NEGOTIATION_TIMEOUT))?;
    plain.set_write_timeout(Some(REPLY_WRITE_TIMEOUT))?;
    tracing::debug!(id, tls = %peer.describe(), "NBD TLS started");
    shared.replace_stream(id, Arc::clone(&plain));
    let remaining = deadline.saturating_duration_since(std::time::Instant::now());
    *channel = Channel::new(plain, Some(remaining));
    channel.peer = peer;
    Ok(())
}

/// Whether the client `peer` may open `name` (canonical): the option error to answer
/// if not.
fn may_open(shared: &Shared, peer: &Peer, name: &str) -> Result<(), (u32, String)> {
    let Some(allowed) = shared
        .config()
        .access
        .as_ref()
        .and_then(|a| a.allowed(name))
    else {
        return Ok(());
    };
    match peer {
        Peer::Clear => Err((
            REP_ERR_TLS_REQD,
            format!(
                "export '{}' is limited to some TLS identities: start TLS first",
                name.escape_debug()
            ),
        )),
        Peer::Tls {
            identity: Some(identity),
        } if allowed.iter().any(|a| a == identity) => Ok(()),
        Peer::Tls {
            identity: Some(identity),
        } => Err((
            REP_ERR_POLICY,
            format!(
                "TLS identity '{}' may not open export '{}'",
                identity.escape_debug(),
                name.escape_debug()
            ),
        )),
        Peer::Tls { identity: None } => Err((
            REP_ERR_POLICY,
            format!(
                "export '{}' is limited to some TLS identities, and this connection has \
                 none (a PSK identity, or a client certificate the server verifies)",
                name.escape_debug()
            ),
        )),
    }
}

/// Read one option: its header (checked) and its data.
fn read_option(reader: &mut impl Read) -> Result<(u32, Vec<u8>), NegotiationError> {
    let mut head = [0u8; 16];
    reader.read_exact(&mut head)?;
    let mut r = WireReader::new(&head);
    let (magic, option, len) = match (r.u64(), r.u32(), r.u32()) {
        (Some(m), Some(o), Some(l)) => (m, o, l),
        _ => return Err(NegotiationError::Io(io::ErrorKind::UnexpectedEof.into())),
    };
    if magic != IHAVEOPT {
        return Err(NegotiationError::BadOptionMagic(magic));
    }
    if len > OPTION_DATA_MAX_BYTES {
        return Err(NegotiationError::OptionTooLarge {
            option,
            len,
            max: OPTION_DATA_MAX_BYTES,
        });
    }
    let mut data = vec![0u8; len as usize];
    reader.read_exact(&mut data)?;
    Ok((option, data))
}

/// Answer an option that does not end negotiation.
fn answer_option(
    shared: &Shared,
    peer: &Peer,
    agreed: &mut Agreed,
    data: &[u8],
    replies: &mut Replies<'_>,
) -> io::Result<()> {
    match replies.option {
        OPT_LIST => list(shared, peer, data, replies),
        OPT_STARTTLS if data.is_empty() => {
            replies.error(REP_ERR_POLICY, "TLS is not offered on this endpoint")
        }
        OPT_STRUCTURED_REPLY if data.is_empty() && agreed.mode.extended => replies.error(
            REP_ERR_EXT_HEADER_REQD,
            "extended headers are already negotiated",
        ),
        OPT_STRUCTURED_REPLY if data.is_empty() => {
            agreed.mode.structured = true;
            replies.send(REP_ACK, &[])
        }
        OPT_EXTENDED_HEADERS if data.is_empty() => {
            agreed.mode.extended = true;
            replies.send(REP_ACK, &[])
        }
        OPT_STARTTLS | OPT_STRUCTURED_REPLY | OPT_EXTENDED_HEADERS => {
            replies.error(REP_ERR_INVALID, "this option takes no data")
        }
        OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
            meta_context(shared, peer, agreed, data, replies)
        }
        option => {
            let text = format!("option {option} is not supported by this server");
            replies.error(REP_ERR_UNSUP, &text)
        }
    }
}

/// Option replies for one option.
struct Replies<'a> {
    writer: &'a Stream,
    option: u32,
}

impl Replies<'_> {
    fn send(&mut self, kind: u32, data: &[u8]) -> io::Result<()> {
        // Every reply this module builds is far below 4 GiB (names ≤ 64 KiB).
        let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
        let mut out = Vec::with_capacity(20 + data.len());
        out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.option.to_be_bytes());
        out.extend_from_slice(&kind.to_be_bytes());
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(data);
        let mut w = self.writer;
        w.write_all(&out)
    }

    fn error(&mut self, kind: u32, message: &str) -> io::Result<()> {
        tracing::debug!(option = self.option, kind, message = %message.escape_debug(), "NBD option refused");
        self.send(kind, message.as_bytes())
    }
}

fn read_u32(reader: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    reader.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

/// The canonical name for what the client asked: "" is the default export.
fn resolve_name(shared: &Shared, name: &str) -> Result<String, String> {
    if !name.is_empty() {
        return Ok(name.to_string());
    }
    shared
        .config()
        .default_export
        .clone()
        .or_else(|| shared.exports().default_name())
        .ok_or_else(|| {
            "no default export on this server: ask for an export by name (NBD_OPT_LIST lists them)"
                .to_string()
        })
}

/// Open the export `name` asks for, if `peer` may: else the option error to answer.
/// An export `peer` may not open is answered as a name that does not exist, with the
/// same error and words, so that probing cannot find what `NBD_OPT_LIST` hides; the
/// real reason goes to the log (at info for a refusal, which an admin wants to see).
fn open(
    shared: &Shared,
    peer: &Peer,
    name: &str,
) -> Result<(String, Arc<dyn Export>), (u32, String)> {
    let canonical = resolve_name(shared, name).map_err(|e| (REP_ERR_UNKNOWN, e))?;
    let unavailable = || {
        (
            REP_ERR_UNKNOWN,
            format!(
                "no export '{}' this client may open (NBD_OPT_LIST lists those it may; a \
                 volume limited to TLS identities opens only over TLS with one of them)",
                canonical.escape_debug()
            ),
        )
    };
    if let Err((kind, reason)) = may_open(shared, peer, &canonical) {
        tracing::info!(kind, %reason, "NBD export refused by policy");
        return Err(unavailable());
    }
    let export = shared.exports().open(&canonical).map_err(|reason| {
        let reason = reason.escape_debug().to_string();
        tracing::debug!(%reason, "NBD export not opened");
        unavailable()
    })?;
    Ok((canonical, export))
}

fn transmission_flags(read_only: bool, mode: ReplyMode) -> u16 {
    // CAN_MULTI_CONN: the engine's flush makes every acknowledged write of every
    // handle on the pool durable, and all handles see one store (no per-connection
    // cache), which is what the flag promises.
    let mut flags = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_CAN_MULTI_CONN
        | TFLAG_SEND_CACHE;
    if read_only {
        flags |= TFLAG_READ_ONLY;
    } else {
        // Zeroing is a block-map operation whatever its size: always fast.
        flags |= TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO;
    }
    if mode.chunked() {
        flags |= TFLAG_SEND_DF;
    }
    flags
}

fn export_name(
    shared: &Shared,
    peer: &Peer,
    agreed: &Agreed,
    data: &[u8],
    no_zeroes: bool,
    writer: &Stream,
) -> Result<Session, NegotiationError> {
    if agreed.mode.extended {
        return Err(NegotiationError::ExportNameAfterExtendedHeaders);
    }
    let asked = String::from_utf8_lossy(data).into_owned();
    let (name, export) =
        open(shared, peer, &asked).map_err(|(_, reason)| NegotiationError::ExportRefused {
            // Escaped: the error ends up in a log line, where a newline would forge one.
            name: asked.escape_debug().to_string(),
            reason,
        })?;
    // A snapshot is served read-only whatever the server's mode.
    let read_only = shared.config().read_only || export.read_only();
    let mut out = Vec::with_capacity(10 + EXPORT_NAME_PADDING_BYTES);
    out.extend_from_slice(&export.size_bytes().to_be_bytes());
    out.extend_from_slice(&transmission_flags(read_only, agreed.mode).to_be_bytes());
    if !no_zeroes {
        out.resize(out.len() + EXPORT_NAME_PADDING_BYTES, 0);
    }
    let mut w = writer;
    w.write_all(&out)?;
    let contexts = agreed.contexts_for(&name);
    Ok(Session {
        export,
        name,
        mode: agreed.mode,
        contexts,
        read_only,
    })
}

fn list(shared: &Shared, peer: &Peer, data: &[u8], replies: &mut Replies<'_>) -> io::Result<()> {
    if !data.is_empty() {
        return replies.error(REP_ERR_INVALID, "NBD_OPT_LIST takes no data");
    }
    for desc in shared.exports().list() {
        // Only what this client may open.
        if may_open(shared, peer, &desc.name).is_err() {
            continue;
        }
        let name_len = u32::try_from(desc.name.len()).unwrap_or(u32::MAX);
        let mut out = Vec::with_capacity(4 + desc.name.len() + desc.description.len());
        out.extend_from_slice(&name_len.to_be_bytes());
        out.extend_from_slice(desc.name.as_bytes());
        out.extend_from_slice(desc.description.as_bytes());
        replies.send(REP_SERVER, &out)?;
    }
    replies.send(REP_ACK, &[])
}

/// Parse `NBD_OPT_INFO`/`NBD_OPT_GO` data: name, then the information requests.
fn parse_info_request(data: &[u8]) -> Option<(&str, Vec<u16>)> {
    let mut r = WireReader::new(data);
    let name_len = usize::try_from(r.u32()?).ok()?;
    let name = r.string(name_len)?;
    let count = r.u16()?;
    let mut requests = Vec::with_capacity(usize::from(count).min(r.remaining() / 2));
    for _ in 0..count {
        requests.push(r.u16()?);
    }
    if r.remaining() != 0 {
        return None;
    }
    Some((name, requests))
}

fn info_or_go(
    shared: &Shared,
    peer: &Peer,
    agreed: &Agreed,
    data: &[u8],
    replies: &mut Replies<'_>,
) -> Result<Option<Session>, NegotiationError> {
    let go = replies.option == OPT_GO;
    let Some((asked, requests)) = parse_info_request(data) else {
        replies.error(REP_ERR_INVALID, "malformed NBD_OPT_INFO/NBD_OPT_GO data")?;
        return Ok(None);
    };
    let (name, export) = match open(shared, peer, asked) {
        Ok(opened) => opened,
        Err((kind, reason)) => {
            replies.error(kind, &reason)?;
            return Ok(None);
        }
    };
    // A snapshot is served read-only whatever the server's mode.
    let read_only = shared.config().read_only || export.read_only();

    let mut info = Vec::with_capacity(14);
    info.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    info.extend_from_slice(&export.size_bytes().to_be_bytes());
    info.extend_from_slice(&transmission_flags(read_only, agreed.mode).to_be_bytes());
    replies.send(REP_INFO, &info)?;

    // Sent whether asked or not (the spec lets a server): the minimum is the protocol's
    // default of one byte, but the preferred size (a whole 4 KiB block, no
    // read-modify-write) and the payload limit are worth knowing to every client.
    info.clear();
    info.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    info.extend_from_slice(&BLOCK_SIZE_MIN_BYTES.to_be_bytes());
    info.extend_from_slice(&BLOCK_SIZE_PREFERRED_BYTES.to_be_bytes());
    info.extend_from_slice(&PAYLOAD_MAX_BYTES.to_be_bytes());
    replies.send(REP_INFO, &info)?;

    if requests.contains(&INFO_NAME) || asked != name {
        info.clear();
        info.extend_from_slice(&INFO_NAME.to_be_bytes());
        info.extend_from_slice(name.as_bytes());
        replies.send(REP_INFO, &info)?;
    }
    if requests.contains(&INFO_DESCRIPTION) {
        if let Some(desc) = shared.exports().list().into_iter().find(|d| d.name == name) {
            info.clear();
            info.extend_from_slice(&INFO_DESCRIPTION.to_be_bytes());
            info.extend_from_slice(desc.description.as_bytes());
            replies.send(REP_INFO, &info)?;
        }
    }
    replies.send(REP_ACK, &[])?;
    if !go {
        return Ok(None);
    }
    let contexts = agreed.contexts_for(&name);
    Ok(Some(Session {
        export,
        name,
        mode: agreed.mode,
        contexts,
        read_only,
    }))
}

/// Parse LIST/SET_META_CONTEXT data: export name, then the queries.
fn parse_meta_request(data: &[u8]) -> Option<(&str, Vec<&str>)> {
    let mut r = WireReader::new(data);
    let name_len = usize::try_from(r.u32()?).ok()?;
    let name = r.string(name_len)?;
    let count = r.u32()?;
    // Each query takes at least 4 bytes: a count beyond that is malformed.
    if usize::try_from(count).ok()? > r.remaining() / 4 {
        return None;
    }
    let mut queries = Vec::new();
    for _ in 0..count {
        let len = usize::try_from(r.u32()?).ok()?;
        queries.push(r.string(len)?);
    }
    if r.remaining() != 0 {
        return None;
    }
    Some((name, queries))
}

fn meta_context(
    shared: &Shared,
    peer: &Peer,
    agreed: &mut Agreed,
    data: &[u8],
    replies: &mut Replies<'_>,
) -> io::Result<()> {
    let set = replies.option == OPT_SET_META_CONTEXT;
    if set {
        // The spec: SET replaces the previous selection, even when it fails.
        agreed.contexts = None;
    }
    if !agreed.mode.chunked() {
        return replies.error(
            REP_ERR_INVALID,
            "negotiate structured replies or extended headers before metadata contexts",
        );
    }
    let Some((asked, queries)) = parse_meta_request(data) else {
        return replies.error(REP_ERR_INVALID, "malformed metadata context request");
    };
    let (name, export) = match open(shared, peer, asked) {
        Ok(opened) => opened,
        Err((kind, reason)) => return replies.error(kind, &reason),
    };
    // LIST answers with id 0 (the spec: reserved there); SET with the real ids.
    let mut contexts = Contexts::default();
    let base_allocation = if set {
        queries.contains(&META_CONTEXT_BASE_ALLOCATION)
    } else {
        queries.is_empty()
            || queries
                .iter()
                .any(|q| *q == "base:" || *q == META_CONTEXT_BASE_ALLOCATION)
    };
    if base_allocation {
        let id = if set {
            META_CONTEXT_BASE_ALLOCATION_ID
        } else {
            0
        };
        send_context(replies, id, META_CONTEXT_BASE_ALLOCATION)?;
        contexts.base_allocation = true;
    }
    // Dirty bitmaps are named, never listed by a prefix query: which other exports
    // this one could be compared with is not the client's to enumerate.
    for query in &queries {
        let Some(base) = query.strip_prefix(META_CONTEXT_DIRTY_BITMAP_PREFIX) else {
            continue;
        };
        if base.is_empty() || contexts.bitmaps.iter().any(|(b, _)| b == base) {
            continue;
        }
        if contexts.bitmaps.len() == DIRTY_BITMAPS_PER_CONNECTION_MAX {
            return replies.error(
                REP_ERR_TOO_BIG,
                &format!("at most {DIRTY_BITMAPS_PER_CONNECTION_MAX} dirty bitmaps per connection"),
            );
        }
        // The base must be an export this client may open: its bitmap tells which
        // of its blocks differ from this export's.
        // Checked under its full name: a volume's snapshot `before` is `vm@before`.
        let full = export.base_name(base);
        let bitmap = may_open(shared, peer, &full)
            .map_err(|(_, why)| why)
            .and_then(|()| export.dirty_bitmap(&full));
        match bitmap {
            Ok(bitmap) => {
                let id = if set {
                    META_CONTEXT_DIRTY_BITMAP_FIRST_ID + contexts.bitmaps.len() as u32
                } else {
                    0
                };
                send_context(replies, id, query)?;
                contexts.bitmaps.push((base.to_string(), bitmap));
            }
            // Not offered: the spec has the server leave an unknown context out.
            Err(why) => tracing::debug!(
                "metadata context {} for export {} not offered: {why}",
                query.escape_debug(),
                name.escape_debug()
            ),
        }
    }
    if set && contexts.any() {
        agreed.contexts = Some((name, contexts));
    }
    replies.send(REP_ACK, &[])
}

/// One `NBD_REP_META_CONTEXT`: the context's id, then its name.
fn send_context(replies: &mut Replies<'_>, id: u32, name: &str) -> io::Result<()> {
    let mut out = Vec::with_capacity(4 + name.len());
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    replies.send(REP_META_CONTEXT, &out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_request_parsing_is_checked() {
        let mut ok = Vec::new();
        ok.extend_from_slice(&3u32.to_be_bytes());
        ok.extend_from_slice(b"abc");
        ok.extend_from_slice(&2u16.to_be_bytes());
        ok.extend_from_slice(&INFO_NAME.to_be_bytes());
        ok.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        assert_eq!(
            parse_info_request(&ok),
            Some(("abc", vec![INFO_NAME, INFO_BLOCK_SIZE]))
        );
        // Name longer than the data, short request list, trailing bytes.
        let mut long_name = ok.clone();
        long_name[3] = 200;
        assert_eq!(parse_info_request(&long_name), None);
        assert_eq!(parse_info_request(&ok[..ok.len() - 1]), None);
        let mut trailing = ok.clone();
        trailing.push(0);
        assert_eq!(parse_info_request(&trailing), None);
        assert_eq!(parse_info_request(&[]), None);
    }

    #[test]
    fn meta_request_parsing_is_checked() {
        let mut ok = Vec::new();
        ok.extend_from_slice(&0u32.to_be_bytes());
        ok.extend_from_slice(&1u32.to_be_bytes());
        ok.extend_from_slice(&15u32.to_be_bytes());
        ok.extend_from_slice(b"base:allocation");
        assert_eq!(parse_meta_request(&ok), Some(("", vec!["base:allocation"])));
        let mut huge_count = ok.clone();
        huge_count[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(parse_meta_request(&huge_count), None);
        assert_eq!(parse_meta_request(&ok[..ok.len() - 1]), None);
    }

    #[test]
    fn flags_follow_mode_and_read_only() {
        let simple = transmission_flags(false, ReplyMode::default());
        assert_eq!(simple & TFLAG_SEND_DF, 0);
        assert_ne!(simple & TFLAG_SEND_TRIM, 0);
        assert_ne!(simple & TFLAG_CAN_MULTI_CONN, 0);
        let ro = transmission_flags(
            true,
            ReplyMode {
                structured: true,
                extended: false,
            },
        );
        assert_ne!(ro & TFLAG_READ_ONLY, 0);
        assert_ne!(ro & TFLAG_SEND_DF, 0);
        assert_eq!(
            ro & (TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO),
            0
        );
        assert_eq!(ro & TFLAG_ROTATIONAL, 0);
    }
}
