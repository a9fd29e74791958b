//! A seeded simulation: several connections, each in a different reply mode, send
//! pipelined batches of random writes, reads, trims, zeroes and block-status
//! queries over their own region, and every answer is checked against a model
//! (a byte array per region). A failure prints the seed; `NBD_SIM_SEED=N` replays it.

mod common;

use common::*;
use fewerbytes_nbd::protocol::*;
use std::collections::HashMap;

const BLOCK: u64 = 4096;
const REGION_BLOCKS: u64 = 64;
const BATCHES: usize = 40;
const BATCH_MAX: usize = 24;

/// splitmix64: small, seedable, good enough to pick requests.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Simple,
    Structured,
    Extended,
}

enum Expect {
    Ok,
    Read(Vec<u8>),
    /// Per 4 KiB block of the range: holds nonzero data.
    Status(Vec<bool>),
}

fn client(t: &TestServer, mode: Mode) -> Client {
    let mut c = t.connect();
    c.handshake();
    match mode {
        Mode::Simple => {}
        Mode::Structured => c.option_ack(OPT_STRUCTURED_REPLY),
        Mode::Extended => c.option_ack(OPT_EXTENDED_HEADERS),
    }
    if mode != Mode::Simple {
        let (ctx, kind) = c.meta_context(OPT_SET_META_CONTEXT, "a", &["base:allocation"]);
        assert_eq!((ctx.len(), kind), (1, REP_ACK));
    }
    c.go("a", &[INFO_BLOCK_SIZE]).expect("GO");
    c.extended = mode == Mode::Extended;
    c
}

trait ChunksFor {
    fn chunks_for(&mut self, cookie: u64) -> Vec<Chunk>;
}

impl ChunksFor for Client {
    fn chunks_for(&mut self, cookie: u64) -> Vec<Chunk> {
        let chunks = self.chunks();
        assert!(chunks.iter().all(|c| c.cookie == cookie));
        chunks
    }
}

fn run_connection(t: &TestServer, mode: Mode, region: u64, seed: u64) {
    let mut rng = Rng(seed);
    let mut c = client(t, mode);
    let base = region * REGION_BLOCKS * BLOCK;
    let mut model = vec![0u8; (REGION_BLOCKS * BLOCK) as usize];
    let mut cookie = 1u64;
    for _ in 0..BATCHES {
        // Requests of one batch touch distinct blocks, so their order does not matter.
        let mut used = vec![false; REGION_BLOCKS as usize];
        let mut pending: HashMap<u64, (u16, u64, usize, Expect)> = HashMap::new();
        let mut sent = Vec::new();
        let mut next_model = model.clone();
        for _ in 0..1 + rng.below(BATCH_MAX as u64) {
            let first = rng.below(REGION_BLOCKS);
            let blocks = 1 + rng.below(4).min(REGION_BLOCKS - first - 1);
            if (first..first + blocks).any(|b| used[b as usize]) {
                continue;
            }
            (first..first + blocks).for_each(|b| used[b as usize] = true);
            // Sector-granular edges inside the blocks, for some requests.
            let lead = if rng.below(4) == 0 {
                rng.below(8) * 512
            } else {
                0
            };
            let offset = first * BLOCK + lead;
            let len = blocks * BLOCK - lead;
            let range = offset as usize..(offset + len) as usize;
            let kinds: &[u16] = if mode == Mode::Simple {
                &[CMD_WRITE, CMD_READ, CMD_TRIM, CMD_WRITE_ZEROES]
            } else {
                &[
                    CMD_WRITE,
                    CMD_READ,
                    CMD_TRIM,
                    CMD_WRITE_ZEROES,
                    CMD_BLOCK_STATUS,
                ]
            };
            let kind = kinds[rng.below(kinds.len() as u64) as usize];
            let mut payload = Vec::new();
            let expect = match kind {
                CMD_WRITE => {
                    let fill = (rng.below(4) as u8) * 60; // sometimes all zeros
                    payload = (0..len)
                        .map(|i| fill.wrapping_add((i % 7) as u8) & fill)
                        .collect();
                    next_model[range.clone()].copy_from_slice(&payload);
                    Expect::Ok
                }
                CMD_READ => Expect::Read(model[range.clone()].to_vec()),
                CMD_TRIM | CMD_WRITE_ZEROES => {
                    next_model[range.clone()].fill(0);
                    Expect::Ok
                }
                _ => {
                    // Status at block granularity: only whole-block queries.
                    if lead != 0 {
                        continue;
                    }
                    Expect::Status(
                        model[range.clone()]
                            .chunks(BLOCK as usize)
                            .map(|b| b.iter().any(|&x| x != 0))
                            .collect(),
                    )
                }
            };
            let flags = if kind == CMD_WRITE && mode == Mode::Extended {
                CMD_FLAG_PAYLOAD_LEN
            } else {
                0
            };
            c.send_request(flags, kind, cookie, base + offset, len, &payload);
            pending.insert(cookie, (kind, base + offset, len as usize, expect));
            sent.push(cookie);
            cookie += 1;
        }
        for _ in 0..sent.len() {
            let got_cookie;
            if mode == Mode::Simple {
                let (error, ck) = c.simple_reply();
                assert_eq!(error, 0, "seed {seed}: cookie {ck}");
                got_cookie = ck;
                let (_, _, len, expect) = pending.remove(&ck).expect("known cookie");
                if let Expect::Read(want) = expect {
                    assert_eq!(c.read_bytes(len), want, "seed {seed}: read {ck}");
                }
            } else {
                // The first chunk names the request; the rest of its reply follows.
                let first = c.reply_as_chunk();
                got_cookie = first.cookie;
                let (kind, offset, len, expect) =
                    pending.remove(&got_cookie).expect("known cookie");
                let mut chunks = vec![first.clone()];
                if first.flags & REPLY_FLAG_DONE == 0 {
                    chunks.extend(c.chunks_for(got_cookie));
                }
                assert!(
                    chunks.iter().all(|ch| ch.kind & (1 << 15) == 0),
                    "seed {seed}: error reply {chunks:?}"
                );
                match expect {
                    Expect::Ok => {
                        assert!(kind != CMD_READ);
                    }
                    Expect::Read(want) => {
                        let mut out = vec![0xeeu8; len];
                        let mut covered = 0;
                        for ch in &chunks {
                            let start = u64::from_be_bytes(ch.payload[0..8].try_into().unwrap());
                            let at = (start - offset) as usize;
                            if ch.kind == REPLY_TYPE_OFFSET_DATA {
                                let data = &ch.payload[8..];
                                out[at..at + data.len()].copy_from_slice(data);
                                covered += data.len();
                            } else {
                                assert_eq!(ch.kind, REPLY_TYPE_OFFSET_HOLE);
                                let n = u32::from_be_bytes(ch.payload[8..12].try_into().unwrap())
                                    as usize;
                                out[at..at + n].fill(0);
                                covered += n;
                            }
                        }
                        assert_eq!(covered, len, "seed {seed}");
                        assert_eq!(out, want, "seed {seed}: read {got_cookie}");
                    }
                    Expect::Status(want) => {
                        let p = &chunks[0].payload;
                        let descs: Vec<(u64, bool)> = if mode == Mode::Extended {
                            p[8..]
                                .chunks(16)
                                .map(|d| {
                                    (
                                        u64::from_be_bytes(d[0..8].try_into().unwrap()),
                                        u64::from_be_bytes(d[8..16].try_into().unwrap()) == 0,
                                    )
                                })
                                .collect()
                        } else {
                            p[4..]
                                .chunks(8)
                                .map(|d| {
                                    (
                                        u64::from(u32::from_be_bytes(d[0..4].try_into().unwrap())),
                                        u32::from_be_bytes(d[4..8].try_into().unwrap()) == 0,
                                    )
                                })
                                .collect()
                        };
                        let mut got = Vec::new();
                        for (n, data) in descs {
                            assert_eq!(n % BLOCK, 0, "seed {seed}");
                            got.extend(std::iter::repeat_n(data, (n / BLOCK) as usize));
                        }
                        assert_eq!(got, want, "seed {seed}: status {got_cookie}");
                    }
                }
            }
            let _ = got_cookie;
        }
        model = next_model;
    }
    c.disconnect();
    assert_eq!(
        t.a.contents(base as usize, model.len()),
        model,
        "seed {seed}: final contents"
    );
}

#[test]
fn seeded_random_io_matches_a_model() {
    let seed = std::env::var("NBD_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("simulation seed {seed} (replay with NBD_SIM_SEED={seed})");
    let t = TestServer::start();
    assert!(EXPORT_BYTES as u64 >= 6 * REGION_BLOCKS * BLOCK);
    std::thread::scope(|s| {
        for (region, mode) in [
            Mode::Simple,
            Mode::Structured,
            Mode::Extended,
            Mode::Simple,
            Mode::Structured,
            Mode::Extended,
        ]
        .into_iter()
        .enumerate()
        {
            let t = &t;
            let seed = seed.wrapping_add(region as u64);
            s.spawn(move || run_connection(t, mode, region as u64, seed));
        }
    });
    t.wait_idle();
}
