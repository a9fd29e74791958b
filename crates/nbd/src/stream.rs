//! A client's socket ([`Stream`], TCP or unix; after STARTTLS, the plaintext end of
//! the connection's TLS relay) and the reader a connection's `BufReader` owns
//! ([`StreamReader`]: deadlines, and polling between back-to-back requests).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A connected client socket, TCP or unix.
#[derive(Debug)]
pub(crate) enum Stream {
    /// TCP.
    Tcp(TcpStream),
    /// Unix domain.
    Unix(UnixStream),
}

impl Stream {
    /// The socket's descriptor (owned by `self`).
    pub(crate) fn fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        }
    }

    pub(crate) fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(nonblocking),
            Stream::Unix(s) => s.set_nonblocking(nonblocking),
        }
    }

    /// Receive what is there now, without waiting (`WouldBlock` if nothing is).
    fn recv_nowait(&self, buf: &mut [u8]) -> io::Result<usize> {
        let fd = self.fd();
        // SAFETY: `fd` is an open socket owned by `self` for the whole call, and `buf`
        // is valid for writes of its length.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    pub(crate) fn shutdown(&self, how: Shutdown) {
        // Errors only mean the socket is already gone.
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) => s.shutdown(how),
        };
    }

    pub(crate) fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(timeout),
            Stream::Unix(s) => s.set_read_timeout(timeout),
        }
    }

    pub(crate) fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(timeout),
            Stream::Unix(s) => s.set_write_timeout(timeout),
        }
    }

    pub(crate) fn peer(&self) -> String {
        match self {
            Stream::Tcp(s) => s
                .peer_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|_| "tcp".into()),
            Stream::Unix(_) => "unix".into(),
        }
    }

    /// Who is at the other end, as one client: a TCP peer's address without its port,
    /// a unix peer's process (SO_PEERCRED pid and uid). The several connections of
    /// one client (QEMU's multi-conn, nbdcopy's `--connections`) give the same
    /// answer; `None` when the kernel cannot tell.
    pub(crate) fn client(&self) -> Option<String> {
        match self {
            Stream::Tcp(s) => s.peer_addr().ok().map(|a| a.ip().to_string()),
            Stream::Unix(s) => peer_credentials(s)
                .filter(|cred| cred.pid != 0)
                .map(|cred| format!("pid {} uid {}", cred.pid, cred.uid)),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Unix(s) => (&*s).write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match *self {
            Stream::Tcp(s) => (&*s).write_vectored(bufs),
            Stream::Unix(s) => (&*s).write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The read half a connection's `BufReader` owns. With a deadline set, a read after
/// it fails with `TimedOut`: negotiation and each write payload must arrive within
/// their time, however slowly the bytes trickle in.
///
/// During transmission it may poll before it sleeps: while the client's requests
/// come back to back (the last one came within `spin`, by polling or soon after
/// the reader went to sleep), the next read polls for up to `spin` first. One long
/// gap, and reads sleep at once again until gaps are short. Polling pays only for a
/// lone client waiting on each answer (queue depth 1): a reader polls only while its
/// connection is the server's only one in transmission, no request is in flight, and
/// no other reader polls (see [`Polling`]). Four connections at queue depth 32 spent
/// about a fifth of the server's CPU on failed polls otherwise (1.26 M of 1.30 M
/// `recvfrom` calls in 4 s found nothing), CPU the client and the workers needed.
pub(crate) struct StreamReader {
    stream: Arc<Stream>,
    deadline: Option<Instant>,
    /// The poll window (zero: never poll).
    spin: Duration,
    /// The connection's requests in flight: no polling unless zero.
    inflight: Option<Arc<AtomicUsize>>,
    /// The server's requests in flight and its polling slot.
    polling: Option<Polling>,
    /// Whether the last gap between reads was within the window.
    gaps_short: bool,
}

/// What a server's readers share to decide whether one may poll: the requests in
/// flight across the server, and the one slot a polling reader holds.
#[derive(Clone)]
pub(crate) struct Polling {
    /// Requests in flight across the server: no polling unless zero.
    pub(crate) server_requests: Arc<AtomicUsize>,
    /// Held by the reader that polls now; others sleep at once.
    pub(crate) slot: Arc<AtomicBool>,
    /// Connections in transmission: no polling unless this one is alone.
    pub(crate) transmitting: Arc<AtomicUsize>,
}

impl Polling {
    /// A lone server's polling state (for tests).
    #[cfg(test)]
    pub(crate) fn new() -> Polling {
        Polling {
            server_requests: Arc::new(AtomicUsize::new(0)),
            slot: Arc::new(AtomicBool::new(false)),
            transmitting: Arc::new(AtomicUsize::new(1)),
        }
    }
}

impl StreamReader {
    /// A reader with no deadline that never polls.
    pub(crate) fn new(stream: Arc<Stream>) -> StreamReader {
        StreamReader {
            stream,
            deadline: None,
            spin: Duration::ZERO,
            inflight: None,
            polling: None,
            gaps_short: false,
        }
    }

    /// Poll for up to `spin` before sleeping, while gaps are short, `inflight` (the
    /// connection's requests in flight) and the server's are zero, and no other
    /// reader polls (see above).
    pub(crate) fn set_spin(
        &mut self,
        spin: Duration,
        inflight: Arc<AtomicUsize>,
        polling: Polling,
    ) {
        self.spin = spin;
        self.inflight = Some(inflight);
        self.polling = Some(polling);
        self.gaps_short = true;
    }

    fn may_spin(&self) -> bool {
        self.gaps_short
            && self
                .inflight
                .as_ref()
                .is_some_and(|n| n.load(Ordering::Relaxed) == 0)
            && self.polling.as_ref().is_some_and(|p| {
                p.transmitting.load(Ordering::Relaxed) <= 1
                    && p.server_requests.load(Ordering::Relaxed) == 0
            })
    }

    /// Take the server's polling slot; `None` if another reader holds it.
    fn take_poll_slot(&self) -> Option<PollSlot<'_>> {
        let slot = &self.polling.as_ref()?.slot;
        slot.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| PollSlot(slot))
    }

    /// Reads fail after `timeout` from now (`None`: no deadline).
    pub(crate) fn set_deadline(&mut self, timeout: Option<Duration>) {
        self.deadline = timeout.map(|t| Instant::now() + t);
    }

    /// The deadline, if one is set.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Whether a deadline is set.
    pub(crate) fn has_deadline(&self) -> bool {
        self.deadline.is_some()
    }
}

impl Read for StreamReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client did not send in time",
                ));
            }
            match self.read_once(buf) {
                // The socket's timeout may be shorter than the deadline (it also wakes
                // the reader to check for an idle connection): wait on to the deadline.
                Err(e)
                    if self.deadline.is_some()
                        && matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                        ) => {}
                read => return read,
            }
        }
    }
}

impl StreamReader {
    /// One read from the socket, polling first if allowed (see above).
    fn read_once(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.spin.is_zero() {
            return (&*self.stream).read(buf);
        }
        let start = Instant::now();
        let slot = if self.may_spin() {
            self.take_poll_slot()
        } else {
            None
        };
        if slot.is_some() {
            loop {
                match self.stream.recv_nowait(buf) {
                    Ok(n) => return Ok(n),
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                        ) => {}
                    Err(e) => return Err(e),
                }
                if start.elapsed() >= self.spin {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        drop(slot);
        let read = (&*self.stream).read(buf);
        self.gaps_short = start.elapsed() < self.spin * 2;
        read
    }
}

/// The server's polling slot while a reader holds it.
struct PollSlot<'a>(&'a AtomicBool);

impl Drop for PollSlot<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The process at the other end of a unix socket (SO_PEERCRED: pid, uid, gid), or
/// `None` when the kernel cannot tell.
pub fn peer_credentials(stream: &UnixStream) -> Option<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given, and the fd is
    // a live unix socket owned by `stream` for the duration of the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fail_after_the_deadline() {
        let (a, b) = UnixStream::pair().expect("socket pair");
        (&b).write_all(b"abcd").expect("write");
        let mut reader = StreamReader::new(Arc::new(Stream::Unix(a)));
        let mut buf = [0u8; 2];
        reader.read_exact(&mut buf).expect("no deadline");
        reader.set_deadline(Some(Duration::ZERO));
        assert!(reader.has_deadline());
        let err = reader.read_exact(&mut buf).expect_err("past the deadline");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        reader.set_deadline(None);
        reader.read_exact(&mut buf).expect("deadline cleared");
        assert_eq!(&buf, b"cd");
    }

    #[test]
    fn polling_follows_the_gaps_between_requests() {
        let (a, b) = UnixStream::pair().expect("socket pair");
        let mut reader = StreamReader::new(Arc::new(Stream::Unix(a)));
        let inflight = Arc::new(AtomicUsize::new(0));
        let polling = Polling::new();
        reader.set_spin(
            Duration::from_millis(5),
            Arc::clone(&inflight),
            polling.clone(),
        );
        assert!(reader.may_spin(), "a new connection polls");
        let mut buf = [0u8; 4];
        // Bytes already there: a short gap, polling goes on.
        (&b).write_all(b"abcd").expect("write");
        reader.read_exact(&mut buf).expect("read");
        assert!(reader.may_spin());
        // Requests in flight: no polling, whatever the gaps.
        inflight.store(1, Ordering::Relaxed);
        assert!(!reader.may_spin());
        inflight.store(0, Ordering::Relaxed);
        // Another connection's requests in flight: the CPUs are theirs.
        polling.server_requests.store(1, Ordering::Relaxed);
        assert!(!reader.may_spin());
        polling.server_requests.store(0, Ordering::Relaxed);
        assert!(reader.may_spin());
        // Other connections in transmission: never (their clients need the CPUs).
        polling.transmitting.store(2, Ordering::Relaxed);
        assert!(!reader.may_spin());
        polling.transmitting.store(1, Ordering::Relaxed);
        // One reader polls at a time.
        let held = reader.take_poll_slot().expect("the slot is free");
        assert!(reader.take_poll_slot().is_none(), "a second poller");
        drop(held);
        assert!(reader.take_poll_slot().is_some(), "the slot is given back");
        // A long gap: the next read sleeps at once.
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            (&b).write_all(b"efgh").expect("write");
            b
        });
        reader.read_exact(&mut buf).expect("read");
        assert_eq!(&buf, b"efgh");
        assert!(!reader.may_spin(), "a 100 ms gap must stop the polling");
        let b = writer.join().expect("writer");
        // And a short one starts it again.
        (&b).write_all(b"ijkl").expect("write");
        reader.read_exact(&mut buf).expect("read");
        assert!(reader.may_spin());
    }
}
