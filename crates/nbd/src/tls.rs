//! TLS: the credentials a server offers ([`TlsCredentials`]: x509 as qemu's
//! `tls-creds-x509` and nbdkit's `--tls-certificates` lay them out, or PSK in
//! psktool's `identity:hexkey` format), the handshake after `NBD_OPT_STARTTLS`, and
//! the relay that carries a connection's bytes through OpenSSL afterwards.
//!
//! Why a relay thread: the server's connection code is synchronous, and a
//! connection's reader thread and its reply writers use the socket at once. An
//! OpenSSL stream cannot be read and written from two threads at once (one `SSL`
//! object, one state machine). So after the handshake one thread per connection owns
//! the `SslStream`, with the socket nonblocking, and `poll`s it and one end of a
//! socket pair; the other end is the connection's [`Stream`] from then on, so
//! negotiation, transmission and replies run unchanged on plaintext. The price is a
//! thread and two copies per byte through the pair (measured in docs/benchmarks.md).
//!
//! Why OpenSSL (the `openssl` crate over the system's libssl): NBD clients offer PSK
//! (`tls-psk-file`, qemu's `tls-creds-psk`) as well as x509, and rustls has no
//! external PSK; OpenSSL does both, in TLS 1.2 and 1.3.

use crate::stream::Stream;
use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::nid::Nid;
use openssl::ssl::{
    ErrorCode, HandshakeError, Ssl, SslAcceptor, SslFiletype, SslMethod, SslOptions,
    SslSessionCacheMode, SslStream, SslVerifyMode, SslVersion,
};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes each direction of a relay holds at most: four full TLS records, so one
/// `SSL_write` and one socket write move a 64 KiB NBD payload.
pub const RELAY_BUFFER_BYTES: usize = 64 << 10;
/// Stack of a relay thread: OpenSSL's record layer needs a few KiB; buffers are on
/// the heap. The same as the server's other threads (`server::THREAD_STACK_BYTES`).
pub(crate) const RELAY_THREAD_STACK_BYTES: usize = 256 << 10;
/// Longest PSK key accepted (OpenSSL's `PSK_MAX_PSK_LEN`).
const PSK_KEY_MAX_BYTES: usize = 512;
/// PSK identities read from one file at most: a bound on what a stray file can cost.
const PSK_IDENTITIES_MAX: usize = 65_536;

/// When a listener asks clients for TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// `NBD_OPT_STARTTLS` is refused; everything in clear.
    Off,
    /// TLS offered; a client may also negotiate in clear (exports with an allow list
    /// then answer `NBD_REP_ERR_TLS_REQD`).
    On,
    /// Every option but STARTTLS and ABORT answers `NBD_REP_ERR_TLS_REQD` until TLS is up.
    Require,
}

/// What a connection knows of its client's TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Peer {
    /// No TLS on this connection.
    Clear,
    /// TLS is up; the identity is the PSK identity, or the client certificate's
    /// subject CN when `--tls-verify-peer` verified one (else `None`).
    Tls { identity: Option<String> },
}

impl Peer {
    pub(crate) fn is_tls(&self) -> bool {
        matches!(self, Peer::Tls { .. })
    }

    /// For the log: "none", "TLS, no identity", or "TLS as 'alice'".
    pub(crate) fn describe(&self) -> String {
        match self {
            Peer::Clear => "none".into(),
            Peer::Tls { identity: None } => "TLS, no identity".into(),
            Peer::Tls {
                identity: Some(identity),
            } => format!("TLS as '{identity}'"),
        }
    }
}

/// Why TLS credentials could not be loaded, or a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// OpenSSL refused a certificate, key or setting.
    #[error("{what}: {source}")]
    Openssl {
        /// What was being done.
        what: String,
        /// OpenSSL's errors.
        source: ErrorStack,
    },
    /// A PSK file line that is not `identity:hexkey`.
    #[error("{path} line {line}: {reason} (psktool's format is one `identity:hexkey` per line)")]
    PskLine {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The handshake did not complete.
    #[error("TLS handshake: {0}")]
    Handshake(String),
}

/// The server's TLS credentials, ready to accept handshakes.
pub struct TlsCredentials {
    acceptor: SslAcceptor,
    /// Whether a client certificate is required (and its CN is the identity).
    verify_peer: bool,
    /// With PSK: the ex-data slot where the PSK callback leaves the identity it accepted.
    psk_identity: Option<Index<Ssl, String>>,
}

impl std::fmt::Debug for TlsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsCredentials")
            .field("verify_peer", &self.verify_peer)
            .finish_non_exhaustive()
    }
}

fn openssl(what: impl Into<String>) -> impl FnOnce(ErrorStack) -> TlsError {
    let what = what.into();
    move |source| TlsError::Openssl { what, source }
}

/// Mozilla's "intermediate" settings (TLS 1.2 and 1.3, forward-secret AEAD suites;
/// OpenSSL offers 1.3 first), with no session resumption: every connection runs the
/// full handshake, so the identity it is given is always one its credentials prove.
fn acceptor_builder() -> Result<openssl::ssl::SslAcceptorBuilder, TlsError> {
    let mut builder = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())
        .map_err(openssl("TLS settings"))?;
    builder
        .set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(openssl("TLS settings"))?;
    // A client that closes without close_notify (most do, once NBD_CMD_DISC is
    // answered) is an end of stream, not an error that would stop the replies
    // still going the other way.
    builder.set_options(SslOptions::NO_TICKET | SslOptions::IGNORE_UNEXPECTED_EOF);
    builder.set_session_cache_mode(SslSessionCacheMode::OFF);
    // Take whatever the socket holds in one read, not a record header and then its
    // body: pipelined requests cost one system call, not two per record.
    builder.set_read_ahead(true);
    builder
        .set_num_tickets(0)
        .map_err(openssl("TLS settings"))?;
    Ok(builder)
}

impl TlsCredentials {
    /// x509 from `dir`: `server-cert.pem` and `server-key.pem`, and `ca-cert.pem`
    /// (required with `verify_peer`, which then demands a client certificate it signed).
    pub fn x509(dir: &Path, verify_peer: bool) -> Result<TlsCredentials, TlsError> {
        let mut builder = acceptor_builder()?;
        let cert = dir.join("server-cert.pem");
        let key = dir.join("server-key.pem");
        let ca = dir.join("ca-cert.pem");
        for path in [&cert, &key] {
            std::fs::metadata(path).map_err(|source| TlsError::Read {
                path: path.clone(),
                source,
            })?;
        }
        builder
            .set_certificate_chain_file(&cert)
            .map_err(openssl(format!("{}", cert.display())))?;
        builder
            .set_private_key_file(&key, SslFiletype::PEM)
            .map_err(openssl(format!("{}", key.display())))?;
        builder.check_private_key().map_err(openssl(format!(
            "{} does not match {}",
            key.display(),
            cert.display()
        )))?;
        if verify_peer {
            std::fs::metadata(&ca).map_err(|source| TlsError::Read {
                path: ca.clone(),
                source,
            })?;
            builder
                .set_ca_file(&ca)
                .map_err(openssl(format!("{}", ca.display())))?;
            builder.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
        }
        Ok(TlsCredentials {
            acceptor: builder.build(),
            verify_peer,
            psk_identity: None,
        })
    }

    /// PSK from a psktool file: one `identity:hexkey` per line.
    pub fn psk(path: &Path) -> Result<TlsCredentials, TlsError> {
        let text = std::fs::read_to_string(path).map_err(|source| TlsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let keys = Arc::new(parse_psk_file(path, &text)?);
        let mut builder = acceptor_builder()?;
        // TLS 1.2 clients need PSK suites too (TLS 1.3 uses its own with a PSK).
        builder
            .set_cipher_list(
                "ECDHE-PSK-CHACHA20-POLY1305:DHE-PSK-AES256-GCM-SHA384:\
                 DHE-PSK-AES128-GCM-SHA256:DHE-PSK-CHACHA20-POLY1305:\
                 ECDHE-PSK-AES256-CBC-SHA384:ECDHE-PSK-AES128-CBC-SHA256",
            )
            .map_err(openssl("TLS PSK cipher suites"))?;
        let identity_index = Ssl::new_ex_index::<String>().map_err(openssl("TLS PSK setup"))?;
        builder.set_psk_server_callback(move |ssl, identity, out| {
            let Some(identity) = identity.and_then(|i| std::str::from_utf8(i).ok()) else {
                return Ok(0);
            };
            let Some(key) = keys.get(identity) else {
                tracing::debug!(identity, "TLS PSK identity unknown");
                return Ok(0);
            };
            let Some(slot) = out.get_mut(..key.len()) else {
                return Ok(0);
            };
            slot.copy_from_slice(key);
            ssl.set_ex_data(identity_index, identity.to_string());
            Ok(key.len())
        });
        Ok(TlsCredentials {
            acceptor: builder.build(),
            verify_peer: false,
            psk_identity: Some(identity_index),
        })
    }

    /// Run the server side of the handshake on `stream` (made nonblocking), within
    /// `deadline`, and start the relay. Returns the plaintext stream the connection
    /// uses from now on, and the client's identity.
    pub(crate) fn start(
        &self,
        stream: Arc<Stream>,
        deadline: Instant,
        reply_write_timeout: Duration,
    ) -> Result<(Stream, Peer), TlsError> {
        let io_error = |e: io::Error| TlsError::Handshake(e.to_string());
        stream.set_nonblocking(true).map_err(io_error)?;
        let mut attempt = self.acceptor.accept(RawSocket(Arc::clone(&stream)));
        let tls = loop {
            match attempt {
                Ok(tls) => break tls,
                Err(HandshakeError::WouldBlock(mid)) => {
                    let events = if mid.error().code() == ErrorCode::WANT_WRITE {
                        libc::POLLOUT
                    } else {
                        libc::POLLIN
                    };
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() || !poll_one(stream.fd(), events, left).map_err(io_error)? {
                        return Err(TlsError::Handshake(
                            "the client did not complete it in time".into(),
                        ));
                    }
                    attempt = mid.handshake();
                }
                Err(HandshakeError::Failure(mid)) => {
                    return Err(TlsError::Handshake(mid.error().to_string()))
                }
                Err(HandshakeError::SetupFailure(e)) => {
                    return Err(TlsError::Handshake(e.to_string()))
                }
            }
        };
        let identity = self.identity(&tls);
        let (inner, outer) = UnixStream::pair().map_err(io_error)?;
        outer.set_nonblocking(true).map_err(io_error)?;
        std::thread::Builder::new()
            .name("nbd-tls".into())
            .stack_size(RELAY_THREAD_STACK_BYTES)
            .spawn(move || Relay::new(tls, outer, reply_write_timeout).run())
            .map_err(io_error)?;
        Ok((Stream::Unix(inner), Peer::Tls { identity }))
    }

    fn identity(&self, tls: &SslStream<RawSocket>) -> Option<String> {
        if let Some(index) = self.psk_identity {
            return tls.ssl().ex_data(index).cloned();
        }
        if !self.verify_peer {
            return None;
        }
        let cert = tls.ssl().peer_certificate()?;
        let cn = cert.subject_name().entries_by_nid(Nid::COMMONNAME).next()?;
        cn.data().to_string().ok()
    }
}

/// Parse psktool's format: `identity:hexkey` lines (blank lines skipped).
fn parse_psk_file(path: &Path, text: &str) -> Result<HashMap<String, Vec<u8>>, TlsError> {
    let mut keys = HashMap::new();
    for (number, line) in text.lines().enumerate() {
        let bad = |reason: &str| TlsError::PskLine {
            path: path.to_path_buf(),
            line: number + 1,
            reason: reason.to_string(),
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let Some((identity, hex)) = line.rsplit_once(':') else {
            return Err(bad("no ':' between identity and key"));
        };
        if identity.is_empty() {
            return Err(bad("empty identity"));
        }
        let key =
            decode_hex(hex).ok_or_else(|| bad("the key is not an even number of hex digits"))?;
        if key.is_empty() || key.len() > PSK_KEY_MAX_BYTES {
            return Err(bad(&format!(
                "the key must be 1 to {PSK_KEY_MAX_BYTES} bytes"
            )));
        }
        if keys.len() >= PSK_IDENTITIES_MAX {
            return Err(bad(&format!("more than {PSK_IDENTITIES_MAX} identities")));
        }
        keys.insert(identity.to_string(), key);
    }
    if keys.is_empty() {
        return Err(TlsError::PskLine {
            path: path.to_path_buf(),
            line: 0,
            reason: "no identities".into(),
        });
    }
    Ok(keys)
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Wait until `fd` is ready for `events` or `timeout` passes: `Ok(false)` on timeout.
fn poll_one(fd: std::os::fd::RawFd, events: libc::c_short, timeout: Duration) -> io::Result<bool> {
    let mut fds = [libc::pollfd {
        fd,
        events,
        revents: 0,
    }];
    let timeout_ms = libc::c_int::try_from(timeout.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
    // SAFETY: `fds` is a valid array of one pollfd for the whole call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, timeout_ms) };
    match n {
        n if n < 0 => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                Ok(true)
            } else {
                Err(e)
            }
        }
        0 => Ok(false),
        _ => Ok(true),
    }
}

/// The client's socket as OpenSSL's transport (the connection keeps its own handle
/// in the server's registry, for shutdown).
#[derive(Debug)]
struct RawSocket(Arc<Stream>);

impl Read for RawSocket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self.0).read(buf)
    }
}

impl Write for RawSocket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self.0).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Bytes waiting to be written, at most [`RELAY_BUFFER_BYTES`].
struct Pending {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Pending {
    fn new() -> Pending {
        Pending {
            buf: vec![0; RELAY_BUFFER_BYTES],
            start: 0,
            end: 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    fn bytes(&self) -> &[u8] {
        self.buf.get(self.start..self.end).unwrap_or_default()
    }

    fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Room after what is pending, to fill.
    fn space(&mut self) -> &mut [u8] {
        self.buf.get_mut(self.end..).unwrap_or_default()
    }

    fn is_full(&self) -> bool {
        self.end == self.buf.len()
    }

    /// `n` more bytes were put in [`Pending::space`].
    fn filled(&mut self, n: usize) {
        self.end = (self.end + n).min(self.buf.len());
    }
}

/// One connection's relay: TLS on the client's socket, plaintext on a socket pair.
struct Relay {
    tls: SslStream<RawSocket>,
    plain: UnixStream,
    /// Decrypted, waiting for the connection to read.
    to_plain: Pending,
    /// From the connection, waiting to be encrypted and sent.
    to_tls: Pending,
    /// The client ended its side (or it failed): nothing more to read from it.
    tls_read_done: bool,
    /// The connection ended its side: what is pending goes out, then the relay ends.
    plain_read_done: bool,
    plain_write_shut: bool,
    /// Whether a read of each side may find bytes: cleared when one found none, set
    /// when poll says so, so that a pass reads only the side that woke the relay.
    tls_readable: bool,
    plain_readable: bool,
    reply_write_timeout: Duration,
}

/// What each side waits for when the relay has nothing to do.
#[derive(Default)]
struct Wants {
    tls_in: bool,
    tls_out: bool,
    plain_in: bool,
    plain_out: bool,
}

impl Relay {
    fn new(tls: SslStream<RawSocket>, plain: UnixStream, reply_write_timeout: Duration) -> Relay {
        Relay {
            tls,
            plain,
            to_plain: Pending::new(),
            to_tls: Pending::new(),
            tls_read_done: false,
            plain_read_done: false,
            plain_write_shut: false,
            tls_readable: true,
            plain_readable: true,
            reply_write_timeout,
        }
    }

    /// Move bytes both ways until both sides are done, or the client stops taking
    /// replies for `reply_write_timeout`.
    fn run(mut self) {
        let mut stalled_since: Option<Instant> = None;
        loop {
            let mut wants = Wants::default();
            let mut progress = false;
            match self.step(&mut wants, &mut progress) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "NBD TLS relay ended");
                    break;
                }
            }
            if progress {
                stalled_since = None;
                continue;
            }
            let timeout = if self.to_tls.is_empty() {
                None
            } else {
                let since = *stalled_since.get_or_insert_with(Instant::now);
                let left = self.reply_write_timeout.saturating_sub(since.elapsed());
                if left.is_zero() {
                    tracing::debug!("NBD TLS relay ended: the client stopped reading");
                    break;
                }
                Some(left)
            };
            if let Err(e) = self.wait(&wants, timeout) {
                tracing::debug!(error = %e, "NBD TLS relay ended: poll failed");
                break;
            }
        }
        // Best effort: a close_notify for a client still there.
        let _ = self.tls.shutdown();
        self.tls.get_ref().0.shutdown(Shutdown::Both);
        let _ = self.plain.shutdown(Shutdown::Both);
    }

    /// One pass each way. `Ok(false)`: the relay is done.
    fn step(&mut self, wants: &mut Wants, progress: &mut bool) -> io::Result<bool> {
        // Client → connection: every record at hand, up to a full buffer, so that
        // pipelined requests cost one write to the connection.
        let tls_wanted = !self.tls_read_done && !self.to_plain.is_full();
        if tls_wanted && !self.tls_readable {
            wants.tls_in = true;
        }
        while self.tls_readable && !self.tls_read_done && !self.to_plain.is_full() {
            match self.tls.ssl_read(self.to_plain.space()) {
                Ok(0) => break,
                Ok(n) => {
                    self.to_plain.filled(n);
                    *progress = true;
                }
                Err(e) => match e.code() {
                    ErrorCode::WANT_READ => {
                        self.tls_readable = false;
                        wants.tls_in = true;
                        break;
                    }
                    ErrorCode::WANT_WRITE => {
                        wants.tls_out = true;
                        break;
                    }
                    _ => {
                        // close_notify, end of stream, or a broken record: the client
                        // sends nothing more; replies may still go out.
                        tracing::debug!(error = %e, "NBD TLS client side ended");
                        self.tls_read_done = true;
                        *progress = true;
                    }
                },
            }
        }
        if !self.to_plain.is_empty() {
            match (&self.plain).write(self.to_plain.bytes()) {
                Ok(n) => {
                    self.to_plain.consume(n);
                    *progress = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => wants.plain_out = true,
                Err(_) => {
                    // The connection stopped reading (shut down): drop what it left.
                    self.to_plain.consume(usize::MAX);
                    self.tls_read_done = true;
                    *progress = true;
                }
            }
        }
        if self.tls_read_done && self.to_plain.is_empty() && !self.plain_write_shut {
            let _ = self.plain.shutdown(Shutdown::Write);
            self.plain_write_shut = true;
        }
        // Connection → client. Refilled only when empty: a write OpenSSL could not
        // finish must be retried with the same bytes.
        let plain_wanted = !self.plain_read_done && self.to_tls.is_empty();
        if plain_wanted && !self.plain_readable {
            wants.plain_in = true;
        }
        if plain_wanted && self.plain_readable {
            match (&self.plain).read(self.to_tls.space()) {
                Ok(0) => {
                    self.plain_read_done = true;
                    *progress = true;
                }
                Ok(n) => {
                    self.to_tls.filled(n);
                    *progress = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.plain_readable = false;
                    wants.plain_in = true;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => *progress = true,
                Err(_) => {
                    self.plain_read_done = true;
                    *progress = true;
                }
            }
        }
        if !self.to_tls.is_empty() {
            match self.tls.ssl_write(self.to_tls.bytes()) {
                Ok(n) => {
                    self.to_tls.consume(n);
                    *progress = true;
                }
                Err(e) => match e.code() {
                    ErrorCode::WANT_WRITE => wants.tls_out = true,
                    ErrorCode::WANT_READ => wants.tls_in = true,
                    _ => {
                        return Err(io::Error::other(format!("TLS write: {e}")));
                    }
                },
            }
        }
        Ok(!(self.plain_read_done && self.to_tls.is_empty()))
    }

    /// Poll for what `wants` says, and note which side has bytes (or an end) to read.
    fn wait(&mut self, wants: &Wants, timeout: Option<Duration>) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let events = |input: bool, output: bool| {
            (if input { libc::POLLIN } else { 0 }) | (if output { libc::POLLOUT } else { 0 })
        };
        // A side nothing is wanted of is left out (a negative fd), so that its hang-up,
        // which poll reports whatever the events asked, cannot keep waking the relay.
        let entry = |fd: std::os::fd::RawFd, events: libc::c_short| libc::pollfd {
            fd: if events == 0 { -1 } else { fd },
            events,
            revents: 0,
        };
        let mut fds = [
            entry(
                self.tls.get_ref().0.fd(),
                events(wants.tls_in, wants.tls_out),
            ),
            entry(
                self.plain.as_raw_fd(),
                events(wants.plain_in, wants.plain_out),
            ),
        ];
        let timeout_ms = timeout.map_or(-1, |t| {
            libc::c_int::try_from(t.as_millis().max(1)).unwrap_or(libc::c_int::MAX)
        });
        // SAFETY: `fds` is a valid array of two pollfds for the whole call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        let readable =
            |fd: &libc::pollfd| fd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
        let [tls, plain] = &fds;
        self.tls_readable |= readable(tls);
        self.plain_readable |= readable(plain);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_files_are_psktool_lines() {
        let path = Path::new("keys.psk");
        let keys = parse_psk_file(path, "alice:00ff10\n\nbob:abcdef01\n").expect("parsed");
        assert_eq!(keys.get("alice"), Some(&vec![0x00, 0xff, 0x10]));
        assert_eq!(keys.get("bob"), Some(&vec![0xab, 0xcd, 0xef, 0x01]));
        for bad in ["alice", "alice:0", "alice:zz", ":00", "alice:", ""] {
            assert!(parse_psk_file(path, bad).is_err(), "{bad:?} accepted");
        }
    }
}
