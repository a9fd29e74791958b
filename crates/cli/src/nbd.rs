//! Stand-in for `fewerbytes_nbd` until the NBD server lands: the same public API,
//! refusing to serve. Replaced by `pub use fewerbytes_nbd::…` when it does.

#![allow(dead_code, reason = "a stand-in: the real server reads these")]

use fewerbytes_engine::Pool;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

/// Server settings (as in `fewerbytes_nbd`).
#[derive(Debug, Clone, Default)]
pub struct ServerConfig {
    pub read_only: bool,
    pub default_export: Option<String>,
    pub max_connections: usize,
    pub max_inflight_per_connection: usize,
    pub max_inflight_total: usize,
}

/// What exports a server offers.
pub trait ExportProvider: Send + Sync {}

struct PoolExports;
impl ExportProvider for PoolExports {}

/// Every volume of a pool.
pub fn pool_exports(pool: Arc<Pool>, default_export: Option<String>) -> Arc<dyn ExportProvider> {
    let _ = (pool, default_export);
    Arc::new(PoolExports)
}

/// The server.
pub struct Server;

impl Server {
    pub fn new(config: ServerConfig, exports: Arc<dyn ExportProvider>) -> Arc<Server> {
        let _ = (config, exports);
        Arc::new(Server)
    }
    pub fn listen_unix(self: &Arc<Self>, path: &Path) -> io::Result<()> {
        let _ = path;
        Err(io::Error::other("this build has no NBD server yet"))
    }
    pub fn listen_tcp(self: &Arc<Self>, addr: &str) -> io::Result<SocketAddr> {
        let _ = addr;
        Err(io::Error::other("this build has no NBD server yet"))
    }
    pub fn shutdown(&self) {}
    pub fn connections(&self) -> usize {
        0
    }
}
