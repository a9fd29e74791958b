//! An NBD server for the fuzz targets, and a client that feeds it raw bytes.
//!
//! One server per process, listening on a unix socket in a private temporary
//! directory, over two small in-memory exports. Each execution connects, sends the
//! fuzz input as the whole client side of the conversation (from another thread, so
//! a server that answers while it reads never stalls on a full socket), closes its
//! half, and reads every reply until the server closes. A panic in a server thread
//! aborts the process (libfuzzer-sys installs that hook), so it is reported.

use fewerbytes_nbd::protocol::*;
use fewerbytes_nbd::{MemoryExport, MemoryExports, Server, ServerConfig};
use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// Size of each export: a few blocks, so reads and writes anywhere stay cheap, and
/// room for requests past the end.
pub const EXPORT_BYTES: usize = 256 << 10;

struct Fixture {
    // Held so the server outlives every execution.
    _server: Arc<Server>,
    path: PathBuf,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        // A Rust `main` ignores SIGPIPE before it runs, and the `fewerbytes` binary
        // relies on that: a write to a socket the peer closed is an EPIPE error. Here
        // libFuzzer's C++ `main` runs instead, so do what Rust's would.
        // SAFETY: setting a signal's disposition to SIG_IGN, once, before any socket exists.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
        let dir = std::env::temp_dir().join(format!("fewerbytes-fuzz-nbd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temporary directory for the NBD socket");
        let path = dir.join("nbd.sock");
        let exports = MemoryExports::new(vec![
            ("a".to_string(), Arc::new(MemoryExport::new(EXPORT_BYTES))),
            ("b".to_string(), Arc::new(MemoryExport::new(EXPORT_BYTES))),
        ]);
        let server = Server::new(ServerConfig::default(), Arc::new(exports));
        server
            .listen_unix(&path)
            .expect("listen on the fuzz socket");
        Fixture {
            _server: server,
            path,
        }
    })
}

/// Send `client_bytes` as everything a client says, then read what the server says
/// until it closes the connection. Returns the bytes the server sent.
pub fn converse(client_bytes: &[u8]) -> Vec<u8> {
    let f = fixture();
    let stream = UnixStream::connect(&f.path).expect("connect to the fuzz server");
    let mut writer = stream.try_clone().expect("clone the client socket");
    let input = client_bytes.to_vec();
    let sender = std::thread::spawn(move || {
        // The server may close first (it refuses garbage): a failed write is normal.
        let _ = writer.write_all(&input);
        let _ = writer.shutdown(Shutdown::Write);
    });
    let mut replies = Vec::new();
    let mut reader = stream;
    let mut buf = [0u8; 64 << 10];
    loop {
        match reader.read(&mut buf) {
            Ok(0) | Err(_) => break,
            // Keep only the start: a read of 32 MiB is answered in full.
            Ok(n) if replies.len() < (1 << 20) => replies.extend_from_slice(&buf[..n]),
            Ok(_) => {}
        }
    }
    sender.join().expect("the sending thread");
    replies
}

/// How the canned handshake before a fuzzed request stream sets up the connection.
#[derive(Debug, Clone, Copy)]
pub enum Mode {
    /// Simple replies only.
    Simple,
    /// Structured replies.
    Structured,
    /// Structured replies and `base:allocation`.
    StructuredWithMeta,
    /// Extended headers (and so structured replies) and `base:allocation`.
    Extended,
}

impl Mode {
    /// The mode a selector byte picks.
    pub fn from_byte(b: u8) -> Mode {
        match b % 4 {
            0 => Mode::Simple,
            1 => Mode::Structured,
            2 => Mode::StructuredWithMeta,
            _ => Mode::Extended,
        }
    }
}

fn option(out: &mut Vec<u8>, opt: u32, data: &[u8]) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// A well-formed handshake that ends in transmission on export "a".
pub fn handshake(mode: Mode) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
    match mode {
        Mode::Simple => {}
        Mode::Structured | Mode::StructuredWithMeta => option(&mut out, OPT_STRUCTURED_REPLY, &[]),
        Mode::Extended => option(&mut out, OPT_EXTENDED_HEADERS, &[]),
    }
    if matches!(mode, Mode::StructuredWithMeta | Mode::Extended) {
        let mut data = Vec::new();
        data.extend_from_slice(&1u32.to_be_bytes());
        data.extend_from_slice(b"a");
        data.extend_from_slice(&1u32.to_be_bytes());
        let ctx = META_CONTEXT_BASE_ALLOCATION.as_bytes();
        data.extend_from_slice(&(ctx.len() as u32).to_be_bytes());
        data.extend_from_slice(ctx);
        option(&mut out, OPT_SET_META_CONTEXT, &data);
    }
    let mut go = Vec::new();
    go.extend_from_slice(&1u32.to_be_bytes());
    go.extend_from_slice(b"a");
    go.extend_from_slice(&1u16.to_be_bytes());
    go.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    option(&mut out, OPT_GO, &go);
    out
}

/// One request in the wire format `mode` negotiated.
pub fn request(
    mode: Mode,
    flags: u16,
    kind: u16,
    cookie: u64,
    offset: u64,
    len: u64,
    payload: &[u8],
) -> Vec<u8> {
    let mut out = Vec::new();
    match mode {
        Mode::Extended => {
            out.extend_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
            out.extend_from_slice(&flags.to_be_bytes());
            out.extend_from_slice(&kind.to_be_bytes());
            out.extend_from_slice(&cookie.to_be_bytes());
            out.extend_from_slice(&offset.to_be_bytes());
            out.extend_from_slice(&len.to_be_bytes());
        }
        _ => {
            out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
            out.extend_from_slice(&flags.to_be_bytes());
            out.extend_from_slice(&kind.to_be_bytes());
            out.extend_from_slice(&cookie.to_be_bytes());
            out.extend_from_slice(&offset.to_be_bytes());
            out.extend_from_slice(&(len as u32).to_be_bytes());
        }
    }
    out.extend_from_slice(payload);
    out
}

/// A few requests of every kind, ending with a disconnect: the seed of a request stream.
pub fn sample_requests(mode: Mode) -> Vec<u8> {
    let mut out = Vec::new();
    let data = [0x5au8; 4096];
    out.extend(request(mode, 0, CMD_WRITE, 1, 8192, 4096, &data));
    out.extend(request(
        mode,
        CMD_FLAG_FUA,
        CMD_WRITE,
        2,
        0,
        512,
        &data[..512],
    ));
    out.extend(request(mode, 0, CMD_READ, 3, 8192, 4096, &[]));
    out.extend(request(mode, 0, CMD_READ, 4, 0, 12288, &[]));
    out.extend(request(mode, 0, CMD_TRIM, 5, 8192, 4096, &[]));
    out.extend(request(mode, 0, CMD_WRITE_ZEROES, 6, 16384, 8192, &[]));
    out.extend(request(mode, 0, CMD_BLOCK_STATUS, 7, 0, 65536, &[]));
    out.extend(request(mode, 0, CMD_CACHE, 8, 0, 4096, &[]));
    out.extend(request(mode, 0, CMD_FLUSH, 9, 0, 0, &[]));
    out.extend(request(mode, 0, CMD_DISC, 10, 0, 0, &[]));
    out
}
