//! The relay of a TLS connection: one thread that owns the OpenSSL stream and moves
//! bytes between it and the connection's plaintext socket pair.
//!
//! Why a relay thread: the server's connection code is synchronous, and a
//! connection's reader thread and its reply writers use the socket at once. An
//! OpenSSL stream cannot be read and written from two threads at once (one `SSL`
//! object, one state machine). So after the handshake (`tls.rs`) one thread per
//! connection owns the `SslStream`, with the socket nonblocking, and `poll`s it and one
//! end of a socket pair; the other end is the connection's [`Stream`] from then on, so
//! negotiation, transmission and replies run unchanged on plaintext. The price is a
//! thread and two copies per byte through the pair (measured in docs/benchmarks.md).

use crate::stream::Stream;
use openssl::ssl::{ErrorCode, SslStream};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes each direction of a relay holds at most: four full TLS records, so one
/// `SSL_write` and one socket write move a 64 KiB NBD payload.
pub const RELAY_BUFFER_BYTES: usize = 64 << 10;

/// The client's socket as OpenSSL's transport (the connection keeps its own handle
/// in the server's registry, for shutdown).
#[derive(Debug)]
pub(crate) struct RawSocket(pub(crate) Arc<Stream>);

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
pub(crate) struct Relay {
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
    pub(crate) fn new(
        tls: SslStream<RawSocket>,
        plain: UnixStream,
        reply_write_timeout: Duration,
    ) -> Relay {
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
    pub(crate) fn run(mut self) {
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
