//! How a server behaves: [`ServerConfig`], its TLS settings and access policy, and
//! the named limits and timeouts, each with its reason, that the server, negotiation
//! and transmission share.

use crate::tls::{TlsCredentials, TlsMode};
use std::sync::Arc;
use std::time::Duration;

/// Default for [`ServerConfig::max_connections`]: a host runs tens of VMs with a few
/// connections each (multi-conn); 512 leaves room while bounding threads and fds
/// (each connection holds one socket and at most 1 + [`WORKERS_PER_CONNECTION_MAX`]
/// threads; over TLS also a socket pair and its relay thread).
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// Default for [`ServerConfig::max_connections_per_source`]: a quarter of
/// [`DEFAULT_MAX_CONNECTIONS`], so one local user (by uid) or one remote host (by IP)
/// cannot take every slot, while a hypervisor host still attaches 64 VMs with two
/// connections each. Peers the kernel names as trusted (root, the pool's owner: see
/// [`ServerConfig::trusted_uids`]) are not limited by it: they run the VMs.
pub const DEFAULT_MAX_CONNECTIONS_PER_SOURCE: usize = 128;
/// Default for [`ServerConfig::trusted_reserved_connections`]: slots of
/// [`ServerConfig::max_connections`] only trusted peers may take, so root (or the
/// pool's owner) can still attach and manage volumes while other sources hold every
/// other slot. 32: a few VMs and tools at once.
pub const DEFAULT_TRUSTED_RESERVED_CONNECTIONS: usize = 32;
/// Default for [`ServerConfig::idle_timeout`]: never. Closing a VM's idle disk fails
/// its next I/O (QEMU without `reconnect-delay` and the kernel client do not
/// reconnect), and a guest's data disk may stay idle for days; idle connections
/// cannot lock others out, as per-source slots bound what each source holds.
pub const DEFAULT_IDLE_TIMEOUT: Option<Duration> = None;
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
/// the kernel, while its client sends requests back to back (see
/// [`crate::stream::StreamReader`]).
/// A queue-depth-1 client's next request usually comes within this; catching it
/// without a sleep and a cross-CPU wake-up cut 4 KiB read latency at queue depth 1
/// from ~70 µs to ~30 µs on a 2-vCPU VM. The price: while a client keeps its gaps
/// that short, its reader spins through them instead of sleeping; so only one reader
/// of the server polls at a time, and only while no request is in flight anywhere.
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
/// CPU runs quick requests at once (see `workers_running_max` in [`crate::Server::stats`]);
/// the rest serve requests that wait on the disk (flushes and FUA writes waiting for
/// a group commit), so 8 overlap enough of those to keep a queue-depth-32 client busy.
pub const WORKERS_PER_CONNECTION_MAX: usize = 8;
/// A client that has not finished negotiating within this time is dropped, so idle
/// sockets cannot hold connection slots forever.
pub const NEGOTIATION_TIMEOUT: Duration = Duration::from_secs(120);
/// A write payload is charged to the buffer budget as it arrives, in pieces of this
/// size, not all at its header: a client that sends a 32 MiB write's header and
/// stalls holds one piece (from its own reserve), not 32 MiB of the shared pool
/// that other clients' large requests need. 1 MiB: 32 budget checks per maximum
/// write, each a lock, against a reader that copies 1 MiB in tens of microseconds.
pub const PAYLOAD_PIECE_BYTES: u64 = 1 << 20;
/// Bytes of the shared buffer pool that pieces of partly received payloads leave
/// free: one maximum payload, so that however many payloads are part-way in, one of
/// them can always take the rest of its bytes and finish (no two readers wait on
/// each other's half-charged payloads).
pub const PAYLOAD_COMPLETION_RESERVE_BYTES: u64 = crate::protocol::PAYLOAD_MAX_BYTES as u64;
/// A write payload must arrive within this time of its header (32 MiB at 280 KB/s),
/// else the connection is dropped: a client trickling payloads would otherwise hold
/// its share of [`INFLIGHT_BUFFER_BYTES_MAX`] forever. Also the socket's read timeout
/// in transmission, where an idle client between requests is simply waited for.
pub const PAYLOAD_TIMEOUT: Duration = Duration::from_secs(120);
/// A reply that cannot be written for this long means the client stopped reading;
/// the connection is dropped so its workers and buffers are freed.
pub const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long [`crate::Server::shutdown`] lets in-flight requests finish before it drops the
/// remaining connections outright.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// Read buffer per connection: a few pipelined headers, or a 64 KiB write, per system call.
pub const READ_BUFFER_BYTES: usize = 64 << 10;
/// Stack of connection and worker threads; buffers live on the heap.
pub const THREAD_STACK_BYTES: usize = 256 << 10;
const _: () = assert!(THREAD_STACK_BYTES == crate::tls::RELAY_THREAD_STACK_BYTES);

// Any request's buffer fits a connection's share of the pool, and the pool holds
// more than one connection's share.
const _: () =
    assert!(CONNECTION_SHARED_BUFFER_BYTES_MAX >= crate::protocol::PAYLOAD_MAX_BYTES as u64);
const _: () = assert!(INFLIGHT_BUFFER_BYTES_MAX >= 2 * CONNECTION_SHARED_BUFFER_BYTES_MAX);
// Pieces of partly received payloads can use the pool beyond the completion reserve.
const _: () = assert!(
    INFLIGHT_BUFFER_BYTES_MAX >= PAYLOAD_COMPLETION_RESERVE_BYTES + 8 * PAYLOAD_PIECE_BYTES
);
// A connection's first piece fits its own reserve.
const _: () = assert!(CONNECTION_RESERVED_BUFFER_BYTES >= PAYLOAD_PIECE_BYTES);
// A block status answer, charged at its largest, fits a connection's reserve.
const _: () =
    assert!(CONNECTION_RESERVED_BUFFER_BYTES >= crate::protocol::BLOCK_STATUS_MEMORY_MAX_BYTES);
// Trusted peers always have slots of their own.
const _: () = assert!(DEFAULT_TRUSTED_RESERVED_CONNECTIONS < DEFAULT_MAX_CONNECTIONS);
const _: () = assert!(DEFAULT_MAX_CONNECTIONS_PER_SOURCE < DEFAULT_MAX_CONNECTIONS);

/// How a server behaves. `Default` gives the named limits above.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Serve every export read-only (`NBD_FLAG_READ_ONLY`; writes answer EPERM).
    pub read_only: bool,
    /// The export the empty name "" means; `None` asks the provider.
    pub default_export: Option<String>,
    /// Connections at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Connections at once from one source other than a trusted peer: a unix peer's
    /// uid (SO_PEERCRED), a TCP peer's IP address, or for a TCP peer on this host
    /// (loopback) the uid that owns its socket. More are closed when accepted.
    pub max_connections_per_source: usize,
    /// Slots of `max_connections` that only trusted peers may take.
    pub trusted_reserved_connections: usize,
    /// Uids whose connections are trusted, as the kernel names the peer (unix
    /// sockets, and TCP from this host): root and the pool's owner, who can read the
    /// pool anyway. They take the reserved slots and have no per-source limit.
    pub trusted_uids: Vec<u32>,
    /// A connection in transmission with nothing in flight and no request for this
    /// long is closed; `None`: never.
    pub idle_timeout: Option<Duration>,
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
            max_connections_per_source: DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
            trusted_reserved_connections: DEFAULT_TRUSTED_RESERVED_CONNECTIONS,
            trusted_uids: vec![0],
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_inflight_per_connection: DEFAULT_MAX_INFLIGHT_PER_CONNECTION,
            max_inflight_total: DEFAULT_MAX_INFLIGHT_TOTAL,
            read_spin: DEFAULT_READ_SPIN,
            tls: None,
            access: None,
        }
    }
}
