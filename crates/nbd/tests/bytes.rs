//! Byte-granular requests over a real pool, from a raw-socket client that never
//! asks for block sizes: `NBD_OPT_EXPORT_NAME`, simple replies. Every offset and
//! length inside the export is served, and every byte read back is checked
//! against a model of the volume.

mod common;

use common::{Client, TempDir};
use fewerbytes_engine::{CreateOptions, OpenOptions, Pool};
use fewerbytes_nbd::protocol::*;
use fewerbytes_nbd::{pool_exports, Server, ServerConfig, EINVAL, ENOSPC};
use std::net::SocketAddr;
use std::sync::Arc;

const VOLUME_BYTES: u64 = 4 << 20;
const BLOCK: u64 = 4096;

/// A pool with one volume "vm1" of `VOLUME_BYTES`, served on a TCP port.
struct Served {
    dir: TempDir,
    pool: Arc<Pool>,
    server: Arc<Server>,
    addr: SocketAddr,
}

impl Served {
    fn start(tag: &str) -> Served {
        let dir = TempDir::new(tag);
        let path = dir.0.join("test.pool");
        Pool::create(&CreateOptions {
            path: path.clone(),
            size_bytes: Some(128 << 20),
            ..CreateOptions::default()
        })
        .expect("create pool");
        let pool = Pool::open(&path, &OpenOptions::default()).expect("open pool");
        pool.create_volume("vm1", VOLUME_BYTES).expect("create vm1");
        Served::serve(dir, pool)
    }

    fn serve(dir: TempDir, pool: Arc<Pool>) -> Served {
        let server = Server::new(ServerConfig::default(), pool_exports(pool.clone(), None));
        let addr = server.listen_tcp("127.0.0.1:0").expect("listen");
        Served {
            dir,
            pool,
            server,
            addr,
        }
    }

    /// A client that picks the export with `NBD_OPT_EXPORT_NAME`: no block sizes
    /// asked or seen, simple replies only.
    fn export_name_client(&self) -> Client {
        let mut c = Client::connect(self.addr);
        c.handshake();
        c.send_option(OPT_EXPORT_NAME, b"vm1");
        assert_eq!(c.u64(), VOLUME_BYTES);
        let flags = c.u16();
        assert_ne!(flags & TFLAG_HAS_FLAGS, 0);
        c
    }

    /// Stop serving and close the pool; the pool's directory stays.
    fn close(self) -> TempDir {
        let Served {
            dir, pool, server, ..
        } = self;
        server.shutdown();
        // The server's export provider holds the pool: drop it, so closing the pool
        // releases its file.
        drop(server);
        pool.close().expect("close pool");
        dir
    }

    /// Close, reopen the pool and serve it again.
    fn restart(self) -> Served {
        let dir = self.close();
        let pool =
            Pool::open(&dir.0.join("test.pool"), &OpenOptions::default()).expect("reopen pool");
        Served::serve(dir, pool)
    }

    fn stop(self) {
        self.close();
    }
}

/// Bytes that neither dedup nor compress away (xorshift), never all zero.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// The client with a model of the volume's bytes; every answer is checked.
struct Checked {
    c: Client,
    model: Vec<u8>,
    cookie: u64,
}

impl Checked {
    fn next_cookie(&mut self) -> u64 {
        self.cookie += 1;
        self.cookie
    }

    fn write(&mut self, offset: u64, data: &[u8], flags: u16) {
        let cookie = self.next_cookie();
        self.c
            .send_request(flags, CMD_WRITE, cookie, offset, data.len() as u64, data);
        assert_eq!(
            self.c.simple_reply(),
            (0, cookie),
            "write of {} bytes at {offset}",
            data.len()
        );
        self.model[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }

    /// Trim or write-zeroes: both leave exactly their bytes reading as zeros.
    fn zero(&mut self, kind: u16, offset: u64, len: u64) {
        let cookie = self.next_cookie();
        self.c.send_request(0, kind, cookie, offset, len, &[]);
        assert_eq!(
            self.c.simple_reply(),
            (0, cookie),
            "{} of {len} bytes at {offset}",
            command_name(kind)
        );
        self.model[offset as usize..(offset + len) as usize].fill(0);
    }

    fn read(&mut self, offset: u64, len: u64) -> Vec<u8> {
        let cookie = self.next_cookie();
        self.c.send_request(0, CMD_READ, cookie, offset, len, &[]);
        assert_eq!(
            self.c.simple_reply(),
            (0, cookie),
            "read of {len} bytes at {offset}"
        );
        self.c.read_bytes(len as usize)
    }

    /// Read `[offset, offset+len)` and compare every byte with the model.
    fn check(&mut self, offset: u64, len: u64) {
        let got = self.read(offset, len);
        let want = &self.model[offset as usize..(offset + len) as usize];
        if let Some(i) = got.iter().zip(want).position(|(g, w)| g != w) {
            panic!(
                "read of {len} bytes at {offset}: byte {} (offset {}) is {:#04x}, the model has {:#04x}",
                i,
                offset + i as u64,
                got[i],
                want[i]
            );
        }
    }

    /// Check a request's bytes and a block on either side (what a read-modify-write
    /// of a partial block must keep).
    fn check_around(&mut self, offset: u64, len: u64) {
        let from = offset.saturating_sub(BLOCK);
        let to = (offset + len + BLOCK).min(VOLUME_BYTES);
        self.check(from, to - from);
    }
}

#[test]
fn export_name_client_reads_and_writes_at_any_byte() {
    let served = Served::start("bytes");
    let mut t = Checked {
        c: served.export_name_client(),
        model: vec![0; VOLUME_BYTES as usize],
        cookie: 0,
    };
    let mib = 1u64 << 20;
    // (offset, length) of writes: one byte, 511 bytes, 4095 across a block
    // boundary, 1 MiB + 14 at offset 1, the export's last byte, and a few more
    // that start and end mid-block.
    let writes = [
        (0, 1),
        (4097, 1),
        (3, 511),
        (4095, 4095),
        (1, mib + 14),
        (VOLUME_BYTES - 1, 1),
        (2 * mib + 4093, 3 * BLOCK + 7),
        (3 * mib - 100, 200),
    ];
    for (i, &(offset, len)) in writes.iter().enumerate() {
        let data = noise(i as u64 + 1, len as usize);
        t.write(offset, &data, 0);
        t.check_around(offset, len);
    }
    // A FUA write of a partial block.
    t.write(5 * BLOCK + 17, &noise(99, 33), CMD_FLAG_FUA);
    t.check_around(5 * BLOCK + 17, 33);
    // The read the issue names: 1 MiB + 14 at offset 1, every byte checked.
    t.check(1, mib + 14);
    // Write-zeroes zeroes exactly its bytes; so does a trim of a partial block,
    // and a trim with partial ends frees the whole blocks between them.
    t.zero(CMD_WRITE_ZEROES, 100_003, 10);
    t.check_around(100_003, 10);
    t.zero(CMD_TRIM, 5000, 100);
    t.check_around(5000, 100);
    t.zero(CMD_TRIM, 8191, 3 * BLOCK + 2);
    t.check_around(8191, 3 * BLOCK + 2);
    t.zero(CMD_WRITE_ZEROES, 2 * mib + 1, 2 * BLOCK);
    t.check_around(2 * mib + 1, 2 * BLOCK);
    // CACHE at an odd place is a hint, answered with success.
    let cookie = t.next_cookie();
    t.c.send_request(0, CMD_CACHE, cookie, 12345, 6789, &[]);
    assert_eq!(t.c.simple_reply(), (0, cookie));
    // The end is still the end; a refused read sends no payload (the next reply
    // would be misread otherwise), a refused write's payload is consumed.
    let cookie = t.next_cookie();
    t.c.send_request(0, CMD_READ, cookie, VOLUME_BYTES - 1, 2, &[]);
    assert_eq!(t.c.simple_reply(), (EINVAL, cookie));
    let cookie = t.next_cookie();
    t.c.send_request(0, CMD_WRITE, cookie, VOLUME_BYTES - 2, 3, &[7; 3]);
    assert_eq!(t.c.simple_reply(), (ENOSPC, cookie));
    // Everything, once more, byte for byte.
    t.check(0, VOLUME_BYTES);
    t.c.disconnect();

    // The same bytes from a fresh connection after the pool is closed and reopened.
    let model = std::mem::take(&mut t.model);
    let served = served.restart();
    let mut t = Checked {
        c: served.export_name_client(),
        model,
        cookie: 0,
    };
    t.check(0, VOLUME_BYTES);
    t.c.disconnect();
    served.stop();
}

#[test]
fn concurrent_unaligned_writes_into_one_block_both_land() {
    let served = Served::start("race");
    let mut a = served.export_name_client();
    let mut b = served.export_name_client();
    let mut check = served.export_name_client();
    let block_at = 7 * BLOCK;
    for round in 0..300u64 {
        // Disjoint bytes of one block, in flight at once: on two connections, and
        // back to back on one (whose requests run on different workers).
        let (x, y) = (noise(2 * round + 1, 700), noise(2 * round + 2, 1500));
        let (xa, ya) = (block_at + 1 + round % 7, block_at + 2000 + round % 11);
        a.send_request(0, CMD_WRITE, 1, xa, 700, &x);
        b.send_request(0, CMD_WRITE, 2, ya, 1500, &y);
        assert_eq!(a.simple_reply(), (0, 1));
        assert_eq!(b.simple_reply(), (0, 2));
        let (z, w) = (noise(round + 1000, 9), noise(round + 2000, 100));
        let (za, wa) = (block_at + 800, block_at + 3900);
        a.send_request(0, CMD_WRITE, 3, za, 9, &z);
        a.send_request(0, CMD_WRITE, 4, wa, 100, &w);
        let mut cookies = [a.simple_reply().1, a.simple_reply().1];
        cookies.sort_unstable();
        assert_eq!(cookies, [3, 4]);

        check.send_request(0, CMD_READ, 5, block_at, 2 * BLOCK, &[]);
        assert_eq!(check.simple_reply(), (0, 5));
        let got = check.read_bytes(2 * BLOCK as usize);
        let at = |o: u64| (o - block_at) as usize;
        assert!(
            got[at(xa)..at(xa) + 700] == x[..],
            "round {round}: first write lost"
        );
        assert!(
            got[at(ya)..at(ya) + 1500] == y[..],
            "round {round}: second write lost"
        );
        assert!(
            got[at(za)..at(za) + 9] == z[..],
            "round {round}: third write lost"
        );
        assert!(
            got[at(wa)..at(wa) + 100] == w[..],
            "round {round}: fourth write lost"
        );

        // A partial write racing a trim of its whole block ends in one of the two
        // orders: the trim's zeros with the write's bytes, or all zeros.
        a.send_request(0, CMD_WRITE, 6, block_at + 10, 20, &x[..20]);
        b.send_request(0, CMD_TRIM, 7, block_at, BLOCK, &[]);
        assert_eq!(a.simple_reply(), (0, 6));
        assert_eq!(b.simple_reply(), (0, 7));
        check.send_request(0, CMD_READ, 8, block_at, BLOCK, &[]);
        assert_eq!(check.simple_reply(), (0, 8));
        let got = check.read_bytes(BLOCK as usize);
        let write_last = got[10..30] == x[..20];
        let trim_last = got[10..30].iter().all(|&v| v == 0);
        assert!(write_last || trim_last, "round {round}: neither order");
        let rest_zero = got[..10].iter().chain(&got[30..]).all(|&v| v == 0);
        assert!(rest_zero, "round {round}: bytes the trim cleared came back");
    }
    for mut c in [a, b, check] {
        c.disconnect();
    }
    served.stop();
}
