//! No client starves another: write payloads that stall, block status replies a
//! client never reads, connections that idle after negotiating, and probes for
//! names the export list hides. Alone in its own test binary: it measures the
//! process's memory and holds large payloads on purpose.

mod common;

use common::*;
use fewerbytes_nbd::protocol::*;
use fewerbytes_nbd::{
    AccessPolicy, Export, ExportDesc, ExportProvider, MemoryExport, MemoryExports, ServerConfig,
    CONNECTION_RESERVED_BUFFER_BYTES, CONNECTION_SHARED_BUFFER_BYTES_MAX, PAYLOAD_PIECE_BYTES,
    PAYLOAD_TIMEOUT,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// Wait (bounded by a minute) until `ready()`.
fn wait_for(what: &str, ready: impl Fn() -> bool) {
    let started = Instant::now();
    while !ready() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{what}: never happened"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn stalled_write_payloads_do_not_hold_a_good_clients_16_mib_write() {
    // Bug: a write's whole length was charged to the server-wide buffer budget at its
    // header, so 8 connections that each sent a 32 MiB write's header and one byte of
    // its payload held all 256 MiB, and every other client's request over 2 MiB
    // waited for their 120 s payload timeout.
    let a = Arc::new(MemoryExport::new(40 << 20));
    let b = Arc::new(MemoryExport::new(40 << 20));
    let provider = MemoryExports::new(vec![
        ("a".to_string(), Arc::clone(&a)),
        ("b".to_string(), Arc::clone(&b)),
    ]);
    let t = TestServer::with_provider(ServerConfig::default(), Arc::new(provider), a, b);
    let mut stallers = Vec::new();
    for cookie in 0..8u64 {
        let mut c = t.connect();
        c.handshake();
        c.go("a", &[]).expect("GO");
        c.send_request(0, CMD_WRITE, cookie, 0, 32 * MIB, &[1]);
        stallers.push(c);
    }
    // Each staller holds its first piece, from its own reserve.
    wait_for("the stallers' first pieces charged", || {
        t.server.stats().inflight_buffer_bytes >= 8 * PAYLOAD_PIECE_BYTES
    });

    // The good client's read timeout is half the stall timeout: it must be answered
    // while the stallers still hang, not after the server gave up on them.
    let mut good = t.connect();
    good.s
        .set_read_timeout(Some(PAYLOAD_TIMEOUT / 2))
        .expect("timeout");
    good.handshake();
    good.go("b", &[]).expect("GO");
    let data: Vec<u8> = (0..16 * MIB).map(|i| (i % 251) as u8).collect();
    good.send_request(0, CMD_WRITE, 1, 0, 16 * MIB, &data);
    assert_eq!(good.simple_reply(), (0, 1), "the 16 MiB write failed");
    good.send_request(0, CMD_READ, 2, 0, 16 * MIB, &[]);
    assert_eq!(good.simple_reply(), (0, 2), "the 16 MiB read failed");
    assert!(good.read_bytes(16 << 20) == data, "read back other bytes");
    good.disconnect();

    // The stallers were not given up on: served while they still hang.
    assert_eq!(t.server.connections(), 8, "the stallers' connections");
    for c in &mut stallers {
        // The rest of the payload: their writes then complete as well.
        c.send(&vec![1u8; (32 * MIB - 1) as usize]);
        assert_eq!(
            c.simple_reply().0,
            0,
            "a staller's write, once its payload came"
        );
    }
    assert_eq!(t.a.contents(0, 4096), vec![1; 4096]);
}

/// An export of `size` bytes whose first `fragmented` bytes alternate data and zero
/// blocks of 4 KiB (the rest zero), without storing any of it: a thin volume's
/// worst case for block status.
struct Striped {
    size: u64,
    fragmented: u64,
    extents_calls: AtomicUsize,
}

impl Export for Striped {
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn read(&self, _offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        buf.fill(0);
        Ok(())
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), u32> {
        Ok(())
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool) -> Result<(), u32> {
        Ok(())
    }
    fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), u32> {
        Ok(())
    }
    fn flush(&self) -> Result<(), u32> {
        Ok(())
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>, u32> {
        self.extents_calls.fetch_add(1, Ordering::SeqCst);
        let end = offset + len;
        let mut runs = Vec::new();
        let mut pos = offset;
        while pos < end.min(self.fragmented) {
            let block_end = (pos / 4096 + 1) * 4096;
            let n = block_end.min(end) - pos;
            runs.push((n, (pos / 4096).is_multiple_of(2)));
            pos += n;
        }
        if pos < end {
            runs.push((end - pos, false));
        }
        Ok(runs)
    }
}

struct StripedProvider(Arc<Striped>);

impl ExportProvider for StripedProvider {
    fn list(&self) -> Vec<ExportDesc> {
        vec![ExportDesc {
            name: "thin".into(),
            description: String::new(),
            size_bytes: self.0.size,
        }]
    }
    fn default_name(&self) -> Option<String> {
        Some("thin".into())
    }
    fn open(&self, name: &str) -> Result<Arc<dyn Export>, String> {
        match name {
            "thin" => Ok(Arc::clone(&self.0) as Arc<dyn Export>),
            _ => Err(format!("no export {name}")),
        }
    }
}

/// Resident memory of this process (the server runs in it).
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS line");
    kib * 1024
}

/// What the server may hold for one connection's unread replies: its buffer
/// budget (its reserve and its share of the pool), as the README states.
const REPLY_BYTES_BOUND: u64 =
    CONNECTION_RESERVED_BUFFER_BYTES + CONNECTION_SHARED_BUFFER_BYTES_MAX;
/// Room for what else moves in a process that allocates: worker stacks, the runs
/// of the block status being answered, allocator slack.
const RSS_SLACK_BYTES: u64 = 32 * MIB;

#[test]
fn unread_block_status_replies_stay_within_the_connections_budget() {
    // Bug: a block status reply (up to 2^20 descriptors, ~18 MiB with the runs it was
    // built from) was charged nothing, so one connection that sent 30 block status
    // requests of 16 GiB over alternating data and zero blocks and never read a reply
    // grew the server by ~18 MiB per request (1,024 in flight: ~18 GiB).
    let striped = Arc::new(Striped {
        size: 16 << 30,
        fragmented: 4 << 30,
        extents_calls: AtomicUsize::new(0),
    });
    let a = Arc::new(MemoryExport::new(4096));
    let t = TestServer::with_provider(
        ServerConfig::default(),
        Arc::new(StripedProvider(Arc::clone(&striped))),
        Arc::clone(&a),
        a,
    );
    let mut c = t.connect();
    c.handshake();
    c.option_ack(OPT_EXTENDED_HEADERS);
    let (ctx, kind) = c.meta_context(OPT_SET_META_CONTEXT, "thin", &["base:allocation"]);
    assert_eq!((ctx.len(), kind), (1, REP_ACK));
    c.go("thin", &[]).expect("GO");
    c.extended = true;
    // A first request, read: the server's memory for one answered block status.
    c.send_request(0, CMD_BLOCK_STATUS, 1000, 0, 16 << 30, &[]);
    let first = c.chunks();
    assert!(!first.is_empty(), "a block status reply");
    let before = rss_bytes();
    let calls_before = striped.extents_calls.load(Ordering::SeqCst);

    const REQUESTS: u64 = 30;
    for cookie in 0..REQUESTS {
        c.send_request(0, CMD_BLOCK_STATUS, cookie, 0, 16 << 30, &[]);
    }
    // Every request was read and asked of the export (each at least once).
    wait_for("30 block status requests answered", || {
        striped.extents_calls.load(Ordering::SeqCst) >= calls_before + REQUESTS as usize
    });
    // The peak while the replies wait for a client that does not read them.
    let mut peak = rss_bytes();
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(10));
        peak = peak.max(rss_bytes());
    }
    let grown = peak.saturating_sub(before);
    eprintln!("RSS grew by {} MiB for 30 unread replies", grown >> 20);
    assert!(
        grown <= REPLY_BYTES_BOUND + RSS_SLACK_BYTES,
        "the server grew by {} MiB for one connection's unread replies (bound {} MiB)",
        grown >> 20,
        (REPLY_BYTES_BOUND + RSS_SLACK_BYTES) >> 20
    );
    assert!(t.server.stats().inflight_buffer_bytes <= REPLY_BYTES_BOUND);
    // The replies are all there once the client reads them.
    for _ in 0..REQUESTS {
        let chunks = c.chunks();
        assert_eq!(chunks.len(), 1, "one block status chunk per reply");
    }
}

#[test]
fn a_connection_idle_after_negotiation_is_closed_after_the_idle_timeout() {
    // Bug: connections that negotiated and then sent nothing held their slot forever.
    let config = ServerConfig {
        idle_timeout: Some(Duration::from_secs(1)),
        ..ServerConfig::default()
    };
    let t = TestServer::with_config(config);
    let mut busy = t.connect();
    busy.handshake();
    busy.go("a", &[]).expect("GO");
    let mut idle = t.connect();
    idle.handshake();
    idle.go("a", &[]).expect("GO");
    // The busy one keeps sending, each gap under the timeout.
    for cookie in 0..4u64 {
        busy.send_request(0, CMD_WRITE, cookie, 0, 4096, &[3; 4096]);
        assert_eq!(busy.simple_reply(), (0, cookie));
        std::thread::sleep(Duration::from_millis(400));
    }
    // The idle one was closed: its read ends (a timeout of the client's read, 20 s,
    // is not a close).
    let mut byte = [0u8; 1];
    match std::io::Read::read(&mut idle.s, &mut byte) {
        Ok(0) => {}
        Ok(_) => panic!("the server sent data to the idle client"),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the idle client was not closed: {e}"),
    }
    wait_for("the idle connection unregistered", || {
        t.server.connections() == 1
    });
    busy.send_request(0, CMD_READ, 9, 0, 4096, &[]);
    assert_eq!(
        busy.simple_reply(),
        (0, 9),
        "the busy client was closed too"
    );
    assert_eq!(busy.read_bytes(4096), vec![3; 4096]);
    busy.disconnect();
}

/// Export "b" limited to the TLS identity "alice".
#[derive(Debug)]
struct OnlyAlice;

impl AccessPolicy for OnlyAlice {
    fn allowed(&self, export: &str) -> Option<Vec<String>> {
        (export == "b").then(|| vec!["alice".to_string()])
    }
}

#[test]
fn probing_a_hidden_name_answers_as_an_unknown_one() {
    // Bug: an export left out of NBD_OPT_LIST answered NBD_REP_ERR_TLS_REQD (or
    // ERR_POLICY) where an unknown name answers ERR_UNKNOWN: probing found it.
    let config = ServerConfig {
        access: Some(Arc::new(OnlyAlice)),
        ..ServerConfig::default()
    };
    let t = TestServer::with_config(config);
    let mut c = t.connect();
    c.handshake();
    for option in [OPT_INFO, OPT_GO] {
        let hidden = c
            .info_or_go(option, "b", &[])
            .expect_err("hidden export opened");
        let unknown = c
            .info_or_go(option, "q", &[])
            .expect_err("unknown export opened");
        assert_eq!(hidden.0, REP_ERR_UNKNOWN, "{}", hidden.1);
        assert_eq!(
            (hidden.0, hidden.1.replace("'b'", "'?'")),
            (unknown.0, unknown.1.replace("'q'", "'?'")),
            "a hidden name and an unknown one answer alike"
        );
    }
    c.option_ack(OPT_STRUCTURED_REPLY);
    let (_, hidden) = c.meta_context(OPT_LIST_META_CONTEXT, "b", &[]);
    let (_, unknown) = c.meta_context(OPT_LIST_META_CONTEXT, "q", &[]);
    assert_eq!(hidden, unknown, "LIST_META_CONTEXT on a hidden name");
    c.go("a", &[]).expect("the open export still opens");
    c.disconnect();
}
