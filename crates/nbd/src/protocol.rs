//! The NBD wire protocol: magic numbers, flags, option and command codes, the
//! layout of every header this server sends or receives, and the parsing of a
//! transmission request into a validated [`Command`] with one error per
//! malformed case.
//!
//! Every value here is taken from `doc/proto.md` of `NetworkBlockDevice/nbd`
//! (master) and, for extended headers, its `extension-ext-header` branch. All
//! integers on the wire are big-endian.

use crate::export::{EINVAL, ENOSPC, EPERM};

// ---------------------------------------------------------------------------
// Handshake
// ---------------------------------------------------------------------------

/// `NBDMAGIC`, the first 8 bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the newstyle magic, and the prefix of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic that starts every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Handshake flag: fixed newstyle negotiation.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: no 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: the client does not want the 124 zero bytes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;
/// Every client flag this server knows; any other bit means the connection is dropped.
pub const CLIENT_FLAGS_KNOWN: u32 = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;

/// Zero bytes after the `NBD_OPT_EXPORT_NAME` reply unless `NO_ZEROES` was agreed.
pub const EXPORT_NAME_PADDING_BYTES: usize = 124;

/// `NBD_OPT_EXPORT_NAME`.
pub const OPT_EXPORT_NAME: u32 = 1;
/// `NBD_OPT_ABORT`.
pub const OPT_ABORT: u32 = 2;
/// `NBD_OPT_LIST`.
pub const OPT_LIST: u32 = 3;
/// `NBD_OPT_PEEK_EXPORT` (withdrawn; answered `NBD_REP_ERR_UNSUP`).
pub const OPT_PEEK_EXPORT: u32 = 4;
/// `NBD_OPT_STARTTLS`.
pub const OPT_STARTTLS: u32 = 5;
/// `NBD_OPT_INFO`.
pub const OPT_INFO: u32 = 6;
/// `NBD_OPT_GO`.
pub const OPT_GO: u32 = 7;
/// `NBD_OPT_STRUCTURED_REPLY`.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// `NBD_OPT_LIST_META_CONTEXT`.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// `NBD_OPT_SET_META_CONTEXT`.
pub const OPT_SET_META_CONTEXT: u32 = 10;
/// `NBD_OPT_EXTENDED_HEADERS`.
pub const OPT_EXTENDED_HEADERS: u32 = 11;

/// `NBD_REP_ACK`.
pub const REP_ACK: u32 = 1;
/// `NBD_REP_SERVER`: one export in a `NBD_OPT_LIST` answer.
pub const REP_SERVER: u32 = 2;
/// `NBD_REP_INFO`: one item of `NBD_OPT_INFO`/`NBD_OPT_GO`.
pub const REP_INFO: u32 = 3;
/// `NBD_REP_META_CONTEXT`.
pub const REP_META_CONTEXT: u32 = 4;
/// Bit 31 marks an option error reply.
const REP_ERR: u32 = 1 << 31;
/// `NBD_REP_ERR_UNSUP`: unknown option.
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
/// `NBD_REP_ERR_POLICY`: known option, refused by policy.
pub const REP_ERR_POLICY: u32 = REP_ERR | 2;
/// `NBD_REP_ERR_INVALID`: known option, malformed.
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
/// `NBD_REP_ERR_TLS_REQD`: the option needs TLS started first.
pub const REP_ERR_TLS_REQD: u32 = REP_ERR | 5;
/// `NBD_REP_ERR_UNKNOWN`: no such export.
pub const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
/// `NBD_REP_ERR_SHUTDOWN`: the server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR | 7;
/// `NBD_REP_ERR_TOO_BIG`: the option's data, or what it asks for, is larger than this
/// server accepts.
pub const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;
/// `NBD_REP_ERR_EXT_HEADER_REQD`: structured replies asked after extended headers.
pub const REP_ERR_EXT_HEADER_REQD: u32 = REP_ERR | 10;

/// `NBD_INFO_EXPORT`: size and transmission flags.
pub const INFO_EXPORT: u16 = 0;
/// `NBD_INFO_NAME`: canonical export name.
pub const INFO_NAME: u16 = 1;
/// `NBD_INFO_DESCRIPTION`: human-readable description.
pub const INFO_DESCRIPTION: u16 = 2;
/// `NBD_INFO_BLOCK_SIZE`: minimum, preferred and maximum sizes.
pub const INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------
// Transmission flags (sent with the export's size)
// ---------------------------------------------------------------------------

/// `NBD_FLAG_HAS_FLAGS`: always set.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// `NBD_FLAG_READ_ONLY`.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// `NBD_FLAG_SEND_FLUSH`.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// `NBD_FLAG_SEND_FUA`.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// `NBD_FLAG_ROTATIONAL` (never set: the store is not a spinning disk to its clients).
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
/// `NBD_FLAG_SEND_TRIM`.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// `NBD_FLAG_SEND_WRITE_ZEROES`.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// `NBD_FLAG_SEND_DF`: only when structured replies or extended headers are on.
pub const TFLAG_SEND_DF: u16 = 1 << 7;
/// `NBD_FLAG_CAN_MULTI_CONN`.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// `NBD_FLAG_SEND_CACHE`.
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
/// `NBD_FLAG_SEND_FAST_ZERO`.
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---------------------------------------------------------------------------
// Requests and replies
// ---------------------------------------------------------------------------

/// `NBD_REQUEST_MAGIC`: a compact (28-byte) request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// `NBD_EXTENDED_REQUEST_MAGIC`: a 32-byte request with a 64-bit length.
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// `NBD_SIMPLE_REPLY_MAGIC`.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// `NBD_STRUCTURED_REPLY_MAGIC`.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// `NBD_EXTENDED_REPLY_MAGIC`.
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// Bytes of a compact request header.
pub const COMPACT_REQUEST_BYTES: usize = 28;
/// Bytes of an extended request header.
pub const EXTENDED_REQUEST_BYTES: usize = 32;
/// Bytes of a simple reply header.
pub const SIMPLE_REPLY_BYTES: usize = 16;
/// Bytes of a structured reply chunk header.
pub const STRUCTURED_REPLY_BYTES: usize = 20;
/// Bytes of an extended reply chunk header.
pub const EXTENDED_REPLY_BYTES: usize = 32;

/// `NBD_CMD_READ`.
pub const CMD_READ: u16 = 0;
/// `NBD_CMD_WRITE`.
pub const CMD_WRITE: u16 = 1;
/// `NBD_CMD_DISC`.
pub const CMD_DISC: u16 = 2;
/// `NBD_CMD_FLUSH`.
pub const CMD_FLUSH: u16 = 3;
/// `NBD_CMD_TRIM`.
pub const CMD_TRIM: u16 = 4;
/// `NBD_CMD_CACHE`.
pub const CMD_CACHE: u16 = 5;
/// `NBD_CMD_WRITE_ZEROES`.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// `NBD_CMD_BLOCK_STATUS`.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// `NBD_CMD_FLAG_FUA`: valid on every command (the spec: existing clients set it anywhere).
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// `NBD_CMD_FLAG_NO_HOLE` (WRITE_ZEROES).
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// `NBD_CMD_FLAG_DF` (READ, structured replies only).
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// `NBD_CMD_FLAG_REQ_ONE` (BLOCK_STATUS).
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// `NBD_CMD_FLAG_FAST_ZERO` (WRITE_ZEROES).
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
/// `NBD_CMD_FLAG_PAYLOAD_LEN` (extended headers: *length* is a payload length).
pub const CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

/// `NBD_REPLY_FLAG_DONE`: the last chunk of a structured reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// `NBD_REPLY_TYPE_NONE`.
pub const REPLY_TYPE_NONE: u16 = 0;
/// `NBD_REPLY_TYPE_OFFSET_DATA`.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// `NBD_REPLY_TYPE_OFFSET_HOLE`.
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// `NBD_REPLY_TYPE_BLOCK_STATUS` (structured replies, 32-bit descriptors).
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// `NBD_REPLY_TYPE_BLOCK_STATUS_EXT` (extended headers, 64-bit descriptors).
pub const REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
/// `NBD_REPLY_TYPE_ERROR`.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;

/// `base:allocation` flag: not allocated.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` flag: reads as zeros.
pub const STATE_ZERO: u32 = 1 << 1;
/// The allocation metadata context.
pub const META_CONTEXT_BASE_ALLOCATION: &str = "base:allocation";
/// The id this server gives `base:allocation` in `NBD_REP_META_CONTEXT` (any nonzero value).
pub const META_CONTEXT_BASE_ALLOCATION_ID: u32 = 1;
/// The prefix of QEMU's dirty-bitmap contexts: `qemu:dirty-bitmap:NAME`, the blocks
/// changed since NAME (here: another export, a snapshot of this one).
pub const META_CONTEXT_DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";
/// The id of the first dirty-bitmap context a client selects; the next get the ids
/// after it.
pub const META_CONTEXT_DIRTY_BITMAP_FIRST_ID: u32 = 2;
/// Dirty bitmaps one connection may select at once.
pub const DIRTY_BITMAPS_PER_CONNECTION_MAX: usize = 8;
/// `qemu:dirty-bitmap` flag: the block changed.
pub const STATE_DIRTY: u32 = 1 << 0;

// ---------------------------------------------------------------------------
// Size constraints (NBD_INFO_BLOCK_SIZE)
// ---------------------------------------------------------------------------

/// Minimum block size: one byte, the protocol's default. Any offset and length
/// inside the export is served, as the spec asks of a server that a client may
/// never ask for block sizes (`NBD_OPT_EXPORT_NAME`, or GO without
/// `NBD_INFO_BLOCK_SIZE`), and as qemu-nbd serves a raw file.
pub const BLOCK_SIZE_MIN_BYTES: u32 = 1;
/// Preferred block size: the engine's 4 KiB block; a write covering part of one is
/// a read-modify-write of that block.
pub const BLOCK_SIZE_PREFERRED_BYTES: u32 = 4096;
/// Maximum payload: 32 MiB, the size every client keeps to for interoperability.
pub const PAYLOAD_MAX_BYTES: u32 = 32 << 20;
/// A write payload this large or smaller that is refused is read and thrown away so the
/// connection stays usable; a larger one drops the connection. 64 MiB: fio sends writes
/// of up to 64 MiB, and the spec says payloads of 32 MiB must not count as an attack.
pub const DISCARD_PAYLOAD_MAX_BYTES: u64 = 64 << 20;
/// Most descriptors in one block status chunk: 16,384 (the spec's ceiling is 2^20),
/// so answering one holds at most [`BLOCK_STATUS_MEMORY_MAX_BYTES`] (1.25 MiB), which
/// is charged to the connection's buffer budget like a read's data; at 2^20 a client
/// that never read its replies grew the server by ~18 MiB per request. The spec lets a
/// server answer less than asked; clients ask again from where the answer ends.
pub const BLOCK_STATUS_DESCRIPTORS_MAX: usize = 1 << 14;
/// Largest block status payload: the context id, a count, and
/// [`BLOCK_STATUS_DESCRIPTORS_MAX`] extended (16-byte) descriptors.
pub const BLOCK_STATUS_REPLY_MAX_BYTES: u64 = 8 + 16 * BLOCK_STATUS_DESCRIPTORS_MAX as u64;
/// Memory one block status answer holds at most, per descriptor: the export's runs
/// (16 bytes each), their clipped copy and the merged answer (24 each), and the reply
/// (16).
pub const BLOCK_STATUS_MEMORY_MAX_BYTES: u64 = 80 * BLOCK_STATUS_DESCRIPTORS_MAX as u64;
/// The export is asked about a block status range in steps of this size, each one
/// answered with at most one run per 4 KiB block: the runs in memory at once stay
/// near [`BLOCK_STATUS_DESCRIPTORS_MAX`], however fragmented a 16 GiB range is.
pub const BLOCK_STATUS_QUERY_STEP_BYTES: u64 = BLOCK_STATUS_DESCRIPTORS_MAX as u64 * 4096;
/// Largest range one BLOCK_STATUS asks the export about; the spec lets the server answer
/// less than asked, and a bound keeps one request from walking a whole large volume.
pub const BLOCK_STATUS_QUERY_MAX_BYTES: u64 = 1 << 34;
/// Longest descriptor in a compact (32-bit) block status chunk, a multiple of 512.
pub const COMPACT_DESCRIPTOR_MAX_BYTES: u64 = (u32::MAX as u64) & !511;

const _: () = assert!(BLOCK_SIZE_MIN_BYTES.is_power_of_two());
const _: () = assert!(BLOCK_SIZE_PREFERRED_BYTES.is_power_of_two());
const _: () = assert!(BLOCK_SIZE_PREFERRED_BYTES >= BLOCK_SIZE_MIN_BYTES);
const _: () = assert!(PAYLOAD_MAX_BYTES >= BLOCK_SIZE_PREFERRED_BYTES);
const _: () = assert!(PAYLOAD_MAX_BYTES.is_multiple_of(BLOCK_SIZE_MIN_BYTES));
const _: () = assert!(DISCARD_PAYLOAD_MAX_BYTES >= PAYLOAD_MAX_BYTES as u64);

// ---------------------------------------------------------------------------
// Request parsing
// ---------------------------------------------------------------------------

/// A request header as it came off the wire: nothing in it is trusted yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// Command flags.
    pub flags: u16,
    /// Command type.
    pub kind: u16,
    /// Opaque cookie, echoed in the reply.
    pub cookie: u64,
    /// Offset in bytes.
    pub offset: u64,
    /// Length in bytes (32 bits on the wire unless extended headers are on).
    pub length: u64,
}

/// Which request and reply headers a connection uses, as negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplyMode {
    /// `NBD_OPT_STRUCTURED_REPLY` was acknowledged.
    pub structured: bool,
    /// `NBD_OPT_EXTENDED_HEADERS` was acknowledged (implies structured chunks).
    pub extended: bool,
}

impl ReplyMode {
    /// Whether replies may be chunked (structured or extended).
    pub fn chunked(self) -> bool {
        self.structured || self.extended
    }
}

impl RequestHeader {
    /// Bytes of the header in this mode.
    pub fn wire_bytes(mode: ReplyMode) -> usize {
        if mode.extended {
            EXTENDED_REQUEST_BYTES
        } else {
            COMPACT_REQUEST_BYTES
        }
    }

    /// Decode a header. A wrong magic is the only failure: the stream is then
    /// out of step and the connection must be dropped.
    pub fn decode(bytes: &[u8], mode: ReplyMode) -> Result<RequestHeader, RequestError> {
        let mut r = WireReader::new(bytes);
        let magic = r.u32().ok_or(RequestError::Truncated)?;
        let expected = if mode.extended {
            EXTENDED_REQUEST_MAGIC
        } else {
            REQUEST_MAGIC
        };
        if magic != expected {
            return Err(RequestError::BadMagic { magic, expected });
        }
        let flags = r.u16().ok_or(RequestError::Truncated)?;
        let kind = r.u16().ok_or(RequestError::Truncated)?;
        let cookie = r.u64().ok_or(RequestError::Truncated)?;
        let offset = r.u64().ok_or(RequestError::Truncated)?;
        let length = if mode.extended {
            r.u64().ok_or(RequestError::Truncated)?
        } else {
            u64::from(r.u32().ok_or(RequestError::Truncated)?)
        };
        Ok(RequestHeader {
            flags,
            kind,
            cookie,
            offset,
            length,
        })
    }

    /// Bytes of payload that follow this header on the wire, whatever the command's
    /// validity: the reader must consume them to stay in step.
    pub fn payload_bytes(&self, mode: ReplyMode) -> u64 {
        // A WRITE always carries its data. Under extended headers the spec says the
        // client MUST also set PAYLOAD_LEN on it, but QEMU 10's client does not, and
        // QEMU's own server reads the payload either way; so does this one.
        let flagged = mode.extended && self.flags & CMD_FLAG_PAYLOAD_LEN != 0;
        if flagged || self.kind == CMD_WRITE {
            self.length
        } else {
            0
        }
    }
}

/// What a validated request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Read `len` bytes; `df`: at most one content chunk.
    Read {
        /// Offset.
        offset: u64,
        /// Length (≤ [`PAYLOAD_MAX_BYTES`]).
        len: u32,
        /// Don't fragment.
        df: bool,
    },
    /// Write the payload that follows the header.
    Write {
        /// Offset.
        offset: u64,
        /// Payload length (≤ [`PAYLOAD_MAX_BYTES`]).
        len: u32,
        /// Force unit access.
        fua: bool,
    },
    /// Make acknowledged writes durable.
    Flush,
    /// Discard a range.
    Trim {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Force unit access.
        fua: bool,
    },
    /// Zero a range (always a fast metadata operation here).
    WriteZeroes {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Force unit access.
        fua: bool,
    },
    /// Report `base:allocation` over a range.
    BlockStatus {
        /// Offset.
        offset: u64,
        /// Length asked (a hint).
        len: u64,
        /// Exactly one extent in the reply.
        req_one: bool,
    },
    /// Prefetch hint: a no-op that succeeds.
    Cache,
    /// Soft disconnect.
    Disconnect,
}

/// What the validation of a request needs to know about the connection and export.
#[derive(Debug, Clone, Copy)]
pub struct RequestContext {
    /// Reply mode negotiated.
    pub mode: ReplyMode,
    /// The export's size now (re-read per request: volumes can be resized).
    pub size_bytes: u64,
    /// The connection may not write.
    pub read_only: bool,
    /// `base:allocation` was selected for this export.
    pub meta_context: bool,
}

/// Why a request was refused. Each malformed case has its own variant; the
/// message is what a structured error chunk shows to a person.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The header was shorter than its layout (internal: the reader reads whole headers).
    #[error("request header truncated")]
    Truncated,
    /// Not a request magic: the stream is out of step. The connection is dropped.
    #[error("bad request magic {magic:#010x}, expected {expected:#010x}")]
    BadMagic {
        /// What came.
        magic: u32,
        /// What this connection's mode expects.
        expected: u32,
    },
    /// A payload too large to read and throw away. The connection is dropped.
    #[error("payload of {len} bytes is over the {max} bytes this server will read")]
    PayloadTooLarge {
        /// Payload length.
        len: u64,
        /// [`DISCARD_PAYLOAD_MAX_BYTES`].
        max: u64,
    },
    /// A command type this server does not know.
    #[error("unknown command type {kind}")]
    UnknownCommand {
        /// The type.
        kind: u16,
    },
    /// Flags that are not valid for this command (or not negotiated).
    #[error("command flags {flags:#06x} are not valid for {command}")]
    UnknownFlags {
        /// Command name.
        command: &'static str,
        /// The invalid bits.
        flags: u16,
    },
    /// A length of zero.
    #[error("{command} of zero bytes at offset {offset}")]
    ZeroLength {
        /// Command name.
        command: &'static str,
        /// Offset.
        offset: u64,
    },
    /// Longer than the maximum payload.
    #[error("{command} of {len} bytes is longer than the {max}-byte maximum")]
    TooLong {
        /// Command name.
        command: &'static str,
        /// Length asked.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// Past the end of the export (or offset + length overflows).
    #[error(
        "{command} of {len} bytes at offset {offset} is past the end of the export ({size} bytes)"
    )]
    OutOfRange {
        /// Command name.
        command: &'static str,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Export size.
        size: u64,
    },
    /// A write-type command on a read-only export.
    #[error("{command} refused: the export is read-only")]
    ReadOnly {
        /// Command name.
        command: &'static str,
    },
    /// BLOCK_STATUS without `base:allocation` selected during negotiation.
    #[error("block status without a metadata context selected")]
    NoMetaContext,
    /// FLUSH with a nonzero offset or length (both are reserved, must be zero).
    #[error("flush with offset {offset} and length {len}; both must be zero")]
    FlushFieldsNonZero {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// A payload on a command that takes none (the payload was consumed).
    #[error("{command} does not take a payload")]
    UnexpectedPayload {
        /// Command name.
        command: &'static str,
    },
}

impl RequestError {
    /// Whether the connection must be dropped rather than answered.
    pub fn drops_connection(&self) -> bool {
        matches!(
            self,
            RequestError::Truncated
                | RequestError::BadMagic { .. }
                | RequestError::PayloadTooLarge { .. }
        )
    }

    /// The NBD error value to answer with.
    pub fn errno(&self) -> u32 {
        match self {
            RequestError::ReadOnly { .. } => EPERM,
            RequestError::OutOfRange { command, .. }
                if *command == "write" || *command == "write zeroes" =>
            {
                ENOSPC
            }
            _ => EINVAL,
        }
    }
}

/// The name of a command type, for messages and logs.
pub fn command_name(kind: u16) -> &'static str {
    match kind {
        CMD_READ => "read",
        CMD_WRITE => "write",
        CMD_DISC => "disconnect",
        CMD_FLUSH => "flush",
        CMD_TRIM => "trim",
        CMD_CACHE => "cache",
        CMD_WRITE_ZEROES => "write zeroes",
        CMD_BLOCK_STATUS => "block status",
        _ => "unknown command",
    }
}

/// Check a range against the maximum length (if any) and the export's end. Any
/// offset and length is aligned: the minimum block size is one byte.
fn check_range(
    command: &'static str,
    offset: u64,
    len: u64,
    len_max: Option<u64>,
    size: u64,
) -> Result<(), RequestError> {
    if len == 0 {
        return Err(RequestError::ZeroLength { command, offset });
    }
    if let Some(max) = len_max {
        if len > max {
            return Err(RequestError::TooLong { command, len, max });
        }
    }
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(RequestError::OutOfRange {
            command,
            offset,
            len,
            size,
        }),
    }
}

/// Validate a header into a command. The caller has already consumed (or will
/// consume) [`RequestHeader::payload_bytes`] whatever this returns.
pub fn validate(header: &RequestHeader, ctx: &RequestContext) -> Result<Command, RequestError> {
    let command = command_name(header.kind);
    let mode = ctx.mode;
    // Flags valid on every command: FUA (the spec: servers must accept it anywhere
    // once SEND_FUA is advertised), and PAYLOAD_LEN under extended headers (whether
    // the command accepts a payload is checked per command below).
    let mut allowed = CMD_FLAG_FUA;
    if mode.extended {
        allowed |= CMD_FLAG_PAYLOAD_LEN;
    }
    allowed |= match header.kind {
        CMD_READ if mode.chunked() => CMD_FLAG_DF,
        CMD_WRITE_ZEROES => CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        CMD_BLOCK_STATUS => CMD_FLAG_REQ_ONE,
        CMD_READ | CMD_WRITE | CMD_DISC | CMD_FLUSH | CMD_TRIM | CMD_CACHE => 0,
        kind => return Err(RequestError::UnknownCommand { kind }),
    };
    let unknown = header.flags & !allowed;
    if unknown != 0 {
        return Err(RequestError::UnknownFlags {
            command,
            flags: unknown,
        });
    }
    let has_payload_flag = header.flags & CMD_FLAG_PAYLOAD_LEN != 0;
    if header.kind != CMD_WRITE && has_payload_flag {
        return Err(RequestError::UnexpectedPayload { command });
    }
    let fua = header.flags & CMD_FLAG_FUA != 0;
    let (offset, len, size) = (header.offset, header.length, ctx.size_bytes);
    let max_payload = u64::from(PAYLOAD_MAX_BYTES);
    let writes = matches!(header.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    match header.kind {
        CMD_DISC => return Ok(Command::Disconnect),
        CMD_FLUSH => {
            if offset != 0 || len != 0 {
                return Err(RequestError::FlushFieldsNonZero { offset, len });
            }
            return Ok(Command::Flush);
        }
        _ => {}
    }
    let len_max = match header.kind {
        CMD_READ | CMD_WRITE => Some(max_payload),
        _ => None,
    };
    // Length comes before permission so that a malformed request
    // is reported as malformed whatever the export; permission before range so
    // that a read-only export answers EPERM to every write, as clients expect.
    if len == 0 {
        return Err(RequestError::ZeroLength { command, offset });
    }
    if let Some(max) = len_max {
        if len > max {
            return Err(RequestError::TooLong { command, len, max });
        }
    }
    if writes && ctx.read_only {
        check_range(command, offset, len, len_max, u64::MAX)?;
        return Err(RequestError::ReadOnly { command });
    }
    if header.kind == CMD_BLOCK_STATUS && !ctx.meta_context {
        return Err(RequestError::NoMetaContext);
    }
    check_range(command, offset, len, len_max, size)?;
    // `len_max` bounds READ and WRITE to 32 MiB, so these fit in u32.
    let len32 = u32::try_from(len).unwrap_or(PAYLOAD_MAX_BYTES);
    Ok(match header.kind {
        CMD_READ => Command::Read {
            offset,
            len: len32,
            df: header.flags & CMD_FLAG_DF != 0,
        },
        CMD_WRITE => Command::Write {
            offset,
            len: len32,
            fua,
        },
        CMD_TRIM => Command::Trim { offset, len, fua },
        CMD_WRITE_ZEROES => Command::WriteZeroes { offset, len, fua },
        CMD_BLOCK_STATUS => Command::BlockStatus {
            offset,
            len,
            req_one: header.flags & CMD_FLAG_REQ_ONE != 0,
        },
        _ => Command::Cache,
    })
}

// ---------------------------------------------------------------------------
// Reply headers
// ---------------------------------------------------------------------------

/// Encode a simple reply header.
pub fn simple_reply(cookie: u64, error: u32) -> [u8; SIMPLE_REPLY_BYTES] {
    let mut out = [0u8; SIMPLE_REPLY_BYTES];
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out
}

/// A chunk header, structured or extended, ready to send.
#[derive(Debug, Clone, Copy)]
pub struct ChunkHeader {
    bytes: [u8; EXTENDED_REPLY_BYTES],
    used: usize,
}

impl ChunkHeader {
    /// Encode a chunk header for `mode` (which must be chunked). `request_offset` is
    /// the offset of the client's request (the extended header echoes it).
    pub fn new(
        mode: ReplyMode,
        flags: u16,
        kind: u16,
        cookie: u64,
        request_offset: u64,
        payload_bytes: u64,
    ) -> ChunkHeader {
        let mut bytes = [0u8; EXTENDED_REPLY_BYTES];
        let used = if mode.extended {
            bytes[0..4].copy_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
            bytes[4..6].copy_from_slice(&flags.to_be_bytes());
            bytes[6..8].copy_from_slice(&kind.to_be_bytes());
            bytes[8..16].copy_from_slice(&cookie.to_be_bytes());
            bytes[16..24].copy_from_slice(&request_offset.to_be_bytes());
            bytes[24..32].copy_from_slice(&payload_bytes.to_be_bytes());
            EXTENDED_REPLY_BYTES
        } else {
            // Structured chunks carry 32-bit lengths; every payload this server builds
            // is bounded by PAYLOAD_MAX_BYTES plus a fixed overhead, or by
            // BLOCK_STATUS_DESCRIPTORS_MAX descriptors (256 KiB), so it fits.
            debug_assert!(payload_bytes <= u64::from(u32::MAX));
            let len32 = u32::try_from(payload_bytes).unwrap_or(u32::MAX);
            bytes[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
            bytes[4..6].copy_from_slice(&flags.to_be_bytes());
            bytes[6..8].copy_from_slice(&kind.to_be_bytes());
            bytes[8..16].copy_from_slice(&cookie.to_be_bytes());
            bytes[16..20].copy_from_slice(&len32.to_be_bytes());
            STRUCTURED_REPLY_BYTES
        };
        ChunkHeader { bytes, used }
    }

    /// The encoded bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.bytes.get(..self.used).unwrap_or(&self.bytes)
    }
}

/// The payload of an `NBD_REPLY_TYPE_ERROR` chunk: error, message length, message.
/// The message is cut to the spec's 4096-byte string limit, on a character boundary.
pub fn error_chunk_payload(error: u32, message: &str) -> Vec<u8> {
    let mut end = message.len().min(4096);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let text = message.get(..end).unwrap_or("");
    let mut out = Vec::with_capacity(6 + text.len());
    out.extend_from_slice(&error.to_be_bytes());
    // `end` ≤ 4096, so it fits in 16 bits.
    out.extend_from_slice(&(text.len() as u16).to_be_bytes());
    out.extend_from_slice(text.as_bytes());
    out
}

// ---------------------------------------------------------------------------
// Checked reading of option data
// ---------------------------------------------------------------------------

/// A cursor over bytes received from a client: every read is bounds-checked and
/// returns `None` past the end instead of panicking.
#[derive(Debug)]
pub struct WireReader<'a> {
    bytes: &'a [u8],
}

impl<'a> WireReader<'a> {
    /// Read from `bytes`.
    pub fn new(bytes: &'a [u8]) -> WireReader<'a> {
        WireReader { bytes }
    }

    /// Take `n` bytes.
    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.bytes.len() {
            return None;
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Some(head)
    }

    /// Take a big-endian u16.
    pub fn u16(&mut self) -> Option<u16> {
        self.take(2)?.try_into().ok().map(u16::from_be_bytes)
    }

    /// Take a big-endian u32.
    pub fn u32(&mut self) -> Option<u32> {
        self.take(4)?.try_into().ok().map(u32::from_be_bytes)
    }

    /// Take a big-endian u64.
    pub fn u64(&mut self) -> Option<u64> {
        self.take(8)?.try_into().ok().map(u64::from_be_bytes)
    }

    /// Take a string of `n` bytes; `None` if short or not UTF-8.
    pub fn string(&mut self, n: usize) -> Option<&'a str> {
        std::str::from_utf8(self.take(n)?).ok()
    }

    /// Bytes left.
    pub fn remaining(&self) -> usize {
        self.bytes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COMPACT: ReplyMode = ReplyMode {
        structured: false,
        extended: false,
    };
    const EXTENDED: ReplyMode = ReplyMode {
        structured: false,
        extended: true,
    };

    fn ctx(mode: ReplyMode) -> RequestContext {
        RequestContext {
            mode,
            size_bytes: 1 << 20,
            read_only: false,
            meta_context: false,
        }
    }

    fn header(kind: u16, flags: u16, offset: u64, length: u64) -> RequestHeader {
        RequestHeader {
            flags,
            kind,
            cookie: 7,
            offset,
            length,
        }
    }

    #[test]
    fn decodes_compact_and_extended_headers() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        wire.extend_from_slice(&1u16.to_be_bytes());
        wire.extend_from_slice(&CMD_WRITE.to_be_bytes());
        wire.extend_from_slice(&0xdead_beefu64.to_be_bytes());
        wire.extend_from_slice(&4096u64.to_be_bytes());
        wire.extend_from_slice(&512u32.to_be_bytes());
        let h = RequestHeader::decode(&wire, COMPACT).expect("compact header");
        assert_eq!(h, header(CMD_WRITE, 1, 4096, 512).with_cookie(0xdead_beef));
        assert_eq!(h.payload_bytes(COMPACT), 512);
        assert!(matches!(
            RequestHeader::decode(&wire, EXTENDED),
            Err(RequestError::BadMagic { .. })
        ));

        let mut ext = Vec::new();
        ext.extend_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        ext.extend_from_slice(&CMD_FLAG_PAYLOAD_LEN.to_be_bytes());
        ext.extend_from_slice(&CMD_WRITE.to_be_bytes());
        ext.extend_from_slice(&1u64.to_be_bytes());
        ext.extend_from_slice(&0u64.to_be_bytes());
        ext.extend_from_slice(&(5u64 << 32).to_be_bytes());
        let h = RequestHeader::decode(&ext, EXTENDED).expect("extended header");
        assert_eq!(h.length, 5 << 32);
        assert_eq!(h.payload_bytes(EXTENDED), 5 << 32);
    }

    impl RequestHeader {
        fn with_cookie(mut self, cookie: u64) -> RequestHeader {
            self.cookie = cookie;
            self
        }
    }

    #[test]
    fn each_malformed_case_has_its_own_error() {
        let c = ctx(COMPACT);
        type Check = fn(&RequestError) -> bool;
        let cases: Vec<(RequestHeader, Check)> = vec![
            (header(42, 0, 0, 512), |e| {
                matches!(e, RequestError::UnknownCommand { kind: 42 })
            }),
            (header(CMD_READ, 1 << 9, 0, 512), |e| {
                matches!(e, RequestError::UnknownFlags { .. })
            }),
            (header(CMD_READ, CMD_FLAG_DF, 0, 512), |e| {
                matches!(e, RequestError::UnknownFlags { .. })
            }),
            (header(CMD_READ, 0, 0, 0), |e| {
                matches!(e, RequestError::ZeroLength { .. })
            }),
            (header(CMD_READ, 0, 0, (32 << 20) + 512), |e| {
                matches!(e, RequestError::TooLong { .. })
            }),
            (header(CMD_READ, 0, 1 << 20, 512), |e| {
                matches!(e, RequestError::OutOfRange { .. })
            }),
            (header(CMD_TRIM, 0, u64::MAX - 511, 1024), |e| {
                matches!(e, RequestError::OutOfRange { .. })
            }),
            (header(CMD_FLUSH, 0, 512, 0), |e| {
                matches!(e, RequestError::FlushFieldsNonZero { .. })
            }),
            (header(CMD_BLOCK_STATUS, 0, 0, 512), |e| {
                matches!(e, RequestError::NoMetaContext)
            }),
            (header(CMD_TRIM, CMD_FLAG_PAYLOAD_LEN, 0, 512), |e| {
                matches!(e, RequestError::UnknownFlags { .. })
            }),
        ];
        for (h, check) in cases {
            let err = validate(&h, &c).expect_err("malformed request accepted");
            assert!(check(&err), "{h:?} gave {err:?}");
            assert!(!err.drops_connection());
            assert_eq!(err.errno(), EINVAL, "{h:?}");
        }
    }

    #[test]
    fn writes_past_the_end_are_enospc_and_read_only_is_eperm() {
        let c = ctx(COMPACT);
        let err = validate(&header(CMD_WRITE, 0, 1 << 20, 512), &c).expect_err("past end");
        assert_eq!(err.errno(), ENOSPC);
        let ro = RequestContext {
            read_only: true,
            ..c
        };
        for kind in [CMD_WRITE, CMD_TRIM, CMD_WRITE_ZEROES] {
            let err = validate(&header(kind, 0, 0, 512), &ro).expect_err("read-only");
            assert_eq!(
                err,
                RequestError::ReadOnly {
                    command: command_name(kind)
                }
            );
            assert_eq!(err.errno(), EPERM);
        }
        assert!(validate(&header(CMD_READ, 0, 0, 512), &ro).is_ok());
    }

    // Regression: a read of 1 MiB + 14 bytes at offset 1 was refused with EINVAL (the
    // server asked for 512-byte alignment, even of clients that never saw it advertised).
    #[test]
    fn any_offset_and_length_inside_the_export_is_accepted() {
        let mut c = ctx(COMPACT);
        c.meta_context = true;
        let size = c.size_bytes;
        for (kind, offset, len) in [
            (CMD_READ, 1, (1 << 19) + 14),
            (CMD_READ, size - 1, 1),
            (CMD_WRITE, 4095, 2),
            (CMD_WRITE, 7, 511),
            (CMD_TRIM, 100, 4097),
            (CMD_WRITE_ZEROES, 3, 1),
            (CMD_CACHE, 5, 5),
            (CMD_BLOCK_STATUS, 4097, 3),
        ] {
            let got = validate(&header(kind, 0, offset, len), &c);
            assert!(
                got.is_ok(),
                "{} at {offset}+{len}: {got:?}",
                command_name(kind)
            );
        }
        // The end is still the end: one byte past it is refused.
        assert!(matches!(
            validate(&header(CMD_READ, 0, size - 1, 2), &c),
            Err(RequestError::OutOfRange { .. })
        ));
        assert_eq!(
            validate(&header(CMD_WRITE, 0, size, 1), &c).map_err(|e| e.errno()),
            Err(ENOSPC)
        );
    }

    #[test]
    fn extended_payload_rules() {
        let c = ctx(EXTENDED);
        // QEMU 10 sends WRITE without PAYLOAD_LEN: the payload is there all the same.
        assert_eq!(header(CMD_WRITE, 0, 0, 512).payload_bytes(EXTENDED), 512);
        assert!(validate(&header(CMD_WRITE, 0, 0, 512), &c).is_ok());
        assert_eq!(header(CMD_TRIM, 0, 0, 512).payload_bytes(EXTENDED), 0);
        assert_eq!(
            validate(&header(CMD_TRIM, CMD_FLAG_PAYLOAD_LEN, 0, 512), &c),
            Err(RequestError::UnexpectedPayload { command: "trim" })
        );
        assert_eq!(
            validate(&header(CMD_WRITE, CMD_FLAG_PAYLOAD_LEN, 0, 512), &c),
            Ok(Command::Write {
                offset: 0,
                len: 512,
                fua: false
            })
        );
        // A 64-bit effect length is fine for trim when it fits the export.
        let big = RequestContext {
            size_bytes: 1 << 40,
            ..c
        };
        assert_eq!(
            validate(&header(CMD_TRIM, CMD_FLAG_FUA, 0, 1 << 40), &big),
            Ok(Command::Trim {
                offset: 0,
                len: 1 << 40,
                fua: true
            })
        );
    }

    #[test]
    fn good_requests_validate() {
        let c = RequestContext {
            meta_context: true,
            mode: ReplyMode {
                structured: true,
                extended: false,
            },
            ..ctx(COMPACT)
        };
        assert_eq!(
            validate(&header(CMD_READ, CMD_FLAG_DF, 512, 4096), &c),
            Ok(Command::Read {
                offset: 512,
                len: 4096,
                df: true
            })
        );
        assert_eq!(
            validate(&header(CMD_FLUSH, 0, 0, 0), &c),
            Ok(Command::Flush)
        );
        assert_eq!(
            validate(&header(CMD_DISC, 0, 0, 0), &c),
            Ok(Command::Disconnect)
        );
        assert_eq!(
            validate(&header(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 0, 1 << 20), &c),
            Ok(Command::BlockStatus {
                offset: 0,
                len: 1 << 20,
                req_one: true
            })
        );
        assert_eq!(
            validate(
                &header(
                    CMD_WRITE_ZEROES,
                    CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                    0,
                    1 << 20
                ),
                &c
            ),
            Ok(Command::WriteZeroes {
                offset: 0,
                len: 1 << 20,
                fua: false
            })
        );
    }

    #[test]
    fn wire_reader_never_reads_past_the_end() {
        let mut r = WireReader::new(&[0, 0, 0, 9, 1]);
        assert_eq!(r.u32(), Some(9));
        assert_eq!(r.u16(), None);
        assert_eq!(r.take(1), Some(&[1u8][..]));
        assert_eq!(r.u64(), None);
        assert_eq!(r.remaining(), 0);
    }

    #[test]
    fn error_payload_is_bounded() {
        let long = "é".repeat(3000);
        let p = error_chunk_payload(EINVAL, &long);
        let n = u16::from_be_bytes([p[4], p[5]]) as usize;
        assert!(n <= 4096);
        assert_eq!(p.len(), 6 + n);
        assert!(std::str::from_utf8(&p[6..]).is_ok());
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        fn mode_strategy() -> impl Strategy<Value = ReplyMode> {
            (any::<bool>(), any::<bool>()).prop_map(|(structured, extended)| ReplyMode {
                structured,
                extended,
            })
        }

        proptest! {
            /// Any bytes: decoding never panics, and a header decodes only with the magic
            /// of the connection's mode.
            #[test]
            fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..40), mode in mode_strategy()) {
                if let Ok(h) = RequestHeader::decode(&bytes, mode) {
                    let want = if mode.extended { EXTENDED_REQUEST_MAGIC } else { REQUEST_MAGIC };
                    prop_assert_eq!(&bytes[0..4], &want.to_be_bytes()[..]);
                    if !mode.extended {
                        prop_assert!(h.length <= u64::from(u32::MAX));
                    }
                }
            }

            /// Whatever the header, an accepted command lies inside the export and a
            /// read or write fits the maximum payload; every refusal is answerable
            /// (none drops the connection).
            #[test]
            fn accepted_commands_are_in_bounds(
                flags in any::<u16>(),
                kind in 0u16..10,
                offset in prop_oneof![any::<u64>(), (0u64..4096).prop_map(|x| x * 512)],
                length in prop_oneof![any::<u64>(), (0u64..4096).prop_map(|x| x * 512)],
                size_bytes in prop_oneof![Just(0u64), Just(1u64 << 20), any::<u64>()],
                read_only in any::<bool>(),
                meta_context in any::<bool>(),
                mode in mode_strategy(),
            ) {
                let length = if mode.extended { length } else { length & u64::from(u32::MAX) };
                let header = RequestHeader { flags, kind, cookie: 1, offset, length };
                let ctx = RequestContext { mode, size_bytes, read_only, meta_context };
                match validate(&header, &ctx) {
                    Ok(Command::Read { offset, len, .. }) | Ok(Command::Write { offset, len, .. }) => {
                        prop_assert!(len > 0 && len <= PAYLOAD_MAX_BYTES);
                        prop_assert!(offset.checked_add(u64::from(len)).is_some_and(|e| e <= size_bytes));
                    }
                    Ok(Command::Trim { offset, len, .. })
                    | Ok(Command::WriteZeroes { offset, len, .. })
                    | Ok(Command::BlockStatus { offset, len, .. }) => {
                        prop_assert!(len > 0);
                        prop_assert!(offset.checked_add(len).is_some_and(|e| e <= size_bytes));
                    }
                    Ok(_) => {}
                    Err(e) => prop_assert!(!e.drops_connection()),
                }
                if read_only {
                    let writes = matches!(
                        validate(&header, &ctx),
                        Ok(Command::Write { .. }) | Ok(Command::Trim { .. }) | Ok(Command::WriteZeroes { .. })
                    );
                    prop_assert!(!writes);
                }
            }
        }
    }
}
