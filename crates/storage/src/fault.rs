//! `FaultStorage`: an in-memory device for tests that can crash and fail.
//!
//! It keeps the *durable* image (what survived the last flush) apart from the
//! writes made since, in order. A crash produces a new durable image: the old one
//! plus a chosen subset of the unflushed writes, each possibly torn at a 512-byte
//! boundary. It can also fail the Nth read, write or flush; after any injected
//! failure it stays failed, as a real device that returned EIO is not trusted again.
//! Apart from those, a plan may name an unreadable range (a bad sector): reads
//! touching it fail every time, and nothing else does.

use crate::{check_bounds, IoCounters, IoOp, Storage, StorageError};
use parking_lot::Mutex;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// Which unflushed writes survive a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashMode {
    /// None of them: the device holds exactly what the last flush made durable.
    DropAll,
    /// All of them, in order.
    KeepAll,
    /// A random subset, each write possibly torn at a 512-byte boundary (seeded).
    Random(u64),
}

/// When to fail.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Fail the write with this 0-based index (counted from the plan's installation).
    pub fail_write: Option<u64>,
    /// Fail the flush with this index.
    pub fail_flush: Option<u64>,
    /// Fail the read with this index.
    pub fail_read: Option<u64>,
    /// `(offset_bytes, len_bytes)`: every read touching these bytes fails, without
    /// latching the device (a bad sector; other reads, writes and flushes go on).
    pub unreadable: Option<(u64, u64)>,
}

struct State {
    durable: Vec<u8>,
    live: Vec<u8>,
    unflushed: Vec<(u64, Vec<u8>)>,
    plan: FaultPlan,
    writes_seen: u64,
    flushes_seen: u64,
    reads_seen: u64,
    failed: bool,
}

/// An in-memory device that can crash and fail on demand.
pub struct FaultStorage {
    name: String,
    len_bytes: u64,
    state: Mutex<State>,
    counters: IoCounters,
}

impl FaultStorage {
    /// A zero-filled device of `len_bytes`.
    pub fn new(name: &str, len_bytes: u64) -> Self {
        Self::from_image(name, vec![0; len_bytes as usize])
    }

    /// A device whose durable content is `image`.
    pub fn from_image(name: &str, image: Vec<u8>) -> Self {
        FaultStorage {
            name: name.to_string(),
            len_bytes: image.len() as u64,
            state: Mutex::new(State {
                live: image.clone(),
                durable: image,
                unflushed: Vec::new(),
                plan: FaultPlan::default(),
                writes_seen: 0,
                flushes_seen: 0,
                reads_seen: 0,
                failed: false,
            }),
            counters: IoCounters::default(),
        }
    }

    /// Install a fault plan; its counts start now.
    pub fn set_plan(&self, plan: FaultPlan) {
        let mut s = self.state.lock();
        s.plan = plan;
        s.writes_seen = 0;
        s.flushes_seen = 0;
        s.reads_seen = 0;
    }

    /// The image a crash would leave now, under `mode`.
    pub fn crash_image(&self, mode: CrashMode) -> Vec<u8> {
        let s = self.state.lock();
        let mut image = s.durable.clone();
        match mode {
            CrashMode::DropAll => {}
            CrashMode::KeepAll => {
                for (off, data) in &s.unflushed {
                    apply(&mut image, *off, data);
                }
            }
            CrashMode::Random(seed) => {
                let mut rng = StdRng::seed_from_u64(seed);
                for (off, data) in &s.unflushed {
                    match rng.gen_range(0..4) {
                        0 => {}
                        1 => {
                            // Torn: a random subset of its 512-byte sectors lands.
                            for (i, sector) in data.chunks(512).enumerate() {
                                if rng.gen_bool(0.5) {
                                    apply(&mut image, off + (i as u64) * 512, sector);
                                }
                            }
                        }
                        _ => apply(&mut image, *off, data),
                    }
                }
            }
        }
        image
    }

    fn fail(&self, s: &mut State, op: IoOp) -> StorageError {
        s.failed = true;
        StorageError::Injected {
            device: self.name.clone(),
            op,
        }
    }
}

fn apply(image: &mut [u8], off: u64, data: &[u8]) {
    let start = off as usize;
    if let Some(dst) = image.get_mut(start..start + data.len()) {
        dst.copy_from_slice(data);
    }
}

impl Storage for FaultStorage {
    fn read_at(&self, buf: &mut [u8], offset_bytes: u64) -> Result<(), StorageError> {
        check_bounds(
            &self.name,
            IoOp::Read,
            offset_bytes,
            buf.len() as u64,
            self.len_bytes,
        )?;
        let mut s = self.state.lock();
        let index = s.reads_seen;
        s.reads_seen += 1;
        if s.failed || s.plan.fail_read == Some(index) {
            return Err(self.fail(&mut s, IoOp::Read));
        }
        if let Some((bad_offset, bad_len)) = s.plan.unreadable {
            let end = offset_bytes + buf.len() as u64;
            if offset_bytes < bad_offset + bad_len && bad_offset < end {
                return Err(StorageError::Injected {
                    device: self.name.clone(),
                    op: IoOp::Read,
                });
            }
        }
        let start = offset_bytes as usize;
        if let Some(src) = s.live.get(start..start + buf.len()) {
            buf.copy_from_slice(src);
        }
        self.counters.count_read(buf.len());
        Ok(())
    }

    /// Memory never waits: the same as `read_at` (faults included).
    fn read_at_cached(&self, buf: &mut [u8], offset_bytes: u64) -> Result<bool, StorageError> {
        self.read_at(buf, offset_bytes).map(|()| true)
    }

    fn write_at(&self, buf: &[u8], offset_bytes: u64) -> Result<(), StorageError> {
        check_bounds(
            &self.name,
            IoOp::Write,
            offset_bytes,
            buf.len() as u64,
            self.len_bytes,
        )?;
        let mut s = self.state.lock();
        let index = s.writes_seen;
        s.writes_seen += 1;
        if s.failed || s.plan.fail_write == Some(index) {
            return Err(self.fail(&mut s, IoOp::Write));
        }
        apply(&mut s.live, offset_bytes, buf);
        s.unflushed.push((offset_bytes, buf.to_vec()));
        self.counters.count_write(buf.len());
        Ok(())
    }

    fn flush(&self) -> Result<(), StorageError> {
        let mut s = self.state.lock();
        let index = s.flushes_seen;
        s.flushes_seen += 1;
        if s.failed || s.plan.fail_flush == Some(index) {
            return Err(self.fail(&mut s, IoOp::Flush));
        }
        let writes = std::mem::take(&mut s.unflushed);
        for (off, data) in writes {
            apply(&mut s.durable, off, &data);
        }
        self.counters.count_flush();
        Ok(())
    }

    fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn counters(&self) -> &IoCounters {
        &self.counters
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn crash_drops_unflushed_writes_and_keeps_flushed_ones() {
        let dev = FaultStorage::new("t", 4096);
        dev.write_at(&[1; 512], 0).unwrap();
        dev.flush().unwrap();
        dev.write_at(&[2; 512], 512).unwrap();
        let image = dev.crash_image(CrashMode::DropAll);
        assert_eq!(image[0], 1);
        assert_eq!(image[512], 0);
        let image = dev.crash_image(CrashMode::KeepAll);
        assert_eq!(image[512], 2);
    }

    #[test]
    fn injected_failure_latches() {
        let dev = FaultStorage::new("t", 4096);
        dev.set_plan(FaultPlan {
            fail_write: Some(1),
            ..Default::default()
        });
        dev.write_at(&[1; 512], 0).unwrap();
        assert!(dev.write_at(&[1; 512], 0).is_err());
        assert!(dev.flush().is_err(), "a failed device stays failed");
    }

    #[test]
    fn an_unreadable_range_fails_only_reads_touching_it() {
        let dev = FaultStorage::new("t", 8192);
        dev.set_plan(FaultPlan {
            unreadable: Some((4096, 512)),
            ..Default::default()
        });
        let mut buf = [0u8; 512];
        for _ in 0..2 {
            assert!(dev.read_at(&mut buf, 4096).is_err());
            assert!(dev.read_at(&mut [0u8; 4096], 1024).is_err(), "overlapping");
            dev.read_at(&mut buf, 3584).unwrap();
            dev.read_at(&mut buf, 4608).unwrap();
            dev.write_at(&[1; 512], 4096).unwrap();
            dev.flush().unwrap();
        }
    }
}
