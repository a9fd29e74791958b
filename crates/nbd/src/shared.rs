//! What a server's connections share: its configuration, its exports, the limits on
//! requests in flight, the registry of live connections (with, for those in
//! transmission, their export and their client: who uses each export), and the flag
//! that says the server is shutting down. The server (`server.rs`) owns one and hands
//! it to every connection thread; negotiation and transmission read it, and never
//! see the listeners.

use crate::config::{
    ServerConfig, CONNECTION_RESERVED_REQUESTS, INFLIGHT_BUFFER_BYTES_MAX,
    WORKERS_PER_CONNECTION_MAX,
};
use crate::export::ExportProvider;
use crate::inflight::{Inflight, InflightLimits};
use crate::sources::{Refusal, SlotLimits, Source, SourceSlots};
use crate::stream::{Polling, Stream};
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The live connections (negotiating or transmitting), by id: what a shutdown closes.
#[derive(Default)]
struct Registry {
    next_id: u64,
    connections: HashMap<u64, Arc<Stream>>,
    /// Connections in transmission: the export each serves, and its client (see
    /// [`Stream::client`]; the connection id when the kernel cannot tell).
    attached: HashMap<u64, (String, String)>,
    /// The source each connection's slot is counted against.
    sources: HashMap<u64, Source>,
    /// Slots held by source.
    slots: SourceSlots,
}

/// Who uses one export now: connections in transmission, and the distinct clients
/// that hold them (one client may hold several connections: multi-conn).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportUsers {
    /// Connections in transmission on the export.
    pub connections: usize,
    /// Distinct clients among them (a TCP address, a unix peer process).
    pub clients: usize,
}

/// A server's state that its connections share.
pub(crate) struct Shared {
    config: ServerConfig,
    exports: Arc<dyn ExportProvider>,
    inflight: Arc<InflightLimits>,
    /// Workers per connection running quick requests at once: one per CPU.
    workers_running_max: usize,
    /// Taken by the one reader that polls its socket (see [`Polling`]).
    poll_slot: Arc<AtomicBool>,
    /// Connections in transmission (`Registry::attached`), readable without the lock.
    transmitting: Arc<AtomicUsize>,
    shutting_down: AtomicBool,
    registry: Mutex<Registry>,
    registry_empty: Condvar,
}

impl Shared {
    /// The state of a server over `exports`. Limits of zero are raised to one.
    pub(crate) fn new(config: ServerConfig, exports: Arc<dyn ExportProvider>) -> Shared {
        let mut config = config;
        config.max_connections = config.max_connections.max(1);
        config.max_connections_per_source = config.max_connections_per_source.max(1);
        // Others keep at least one slot.
        config.trusted_reserved_connections = config
            .trusted_reserved_connections
            .min(config.max_connections - 1);
        config.max_inflight_per_connection = config.max_inflight_per_connection.max(1);
        config.max_inflight_total = config.max_inflight_total.max(1);
        let inflight = Arc::new(InflightLimits::new(
            config.max_inflight_total,
            INFLIGHT_BUFFER_BYTES_MAX,
        ));
        Shared {
            config,
            exports,
            inflight,
            workers_running_max: workers_running_max(),
            poll_slot: Arc::new(AtomicBool::new(false)),
            transmitting: Arc::new(AtomicUsize::new(0)),
            shutting_down: AtomicBool::new(false),
            registry: Mutex::new(Registry::default()),
            registry_empty: Condvar::new(),
        }
    }

    /// The configuration, with limits of zero raised to one.
    pub(crate) fn config(&self) -> &ServerConfig {
        &self.config
    }

    /// What the server serves.
    pub(crate) fn exports(&self) -> &dyn ExportProvider {
        &*self.exports
    }

    /// Workers per connection running quick requests at once: one per CPU.
    pub(crate) fn workers_running_max(&self) -> usize {
        self.workers_running_max
    }

    /// A new connection's requests in flight: its own limit, and its reserve of
    /// server-wide slots.
    pub(crate) fn inflight_for_connection(&self) -> Arc<Inflight> {
        let per_connection = self.config.max_inflight_per_connection;
        self.inflight.for_connection(
            per_connection,
            CONNECTION_RESERVED_REQUESTS.min(per_connection),
        )
    }

    /// What a connection's reader needs to decide whether to poll its socket: the
    /// server's requests in flight (read without a lock) and the one polling slot.
    pub(crate) fn polling(&self) -> Polling {
        Polling {
            server_requests: self.inflight.requests_now(),
            slot: Arc::clone(&self.poll_slot),
            transmitting: Arc::clone(&self.transmitting),
        }
    }

    /// Requests in flight across all connections now.
    pub(crate) fn inflight_requests(&self) -> usize {
        self.inflight.requests()
    }

    /// Requests and buffer bytes in flight across all connections now.
    pub(crate) fn inflight_snapshot(&self) -> (usize, u64) {
        self.inflight.snapshot()
    }

    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// From now on the server is shutting down: listeners refuse to start,
    /// connections are not admitted, options are refused.
    pub(crate) fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    /// Connections open now (negotiating or transmitting).
    pub(crate) fn connections(&self) -> usize {
        self.registry.lock().connections.len()
    }

    /// Register a new connection from `source`: its id, or why it has no slot.
    pub(crate) fn register(&self, stream: &Arc<Stream>, source: Source) -> Result<u64, Refusal> {
        let trusted = matches!(source, Source::Uid(uid) if self.config.trusted_uids.contains(&uid));
        let limits = SlotLimits {
            total: self.config.max_connections,
            per_source: self.config.max_connections_per_source,
            trusted_reserved: self.config.trusted_reserved_connections,
        };
        let mut registry = self.registry.lock();
        registry.slots.take(source, trusted, limits)?;
        let id = registry.next_id;
        registry.next_id += 1;
        registry.connections.insert(id, Arc::clone(stream));
        registry.sources.insert(id, source);
        Ok(id)
    }

    /// Connection `id` is in transmission on `export`, for `client`.
    pub(crate) fn attach(&self, id: u64, export: &str, client: Option<String>) {
        let client = client.unwrap_or_else(|| format!("connection {id}"));
        let mut registry = self.registry.lock();
        registry.attached.insert(id, (export.to_string(), client));
        self.transmitting
            .store(registry.attached.len(), Ordering::Relaxed);
    }

    /// Connections and distinct clients in transmission, by export.
    pub(crate) fn users(&self) -> BTreeMap<String, ExportUsers> {
        let registry = self.registry.lock();
        let mut clients: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        let mut users: BTreeMap<String, ExportUsers> = BTreeMap::new();
        for (export, client) in registry.attached.values() {
            users.entry(export.clone()).or_default().connections += 1;
            clients.entry(export).or_default().insert(client);
        }
        for (export, distinct) in clients {
            if let Some(entry) = users.get_mut(export) {
                entry.clients = distinct.len();
            }
        }
        users
    }

    pub(crate) fn unregister(&self, id: u64) {
        let mut registry = self.registry.lock();
        registry.connections.remove(&id);
        registry.attached.remove(&id);
        if let Some(source) = registry.sources.remove(&id) {
            registry.slots.give_back(source);
        }
        self.transmitting
            .store(registry.attached.len(), Ordering::Relaxed);
        if registry.connections.is_empty() {
            self.registry_empty.notify_all();
        }
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

    /// Stop every connection's reader, let in-flight requests finish and their
    /// replies go out for up to `grace`, then drop what is left; return when every
    /// connection has ended.
    pub(crate) fn close_connections(&self, grace: Duration) {
        // Workers finish and reply.
        let streams: Vec<Arc<Stream>> =
            self.registry.lock().connections.values().cloned().collect();
        for stream in &streams {
            stream.shutdown(Shutdown::Read);
        }
        drop(streams);
        let deadline = Instant::now() + grace;
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
