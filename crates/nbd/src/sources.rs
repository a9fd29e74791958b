//! Where a connection comes from, as the kernel says ([`Source`]), and the
//! connection slots each source may hold ([`SourceSlots`]): at most
//! `max_connections_per_source` per source, and `trusted_reserved_connections` of the
//! server's slots kept for trusted peers (root, the pool's owner), so that one local
//! user or one remote host cannot take every slot and lock everyone else out.
//!
//! A unix peer is its uid (SO_PEERCRED). A TCP peer is its IP address, except a
//! peer on this host (a loopback address), which is the uid that owns its socket
//! in the kernel's socket table (`/proc/net/tcp`, `/proc/net/tcp6`): every local
//! user shares 127.0.0.1, and the table, unlike anything the client sends, cannot
//! be forged.

use crate::stream::{peer_credentials, Stream};
use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Who a connection's slot is counted against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    /// A local user, named by the kernel.
    Uid(u32),
    /// A remote host.
    Ip(IpAddr),
    /// The kernel could not say (a unix peer without credentials, a loopback peer
    /// missing from the socket table): all such peers share one count.
    Unknown,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Uid(uid) => write!(f, "uid {uid}"),
            Source::Ip(ip) => write!(f, "{ip}"),
            Source::Unknown => f.write_str("unknown peer"),
        }
    }
}

/// The source of the peer of `stream`.
pub(crate) fn source_of(stream: &Stream) -> Source {
    match stream {
        Stream::Unix(s) => peer_credentials(s).map_or(Source::Unknown, |c| Source::Uid(c.uid)),
        Stream::Tcp(s) => match (s.peer_addr(), s.local_addr()) {
            (Ok(peer), Ok(local)) if is_loopback(peer.ip()) => {
                loopback_uid(peer, local).map_or(Source::Unknown, Source::Uid)
            }
            (Ok(peer), _) => Source::Ip(canonical(peer.ip())),
            (Err(_), _) => Source::Unknown,
        },
    }
}

/// An IPv4 address mapped into IPv6 counts as the IPv4 address.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

fn is_loopback(ip: IpAddr) -> bool {
    canonical(ip).is_loopback()
}

/// The uid owning the TCP socket at `peer` connected to `local`, from the kernel's
/// socket tables.
fn loopback_uid(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .find_map(|table| {
            let text = std::fs::read_to_string(table).ok()?;
            text.lines()
                .skip(1)
                .find_map(|line| uid_in_line(line, peer, local))
        })
}

/// A socket table line's uid, if the line is the socket at `peer` connected to
/// `local` (columns: slot, local address, remote address, state, queues, timer,
/// retransmits, uid, ...).
fn uid_in_line(line: &str, peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    let mut columns = line.split_whitespace();
    let _slot = columns.next()?;
    let at = parse_table_address(columns.next()?)?;
    let to = parse_table_address(columns.next()?)?;
    let same = |a: SocketAddr, b: SocketAddr| {
        a.port() == b.port() && canonical(a.ip()) == canonical(b.ip())
    };
    if !same(at, peer) || !same(to, local) {
        return None;
    }
    columns.nth(4)?.parse().ok()
}

/// `0100007F:1F90` (IPv4) or 32 hex digits and a port (IPv6): each 32-bit word of
/// the address as the kernel holds it in memory (network order), printed as a
/// native integer; the port as a number.
fn parse_table_address(text: &str) -> Option<SocketAddr> {
    let (address, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |hex: &str| u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes);
    let ip = match address.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(address)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(address.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// Why a connection was refused a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Every slot is taken.
    Full,
    /// Only the slots kept for trusted peers are left.
    Reserved,
    /// Its source holds its limit already.
    SourceLimit,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Refusal::Full => "at the connection limit",
            Refusal::Reserved => "only the slots kept for trusted peers are left",
            Refusal::SourceLimit => "its source is at its connection limit",
        })
    }
}

/// The connection slots held, by source.
#[derive(Debug, Default)]
pub(crate) struct SourceSlots {
    held: HashMap<Source, usize>,
    total: usize,
}

/// The limits [`SourceSlots::take`] applies.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotLimits {
    pub(crate) total: usize,
    pub(crate) per_source: usize,
    pub(crate) trusted_reserved: usize,
}

impl SourceSlots {
    /// Take a slot for `source` (`trusted`: a peer the reserve is kept for, with no
    /// per-source limit), or say why not.
    pub(crate) fn take(
        &mut self,
        source: Source,
        trusted: bool,
        limits: SlotLimits,
    ) -> Result<(), Refusal> {
        if self.total >= limits.total {
            return Err(Refusal::Full);
        }
        if !trusted {
            if self.total + limits.trusted_reserved >= limits.total {
                return Err(Refusal::Reserved);
            }
            if self.held.get(&source).copied().unwrap_or(0) >= limits.per_source {
                return Err(Refusal::SourceLimit);
            }
        }
        *self.held.entry(source).or_insert(0) += 1;
        self.total += 1;
        Ok(())
    }

    /// Give back a slot of `source`.
    pub(crate) fn give_back(&mut self, source: Source) {
        let held = self.held.get_mut(&source);
        assert!(
            held.as_ref().is_some_and(|n| **n > 0) && self.total > 0,
            "a connection slot of {source} given back that was never taken"
        );
        if let Some(n) = held {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&source);
            }
        }
        self.total -= 1;
    }

    /// Distinct sources holding slots now.
    #[cfg(test)]
    fn sources(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: SlotLimits = SlotLimits {
        total: 10,
        per_source: 4,
        trusted_reserved: 3,
    };

    #[test]
    fn one_source_cannot_take_every_slot_and_the_reserve_is_kept_for_trusted_peers() {
        let mut slots = SourceSlots::default();
        let nobody = Source::Uid(65534);
        for _ in 0..4 {
            slots
                .take(nobody, false, LIMITS)
                .expect("under the source limit");
        }
        assert_eq!(slots.take(nobody, false, LIMITS), Err(Refusal::SourceLimit));
        let host = Source::Ip(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)));
        for _ in 0..3 {
            slots.take(host, false, LIMITS).expect("another source");
        }
        // 7 of 10 taken: the last 3 are the trusted reserve.
        assert_eq!(
            slots.take(Source::Unknown, false, LIMITS),
            Err(Refusal::Reserved)
        );
        for _ in 0..3 {
            slots.take(Source::Uid(0), true, LIMITS).expect("reserve");
        }
        assert_eq!(slots.take(Source::Uid(0), true, LIMITS), Err(Refusal::Full));
        slots.give_back(nobody);
        slots.give_back(Source::Uid(0));
        assert_eq!(slots.sources(), 3);
        slots
            .take(Source::Uid(0), true, LIMITS)
            .expect("freed slot");
    }

    #[test]
    fn socket_table_lines_name_the_uid_of_a_loopback_peer() {
        // A line of /proc/net/tcp on a little-endian host: 127.0.0.1:41000 connected
        // to 127.0.0.1:10809, owned by uid 65534.
        let peer: SocketAddr = "127.0.0.1:41000".parse().expect("addr");
        let local: SocketAddr = "127.0.0.1:10809".parse().expect("addr");
        let hex = |a: Ipv4Addr| format!("{:08X}", u32::from_ne_bytes(a.octets()));
        let line = format!(
            "   3: {}:A028 {}:2A39 01 00000000:00000000 00:00000000 00000000 65534        0 123 1",
            hex(Ipv4Addr::LOCALHOST),
            hex(Ipv4Addr::LOCALHOST)
        );
        assert_eq!(uid_in_line(&line, peer, local), Some(65534));
        // The server's own end of the same connection is not the peer.
        assert_eq!(uid_in_line(&line, local, peer), None);
        let v6 = parse_table_address("0000000000000000FFFF00000100007F:2A39").expect("v6");
        assert_eq!(canonical(v6.ip()), IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert!(parse_table_address("zz:1").is_none());
    }
}
