//! Raw-socket tests of the transmission phase: simple replies (the kernel's
//! client), structured replies with hole chunks, extended headers, block status,
//! every refused request, pipelining with out-of-order completion, the in-flight
//! limits, many connections at once, and shutdown with requests in flight.

mod common;

use common::*;
use fewerbytes_nbd::protocol::*;
use fewerbytes_nbd::{
    Export, ServerConfig, CONNECTION_RESERVED_REQUESTS, EINVAL, ENOSPC, EPERM,
    WORKERS_PER_CONNECTION_MAX,
};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i / 512) as u8) | 1)
        .collect()
}

/// A client that negotiated nothing: GO with no options, like nbd-client.
fn simple_client(t: &TestServer, name: &str) -> Client {
    let mut c = t.connect();
    c.handshake();
    c.go(name, &[]).expect("GO");
    c
}

fn structured_client(t: &TestServer, name: &str, meta: bool) -> Client {
    let mut c = t.connect();
    c.handshake();
    c.option_ack(OPT_STRUCTURED_REPLY);
    if meta {
        let (ctx, kind) = c.meta_context(OPT_SET_META_CONTEXT, name, &["base:allocation"]);
        assert_eq!((ctx.len(), kind), (1, REP_ACK));
    }
    c.go(name, &[INFO_BLOCK_SIZE]).expect("GO");
    c
}

fn extended_client(t: &TestServer, name: &str) -> Client {
    let mut c = t.connect();
    c.handshake();
    c.option_ack(OPT_EXTENDED_HEADERS);
    let (ctx, kind) = c.meta_context(OPT_SET_META_CONTEXT, name, &["base:allocation"]);
    assert_eq!((ctx.len(), kind), (1, REP_ACK));
    c.go(name, &[INFO_BLOCK_SIZE]).expect("GO");
    c.extended = true;
    c
}

#[test]
fn simple_replies_for_a_client_that_negotiates_nothing() {
    let t = TestServer::start();
    let mut c = simple_client(&t, "a");
    let data = pattern(3, 8192);
    c.send_request(CMD_FLAG_FUA, CMD_WRITE, 1, 4096, 8192, &data);
    assert_eq!(c.simple_reply(), (0, 1));
    c.send_request(0, CMD_READ, 2, 4096, 8192, &[]);
    assert_eq!(c.simple_reply(), (0, 2));
    assert_eq!(c.read_bytes(8192), data);
    c.send_request(0, CMD_FLUSH, 3, 0, 0, &[]);
    assert_eq!(c.simple_reply(), (0, 3));
    assert_eq!(t.a.flushes(), 1);
    c.send_request(0, CMD_TRIM, 4, 4096, 4096, &[]);
    assert_eq!(c.simple_reply(), (0, 4));
    c.send_request(CMD_FLAG_NO_HOLE, CMD_WRITE_ZEROES, 5, 8192, 512, &[]);
    assert_eq!(c.simple_reply(), (0, 5));
    c.send_request(0, CMD_CACHE, 6, 0, 1 << 20, &[]);
    assert_eq!(c.simple_reply(), (0, 6));
    c.send_request(0, CMD_READ, 7, 4096, 8192, &[]);
    assert_eq!(c.simple_reply(), (0, 7));
    let mut want = vec![0u8; 8192];
    want[4096 + 512..].copy_from_slice(&data[4096 + 512..]);
    assert_eq!(c.read_bytes(8192), want);
    // An error reply carries no payload; the next reply follows directly.
    c.send_request(0, CMD_READ, 8, EXPORT_BYTES as u64, 512, &[]);
    assert_eq!(c.simple_reply(), (EINVAL, 8));
    c.send_request(0, CMD_READ, 9, 0, 512, &[]);
    assert_eq!(c.simple_reply(), (0, 9));
    assert_eq!(c.read_bytes(512), vec![0; 512]);
    // Block status needs a metadata context (and so structured replies).
    c.send_request(0, CMD_BLOCK_STATUS, 10, 0, 512, &[]);
    assert_eq!(c.simple_reply(), (EINVAL, 10));
    c.disconnect();
}

#[test]
fn structured_reads_send_holes_as_hole_chunks() {
    let t = TestServer::start();
    let data = pattern(9, 4096);
    t.a.write(4096, &data, false).unwrap();
    let mut c = structured_client(&t, "a", false);
    c.send_request(0, CMD_READ, 11, 0, 4 * 4096, &[]);
    let chunks = c.chunks();
    let kinds: Vec<u16> = chunks.iter().map(|c| c.kind).collect();
    assert_eq!(
        kinds,
        vec![
            REPLY_TYPE_OFFSET_HOLE,
            REPLY_TYPE_OFFSET_DATA,
            REPLY_TYPE_OFFSET_HOLE
        ]
    );
    assert!(chunks.iter().all(|c| c.cookie == 11));
    let hole0 = &chunks[0].payload;
    assert_eq!(u64::from_be_bytes(hole0[0..8].try_into().unwrap()), 0);
    assert_eq!(u32::from_be_bytes(hole0[8..12].try_into().unwrap()), 4096);
    let d = &chunks[1].payload;
    assert_eq!(u64::from_be_bytes(d[0..8].try_into().unwrap()), 4096);
    assert_eq!(&d[8..], &data[..]);
    let hole1 = &chunks[2].payload;
    assert_eq!(u64::from_be_bytes(hole1[0..8].try_into().unwrap()), 8192);
    assert_eq!(u32::from_be_bytes(hole1[8..12].try_into().unwrap()), 8192);
    assert_ne!(chunks[2].flags & REPLY_FLAG_DONE, 0);

    // DF: exactly one data chunk, zeros included.
    c.send_request(CMD_FLAG_DF, CMD_READ, 12, 0, 3 * 4096, &[]);
    let chunks = c.chunks();
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].kind, REPLY_TYPE_OFFSET_DATA);
    let mut want = vec![0u8; 8];
    want.extend_from_slice(&[0u8; 4096]);
    want.extend_from_slice(&data);
    want.extend_from_slice(&[0u8; 4096]);
    assert_eq!(chunks[0].payload, want);

    // Errors come as error chunks; writes still answer with simple replies.
    c.send_request(0, CMD_READ, 13, EXPORT_BYTES as u64 - 1, 2, &[]);
    let chunks = c.chunks();
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunk_error(&chunks[0]), EINVAL);
    let message_len = u16::from_be_bytes(chunks[0].payload[4..6].try_into().unwrap());
    assert!(message_len > 0, "error chunk without a message");
    c.send_request(0, CMD_WRITE, 14, 0, 512, &[1; 512]);
    assert_eq!(c.simple_reply(), (0, 14));
    c.disconnect();
}

#[test]
fn block_status_reports_holes_and_data() {
    let t = TestServer::start();
    t.a.write(8192, &pattern(1, 8192), false).unwrap();
    let mut c = structured_client(&t, "a", true);
    c.send_request(0, CMD_BLOCK_STATUS, 20, 4096, 4 * 4096, &[]);
    let chunks = c.chunks();
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].kind, REPLY_TYPE_BLOCK_STATUS);
    let p = &chunks[0].payload;
    let descs: Vec<(u32, u32)> = p[4..]
        .chunks(8)
        .map(|d| {
            (
                u32::from_be_bytes(d[0..4].try_into().unwrap()),
                u32::from_be_bytes(d[4..8].try_into().unwrap()),
            )
        })
        .collect();
    let hz = STATE_HOLE | STATE_ZERO;
    assert_eq!(descs, vec![(4096, hz), (8192, 0), (4096, hz)]);
    // REQ_ONE: one descriptor, no longer than asked.
    c.send_request(CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, 21, 0, 512, &[]);
    let p = c.chunks().remove(0).payload;
    assert_eq!(p.len(), 12);
    assert_eq!(u32::from_be_bytes(p[4..8].try_into().unwrap()), 512);
    // Past the end.
    c.send_request(0, CMD_BLOCK_STATUS, 22, EXPORT_BYTES as u64, 512, &[]);
    assert_eq!(chunk_error(&c.chunks()[0]), EINVAL);
    c.disconnect();
}

#[test]
fn extended_headers_carry_64_bit_lengths_and_echo_offsets() {
    let t = TestServer::start();
    let mut c = extended_client(&t, "a");
    let data = pattern(5, 4096);
    c.send_request(CMD_FLAG_PAYLOAD_LEN, CMD_WRITE, 30, 8192, 4096, &data);
    let done = c.chunks();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].kind, REPLY_TYPE_NONE);
    assert_eq!(done[0].offset, 8192);
    // QEMU 10 writes without PAYLOAD_LEN; the payload is read all the same.
    c.send_request(0, CMD_WRITE, 31, 12288, 4096, &data);
    assert_eq!(c.chunks()[0].kind, REPLY_TYPE_NONE);
    c.send_request(0, CMD_READ, 32, 4096, 3 * 4096, &[]);
    let chunks = c.chunks();
    assert!(chunks.iter().all(|ch| ch.offset == 4096 && ch.cookie == 32));
    let kinds: Vec<u16> = chunks.iter().map(|c| c.kind).collect();
    assert_eq!(kinds, vec![REPLY_TYPE_OFFSET_HOLE, REPLY_TYPE_OFFSET_DATA]);
    assert_eq!(chunks[1].payload.len(), 8 + 8192);
    // Block status: 64-bit descriptors with a count.
    c.send_request(0, CMD_BLOCK_STATUS, 33, 0, EXPORT_BYTES as u64, &[]);
    let chunks = c.chunks();
    assert_eq!(chunks[0].kind, REPLY_TYPE_BLOCK_STATUS_EXT);
    let p = &chunks[0].payload;
    let count = u32::from_be_bytes(p[4..8].try_into().unwrap()) as usize;
    assert_eq!(p.len(), 8 + 16 * count);
    let lens: Vec<(u64, u64)> = p[8..]
        .chunks(16)
        .map(|d| {
            (
                u64::from_be_bytes(d[0..8].try_into().unwrap()),
                u64::from_be_bytes(d[8..16].try_into().unwrap()),
            )
        })
        .collect();
    let hz = u64::from(STATE_HOLE | STATE_ZERO);
    assert_eq!(
        lens,
        vec![(8192, hz), (8192, 0), (EXPORT_BYTES as u64 - 16384, hz)]
    );
    // A trim with a length that only fits in 64 bits is out of range, not misparsed.
    c.send_request(0, CMD_TRIM, 34, 0, 1 << 40, &[]);
    assert_eq!(chunk_error(&c.chunks()[0]), EINVAL);
    // PAYLOAD_LEN on a command without a payload: consumed, refused, connection fine.
    c.send_request(CMD_FLAG_PAYLOAD_LEN, CMD_TRIM, 35, 0, 16, &[7; 16]);
    assert_eq!(chunk_error(&c.chunks()[0]), EINVAL);
    c.send_request(0, CMD_FLUSH, 36, 0, 0, &[]);
    assert_eq!(c.chunks()[0].kind, REPLY_TYPE_NONE);
    c.disconnect();
}

#[test]
fn each_bad_request_is_refused_and_the_connection_survives() {
    let t = TestServer::start();
    let size = EXPORT_BYTES as u64;
    let mut c = simple_client(&t, "a");
    let good = pattern(7, 4096);
    c.send_request(0, CMD_WRITE, 1, 0, 4096, &good);
    assert_eq!(c.simple_reply(), (0, 1));
    let big = vec![0x77u8; (33 << 20) as usize];
    /// What, flags, command, offset, length, payload, expected error.
    type Case<'a> = (&'a str, u16, u16, u64, u64, &'a [u8], u32);
    let cases: Vec<Case> = vec![
        ("read past end", 0, CMD_READ, size, 512, &[], EINVAL),
        (
            "read straddling end",
            0,
            CMD_READ,
            size - 512,
            1024,
            &[],
            EINVAL,
        ),
        (
            "read near 2^64",
            0,
            CMD_READ,
            u64::MAX - 511,
            512,
            &[],
            EINVAL,
        ),
        ("write past end", 0, CMD_WRITE, size, 512, &[9; 512], ENOSPC),
        ("trim past end", 0, CMD_TRIM, size - 512, 1024, &[], EINVAL),
        ("zero past end", 0, CMD_WRITE_ZEROES, size, 512, &[], ENOSPC),
        // Any offset and length is served: one byte too far is still too far.
        (
            "read one byte past end",
            0,
            CMD_READ,
            size - 1,
            2,
            &[],
            EINVAL,
        ),
        (
            "write one byte past end",
            0,
            CMD_WRITE,
            size - 3,
            4,
            &[9; 4],
            ENOSPC,
        ),
        (
            "trim one byte past end",
            0,
            CMD_TRIM,
            size - 1,
            2,
            &[],
            EINVAL,
        ),
        ("zero-length read", 0, CMD_READ, 0, 0, &[], EINVAL),
        ("zero-length write", 0, CMD_WRITE, 0, 0, &[], EINVAL),
        ("zero-length trim", 0, CMD_TRIM, 0, 0, &[], EINVAL),
        ("read over 32 MiB", 0, CMD_READ, 0, 33 << 20, &[], EINVAL),
        ("write over 32 MiB", 0, CMD_WRITE, 0, 33 << 20, &big, EINVAL),
        ("unknown command", 0, 77, 0, 512, &[], EINVAL),
        ("unknown flag", 1 << 12, CMD_READ, 0, 512, &[], EINVAL),
        (
            "DF without structured replies",
            CMD_FLAG_DF,
            CMD_READ,
            0,
            512,
            &[],
            EINVAL,
        ),
        (
            "REQ_ONE on a read",
            CMD_FLAG_REQ_ONE,
            CMD_READ,
            0,
            512,
            &[],
            EINVAL,
        ),
        ("flush with a length", 0, CMD_FLUSH, 0, 512, &[], EINVAL),
    ];
    for (i, (what, flags, kind, offset, len, payload, errno)) in cases.into_iter().enumerate() {
        let cookie = 100 + i as u64;
        c.send_request(flags, kind, cookie, offset, len, payload);
        assert_eq!(c.simple_reply(), (errno, cookie), "{what}");
        // The connection still works and the data is intact; a refused read sent
        // no payload (else this reply would be misread).
        c.send_request(0, CMD_READ, 1000 + i as u64, 0, 4096, &[]);
        assert_eq!(c.simple_reply(), (0, 1000 + i as u64), "after {what}");
        assert_eq!(c.read_bytes(4096), good, "after {what}");
    }
    c.disconnect();
    t.assert_healthy();
}

#[test]
fn bad_magic_and_huge_payloads_drop_only_that_connection() {
    let t = TestServer::start();
    let mut bystander = simple_client(&t, "a");
    let mut c = simple_client(&t, "a");
    c.send(&[0xde, 0xad, 0xbe, 0xef]);
    c.send(&[0u8; 24]);
    c.assert_dropped();
    // A write whose payload is too large to read and throw away.
    let mut c = simple_client(&t, "a");
    c.send_request(0, CMD_WRITE, 1, 0, u64::from(u32::MAX), &[]);
    c.assert_dropped();
    // A client that leaves in the middle of a write payload.
    let mut c = simple_client(&t, "a");
    c.send_request(0, CMD_WRITE, 2, 0, 1 << 20, &[1; 4096]);
    drop(c);
    bystander.send_request(0, CMD_READ, 3, 0, 512, &[]);
    assert_eq!(bystander.simple_reply(), (0, 3));
    bystander.read_bytes(512);
    bystander.disconnect();
    t.assert_healthy();
    t.wait_idle();
}

#[test]
fn read_only_export_answers_eperm_to_writes() {
    let config = ServerConfig {
        read_only: true,
        ..ServerConfig::default()
    };
    let t = TestServer::with_config(config);
    t.a.write(0, &[3; 512], false).unwrap();
    let mut c = simple_client(&t, "a");
    c.send_request(0, CMD_WRITE, 1, 0, 512, &[9; 512]);
    assert_eq!(c.simple_reply(), (EPERM, 1));
    c.send_request(0, CMD_TRIM, 2, 0, 512, &[]);
    assert_eq!(c.simple_reply(), (EPERM, 2));
    c.send_request(0, CMD_WRITE_ZEROES, 3, 0, 512, &[]);
    assert_eq!(c.simple_reply(), (EPERM, 3));
    c.send_request(0, CMD_READ, 4, 0, 512, &[]);
    assert_eq!(c.simple_reply(), (0, 4));
    assert_eq!(c.read_bytes(512), vec![3; 512]);
    c.send_request(0, CMD_FLUSH, 5, 0, 0, &[]);
    assert_eq!(c.simple_reply(), (0, 5));
    c.disconnect();
}

#[test]
fn pipelined_requests_complete_out_of_order() {
    const GATED: u64 = 1 << 20;
    let (t, gate) = gated_server(ServerConfig::default(), GATED);
    let mut c = simple_client(&t, "g");
    // The first request waits at the gate; 63 more go in behind it.
    c.send_request(0, CMD_READ, 0, GATED, 512, &[]);
    gate.wait_for_waiting(1);
    for i in 1..64u64 {
        if i % 2 == 0 {
            c.send_request(0, CMD_WRITE, i, i * 4096, 4096, &pattern(i as u8, 4096));
        } else {
            c.send_request(0, CMD_READ, i, 0, 512, &[]);
        }
    }
    let mut seen = HashSet::new();
    for _ in 1..64 {
        let (error, cookie) = c.simple_reply();
        assert_eq!(error, 0);
        assert_ne!(
            cookie, 0,
            "the gated request was answered before the gate opened"
        );
        if cookie % 2 == 1 {
            c.read_bytes(512);
        }
        assert!(seen.insert(cookie), "cookie {cookie} answered twice");
    }
    gate.open_gate();
    assert_eq!(c.simple_reply(), (0, 0));
    c.read_bytes(512);
    for i in (2..64u64).step_by(2) {
        assert_eq!(
            t.a.contents((i * 4096) as usize, 4096),
            pattern(i as u8, 4096)
        );
    }
    c.disconnect();
}

/// Large writes are CPU work (hashing a 128 KiB write takes tens of microseconds): one
/// waiting for a worker gets an idle CPU's worker at once, not only after the running
/// one finishes.
#[test]
fn large_writes_run_on_workers_side_by_side() {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        eprintln!("one CPU: the server runs one worker at a time; nothing to check");
        return;
    }
    const GATED: u64 = 1 << 20;
    let (t, gate) = gated_server(ServerConfig::default(), u64::MAX);
    *gate.gated_write_offset.lock() = Some(GATED);
    let mut c = simple_client(&t, "g");
    let big = 128 << 10;
    c.send_request(0, CMD_WRITE, 1, GATED, big, &pattern(1, big as usize));
    gate.wait_for_waiting(1);
    c.send_request(0, CMD_WRITE, 2, GATED, big, &pattern(2, big as usize));
    // Both reach the export while the gate is shut: two workers run at once.
    gate.wait_for_waiting(2);
    gate.open_gate();
    let mut cookies = [c.simple_reply(), c.simple_reply()];
    cookies.sort();
    assert_eq!(cookies, [(0, 1), (0, 2)]);
    c.disconnect();
}

#[test]
fn per_connection_limit_stops_reading_until_a_request_completes() {
    const GATED: u64 = 0;
    let config = ServerConfig {
        max_inflight_per_connection: 4,
        ..ServerConfig::default()
    };
    let (t, gate) = gated_server(config, GATED);
    let mut c = simple_client(&t, "g");
    for i in 0..10u64 {
        c.send_request(0, CMD_READ, i, GATED, 512, &[]);
    }
    gate.wait_for_waiting(4);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(gate.waiting(), 4, "more than the limit reached the export");
    let stats = t.server.stats();
    assert_eq!(stats.inflight_requests, 4);
    assert_eq!(stats.inflight_buffer_bytes, 4 * 512);
    assert_eq!(stats.connections, 1);
    assert!(stats
        .limits
        .contains(&("max_inflight_per_connection".to_string(), 4)));
    gate.open_gate();
    let mut seen = HashSet::new();
    for _ in 0..10 {
        let (error, cookie) = c.simple_reply();
        assert_eq!(error, 0);
        c.read_bytes(512);
        seen.insert(cookie);
    }
    assert_eq!(seen.len(), 10);
    c.disconnect();
    t.wait_idle();
    assert_eq!(t.server.inflight_requests(), 0);
}

/// Beyond each connection's own reserve of request slots, the total limit is
/// shared: three connections at a limit of 3 hold their reserves and 3 slots more
/// between them, and the rest of their requests wait unread.
#[test]
fn total_limit_is_shared_by_connections() {
    const GATED: u64 = 0;
    let config = ServerConfig {
        max_inflight_total: 3,
        ..ServerConfig::default()
    };
    let (t, gate) = gated_server(config, GATED);
    let per_client = CONNECTION_RESERVED_REQUESTS as u64 + 2;
    let mut clients: Vec<Client> = (0..3).map(|_| simple_client(&t, "g")).collect();
    for (i, c) in clients.iter_mut().enumerate() {
        for j in 0..per_client {
            c.send_request(0, CMD_READ, i as u64 * 100 + j, GATED, 512, &[]);
        }
    }
    // Each connection runs at most WORKERS_PER_CONNECTION_MAX (8) at the gate.
    gate.wait_for_waiting(3 * CONNECTION_RESERVED_REQUESTS.min(WORKERS_PER_CONNECTION_MAX));
    let held = 3 * CONNECTION_RESERVED_REQUESTS + 3;
    for _ in 0..500 {
        if t.server.inflight_requests() >= held {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        t.server.inflight_requests(),
        held,
        "three reserves and the shared three"
    );
    gate.open_gate();
    for c in clients.iter_mut() {
        for _ in 0..per_client {
            assert_eq!(c.simple_reply().0, 0);
            c.read_bytes(512);
        }
        c.disconnect();
    }
}

#[test]
fn two_hundred_connections_at_once() {
    let t = TestServer::start();
    let addr = t.addr;
    // Every client holds its connection open until all have connected.
    let barrier = Arc::new(std::sync::Barrier::new(210));
    let threads: Vec<_> = (0..210u64)
        .map(|i| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let mut c = Client::connect(addr);
                c.handshake();
                let name = if i % 2 == 0 { "a" } else { "b" };
                c.go(name, &[]).expect("GO");
                let offset = (i / 2) * 4096;
                let data = pattern(i as u8, 4096);
                c.send_request(0, CMD_WRITE, i, offset, 4096, &data);
                assert_eq!(c.simple_reply(), (0, i));
                barrier.wait();
                c.send_request(0, CMD_READ, i, offset, 4096, &[]);
                assert_eq!(c.simple_reply(), (0, i));
                assert_eq!(c.read_bytes(4096), data);
                c.disconnect();
            })
        })
        .collect();
    for th in threads {
        th.join().expect("client thread");
    }
    t.wait_idle();
}

#[test]
fn shutdown_finishes_in_flight_requests_then_closes() {
    const GATED: u64 = 4096;
    let (t, gate) = gated_server(ServerConfig::default(), GATED);
    let mut c = simple_client(&t, "g");
    let mut idle = simple_client(&t, "g");
    c.send_request(0, CMD_READ, 1, GATED, 512, &[]);
    gate.wait_for_waiting(1);
    let server = Arc::clone(&t.server);
    let stopper = std::thread::spawn(move || server.shutdown());
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !stopper.is_finished(),
        "shutdown returned with a request in flight"
    );
    gate.open_gate();
    assert_eq!(c.simple_reply(), (0, 1));
    c.read_bytes(512);
    c.assert_dropped();
    idle.assert_dropped();
    stopper.join().expect("shutdown");
    assert_eq!(t.server.connections(), 0);
    assert!(
        std::net::TcpStream::connect(t.addr).is_err(),
        "still accepting"
    );
}

#[test]
fn unix_socket_replaces_a_stale_socket_and_is_removed_at_shutdown() {
    let dir = std::env::temp_dir().join(format!("fewerbytes-nbd-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("nbd.sock");
    // A socket file left by a process that is gone.
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    let t = TestServer::start();
    t.server
        .listen_unix(&path)
        .expect("listen over a stale socket");
    let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
    let mut greeting = [0u8; 18];
    std::io::Read::read_exact(&mut s, &mut greeting).unwrap();
    assert_eq!(&greeting[0..8], b"NBDMAGIC");
    // A live socket is not stolen.
    let second = fewerbytes_nbd::Server::new(
        ServerConfig::default(),
        Arc::new(fewerbytes_nbd::MemoryExports::new(vec![])),
    );
    assert!(second.listen_unix(&path).is_err());
    drop(s);
    t.server.shutdown();
    assert!(!path.exists(), "socket file left behind");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An export that panics on reads at one offset, as an unfinished backend might.
struct PanickyExport(Arc<fewerbytes_nbd::MemoryExport>);

impl Export for PanickyExport {
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        assert_ne!(offset, 4096, "deliberate panic in a test export");
        self.0.read(offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), u32> {
        self.0.write(offset, data, fua)
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), u32> {
        self.0.write_zeroes(offset, len, fua)
    }
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), u32> {
        self.0.trim(offset, len, fua)
    }
    fn flush(&self) -> Result<(), u32> {
        Err(fewerbytes_nbd::EIO)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>, u32> {
        self.0.extents(offset, len)
    }
}

struct PanickyProvider(Arc<PanickyExport>);

impl fewerbytes_nbd::ExportProvider for PanickyProvider {
    fn list(&self) -> Vec<fewerbytes_nbd::ExportDesc> {
        Vec::new()
    }
    fn default_name(&self) -> Option<String> {
        Some("p".into())
    }
    fn open(&self, _name: &str) -> Result<Arc<dyn Export>, String> {
        Ok(self.0.clone())
    }
}

#[test]
fn export_failures_and_panics_become_error_replies() {
    let inner = Arc::new(fewerbytes_nbd::MemoryExport::new(EXPORT_BYTES));
    let provider = Arc::new(PanickyProvider(Arc::new(PanickyExport(Arc::clone(&inner)))));
    let t = TestServer::with_provider(ServerConfig::default(), provider, Arc::clone(&inner), inner);
    let mut c = simple_client(&t, "");
    c.send_request(0, CMD_READ, 1, 4096, 512, &[]);
    assert_eq!(c.simple_reply(), (fewerbytes_nbd::EIO, 1));
    c.send_request(0, CMD_FLUSH, 2, 0, 0, &[]);
    assert_eq!(c.simple_reply(), (fewerbytes_nbd::EIO, 2));
    c.send_request(0, CMD_READ, 3, 0, 512, &[]);
    assert_eq!(c.simple_reply(), (0, 3));
    c.read_bytes(512);
    c.disconnect();
}

/// The wire bytes of a compact request, so a test can send many in one system call
/// (and the server finds them all in one read).
fn request_bytes(
    flags: u16,
    kind: u16,
    cookie: u64,
    offset: u64,
    payload: &[u8],
    len: u32,
) -> Vec<u8> {
    let mut b = Vec::with_capacity(28 + payload.len());
    b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(&offset.to_be_bytes());
    b.extend_from_slice(&len.to_be_bytes());
    b.extend_from_slice(payload);
    b
}

/// The reader parses every request already in its buffer before handing them to
/// workers, and each holds a permit; at a limit it must hand its batch over before
/// it waits, or the connection would wait for itself. A burst far past both limits,
/// with flushes and FUA writes in it, is answered whole.
#[test]
fn a_burst_past_the_limits_is_answered_whole() {
    let config = ServerConfig {
        max_inflight_per_connection: 3,
        max_inflight_total: 5,
        ..ServerConfig::default()
    };
    let t = TestServer::with_config(config);
    let mut c = simple_client(&t, "a");
    let mut burst = Vec::new();
    for i in 0..200u64 {
        let data = pattern(i as u8, 4096);
        let request = match i % 25 {
            0 => request_bytes(0, CMD_FLUSH, i, 0, &[], 0),
            1 => request_bytes(CMD_FLAG_FUA, CMD_WRITE, i, i * 4096, &data, 4096),
            _ => request_bytes(0, CMD_WRITE, i, i * 4096, &data, 4096),
        };
        burst.extend_from_slice(&request);
    }
    c.send(&burst);
    let mut seen = HashSet::new();
    for _ in 0..200 {
        let (error, cookie) = c.simple_reply();
        assert_eq!(error, 0, "request {cookie}");
        assert!(seen.insert(cookie), "cookie {cookie} answered twice");
    }
    for i in (0..200u64).filter(|i| i % 25 != 0) {
        assert_eq!(
            t.a.contents((i * 4096) as usize, 4096),
            pattern(i as u8, 4096),
            "block {i}"
        );
    }
    c.disconnect();
    t.wait_idle();
    assert_eq!(t.server.inflight_requests(), 0);
}

/// A lone small write may run on the connection's reader thread, a read never does:
/// while a read waits (for the disk, here a gate), writes on the same connection,
/// with and without FUA, are still read and answered.
#[test]
fn writes_are_answered_while_a_read_waits() {
    const GATED: u64 = 1 << 20;
    let (t, gate) = gated_server(ServerConfig::default(), GATED);
    let mut c = simple_client(&t, "g");
    c.send_request(0, CMD_READ, 1, GATED, 512, &[]);
    gate.wait_for_waiting(1);
    c.send_request(0, CMD_WRITE, 2, 0, 4096, &pattern(2, 4096));
    assert_eq!(c.simple_reply(), (0, 2));
    c.send_request(CMD_FLAG_FUA, CMD_WRITE, 3, 4096, 4096, &pattern(3, 4096));
    assert_eq!(c.simple_reply(), (0, 3));
    c.send_request(0, CMD_READ, 4, 0, 8192, &[]);
    assert_eq!(c.simple_reply(), (0, 4));
    let mut both = pattern(2, 4096);
    both.extend_from_slice(&pattern(3, 4096));
    assert_eq!(c.read_bytes(8192), both);
    gate.open_gate();
    assert_eq!(c.simple_reply(), (0, 1));
    c.read_bytes(512);
    c.disconnect();
    t.wait_idle();
}
