//! Serve in-memory exports over NBD, to try the server with real clients.
//!
//! ```text
//! cargo run -p fewerbytes-nbd --example memserve -- [--unix PATH] [--tcp ADDR] [--size BYTES] [--read-only] [NAME...]
//! nbdinfo --json 'nbd+unix:///?socket=/tmp/memserve.sock'
//! qemu-io -f raw 'nbd+unix:///?socket=/tmp/memserve.sock' -c 'write -P 0xab 512 4096'
//! ```
//!
//! Exports are zero-filled (all holes) and `--size` bytes each (default 64 MiB);
//! the first is the default export. Runs until stdin closes or a line is read,
//! then shuts the server down.

use fewerbytes_nbd::{MemoryExport, MemoryExports, Server, ServerConfig};
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut unix = None;
    let mut tcp = None;
    let mut size_bytes: usize = 64 << 20;
    let mut read_only = false;
    let mut names = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--unix" => unix = Some(args.next().ok_or("--unix needs a path")?),
            "--tcp" => tcp = Some(args.next().ok_or("--tcp needs an address")?),
            "--size" => size_bytes = args.next().ok_or("--size needs bytes")?.parse()?,
            "--read-only" => read_only = true,
            name => names.push(name.to_string()),
        }
    }
    if names.is_empty() {
        names.push("mem".to_string());
    }
    if unix.is_none() && tcp.is_none() {
        unix = Some("/tmp/memserve.sock".to_string());
    }
    let exports = names
        .into_iter()
        .map(|n| (n, Arc::new(MemoryExport::new(size_bytes))))
        .collect();
    let config = ServerConfig {
        read_only,
        ..ServerConfig::default()
    };
    let server = Server::new(config, Arc::new(MemoryExports::new(exports)));
    if let Some(path) = unix {
        server.listen_unix(std::path::Path::new(&path))?;
        println!("listening on unix socket {path}");
    }
    if let Some(addr) = tcp {
        let bound = server.listen_tcp(&addr)?;
        println!("listening on tcp {bound}");
    }
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    server.shutdown();
    Ok(())
}
