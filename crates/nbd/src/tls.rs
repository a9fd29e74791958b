//! TLS: the credentials a server offers ([`TlsCredentials`]: x509 as qemu's
//! `tls-creds-x509` and nbdkit's `--tls-certificates` lay them out, or PSK in
//! psktool's `identity:hexkey` format), the handshake after `NBD_OPT_STARTTLS`, and
//! the relay that carries a connection's bytes through OpenSSL afterwards.
//!
//! After the handshake the connection's bytes go through a relay thread that owns
//! the OpenSSL stream (`relay.rs`, which says why).
//!
//! Why OpenSSL (the `openssl` crate over the system's libssl): NBD clients offer PSK
//! (`tls-psk-file`, qemu's `tls-creds-psk`) as well as x509, and rustls has no
//! external PSK; OpenSSL does both, in TLS 1.2 and 1.3.

use crate::relay::{RawSocket, Relay};
use crate::stream::Stream;
use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::nid::Nid;
use openssl::ssl::{
    ErrorCode, HandshakeError, Ssl, SslAcceptor, SslFiletype, SslMethod, SslOptions,
    SslSessionCacheMode, SslStream, SslVerifyMode, SslVersion,
};
use std::collections::HashMap;
use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Stack of a relay thread: OpenSSL's record layer needs a few KiB; buffers are on
/// the heap. The same as the server's other threads (`config::THREAD_STACK_BYTES`).
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
