//! `FaultStorage`: an in-memory device for tests that can crash and fail.
//!
//! It keeps the *durable* image (what survived the last flush) apart from the
//! writes made since, in order. A crash produces a new durable image: the old one
//! plus a chosen subset of the unflushed writes, each possibly torn at a 512-byte
//! boundary. It can also fail the Nth read, write or flush; after any injected
//! failure it stays failed, as a real device that returned EIO is not trusted again.

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
    /// Lose the write with this index: it returns Ok and never reaches the device
    /// (a drive that acknowledged a write it dropped). Reads go on seeing the old bytes.
    pub lose_write: Option<u64>,
    /// Misdirect the write with this index to the byte offset given: it returns Ok
    /// and lands there instead (a drive that wrote the right bytes at the wrong place).
    pub misdirect_write: Option<(u64, u64)>,
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
        if s.plan.lose_write == Some(index) {
            self.counters.count_write(buf.len());
            return Ok(());
        }
        let offset_bytes = match s.plan.misdirect_write {
            Some((i, to))
                if i == index && to.saturating_add(buf.len() as u64) <= self.len_bytes =>
            {
                to
            }
            _ => offset_bytes,
        };
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
    fn a_lost_write_succeeds_and_changes_nothing() {
        let dev = FaultStorage::new("t", 8192);
        dev.set_plan(FaultPlan {
            lose_write: Some(1),
            ..Default::default()
        });
        dev.write_at(&[1; 512], 0).unwrap();
        dev.write_at(&[2; 512], 0).unwrap();
        dev.flush().unwrap();
        let mut buf = [0u8; 512];
        dev.read_at(&mut buf, 0).unwrap();
        assert_eq!(buf, [1; 512]);
        assert_eq!(dev.crash_image(CrashMode::DropAll)[0], 1);
    }

    #[test]
    fn a_misdirected_write_lands_elsewhere() {
        let dev = FaultStorage::new("t", 8192);
        dev.set_plan(FaultPlan {
            misdirect_write: Some((0, 4096)),
            ..Default::default()
        });
        dev.write_at(&[3; 512], 0).unwrap();
        dev.flush().unwrap();
        let image = dev.crash_image(CrashMode::DropAll);
        assert_eq!((image[0], image[4096]), (0, 3));
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
}
