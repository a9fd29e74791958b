//! The server: listeners (TCP and unix), admitting each accepted connection (up to
//! the connection limit) to a thread that negotiates and then transmits, and an
//! orderly shutdown. It is the top of the crate: it calls `negotiate.rs` and
//! `transmission.rs`, which share with it only what `shared.rs` holds (the
//! configuration, the exports, the registry of live connections, the limits on
//! requests in flight), and never see the listeners.
//!
//! Threads: one accept thread per listener; per connection, one thread that
//! negotiates and then reads requests (and runs a lone small write itself), plus up
//! to [`WORKERS_PER_CONNECTION_MAX`] worker threads started on demand, of which one
//! per CPU runs quick requests at once, and retired after
//! [`crate::WORKER_IDLE_TIMEOUT`] idle (see `transmission.rs`); after STARTTLS, one
//! relay thread that owns the TLS session (see `tls.rs`). Every thread ends
//! when its connection or listener does, so threads, memory and file descriptors
//! return to their baseline when clients leave.

use crate::config::{
    ServerConfig, CONNECTION_RESERVED_BUFFER_BYTES, CONNECTION_RESERVED_REQUESTS,
    CONNECTION_SHARED_BUFFER_BYTES_MAX, INFLIGHT_BUFFER_BYTES_MAX, NEGOTIATION_TIMEOUT,
    PAYLOAD_COMPLETION_RESERVE_BYTES, PAYLOAD_PIECE_BYTES, PAYLOAD_TIMEOUT, REPLY_WRITE_TIMEOUT,
    SHUTDOWN_GRACE, THREAD_STACK_BYTES, WORKERS_PER_CONNECTION_MAX,
};
use crate::export::ExportProvider;
use crate::negotiate::{self, Channel, NegotiationError};
use crate::shared::{ExportUsers, Shared};
use crate::sources::source_of;
use crate::stream::Stream;
use crate::tls::TlsMode;
use crate::transmission;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// The shortest wake-up for idle checks (a zero socket timeout means none).
const IDLE_CHECK_MIN: Duration = Duration::from_millis(100);

/// Pause after a failed `accept` (e.g. out of file descriptors) before trying again.
const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(50);

/// What the server holds now, and its limits (for `stats`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerStats {
    /// Connections open (negotiating or transmitting).
    pub connections: usize,
    /// Requests read and not yet answered, across connections.
    pub inflight_requests: usize,
    /// Bytes of read and write buffers those requests hold.
    pub inflight_buffer_bytes: u64,
    /// Every named limit and its value.
    pub limits: Vec<(String, u64)>,
}

enum ListenerSocket {
    Tcp(Arc<TcpListener>),
    Unix(Arc<UnixListener>),
}

struct Listener {
    socket: ListenerSocket,
    thread: Option<JoinHandle<()>>,
    /// A unix listener's path and the device and inode of the socket file bound there:
    /// shutdown removes the file only if it is still this one, never another server's
    /// that took the path after ours was deleted.
    unix_path: Option<(PathBuf, Option<(u64, u64)>)>,
}

/// An NBD server: listeners, and the state its connections share.
pub struct Server {
    shared: Arc<Shared>,
    listeners: Mutex<Vec<Listener>>,
}

impl Server {
    /// A server over `exports`. Limits of zero are raised to one.
    pub fn new(config: ServerConfig, exports: Arc<dyn ExportProvider>) -> Arc<Server> {
        Arc::new(Server {
            shared: Arc::new(Shared::new(config, exports)),
            listeners: Mutex::new(Vec::new()),
        })
    }

    /// Listen on a unix socket (a stale socket file at `path` is removed first) and
    /// accept connections on a new thread.
    pub fn listen_unix(self: &Arc<Self>, path: &Path) -> io::Result<()> {
        // Held until the listener is registered, so a concurrent shutdown sees it.
        let mut listeners = self.listeners.lock();
        self.refuse_if_shutting_down()?;
        remove_stale_socket(path)?;
        let listener = Arc::new(UnixListener::bind(path)?);
        let server = Arc::clone(self);
        let accepting = Arc::clone(&listener);
        let thread = std::thread::Builder::new()
            .name("nbd-accept-unix".into())
            .spawn(move || loop {
                match accepting.accept() {
                    Ok((stream, _)) => {
                        if !server.admit(Stream::Unix(stream), Listening::Unix) {
                            return;
                        }
                    }
                    Err(e) => {
                        if !server.accept_failed(&e) {
                            return;
                        }
                    }
                }
            })?;
        tracing::info!(path = %path.display(), "NBD server listening on unix socket");
        listeners.push(Listener {
            socket: ListenerSocket::Unix(listener),
            thread: Some(thread),
            unix_path: Some((path.to_path_buf(), file_id(path))),
        });
        Ok(())
    }

    /// Listen on a TCP address (`host:port`; port 0 picks one) and accept connections
    /// on a new thread. Returns the bound address.
    pub fn listen_tcp(self: &Arc<Self>, addr: &str) -> io::Result<SocketAddr> {
        let mut listeners = self.listeners.lock();
        self.refuse_if_shutting_down()?;
        let listener = Arc::new(TcpListener::bind(addr)?);
        let local = listener.local_addr()?;
        let server = Arc::clone(self);
        let accepting = Arc::clone(&listener);
        let thread = std::thread::Builder::new()
            .name("nbd-accept-tcp".into())
            .spawn(move || loop {
                match accepting.accept() {
                    Ok((stream, _)) => {
                        // Replies are written whole; Nagle would only add latency.
                        let _ = stream.set_nodelay(true);
                        set_keepalive(&stream);
                        if !server.admit(Stream::Tcp(stream), Listening::Tcp) {
                            return;
                        }
                    }
                    Err(e) => {
                        if !server.accept_failed(&e) {
                            return;
                        }
                    }
                }
            })?;
        tracing::info!(%local, "NBD server listening on TCP");
        listeners.push(Listener {
            socket: ListenerSocket::Tcp(listener),
            thread: Some(thread),
            unix_path: None,
        });
        Ok(local)
    }

    /// Stop accepting, let in-flight requests finish and their replies go out, close
    /// every connection, and return when all connection threads have ended.
    pub fn shutdown(&self) {
        let listeners: Vec<Listener> = {
            let mut listeners = self.listeners.lock();
            self.shared.set_shutting_down();
            std::mem::take(&mut *listeners)
        };
        for listener in &listeners {
            let fd = match &listener.socket {
                ListenerSocket::Tcp(l) => l.as_raw_fd(),
                ListenerSocket::Unix(l) => l.as_raw_fd(),
            };
            // SAFETY: `fd` belongs to a listener this struct still holds (so it is open);
            // shutdown(2) on a listening socket only wakes the thread blocked in accept(2).
            unsafe {
                libc::shutdown(fd, libc::SHUT_RDWR);
            }
        }
        for mut listener in listeners {
            if let Some(thread) = listener.thread.take() {
                let _ = thread.join();
            }
            if let Some((path, bound_id)) = &listener.unix_path {
                if bound_id.is_some() && file_id(path) == *bound_id {
                    let _ = std::fs::remove_file(path);
                }
            }
        }
        // No new connections now. Stop every reader; workers finish and reply.
        self.shared.close_connections(SHUTDOWN_GRACE);
        tracing::info!("NBD server shut down");
    }

    /// Connections open now (negotiating or transmitting).
    pub fn connections(&self) -> usize {
        self.shared.connections()
    }

    /// Connections in transmission and the distinct clients holding them, by export
    /// (exports no one uses are left out).
    pub fn users(&self) -> BTreeMap<String, ExportUsers> {
        self.shared.users()
    }

    /// Requests in flight across all connections now.
    pub fn inflight_requests(&self) -> usize {
        self.shared.inflight_requests()
    }

    /// Connections, requests and buffer bytes in flight, and the limits on them.
    pub fn stats(&self) -> ServerStats {
        let (inflight_requests, inflight_buffer_bytes) = self.shared.inflight_snapshot();
        let c = self.shared.config();
        let limits = [
            ("max_connections", c.max_connections as u64),
            (
                "max_inflight_per_connection",
                c.max_inflight_per_connection as u64,
            ),
            (
                "max_connections_per_source",
                c.max_connections_per_source as u64,
            ),
            (
                "trusted_reserved_connections",
                c.trusted_reserved_connections as u64,
            ),
            ("idle_timeout_s", c.idle_timeout.map_or(0, |t| t.as_secs())),
            ("max_inflight_total", c.max_inflight_total as u64),
            (
                "connection_reserved_requests",
                CONNECTION_RESERVED_REQUESTS.min(c.max_inflight_per_connection) as u64,
            ),
            ("inflight_buffer_bytes_max", INFLIGHT_BUFFER_BYTES_MAX),
            (
                "connection_reserved_buffer_bytes",
                CONNECTION_RESERVED_BUFFER_BYTES,
            ),
            (
                "connection_shared_buffer_bytes_max",
                CONNECTION_SHARED_BUFFER_BYTES_MAX,
            ),
            (
                "workers_per_connection_max",
                WORKERS_PER_CONNECTION_MAX as u64,
            ),
            (
                "workers_running_max",
                self.shared.workers_running_max() as u64,
            ),
            (
                "payload_max_bytes",
                u64::from(crate::protocol::PAYLOAD_MAX_BYTES),
            ),
            ("payload_piece_bytes", PAYLOAD_PIECE_BYTES),
            (
                "payload_completion_reserve_bytes",
                PAYLOAD_COMPLETION_RESERVE_BYTES,
            ),
            ("payload_timeout_s", PAYLOAD_TIMEOUT.as_secs()),
            ("negotiation_timeout_s", NEGOTIATION_TIMEOUT.as_secs()),
            ("reply_write_timeout_s", REPLY_WRITE_TIMEOUT.as_secs()),
            (
                "block_status_memory_max_bytes",
                crate::protocol::BLOCK_STATUS_MEMORY_MAX_BYTES,
            ),
        ];
        ServerStats {
            connections: self.connections(),
            inflight_requests,
            inflight_buffer_bytes,
            limits: limits
                .into_iter()
                .map(|(name, value)| (name.to_string(), value))
                .collect(),
        }
    }

    fn refuse_if_shutting_down(&self) -> io::Result<()> {
        if self.shared.is_shutting_down() {
            return Err(io::Error::other("the NBD server is shutting down"));
        }
        Ok(())
    }

    /// An `accept` error: keep going (after a pause) unless shutting down.
    fn accept_failed(&self, e: &io::Error) -> bool {
        if self.shared.is_shutting_down() {
            return false;
        }
        tracing::warn!(error = %e, "NBD accept failed");
        std::thread::sleep(ACCEPT_RETRY_DELAY);
        true
    }

    /// Register a new connection and start its thread. Returns false when the
    /// accept loop should end (shutdown).
    fn admit(&self, stream: Stream, listening: Listening) -> bool {
        if self.shared.is_shutting_down() {
            return false;
        }
        let stream = Arc::new(stream);
        let source = source_of(&stream);
        let id = match self.shared.register(&stream, source) {
            Ok(id) => id,
            Err(refusal) => {
                let c = self.shared.config();
                tracing::warn!(
                    max_connections = c.max_connections,
                    max_connections_per_source = c.max_connections_per_source,
                    trusted_reserved_connections = c.trusted_reserved_connections,
                    peer = %stream.peer(),
                    %source,
                    "NBD connection refused: {refusal}"
                );
                return true;
            }
        };
        let shared = Arc::clone(&self.shared);
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .stack_size(THREAD_STACK_BYTES)
            .spawn(move || {
                let guard = Registered { shared, id };
                serve_connection(&guard.shared, id, stream, listening);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "NBD connection dropped: cannot start its thread");
            self.shared.unregister(id);
        }
        true
    }
}

/// The TLS mode of connections from `listening`.
fn tls_mode(config: &ServerConfig, listening: Listening) -> TlsMode {
    match (&config.tls, listening) {
        (None, _) => TlsMode::Off,
        (Some(tls), Listening::Tcp) => tls.tcp,
        (Some(tls), Listening::Unix) => tls.unix,
    }
}

/// Removes a connection from the registry when its thread ends, even by panic.
struct Registered {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.shared.unregister(self.id);
    }
}

/// Which kind of listener accepted a connection (each has its TLS mode).
#[derive(Debug, Clone, Copy)]
enum Listening {
    Tcp,
    Unix,
}

/// One connection from accept to close.
fn serve_connection(shared: &Shared, id: u64, stream: Arc<Stream>, listening: Listening) {
    let peer = stream.peer();
    let client = stream.client();
    tracing::debug!(id, %peer, "NBD connection opened");
    if let Err(e) = stream
        .set_read_timeout(Some(NEGOTIATION_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(REPLY_WRITE_TIMEOUT)))
    {
        tracing::debug!(id, error = %e, "NBD connection closed: socket setup failed");
        return;
    }
    let mut channel = Channel::new(Arc::clone(&stream), Some(NEGOTIATION_TIMEOUT));
    let mode = tls_mode(shared.config(), listening);
    let negotiated = negotiate::negotiate(shared, id, mode, &mut channel);
    // After STARTTLS the relay owns the client's socket: it sends what the connection
    // wrote and then closes the socket, once the connection closes its end.
    let plain = Arc::clone(&channel.stream);
    let relayed = !Arc::ptr_eq(&plain, &stream);
    match negotiated {
        Ok(Some(session)) => {
            let Channel {
                mut reader,
                peer: tls,
                ..
            } = channel;
            reader.get_mut().set_deadline(None);
            // The socket's timeout wakes the reader to check for an idle connection.
            let wake = shared
                .config()
                .idle_timeout
                .map_or(PAYLOAD_TIMEOUT, |idle| {
                    idle.clamp(IDLE_CHECK_MIN, PAYLOAD_TIMEOUT)
                });
            if plain.set_read_timeout(Some(wake)).is_ok() {
                // Names and identities are escaped: a newline in one must not forge a
                // log line.
                let export = session.name.escape_debug().to_string();
                tracing::debug!(id, %export, mode = ?session.mode, "NBD transmission");
                // What an admin reads at the default level: who attached which volume,
                // over what, and when they left (probes that never reach transmission
                // stay at debug).
                let tls = tls.describe().escape_debug().to_string();
                tracing::info!(id, %peer, %export, %tls, "NBD client attached");
                shared.attach(id, &session.name, client);
                transmission::serve(shared, id, session, reader, Arc::clone(&plain));
                tracing::info!(id, %peer, %export, "NBD client detached");
            }
        }
        Ok(None) => tracing::debug!(id, "NBD client ended negotiation"),
        Err(e) => {
            let error = e.to_string().escape_debug().to_string();
            // Refusals an admin wants to see: TLS that failed or was skipped where it
            // is required, and exports refused (unknown, or by policy).
            if matches!(
                e,
                NegotiationError::Tls(_)
                    | NegotiationError::TlsRequired
                    | NegotiationError::BytesAfterStartTls
                    | NegotiationError::ExportRefused { .. }
            ) {
                tracing::info!(id, %peer, %error, "NBD handshake refused");
            } else {
                tracing::debug!(id, %error, "NBD negotiation ended");
            }
        }
    }
    plain.shutdown(Shutdown::Both);
    if !relayed {
        stream.shutdown(Shutdown::Both);
    }
    tracing::debug!(id, %peer, "NBD connection closed");
}

/// Seconds of silence before TCP keepalive probes start, the gap between probes, and
/// how many unanswered probes close the socket: a client host that vanished without
/// closing its connections is noticed within about two minutes, so its connection
/// slots and volume handles (which block `volume delete`) are released.
const KEEPALIVE_IDLE_S: libc::c_int = 60;
const KEEPALIVE_INTERVAL_S: libc::c_int = 10;
const KEEPALIVE_PROBES: libc::c_int = 6;

/// Turn on TCP keepalive with the timings above (best effort: a failure only means
/// a dead peer is noticed later).
fn set_keepalive(stream: &TcpStream) {
    let fd = stream.as_raw_fd();
    let options = [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, KEEPALIVE_IDLE_S),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, KEEPALIVE_PROBES),
    ];
    for (level, name, value) in options {
        // SAFETY: `fd` is an open TCP socket owned by `stream` for the whole call;
        // the option value is a c_int that lives across the call, with its size given.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(error = %io::Error::last_os_error(), "TCP keepalive option not set");
        }
    }
}

/// Device and inode of the file at `path`, if there is one.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|metadata| (metadata.dev(), metadata.ino()))
}

/// Remove a socket file left by an earlier server; refuse to remove anything else.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{} is in use by a running server", path.display()),
                ));
            }
            std::fs::remove_file(path)
        }
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_socket_files_are_removed_but_nothing_else() {
        let dir = std::env::temp_dir().join(format!("fewerbytes-nbd-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("not-a-socket");
        std::fs::write(&file, b"data").expect("file");
        assert!(remove_stale_socket(&file).is_err());
        assert!(file.exists());
        assert!(remove_stale_socket(&dir.join("absent")).is_ok());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
