//! Shared helpers for engine tests: pools on in-memory fault-injecting devices, and
//! block generators shaped like fio's buffers.

#![allow(dead_code)]

use fewerbytes_engine::storage::{CrashMode, FaultPlan, FaultStorage, Storage};
use fewerbytes_engine::{CreateOptions, OpenOptions, Pool};
use rand::{rngs::StdRng, Rng, RngCore};
use std::sync::Arc;

pub const BLOCK: usize = 4096;

/// A block of noise of its own for `seed` (xorshift): unique and incompressible,
/// stored whole.
pub fn random_block(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A pool on an in-memory device.
pub struct TestPool {
    pub dev: Arc<FaultStorage>,
    pub meta: Option<Arc<FaultStorage>>,
    pub pool: Option<Arc<Pool>>,
}

pub fn create(bytes: u64, meta_bytes: Option<u64>) -> TestPool {
    create_with(bytes, meta_bytes, &CreateOptions::default())
}

/// A pool on an in-memory device, made with `opts` (its path and sizes unused).
pub fn create_with(bytes: u64, meta_bytes: Option<u64>, opts: &CreateOptions) -> TestPool {
    let dev = Arc::new(FaultStorage::new("data", bytes));
    let meta = meta_bytes.map(|m| Arc::new(FaultStorage::new("meta", m)));
    Pool::format(
        dev.clone() as Arc<dyn Storage>,
        meta.clone().map(|m| m as Arc<dyn Storage>),
        meta.as_ref().map(|_| "meta".to_string()),
        opts,
    )
    .expect("format");
    let mut t = TestPool {
        dev,
        meta,
        pool: None,
    };
    t.open();
    t
}

impl TestPool {
    pub fn open(&mut self) {
        self.open_with(&OpenOptions {
            threads: Some(2),
            ..OpenOptions::default()
        });
    }

    /// Open with `opts` (after a close or a crash).
    pub fn open_with(&mut self, opts: &OpenOptions) {
        let meta = self
            .meta
            .clone()
            .map(|m| (m as Arc<dyn Storage>, "meta".to_string()));
        let pool =
            Pool::open_devices(self.dev.clone() as Arc<dyn Storage>, meta, opts).expect("open");
        self.pool = Some(pool);
    }

    /// Clean close, leaving the pool closed (`open_with` opens it again).
    pub fn close(&mut self) {
        if let Some(p) = self.pool.take() {
            p.close().expect("close");
        }
    }

    pub fn pool(&self) -> &Arc<Pool> {
        self.pool.as_ref().expect("open pool")
    }

    /// Clean close and reopen.
    pub fn reopen(&mut self) {
        if let Some(p) = self.pool.take() {
            p.close().expect("close");
        }
        self.open();
    }

    /// Crash: keep what `mode` keeps of the unflushed writes, reopen from that image.
    pub fn crash(&mut self, mode: CrashMode) {
        self.crash_then_open_with(
            mode,
            &OpenOptions {
                threads: Some(2),
                ..OpenOptions::default()
            },
        );
    }

    /// [`Self::crash`], reopening with `opts`.
    pub fn crash_then_open_with(&mut self, mode: CrashMode, opts: &OpenOptions) {
        let image = self.dev.crash_image(mode);
        let meta_image = self.meta.as_ref().map(|m| m.crash_image(mode));
        // The old pool keeps its own (old) devices. Fail every write and flush on
        // them, so closing it does nothing a crash would not, and free it (abandoned
        // pools held gigabytes across a property test's cases).
        for dev in std::iter::once(&self.dev).chain(self.meta.as_ref()) {
            dev.set_plan(FaultPlan {
                fail_write: Some(0),
                fail_flush: Some(0),
                ..FaultPlan::default()
            });
        }
        drop(self.pool.take());
        self.dev = Arc::new(FaultStorage::from_image("data", image));
        self.meta = meta_image.map(|i| Arc::new(FaultStorage::from_image("meta", i)));
        self.open_with(opts);
    }
}

/// Fill `out` like fio's `buffer_compress_percentage=50`, `buffer_compress_chunk=512`:
/// each 512-byte chunk is half random bytes, half zeros.
pub fn compressible(rng: &mut StdRng, out: &mut [u8]) {
    for chunk in out.chunks_mut(512) {
        let half = chunk.len() / 2;
        rng.fill_bytes(&mut chunk[..half]);
        chunk[half..].fill(0);
    }
}

/// A generator of the seed's mix: 75% duplicates of earlier unique blocks, the rest
/// new blocks, 50% compressible.
pub struct Mix {
    rng: StdRng,
    uniques: Vec<Vec<u8>>,
}

impl Mix {
    pub fn new(seed: u64) -> Self {
        Mix {
            rng: rand::SeedableRng::seed_from_u64(seed),
            uniques: Vec::new(),
        }
    }

    pub fn next_block(&mut self) -> Vec<u8> {
        if !self.uniques.is_empty() && self.rng.gen_range(0..100) < 75 {
            let i = self.rng.gen_range(0..self.uniques.len());
            return self.uniques[i].clone();
        }
        let mut b = vec![0u8; BLOCK];
        compressible(&mut self.rng, &mut b);
        // Keep a bounded set of uniques to duplicate from, as fio's dedupe pool does.
        if self.uniques.len() < 4096 {
            self.uniques.push(b.clone());
        } else {
            let i = self.rng.gen_range(0..self.uniques.len());
            self.uniques[i] = b.clone();
        }
        b
    }
}

/// The valid super block copy with the highest generation among the first two blocks
/// of `image` (what an open takes).
pub fn newest_super_block(image: &[u8]) -> fewerbytes_format::superblock::SuperBlock {
    [0, 1]
        .iter()
        .filter_map(|c| {
            let block = image.get(c * BLOCK..(c + 1) * BLOCK)?;
            fewerbytes_format::superblock::SuperBlock::decode(block).ok()
        })
        .max_by_key(|sb| sb.generation)
        .expect("a valid super block copy")
}

/// Write blocks `first..first + count` of `volume` with `random_block(seed + i)`,
/// then flush.
pub fn write_blocks(pool: &Arc<Pool>, volume: &str, first: u64, count: u64, seed: u64) {
    let vol = pool.open_volume(volume).expect("volume");
    for i in 0..count {
        vol.write((first + i) * BLOCK as u64, &random_block(seed + i), false)
            .expect("write");
    }
    vol.flush().expect("flush");
}

/// Every byte of `volume`.
pub fn read_all(pool: &Arc<Pool>, volume: &str) -> Vec<u8> {
    let vol = pool.open_volume(volume).expect("volume");
    let mut bytes = vec![0u8; vol.size_bytes() as usize];
    vol.read(0, &mut bytes).expect("read");
    bytes
}

/// Start a scrub of `pool` (no rate limit) and wait for it to end (no timing
/// asserted: it always ends); its report.
pub fn scrub_to_end(pool: &Pool) -> fewerbytes_engine::ScrubStatus {
    pool.scrub_start(0).expect("a scrub starts");
    loop {
        let s = pool.scrub_status();
        if s.state == fewerbytes_engine::ScrubState::Done {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
