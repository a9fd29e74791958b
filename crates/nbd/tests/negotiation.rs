//! Raw-socket tests of the handshake: each option, each refusal, and each kind
//! of garbage that must drop the connection, followed by a good client that must
//! still be served.

mod common;

use common::*;
use fewerbytes_nbd::protocol::*;
use fewerbytes_nbd::ServerConfig;

#[test]
fn go_with_block_size_name_and_description() {
    let t = TestServer::start();
    let mut c = t.connect();
    c.handshake();
    let r = c
        .go("", &[INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION])
        .expect("GO on the default export");
    let (size, flags) = r.size_and_flags();
    assert_eq!(size, EXPORT_BYTES as u64);
    for f in [
        TFLAG_HAS_FLAGS,
        TFLAG_SEND_FLUSH,
        TFLAG_SEND_FUA,
        TFLAG_SEND_TRIM,
        TFLAG_SEND_WRITE_ZEROES,
        TFLAG_CAN_MULTI_CONN,
        TFLAG_SEND_CACHE,
        TFLAG_SEND_FAST_ZERO,
    ] {
        assert_ne!(flags & f, 0, "flag {f:#x} missing from {flags:#x}");
    }
    // No structured replies negotiated: DF must not be offered.
    assert_eq!(flags & (TFLAG_SEND_DF | TFLAG_READ_ONLY), 0);
    let bs = r.info(INFO_BLOCK_SIZE).expect("NBD_INFO_BLOCK_SIZE");
    let words: Vec<u32> = bs
        .chunks(4)
        .map(|w| u32::from_be_bytes(w.try_into().unwrap()))
        .collect();
    // Minimum 1: any byte offset and length is served (the spec's default, what
    // qemu-nbd advertises for a raw file); preferred a whole 4 KiB block.
    assert_eq!(words, vec![1, 4096, 32 << 20]);
    assert_eq!(
        r.info(INFO_NAME),
        Some(&b"a"[..]),
        "canonical name of the default"
    );
    assert_eq!(r.info(INFO_DESCRIPTION), Some(&b"in-memory export 'a'"[..]));
    // Transmission works right after GO.
    c.send_request(0, CMD_FLUSH, 1, 0, 0, &[]);
    assert_eq!(c.simple_reply(), (0, 1));
    c.disconnect();
}

#[test]
fn info_then_go_and_unknown_export_is_refused() {
    let t = TestServer::start();
    let mut c = t.connect();
    c.handshake();
    let info = c
        .info_or_go(OPT_INFO, "b", &[INFO_BLOCK_SIZE])
        .expect("INFO b");
    assert_eq!(info.size_and_flags().0, EXPORT_BYTES as u64);
    let (kind, message) = c.go("nosuch", &[]).expect_err("unknown export accepted");
    assert_eq!(kind, REP_ERR_UNKNOWN, "{message}");
    assert!(message.contains("nosuch"), "{message}");
    // Still negotiating: GO on a real export works.
    c.go("b", &[]).expect("GO b after a refusal");
    c.disconnect();
}

#[test]
fn list_names_every_export() {
    let t = TestServer::start();
    let mut c = t.connect();
    c.handshake();
    c.send_option(OPT_LIST, &[]);
    let mut names = Vec::new();
    loop {
        let (kind, data) = c.option_reply(OPT_LIST);
        if kind == REP_ACK {
            break;
        }
        assert_eq!(kind, REP_SERVER);
        let n = u32::from_be_bytes(data[0..4].try_into().unwrap()) as usize;
        names.push(String::from_utf8(data[4..4 + n].to_vec()).unwrap());
    }
    assert_eq!(names, vec!["a", "b"]);
    // LIST with data is invalid, and negotiation continues.
    c.send_option(OPT_LIST, b"x");
    assert_eq!(c.option_reply(OPT_LIST).0, REP_ERR_INVALID);
    c.go("a", &[]).expect("GO after LIST");
}

#[test]
fn export_name_with_and_without_zero_padding() {
    let t = TestServer::start();
    for (flags, padding) in [
        (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES, 0),
        (FLAG_C_FIXED_NEWSTYLE, 124),
    ] {
        let mut c = t.connect();
        c.handshake_with_flags(flags);
        c.send_option(OPT_EXPORT_NAME, b"b");
        assert_eq!(c.u64(), EXPORT_BYTES as u64);
        let tflags = c.u16();
        assert_ne!(tflags & TFLAG_HAS_FLAGS, 0);
        if padding > 0 {
            assert_eq!(c.read_bytes(padding), vec![0; padding]);
        }
        c.send_request(0, CMD_READ, 5, 0, 512, &[]);
        assert_eq!(c.simple_reply(), (0, 5));
        assert_eq!(c.read_bytes(512), vec![0; 512]);
        c.disconnect();
    }
}

#[test]
fn export_name_for_unknown_export_drops_the_connection() {
    let t = TestServer::start();
    let mut c = t.connect();
    c.handshake();
    c.send_option(OPT_EXPORT_NAME, b"nosuch");
    c.assert_dropped();
    t.assert_healthy();
}

#[test]
fn unknown_options_and_starttls_are_refused_and_negotiation_continues() {
    let t = TestServer::start();
    let mut c = t.connect();
    c.handshake();
    c.send_option(999, b"whatever data");
    assert_eq!(c.option_reply(999).0, REP_ERR_UNSUP);
    c.send_option(OPT_PEEK_EXPORT, &[]);
    assert_eq!(c.option_reply(OPT_PEEK_EXPORT).0, REP_ERR_UNSUP);
    c.send_option(OPT_STARTTLS, &[]);
    let (kind, _) = c.option_reply(OPT_STARTTLS);
    assert!(kind == REP_ERR_POLICY || kind == REP_ERR_UNSUP, "{kind:#x}");
    c.send_option(OPT_STRUCTURED_REPLY, b"junk");
    assert_eq!(c.option_reply(OPT_STRUCTURED_REPLY).0, REP_ERR_INVALID);
    // Malformed GO data: name length beyond the option.
    let mut bad = Client::info_data("a", &[]);
    bad[3] = 200;
    c.send_option(OPT_GO, &bad);
    assert_eq!(c.option_reply(OPT_GO).0, REP_ERR_INVALID);
    c.go("a", &[]).expect("GO after refusals");
    c.disconnect();
}

#[test]
fn abort_is_acknowledged() {
    let t = TestServer::start();
    let mut c = t.connect();
    c.handshake();
    c.send_option(OPT_ABORT, &[]);
    assert_eq!(c.option_reply(OPT_ABORT).0, REP_ACK);
    c.assert_dropped();
}

#[test]
fn meta_contexts_list_and_set() {
    let t = TestServer::start();
    let mut c = t.connect();
    c.handshake();
    // Before structured replies: invalid.
    let (ctx, kind) = c.meta_context(OPT_SET_META_CONTEXT, "a", &["base:allocation"]);
    assert!(ctx.is_empty());
    assert_eq!(kind, REP_ERR_INVALID);
    c.option_ack(OPT_STRUCTURED_REPLY);
    let (ctx, kind) = c.meta_context(OPT_LIST_META_CONTEXT, "a", &[]);
    assert_eq!(
        (ctx, kind),
        (vec![(0, "base:allocation".to_string())], REP_ACK)
    );
    let (ctx, kind) = c.meta_context(OPT_LIST_META_CONTEXT, "a", &["base:"]);
    assert_eq!(ctx.len(), 1);
    assert_eq!(kind, REP_ACK);
    let (ctx, kind) = c.meta_context(OPT_LIST_META_CONTEXT, "a", &["qemu:dirty-bitmap:x"]);
    assert_eq!((ctx.len(), kind), (0, REP_ACK));
    let (ctx, kind) = c.meta_context(OPT_SET_META_CONTEXT, "nosuch", &["base:allocation"]);
    assert_eq!((ctx.len(), kind), (0, REP_ERR_UNKNOWN));
    let (ctx, kind) = c.meta_context(
        OPT_SET_META_CONTEXT,
        "a",
        &["x-unknown:thing", "base:allocation"],
    );
    assert_eq!(kind, REP_ACK);
    assert_eq!(ctx.len(), 1);
    assert_ne!(ctx[0].0, 0, "SET gives a real context id");
    let id = ctx[0].0;
    let r = c.go("a", &[]).expect("GO");
    assert_ne!(
        r.size_and_flags().1 & TFLAG_SEND_DF,
        0,
        "DF with structured replies"
    );
    c.send_request(CMD_FLAG_REQ_ONE, CMD_BLOCK_STATUS, 3, 0, 1 << 20, &[]);
    let chunks = c.chunks();
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0].kind, REPLY_TYPE_BLOCK_STATUS);
    let p = &chunks[0].payload;
    assert_eq!(u32::from_be_bytes(p[0..4].try_into().unwrap()), id);
    assert_eq!(p.len(), 12);
    c.disconnect();
}

#[test]
fn extended_headers_negotiation() {
    let t = TestServer::start();
    let mut c = t.connect();
    c.handshake();
    c.option_ack(OPT_EXTENDED_HEADERS);
    c.send_option(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(
        c.option_reply(OPT_STRUCTURED_REPLY).0,
        REP_ERR_EXT_HEADER_REQD
    );
    // EXPORT_NAME is forbidden once extended headers are on: the server hangs up.
    c.send_option(OPT_EXPORT_NAME, b"a");
    c.assert_dropped();
    t.assert_healthy();
}

#[test]
fn garbage_during_negotiation_drops_the_connection() {
    let t = TestServer::start();
    // Unknown client flags.
    let mut c = t.connect();
    c.handshake_with_flags(0x8000_0001);
    c.assert_dropped();
    t.assert_healthy();
    // Wrong option magic.
    let mut c = t.connect();
    c.handshake();
    c.send(b"GARBAGE!GARBAGE!GARBAGE!");
    c.assert_dropped();
    t.assert_healthy();
    // An option length no real option has.
    let mut c = t.connect();
    c.handshake();
    let mut b = Vec::new();
    b.extend_from_slice(&IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&OPT_GO.to_be_bytes());
    b.extend_from_slice(&u32::MAX.to_be_bytes());
    c.send(&b);
    c.assert_dropped();
    t.assert_healthy();
    // A client that leaves mid-option.
    let mut c = t.connect();
    c.handshake();
    c.send(&IHAVEOPT.to_be_bytes()[..5]);
    drop(c);
    t.assert_healthy();
    t.wait_idle();
}

#[test]
fn connection_limit_refuses_extra_clients() {
    let config = ServerConfig {
        max_connections: 2,
        ..ServerConfig::default()
    };
    let t = TestServer::with_config(config);
    let mut first = t.connect();
    first.handshake();
    let mut second = t.connect();
    second.handshake();
    let mut third = t.connect();
    third.assert_dropped();
    first.go("a", &[]).expect("first still served");
    first.disconnect();
    second.go("a", &[]).expect("second still served");
    second.disconnect();
    t.wait_idle();
    t.assert_healthy();
}

#[test]
fn read_only_is_advertised_without_write_commands() {
    let config = ServerConfig {
        read_only: true,
        ..ServerConfig::default()
    };
    let t = TestServer::with_config(config);
    let mut c = t.connect();
    c.handshake();
    let flags = c.go("a", &[]).expect("GO").size_and_flags().1;
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_eq!(
        flags & (TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO),
        0
    );
    c.disconnect();
}
