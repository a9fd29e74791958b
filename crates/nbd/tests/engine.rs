//! The server over a real pool: `pool_exports` lists and opens volumes, and
//! reads, writes, zeroing, trim, flush and block status reach the engine; a bad
//! sector fails only the reads that touch it.

mod common;

use common::{chunk_error, Client, TempDir};
use fewerbytes_engine::storage::{CrashMode, FaultPlan, FaultStorage, Storage};
use fewerbytes_engine::{CreateOptions, Mode, OpenOptions, Pool};
use fewerbytes_nbd::protocol::*;
use fewerbytes_nbd::{pool_exports, Server, ServerConfig, EINVAL, EIO, ESHUTDOWN};
use std::sync::Arc;

#[test]
fn serves_pool_volumes() {
    let dir = TempDir::new("engine");
    let path = dir.0.join("test.pool");
    Pool::create(&CreateOptions {
        path: path.clone(),
        size_bytes: Some(256 << 20),
        ..CreateOptions::default()
    })
    .expect("create pool");
    let pool = Pool::open(&path, &OpenOptions::default()).expect("open pool");
    pool.create_volume("vm1", 16 << 20).expect("create vm1");

    let server = Server::new(ServerConfig::default(), pool_exports(pool.clone(), None));
    let addr = server.listen_tcp("127.0.0.1:0").expect("listen");

    // The only volume is the default export; LIST names it.
    let mut c = Client::connect(addr);
    c.handshake();
    c.send_option(OPT_LIST, &[]);
    let (kind, data) = c.option_reply(OPT_LIST);
    assert_eq!(kind, REP_SERVER);
    assert_eq!(&data[4..7], b"vm1");
    assert_eq!(c.option_reply(OPT_LIST).0, REP_ACK);
    c.option_ack(OPT_STRUCTURED_REPLY);
    let (ctx, kind) = c.meta_context(OPT_SET_META_CONTEXT, "", &["base:allocation"]);
    assert_eq!((ctx.len(), kind), (1, REP_ACK));
    let info = c.go("", &[INFO_BLOCK_SIZE]).expect("GO default");
    assert_eq!(info.size_and_flags().0, 16 << 20);
    assert_eq!(info.info(INFO_NAME), Some(&b"vm1"[..]));

    let data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8 + 1).collect();
    c.send_request(CMD_FLAG_FUA, CMD_WRITE, 1, 1 << 20, 65536, &data);
    assert_eq!(c.simple_reply(), (0, 1));
    c.send_request(0, CMD_FLUSH, 2, 0, 0, &[]);
    assert_eq!(c.simple_reply(), (0, 2));
    c.send_request(CMD_FLAG_DF, CMD_READ, 3, 1 << 20, 65536, &[]);
    let chunks = c.chunks();
    assert_eq!(chunks.len(), 1);
    assert_eq!(&chunks[0].payload[8..], &data[..]);
    c.send_request(0, CMD_TRIM, 4, 1 << 20, 4096, &[]);
    assert_eq!(c.simple_reply(), (0, 4));
    c.send_request(
        CMD_FLAG_FAST_ZERO,
        CMD_WRITE_ZEROES,
        5,
        (1 << 20) + 8192,
        4096,
        &[],
    );
    assert_eq!(c.simple_reply(), (0, 5));
    c.send_request(0, CMD_BLOCK_STATUS, 6, 1 << 20, 65536, &[]);
    let p = c.chunks().remove(0).payload;
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
    assert_eq!(
        descs,
        vec![(4096, hz), (4096, 0), (4096, hz), (65536 - 12288, 0)]
    );
    // A read past the end is refused by the server before the engine sees it.
    c.send_request(0, CMD_READ, 7, 16 << 20, 4096, &[]);
    assert_eq!(chunk_error(&c.chunks()[0]), EINVAL);

    // A volume deleted under a connected client: requests fail with ESHUTDOWN.
    pool.delete_volume("vm1", true).expect("force delete");
    c.send_request(0, CMD_READ, 8, 0, 4096, &[]);
    let err = chunk_error(&c.chunks()[0]);
    assert!(err == ESHUTDOWN || err == EINVAL, "got {err}");
    c.disconnect();

    // An unknown name is refused.
    let mut c = Client::connect(addr);
    c.handshake();
    assert_eq!(
        c.go("vm1", &[]).expect_err("deleted volume").0,
        REP_ERR_UNKNOWN
    );
    server.shutdown();
    pool.close().expect("close pool");
}

/// Distinct, incompressible 4 KiB blocks (each stored whole, at its own place).
fn random_block(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn a_read_error_fails_that_request_alone() {
    // Bug: a failed data read latched the whole pool read-only (`check_io`), so one
    // bad sector under one block of one volume refused every later write, on
    // every volume, until a restart.
    const BLOCKS: u64 = 8;
    const BAD: u64 = 3;
    let dev = Arc::new(FaultStorage::new("data", 64 << 20));
    Pool::format(
        Arc::clone(&dev) as Arc<dyn Storage>,
        None,
        None,
        &CreateOptions::default(),
    )
    .expect("format");
    let open = || {
        Pool::open_devices(
            Arc::clone(&dev) as Arc<dyn Storage>,
            None,
            &OpenOptions {
                threads: Some(2),
                index_memory_bytes: None,
                no_discard: false,
                hold_index_build: false,
                take_over: None,
                saved_index: fewerbytes_engine::SavedIndex::Off,
            },
        )
        .expect("open pool")
    };
    // Written and closed first, so that reads go to the device, not to a packer's
    // buffer of recent writes.
    let pool = open();
    pool.create_volume("vm1", 16 << 20).expect("create vm1");
    let vol = pool.open_volume("vm1").expect("open vm1");
    for b in 0..BLOCKS {
        vol.write(b * 4096, &random_block(b), false).expect("write");
    }
    drop(vol);
    pool.close().expect("close");
    let pool = open();
    let server = Server::new(ServerConfig::default(), pool_exports(pool.clone(), None));
    let addr = server.listen_tcp("127.0.0.1:0").expect("listen");
    let mut c = Client::connect(addr);
    c.handshake();
    c.go("vm1", &[]).expect("GO");

    // The bad sector: the first 512 bytes of where block BAD's bytes lie.
    let image = dev.crash_image(CrashMode::KeepAll);
    let bad = random_block(BAD);
    let at = image
        .chunks(4096)
        .position(|block| block == &bad[..])
        .expect("block BAD is stored whole") as u64
        * 4096;
    dev.set_plan(FaultPlan {
        unreadable: Some((at, 512)),
        ..FaultPlan::default()
    });

    for round in 0..2u64 {
        c.send_request(0, CMD_READ, 100 + round, BAD * 4096, 4096, &[]);
        assert_eq!(c.simple_reply(), (EIO, 100 + round), "the bad block's read");
        for b in (0..BLOCKS).filter(|&b| b != BAD) {
            c.send_request(0, CMD_READ, b, b * 4096, 4096, &[]);
            assert_eq!(c.simple_reply(), (0, b), "block {b}'s read");
            assert!(c.read_bytes(4096) == random_block(b), "block {b}'s bytes");
        }
    }
    // Writes go on, and the pool is not latched.
    c.send_request(
        CMD_FLAG_FUA,
        CMD_WRITE,
        200,
        10 * 4096,
        4096,
        &random_block(10),
    );
    assert_eq!(c.simple_reply(), (0, 200), "a write after the read error");
    c.send_request(0, CMD_FLUSH, 201, 0, 0, &[]);
    assert_eq!(c.simple_reply(), (0, 201), "a flush after the read error");
    assert_eq!(pool.latched_reason(), None);
    assert_eq!(pool.stats().mode, Mode::Normal);
    // Rewritten, the block is stored elsewhere and reads again.
    c.send_request(
        CMD_FLAG_FUA,
        CMD_WRITE,
        202,
        BAD * 4096,
        4096,
        &random_block(99),
    );
    assert_eq!(c.simple_reply(), (0, 202));
    c.send_request(0, CMD_READ, 203, BAD * 4096, 4096, &[]);
    assert_eq!(c.simple_reply(), (0, 203));
    assert!(
        c.read_bytes(4096) == random_block(99),
        "the rewritten block"
    );
    c.disconnect();
    server.shutdown();
    pool.close().expect("close pool");
}
