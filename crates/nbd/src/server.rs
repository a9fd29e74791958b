//! The server: listeners (TCP and unix), the registry of live connections, the
//! limits on connections and on requests in flight, and an orderly shutdown.
//!
//! Threads: one accept thread per listener; per connection, one thread that
//! negotiates and then reads requests (and runs a lone small write itself), plus up
//! to [`WORKERS_PER_CONNECTION_MAX`] worker threads started on demand, of which one
//! per CPU runs quick requests at once, and retired after
//! [`crate::WORKER_IDLE_TIMEOUT`] idle (see `transmission.rs`); after STARTTLS, one
//! relay thread that owns the TLS session (see `tls.rs`). Every thread ends
//! when its connection or listener does, so threads, memory and file descriptors
//! return to their baseline when clients leave.

use crate::export::ExportProvider;
use crate::stream::{Stream, StreamReader};
use crate::tls::{Peer, TlsCredentials, TlsMode};
use crate::{negotiate, transmission};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::io::{self, BufReader};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Default for [`ServerConfig::max_connections`]: a host runs tens of VMs with a few
/// connections each (multi-conn); 512 leaves room while bounding threads and fds
/// (each connection holds one socket and at most 1 + [`WORKERS_PER_CONNECTION_MAX`]
/// threads; over TLS also a socket pair and its relay thread).
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// Default for [`ServerConfig::max_inflight_per_connection`]: QEMU and fio run queue
/// depths up to 32 per connection and the kernel client up to 128 tags; 64 keeps a
/// deep queue busy while bounding what one client can hold.
pub const DEFAULT_MAX_INFLIGHT_PER_CONNECTION: usize = 64;
/// Default for [`ServerConfig::max_inflight_total`]: 16 clients at full depth. The
/// engine runs one worker per CPU, so more queued requests only add latency.
pub const DEFAULT_MAX_INFLIGHT_TOTAL: usize = 1024;
/// Request slots each connection holds apart from [`ServerConfig::max_inflight_total`]
/// (at most its [`ServerConfig::max_inflight_per_connection`]), so that connections
/// whose clients stall with requests in flight (reads whose replies they never read,
/// write headers whose payloads never come) cannot take every slot and keep other
/// clients' requests unread: 8 keep each of a connection's
/// [`WORKERS_PER_CONNECTION_MAX`] workers busy. Requests in flight are bounded by
/// the total plus the reserves of [`DEFAULT_MAX_CONNECTIONS`] connections (5,120 at
/// the defaults), their buffers by the byte budgets below.
pub const CONNECTION_RESERVED_REQUESTS: usize = 8;
/// How long a connection's reader polls for the next request before it sleeps in
/// the kernel, while its client sends requests back to back (see [`StreamReader`]).
/// A queue-depth-1 client's next request usually comes within this; catching it
/// without a sleep and a cross-CPU wake-up cut 4 KiB read latency at queue depth 1
/// from ~70 µs to ~30 µs on a 2-vCPU VM. The price: while a client keeps its gaps
/// that short, its reader spins through them instead of sleeping.
pub const DEFAULT_READ_SPIN: Duration = Duration::from_micros(50);
/// Bytes of read and write buffers in flight across the server, beyond each
/// connection's own reserve ([`CONNECTION_RESERVED_BUFFER_BYTES`]). 256 MiB holds 8
/// maximum-size (32 MiB) requests, or 65,536 4 KiB ones (more than the request
/// limit), so it only binds for large requests, where 8 at once saturate a disk.
/// Buffer memory is bounded by this plus the reserves of
/// [`DEFAULT_MAX_CONNECTIONS`] connections (1.25 GiB at the defaults).
pub const INFLIGHT_BUFFER_BYTES_MAX: u64 = 256 << 20;
/// Buffer bytes each connection may hold apart from the shared pool, so that a
/// connection whose client stalls the pool (large reads whose replies it never
/// reads, large write headers whose payloads never come) cannot keep other clients'
/// ordinary requests waiting: 2 MiB holds a guest's largest requests (Linux's
/// default `max_sectors_kb` is 1,280 KiB) and `qemu-img convert`'s 2 MiB ones.
pub const CONNECTION_RESERVED_BUFFER_BYTES: u64 = 2 << 20;
/// Bytes of the shared pool one connection may hold: two maximum-size requests (one
/// being read or written while the other is answered), so that a connection that
/// stalls holds a quarter of the pool and large requests of others still find room.
pub const CONNECTION_SHARED_BUFFER_BYTES_MAX: u64 = 2 * crate::protocol::PAYLOAD_MAX_BYTES as u64;
/// Worker threads per connection at most, started as requests arrive. Only one per
/// CPU runs quick requests at once (see `workers_running_max` in [`Server::stats`]);
/// the rest serve requests that wait on the disk (flushes and FUA writes waiting for
/// a group commit), so 8 overlap enough of those to keep a queue-depth-32 client busy.
pub const WORKERS_PER_CONNECTION_MAX: usize = 8;
/// A client that has not finished negotiating within this time is dropped, so idle
/// sockets cannot hold connection slots forever.
pub const NEGOTIATION_TIMEOUT: Duration = Duration::from_secs(120);
/// A write payload must arrive within this time of its header (32 MiB at 280 KB/s),
/// else the connection is dropped: a client trickling payloads would otherwise hold
/// its share of [`INFLIGHT_BUFFER_BYTES_MAX`] forever. Also the socket's read timeout
/// in transmission, where an idle client between requests is simply waited for.
pub const PAYLOAD_TIMEOUT: Duration = Duration::from_secs(120);
/// A reply that cannot be written for this long means the client stopped reading;
/// the connection is dropped so its workers and buffers are freed.
pub const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long [`Server::shutdown`] lets in-flight requests finish before it drops the
/// remaining connections outright.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// Read buffer per connection: a few pipelined headers, or a 64 KiB write, per system call.
pub const READ_BUFFER_BYTES: usize = 64 << 10;
/// Stack of connection and worker threads; buffers live on the heap.
pub const THREAD_STACK_BYTES: usize = 256 << 10;
const _: () = assert!(THREAD_STACK_BYTES == crate::tls::RELAY_THREAD_STACK_BYTES);
/// Pause after a failed `accept` (e.g. out of file descriptors) before trying again.
const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(50);

// Any request's buffer fits a connection's share of the pool, and the pool holds
// more than one connection's share.
const _: () =
    assert!(CONNECTION_SHARED_BUFFER_BYTES_MAX >= crate::protocol::PAYLOAD_MAX_BYTES as u64);
const _: () = assert!(INFLIGHT_BUFFER_BYTES_MAX >= 2 * CONNECTION_SHARED_BUFFER_BYTES_MAX);

/// How a server behaves. `Default` gives the named limits above.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Serve every export read-only (`NBD_FLAG_READ_ONLY`; writes answer EPERM).
    pub read_only: bool,
    /// The export the empty name "" means; `None` asks the provider.
    pub default_export: Option<String>,
    /// Connections at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Requests in flight on one connection; at the limit the server stops reading it.
    pub max_inflight_per_connection: usize,
    /// Requests in flight across all connections beyond each one's reserve of
    /// [`CONNECTION_RESERVED_REQUESTS`]; at the limit readers wait.
    pub max_inflight_total: usize,
    /// A reader's poll for the next request before it sleeps (zero: never polls).
    pub read_spin: Duration,
    /// TLS credentials and where they are offered or required; `None`: no TLS.
    pub tls: Option<TlsSettings>,
    /// Which TLS identities may open which export; `None`: any client, any export.
    pub access: Option<Arc<dyn AccessPolicy>>,
}

/// The server's TLS: its credentials, and the mode of each kind of listener.
#[derive(Clone, Debug)]
pub struct TlsSettings {
    /// Certificates or PSK keys.
    pub credentials: Arc<TlsCredentials>,
    /// The mode on TCP listeners.
    pub tcp: TlsMode,
    /// The mode on the unix socket.
    pub unix: TlsMode,
}

/// Who may open what: exports limited to some TLS identities (a client certificate's
/// subject CN, or a PSK identity). Asked at every option that names an export, so a
/// change takes effect for the next client without a restart.
pub trait AccessPolicy: Send + Sync + std::fmt::Debug {
    /// The identities allowed to open `export`, or `None` when any client may.
    fn allowed(&self, export: &str) -> Option<Vec<String>>;
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            read_only: false,
            default_export: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_inflight_per_connection: DEFAULT_MAX_INFLIGHT_PER_CONNECTION,
            max_inflight_total: DEFAULT_MAX_INFLIGHT_TOTAL,
            read_spin: DEFAULT_READ_SPIN,
            tls: None,
            access: None,
        }
    }
}

/// Requests and buffer bytes in flight across the server, with their limits.
///
/// Buffer bytes come from two places, so that no connection can starve the others
/// by stalling (a client that pipelines large reads and never reads the replies, or
/// sends a large write's header and never its payload, holds its buffers for up to
/// [`REPLY_WRITE_TIMEOUT`] or [`PAYLOAD_TIMEOUT`]):
/// - each connection's own reserve of [`CONNECTION_RESERVED_BUFFER_BYTES`], which no
///   other connection can take, so ordinary requests always find room;
/// - the shared pool of [`INFLIGHT_BUFFER_BYTES_MAX`], of which one connection holds
///   at most [`CONNECTION_SHARED_BUFFER_BYTES_MAX`], so several connections always
///   find room for large requests too.
#[derive(Debug)]
pub(crate) struct InflightLimits {
    state: Mutex<InflightState>,
    released: Condvar,
    requests_max: usize,
    bytes_max: u64,
}

#[derive(Debug, Default)]
struct InflightState {
    /// Request slots taken from the shared pool.
    shared_requests: usize,
    /// Request slots taken from connections' own reserves.
    reserved_requests: usize,
    /// Bytes taken from the shared pool.
    shared_bytes: u64,
    /// Bytes taken from connections' own reserves.
    reserved_bytes: u64,
}

/// One connection's view of the server-wide limits: its request slots and buffer
/// bytes come from its own reserve first, then from the shared pools (bytes up to
/// its cap; request slots up to its per-connection limit, which the connection
/// enforces).
#[derive(Debug)]
pub(crate) struct Inflight {
    limits: Arc<InflightLimits>,
    /// Size of this connection's reserve of request slots.
    requests_reserve: usize,
    /// This connection's request slots in its own reserve, and in the shared pool
    /// (changed only under `limits.state`'s lock, like the bytes below).
    reserved_requests: AtomicUsize,
    shared_requests: AtomicUsize,
    /// This connection's bytes in its own reserve, and in the shared pool. Changed
    /// only under `limits.state`'s lock (atomics only to be `Sync` without a second
    /// lock). Which bucket a request's bytes came from is not remembered: a release
    /// gives back shared bytes first, which leaves the same total held either way.
    reserved_bytes: AtomicU64,
    shared_bytes: AtomicU64,
}

impl InflightLimits {
    /// Limits with `requests_max` shared request slots and `bytes_max` shared bytes.
    fn new(requests_max: usize, bytes_max: u64) -> InflightLimits {
        InflightLimits {
            state: Mutex::new(InflightState::default()),
            released: Condvar::new(),
            requests_max,
            bytes_max,
        }
    }

    /// A new connection's view, with an empty reserve of `requests_reserve` slots.
    pub(crate) fn for_connection(self: &Arc<Self>, requests_reserve: usize) -> Arc<Inflight> {
        Arc::new(Inflight {
            limits: Arc::clone(self),
            requests_reserve,
            reserved_requests: AtomicUsize::new(0),
            shared_requests: AtomicUsize::new(0),
            reserved_bytes: AtomicU64::new(0),
            shared_bytes: AtomicU64::new(0),
        })
    }

    /// Requests in flight now (reserved and shared).
    pub(crate) fn requests(&self) -> usize {
        let state = self.state.lock();
        state.shared_requests + state.reserved_requests
    }

    /// Requests and buffer bytes (reserved and shared) in flight now.
    fn snapshot(&self) -> (usize, u64) {
        let state = self.state.lock();
        (
            state.shared_requests + state.reserved_requests,
            state.shared_bytes + state.reserved_bytes,
        )
    }
}

impl Inflight {
    /// Take a request slot if one is free now.
    pub(crate) fn try_acquire_request(&self) -> bool {
        let mut state = self.limits.state.lock();
        self.take_request(&mut state)
    }

    /// Take a slot from this connection's reserve, else from the shared pool, if
    /// either has one free now.
    fn take_request(&self, state: &mut InflightState) -> bool {
        let reserved = self.reserved_requests.load(Ordering::Relaxed);
        if reserved < self.requests_reserve {
            self.reserved_requests
                .store(reserved + 1, Ordering::Relaxed);
            state.reserved_requests += 1;
            return true;
        }
        if state.shared_requests < self.limits.requests_max {
            self.shared_requests.fetch_add(1, Ordering::Relaxed);
            state.shared_requests += 1;
            return true;
        }
        false
    }

    /// Take `bytes` more buffer bytes if they fit now.
    pub(crate) fn try_acquire_bytes(&self, bytes: u64) -> bool {
        let mut state = self.limits.state.lock();
        self.take_bytes(&mut state, bytes)
    }

    /// Take `bytes` from this connection's reserve, else from the shared pool, if
    /// either has room now.
    fn take_bytes(&self, state: &mut InflightState, bytes: u64) -> bool {
        let reserved = self.reserved_bytes.load(Ordering::Relaxed);
        if reserved + bytes <= CONNECTION_RESERVED_BUFFER_BYTES {
            self.reserved_bytes
                .store(reserved + bytes, Ordering::Relaxed);
            state.reserved_bytes += bytes;
            return true;
        }
        let shared = self.shared_bytes.load(Ordering::Relaxed);
        if shared + bytes <= CONNECTION_SHARED_BUFFER_BYTES_MAX
            && state.shared_bytes + bytes <= self.limits.bytes_max
        {
            self.shared_bytes.store(shared + bytes, Ordering::Relaxed);
            state.shared_bytes += bytes;
            return true;
        }
        false
    }

    /// Wait for a request slot.
    pub(crate) fn acquire_request(&self) {
        let mut state = self.limits.state.lock();
        while !self.take_request(&mut state) {
            self.limits.released.wait(&mut state);
        }
    }

    /// Wait until `bytes` more buffer bytes fit (`bytes` ≤ a connection's share of
    /// the pool, checked at compile time, so they fit once this connection's
    /// earlier requests are answered).
    pub(crate) fn acquire_bytes(&self, bytes: u64) {
        let mut state = self.limits.state.lock();
        while !self.take_bytes(&mut state, bytes) {
            self.limits.released.wait(&mut state);
        }
    }

    /// Give back one request slot and its bytes.
    pub(crate) fn release(&self, bytes: u64) {
        let mut state = self.limits.state.lock();
        let shared = self.shared_bytes.load(Ordering::Relaxed);
        let reserved = self.reserved_bytes.load(Ordering::Relaxed);
        let shared_requests = self.shared_requests.load(Ordering::Relaxed);
        let reserved_requests = self.reserved_requests.load(Ordering::Relaxed);
        // A release without its acquire would corrupt the accounting every other
        // connection waits on: fail loudly rather than clamp.
        assert!(
            shared_requests + reserved_requests > 0,
            "a request slot released but this connection holds none"
        );
        assert!(
            shared + reserved >= bytes,
            "{bytes} buffer bytes released, more than this connection holds"
        );
        let from_shared = bytes.min(shared);
        let from_reserved = bytes - from_shared;
        self.shared_bytes
            .store(shared - from_shared, Ordering::Relaxed);
        self.reserved_bytes
            .store(reserved - from_reserved, Ordering::Relaxed);
        // Shared slots first, as for bytes: the reserve is what stays at hand.
        if shared_requests > 0 {
            self.shared_requests
                .store(shared_requests - 1, Ordering::Relaxed);
            state.shared_requests -= 1;
        } else {
            self.reserved_requests
                .store(reserved_requests - 1, Ordering::Relaxed);
            state.reserved_requests -= 1;
        }
        state.shared_bytes -= from_shared;
        state.reserved_bytes -= from_reserved;
        self.limits.released.notify_all();
    }
}

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

#[derive(Default)]
struct Registry {
    next_id: u64,
    connections: HashMap<u64, Arc<Stream>>,
}

/// An NBD server: listeners, connections, limits.
pub struct Server {
    pub(crate) config: ServerConfig,
    pub(crate) exports: Arc<dyn ExportProvider>,
    pub(crate) inflight: Arc<InflightLimits>,
    /// Workers per connection running quick requests at once: one per CPU.
    pub(crate) workers_running_max: usize,
    shutting_down: AtomicBool,
    registry: Mutex<Registry>,
    registry_empty: Condvar,
    listeners: Mutex<Vec<Listener>>,
}

impl Server {
    /// A server over `exports`. Limits of zero are raised to one.
    pub fn new(config: ServerConfig, exports: Arc<dyn ExportProvider>) -> Arc<Server> {
        let mut config = config;
        config.max_connections = config.max_connections.max(1);
        config.max_inflight_per_connection = config.max_inflight_per_connection.max(1);
        config.max_inflight_total = config.max_inflight_total.max(1);
        let inflight = Arc::new(InflightLimits::new(
            config.max_inflight_total,
            INFLIGHT_BUFFER_BYTES_MAX,
        ));
        Arc::new(Server {
            config,
            exports,
            inflight,
            workers_running_max: workers_running_max(),
            shutting_down: AtomicBool::new(false),
            registry: Mutex::new(Registry::default()),
            registry_empty: Condvar::new(),
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
            self.shutting_down.store(true, Ordering::SeqCst);
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
        let streams: Vec<Arc<Stream>> =
            self.registry.lock().connections.values().cloned().collect();
        for stream in &streams {
            stream.shutdown(Shutdown::Read);
        }
        drop(streams);
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        let mut registry = self.registry.lock();
        while !registry.connections.is_empty() {
            if self
                .registry_empty
                .wait_until(&mut registry, deadline)
                .timed_out()
            {
                tracing::warn!(
                    connections = registry.connections.len(),
                    "NBD shutdown grace period over; dropping remaining connections"
                );
                for stream in registry.connections.values() {
                    stream.shutdown(Shutdown::Both);
                }
                while !registry.connections.is_empty() {
                    self.registry_empty.wait(&mut registry);
                }
            }
        }
        tracing::info!("NBD server shut down");
    }

    /// Connections open now (negotiating or transmitting).
    pub fn connections(&self) -> usize {
        self.registry.lock().connections.len()
    }

    /// Requests in flight across all connections now.
    pub fn inflight_requests(&self) -> usize {
        self.inflight.requests()
    }

    /// Connections, requests and buffer bytes in flight, and the limits on them.
    pub fn stats(&self) -> ServerStats {
        let (inflight_requests, inflight_buffer_bytes) = self.inflight.snapshot();
        let c = &self.config;
        let limits = [
            ("max_connections", c.max_connections as u64),
            (
                "max_inflight_per_connection",
                c.max_inflight_per_connection as u64,
            ),
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
            ("workers_running_max", self.workers_running_max as u64),
            (
                "payload_max_bytes",
                u64::from(crate::protocol::PAYLOAD_MAX_BYTES),
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

    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    fn refuse_if_shutting_down(&self) -> io::Result<()> {
        if self.is_shutting_down() {
            return Err(io::Error::other("the NBD server is shutting down"));
        }
        Ok(())
    }

    /// An `accept` error: keep going (after a pause) unless shutting down.
    fn accept_failed(&self, e: &io::Error) -> bool {
        if self.is_shutting_down() {
            return false;
        }
        tracing::warn!(error = %e, "NBD accept failed");
        std::thread::sleep(ACCEPT_RETRY_DELAY);
        true
    }

    /// Register a new connection and start its thread. Returns false when the
    /// accept loop should end (shutdown).
    fn admit(self: &Arc<Self>, stream: Stream, listening: Listening) -> bool {
        if self.is_shutting_down() {
            return false;
        }
        let stream = Arc::new(stream);
        let id = {
            let mut registry = self.registry.lock();
            if registry.connections.len() >= self.config.max_connections {
                tracing::warn!(
                    limit = self.config.max_connections,
                    peer = %stream.peer(),
                    "NBD connection refused: at the connection limit"
                );
                return true;
            }
            let id = registry.next_id;
            registry.next_id += 1;
            registry.connections.insert(id, Arc::clone(&stream));
            id
        };
        let server = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .stack_size(THREAD_STACK_BYTES)
            .spawn(move || {
                let guard = Registered { server, id };
                serve_connection(&guard.server, id, stream, listening);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "NBD connection dropped: cannot start its thread");
            self.unregister(id);
        }
        true
    }

    /// After STARTTLS: the connection's plaintext stream is what a shutdown closes (its
    /// relay then finishes sending the replies, and closes the client's socket).
    pub(crate) fn replace_stream(&self, id: u64, stream: Arc<Stream>) {
        self.registry
            .lock()
            .connections
            .insert(id, Arc::clone(&stream));
        if self.is_shutting_down() {
            stream.shutdown(Shutdown::Read);
        }
    }

    /// The TLS mode of connections from `listening`.
    pub(crate) fn tls_mode(&self, listening: Listening) -> TlsMode {
        match (&self.config.tls, listening) {
            (None, _) => TlsMode::Off,
            (Some(tls), Listening::Tcp) => tls.tcp,
            (Some(tls), Listening::Unix) => tls.unix,
        }
    }

    fn unregister(&self, id: u64) {
        let mut registry = self.registry.lock();
        registry.connections.remove(&id);
        if registry.connections.is_empty() {
            self.registry_empty.notify_all();
        }
    }
}

/// Workers of one connection that run quick requests at once: the CPUs this process
/// may use (more only take turns on them, and each costs wakeups), at most
/// [`WORKERS_PER_CONNECTION_MAX`].
fn workers_running_max() -> usize {
    std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, WORKERS_PER_CONNECTION_MAX)
}

/// Removes a connection from the registry when its thread ends, even by panic.
struct Registered {
    server: Arc<Server>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.server.unregister(self.id);
    }
}

/// Which kind of listener accepted a connection (each has its TLS mode).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Listening {
    Tcp,
    Unix,
}

/// One connection from accept to close.
fn serve_connection(server: &Arc<Server>, id: u64, stream: Arc<Stream>, listening: Listening) {
    let peer = stream.peer();
    tracing::debug!(id, %peer, "NBD connection opened");
    if let Err(e) = stream
        .set_read_timeout(Some(NEGOTIATION_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(REPLY_WRITE_TIMEOUT)))
    {
        tracing::debug!(id, error = %e, "NBD connection closed: socket setup failed");
        return;
    }
    let mut channel = Channel::new(Arc::clone(&stream), Some(NEGOTIATION_TIMEOUT));
    let mode = server.tls_mode(listening);
    let negotiated = negotiate::negotiate(server, id, mode, &mut channel);
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
            if plain.set_read_timeout(Some(PAYLOAD_TIMEOUT)).is_ok() {
                tracing::debug!(id, export = %session.name, mode = ?session.mode, "NBD transmission");
                // What an admin reads at the default level: who attached which volume,
                // over what, and when they left (probes that never reach transmission
                // stay at debug).
                let export = session.name.clone();
                let tls = tls.describe();
                tracing::info!(id, %peer, %export, %tls, "NBD client attached");
                transmission::serve(server, id, session, reader, Arc::clone(&plain));
                tracing::info!(id, %peer, %export, "NBD client detached");
            }
        }
        Ok(None) => tracing::debug!(id, "NBD client ended negotiation"),
        Err(e) => tracing::debug!(id, error = %e, "NBD negotiation ended"),
    }
    plain.shutdown(Shutdown::Both);
    if !relayed {
        stream.shutdown(Shutdown::Both);
    }
    tracing::debug!(id, %peer, "NBD connection closed");
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
