//! What `serve` prints once every socket accepts: where it serves, a URI per volume a
//! client can use as printed, and how to stop it.
//!
//! A wildcard listen address (`0.0.0.0`, `::`) says where the server accepts, not
//! where to connect: no certificate names it and another host cannot reach it. The
//! URIs name loopback instead (usable on this host, and named by a certificate made as
//! the README makes it), and the `tcp` line says what the wildcard means and which host
//! name other hosts would use.

use fewerbytes_engine::Pool;
use fewerbytes_nbd::TlsMode;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

use crate::size::format_size;

/// What the banner describes.
pub struct Banner<'a> {
    pub pool_path: &'a Path,
    pub pool: &'a Pool,
    pub read_only: bool,
    pub warn_at: u8,
    pub default_volume: Option<&'a str>,
    /// `--tls` was given (TLS on the unix socket too).
    pub tls_asked: bool,
    pub socket: &'a Path,
    /// The TCP address bound, and its TLS mode.
    pub tcp: Option<(&'a str, TlsMode)>,
    pub control: &'a Path,
}

/// The `HOST:PORT` a client on this host connects to for a server bound to `bound`:
/// loopback of the same family for a wildcard address, else `bound` itself.
pub fn client_address(bound: &str) -> String {
    match bound.parse::<SocketAddr>() {
        Ok(addr) if addr.ip().is_unspecified() => {
            let loopback = match addr.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            };
            SocketAddr::new(loopback, addr.port()).to_string()
        }
        _ => bound.to_string(),
    }
}

/// What a wildcard address `bound` means, for the `tcp` line; `None` for another.
fn wildcard_note(bound: &str) -> Option<String> {
    let addr = bound.parse::<SocketAddr>().ok()?;
    if !addr.ip().is_unspecified() {
        return None;
    }
    let family = if addr.is_ipv4() { "IPv4 " } else { "" };
    let host = host_name().map_or_else(
        || "this host's name or address".to_string(),
        |name| format!("this host's name ({name}) or address"),
    );
    Some(format!(
        "every {family}address of this host: clients here use {}, others {host}",
        client_address(bound)
    ))
}

/// This host's name (gethostname(2)), if it has one.
fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..len]).into_owned();
    (!name.is_empty()).then_some(name)
}

/// Print the banner on stdout.
pub fn print(banner: &Banner<'_>) {
    let volumes = banner.pool.list_volumes();
    let socket = banner.socket.display();
    let pool_path = banner.pool_path.display();
    let mode = if banner.read_only { " (read-only)" } else { "" };
    println!("Serving pool {pool_path}{mode} over NBD:");
    println!("  unix socket {socket}");
    if let Some((bound, tls)) = banner.tcp {
        let tls = match tls {
            TlsMode::Off => "",
            TlsMode::On => " (TLS offered)",
            TlsMode::Require => " (TLS required)",
        };
        match wildcard_note(bound) {
            Some(note) => println!("  tcp {bound}{tls}: {note}"),
            None => println!("  tcp {bound}{tls}"),
        }
    }
    println!(
        "  control socket {} (fewerbytes volume/stats commands go through it)",
        banner.control.display()
    );
    println!(
        "  warns when the pool is {}% used (--warn-at)",
        banner.warn_at
    );
    if volumes.is_empty() {
        println!("No volumes yet: `fewerbytes --pool {pool_path} volume create NAME --size 10G` adds one while this runs.");
    }
    let tcp = banner.tcp.map(|(bound, tls)| (client_address(bound), tls));
    for volume in &volumes {
        if volume.incomplete {
            println!(
                "Volume '{}': not served, marked incomplete (an import was cut short; the \
                 log says what to do).",
                volume.name
            );
            continue;
        }
        println!(
            "Volume '{}' ({}):",
            volume.name,
            format_size(volume.size_bytes)
        );
        println!("  nbd+unix:///{}?socket={socket}", volume.name);
        if let Some((addr, tls)) = &tcp {
            let scheme = if *tls == TlsMode::Off { "nbd" } else { "nbds" };
            println!("  {scheme}://{addr}/{}", volume.name);
        }
    }
    let default = banner
        .default_volume
        .map(str::to_string)
        .or_else(|| (volumes.len() == 1).then(|| volumes[0].name.clone()));
    match &default {
        Some(name) => println!("The empty export name (\"\") opens '{name}'."),
        None if volumes.len() > 1 => {
            println!("The empty export name (\"\") opens nothing: name one with --default-volume.")
        }
        None => {}
    }
    if let Some(name) = default.as_ref().or(volumes.first().map(|v| &v.name)) {
        let example = match &tcp {
            Some((addr, TlsMode::Off)) => format!("nbd://{addr}/{name}"),
            // qemu-img needs --object tls-creds-… for TLS: the unix socket is simpler.
            Some(_) if !banner.tls_asked => format!("'nbd+unix:///{name}?socket={socket}'"),
            Some((addr, _)) => format!("nbds://{addr}/{name} (with the client's TLS credentials)"),
            None => format!("'nbd+unix:///{name}?socket={socket}'"),
        };
        println!("Try: qemu-img info {example}");
    }
    println!("Stop with Ctrl-C (or SIGTERM): it flushes and closes the pool; a second Ctrl-C exits at once.");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_address_becomes_loopback_for_clients() {
        assert_eq!(client_address("0.0.0.0:10809"), "127.0.0.1:10809");
        assert_eq!(client_address("[::]:10809"), "[::1]:10809");
        assert_eq!(client_address("192.0.2.10:10809"), "192.0.2.10:10809");
        assert!(wildcard_note("127.0.0.1:10809").is_none());
        let note = wildcard_note("0.0.0.0:10809").expect("a note");
        assert!(note.contains("every IPv4 address"), "{note}");
    }
}
