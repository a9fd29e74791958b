//! The NBD protocol server of fewerbytes, implemented here (no NBD crate): fixed
//! newstyle negotiation with structured replies, extended headers, `base:allocation`
//! block status and multi-connection, over blocking sockets and threads.
//!
//! Files, one noun each, from the top down: `server` (listeners, accepting
//! connections, shutdown), which runs `negotiate` (handshake and options) and then
//! `transmission` (request loop, workers) on each connection; `reply` (replies built
//! whole and written in batches); `shared` (what connections share: configuration,
//! exports, the registry of live connections); `sources` (where a connection comes
//! from, and the connection slots each source may hold); `inflight` (requests in flight, their
//! limits and permits); `config` (the server's configuration and named limits);
//! `protocol` (wire constants, headers, request validation);
//! `stream` (a client's socket and the reader that polls it), `tls` (credentials and
//! the STARTTLS handshake), `relay` (the thread that carries a TLS connection's bytes),
//! `export` (the traits a backend implements), `engine_export` (the adapter to the
//! engine's volumes), `memory_export` (an in-memory backend for tests and examples).
//!
//! **Architecture invariant:** `nbd` knows nothing of dedup or of the engine's
//! internals; it reaches storage only through [`Export`], and the engine only
//! through `engine_export`.

#![deny(missing_docs)]
#![deny(clippy::unwrap_used)]

mod buffers;
mod config;
mod engine_export;
mod export;
mod inflight;
mod memory_export;
mod negotiate;
pub mod protocol;
mod relay;
mod reply;
mod server;
mod shared;
mod sources;
mod stream;
mod tls;
mod transmission;

pub use config::{
    AccessPolicy, ServerConfig, TlsSettings, CONNECTION_RESERVED_BUFFER_BYTES,
    CONNECTION_RESERVED_REQUESTS, CONNECTION_SHARED_BUFFER_BYTES_MAX, DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
    DEFAULT_MAX_INFLIGHT_PER_CONNECTION, DEFAULT_MAX_INFLIGHT_TOTAL, DEFAULT_READ_SPIN,
    DEFAULT_TRUSTED_RESERVED_CONNECTIONS, INFLIGHT_BUFFER_BYTES_MAX, NEGOTIATION_TIMEOUT,
    PAYLOAD_COMPLETION_RESERVE_BYTES, PAYLOAD_PIECE_BYTES, PAYLOAD_TIMEOUT, REPLY_WRITE_TIMEOUT,
    SHUTDOWN_GRACE, WORKERS_PER_CONNECTION_MAX,
};
pub use engine_export::{incomplete_refusal, pool_exports};
pub use export::{
    Bitmap, Export, ExportDesc, ExportProvider, EINVAL, EIO, ENOMEM, ENOSPC, ENOTSUP, EOVERFLOW,
    EPERM, ESHUTDOWN,
};
pub use memory_export::{MemoryExport, MemoryExports, MEMORY_BLOCK_BYTES};
pub use negotiate::{NegotiationError, OPTIONS_PER_CONNECTION_MAX, OPTION_DATA_MAX_BYTES};
pub use relay::RELAY_BUFFER_BYTES;
pub use server::{Server, ServerStats};
pub use shared::ExportUsers;
pub use stream::peer_credentials;
pub use tls::{TlsCredentials, TlsError, TlsMode};
pub use transmission::WORKER_IDLE_TIMEOUT;
