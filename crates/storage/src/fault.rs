//! `FaultStorage`: an in-memory device for tests that can crash and fail.
//!
//! It keeps the *durable* image (what survived the last flush) apart from the
//! writes made since, in order. A crash produces a new durable image: the old one
//! plus a chosen subset of the unflushed writes, each possibly torn at a 512-byte
//! boundary. It can also fail the Nth read, write or flush; after any injected
//! failure it stays failed, as a real device that returned EIO is not trusted again.
//!
//! Images are kept in 4 KiB pages shared copy-on-write ([`Image`], `image.rs`), so
//! copying one costs a pointer per page, not the device's bytes: a crash simulation
//! makes thousands of images of the same pool. A device can also *record* every write and
//! flush that reaches it into an [`IoLog`] shared with other devices; [`LogReplay`]
//! then rebuilds, from one recorded run, the images a crash before any event of the
//! log would have left, without running the workload again.
//!
//! Apart from those, a plan may name an unreadable range (a bad sector): reads
//! touching it fail every time, and nothing else does.
//!
//! **Discards** are modelled as a drive may carry them out: the discarded pages read
//! as zeros at once, and until the next flush a crash may or may not have done the
//! discard, page by page and sector by sector. So a discard is kept, and recorded in
//! the log, as an unflushed *write of zeros* ([`IoEvent::Write`]): every crash mode
//! and every replay treats it as one, and a discarded page that durable state still
//! names reads as zeros after some crash.
//!
//! **Space** can run out: a plan may give the device room for only so many bytes of
//! written pages (a sparse file on a small file system, a thin volume). A write that
//! needs a page past that fails with [`StorageError::NoSpace`], changes nothing, and
//! does not latch the device; a discard gives its pages back; more room can be given
//! at any time ([`FaultStorage::set_space_bytes`]). A device can also **grow**
//! ([`FaultStorage::grow`]), seen by [`Storage::refresh_len`].

use crate::image::{Image, PAGE_BYTES};
use crate::{check_bounds, discard_pages, DiscardOutcome, IoCounters, IoOp, Storage, StorageError};
use parking_lot::Mutex;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// The unit a crash can tear a write at (a disk sector).
const TEAR_BYTES: usize = 512;

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
    /// Lose the write with this index: it returns Ok and never reaches the device
    /// (a drive that acknowledged a write it dropped). Reads go on seeing the old bytes.
    pub lose_write: Option<u64>,
    /// Misdirect the write with this index to the byte offset given: it returns Ok
    /// and lands there instead (a drive that wrote the right bytes at the wrong place).
    pub misdirect_write: Option<(u64, u64)>,
    /// Room for this many bytes of written 4 KiB pages (a full file system under a
    /// sparse file, a full thin pool): a write that needs a page not yet written
    /// past that fails with [`StorageError::NoSpace`] and changes nothing; the
    /// device does not latch, and the same write succeeds once a discard gave pages
    /// back or [`FaultStorage::set_space_bytes`] gave more room. Pages the device
    /// started with count as written when they hold anything but zeros.
    pub space_bytes: Option<u64>,
    /// The device cannot discard: [`Storage::discard`] says
    /// [`DiscardOutcome::Unsupported`] and changes nothing.
    pub discard_unsupported: bool,
    /// One bad sector that reads back wrong: every read covering the byte at
    /// `offset_bytes` returns it with the bits of `mask` flipped (a rotten sector, a
    /// firmware bug), without an error. The bytes held are not changed, and a write
    /// over that byte cures it (a drive remaps a sector on write).
    pub flip_read: Option<FlipRead>,
}

/// A byte a read returns with bits flipped ([`FaultPlan::flip_read`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlipRead {
    /// The byte's offset on the device.
    pub offset_bytes: u64,
    /// The bits flipped (not zero).
    pub mask: u8,
}

/// One event a recording device saw, in the order the devices saw them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoEvent {
    /// A write that returned, or a discard the device took (logged as the write of
    /// zeros a crash may or may not keep; see the module's header).
    Write {
        /// Which device of the log (the number given to [`FaultStorage::record_into`]).
        device: usize,
        /// Where.
        offset_bytes: u64,
        /// What.
        data: Vec<u8>,
    },
    /// A flush that returned.
    Flush {
        /// Which device of the log.
        device: usize,
    },
    /// The device crashed here ([`FaultStorage::crash_in_place`]): what `mode` keeps of
    /// its unflushed writes became durable, and the rest was lost.
    Crash {
        /// Which device of the log.
        device: usize,
        /// Which unflushed writes survived.
        mode: CrashMode,
    },
}

/// Every write and flush that reached a set of recording devices, in order.
///
/// A device appends under its own lock, so the log's order is each device's order,
/// and an event that returned before another was issued comes before it.
#[derive(Default)]
pub struct IoLog {
    events: Mutex<Vec<IoEvent>>,
}

impl IoLog {
    /// An empty log.
    pub fn new() -> Arc<Self> {
        Arc::new(IoLog::default())
    }

    /// Events recorded so far: the log position now.
    pub fn len(&self) -> usize {
        self.events.lock().len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Take the events out, leaving the log empty.
    pub fn take(&self) -> Vec<IoEvent> {
        std::mem::take(&mut *self.events.lock())
    }

    fn push(&self, event: IoEvent) {
        self.events.lock().push(event);
    }
}

/// Apply to `image` what `mode` keeps of `writes` (unflushed writes, in order).
fn apply_survivors<'a>(
    image: &mut Image,
    writes: impl Iterator<Item = (u64, &'a [u8])>,
    mode: CrashMode,
) {
    match mode {
        CrashMode::DropAll => {}
        CrashMode::KeepAll => {
            for (off, data) in writes {
                image.write(data, off);
            }
        }
        CrashMode::Random(seed) => {
            let mut rng = StdRng::seed_from_u64(seed);
            for (off, data) in writes {
                match rng.gen_range(0..4) {
                    0 => {}
                    1 => {
                        // Torn: a random subset of its 512-byte sectors lands.
                        for (i, sector) in data.chunks(TEAR_BYTES).enumerate() {
                            if rng.gen_bool(0.5) {
                                image.write(sector, off + (i * TEAR_BYTES) as u64);
                            }
                        }
                    }
                    _ => image.write(data, off),
                }
            }
        }
    }
}

/// The writes at `positions` of `events`, as (offset, bytes).
fn writes_at<'a>(
    events: &'a [IoEvent],
    positions: &'a [usize],
) -> impl Iterator<Item = (u64, &'a [u8])> + 'a {
    positions.iter().filter_map(|&w| match events.get(w) {
        Some(IoEvent::Write {
            offset_bytes, data, ..
        }) => Some((*offset_bytes, data.as_slice())),
        _ => None,
    })
}

/// Rebuilds, from the images devices started with and the log of what reached them,
/// the images a crash just before any event of the log would leave.
///
/// A crash *at* position `n` means events `0..n` happened and no later one: each
/// device keeps what its last flush before `n` made durable, plus what the crash
/// mode keeps of its writes since. Positions are visited in increasing order
/// ([`LogReplay::seek`]), so each flush is applied once.
pub struct LogReplay<'a> {
    events: &'a [IoEvent],
    durable: Vec<Image>,
    /// Per device, the log positions of its writes since its last flush.
    unflushed: Vec<Vec<usize>>,
    at: usize,
}

impl<'a> LogReplay<'a> {
    /// Start at position 0 with device `d` holding `bases[d]`.
    pub fn new(bases: Vec<Image>, events: &'a [IoEvent]) -> Self {
        let devices = bases.len();
        LogReplay {
            events,
            durable: bases,
            unflushed: vec![Vec::new(); devices],
            at: 0,
        }
    }

    /// Move to position `at` (not before the current one, not past the log's end).
    pub fn seek(&mut self, at: usize) {
        assert!(at >= self.at, "a replay only moves forward");
        assert!(at <= self.events.len(), "position {at} is past the log");
        let events = self.events.get(self.at..at).unwrap_or_default();
        for (index, event) in (self.at..at).zip(events) {
            let (device, survive) = match event {
                IoEvent::Write { device, .. } => (*device, None),
                IoEvent::Flush { device } => (*device, Some(CrashMode::KeepAll)),
                IoEvent::Crash { device, mode } => (*device, Some(*mode)),
            };
            let (Some(unflushed), Some(durable)) =
                (self.unflushed.get_mut(device), self.durable.get_mut(device))
            else {
                panic!("log event {index} names device {device}, which the replay lacks");
            };
            match survive {
                None => unflushed.push(index),
                Some(mode) => {
                    let writes = std::mem::take(unflushed);
                    apply_survivors(durable, writes_at(self.events, &writes), mode);
                }
            }
        }
        self.at = at;
    }

    /// The current position.
    pub fn position(&self) -> usize {
        self.at
    }

    /// Writes not yet flushed at the current position, on all devices.
    pub fn unflushed_writes(&self) -> usize {
        self.unflushed.iter().map(Vec::len).sum()
    }

    /// The images of every device after a crash at the current position. Under
    /// `CrashMode::Random(seed)` each device draws from its own seed (`seed + d`).
    pub fn crash_images(&self, mode: CrashMode) -> Vec<Image> {
        self.durable
            .iter()
            .zip(&self.unflushed)
            .enumerate()
            .map(|(d, (durable, writes))| {
                let mut image = durable.clone();
                let writes = writes_at(self.events, writes);
                let mode = match mode {
                    CrashMode::Random(seed) => CrashMode::Random(seed.wrapping_add(d as u64)),
                    other => other,
                };
                apply_survivors(&mut image, writes, mode);
                image
            })
            .collect()
    }
}

struct State {
    durable: Image,
    live: Image,
    unflushed: Vec<(u64, Vec<u8>)>,
    /// Per 4 KiB page of the device, whether it was written (and not discarded
    /// since): what counts against [`FaultPlan::space_bytes`].
    written: Vec<bool>,
    /// How many of `written` are true.
    written_pages: u64,
    /// Whether discards are on ([`Storage::set_discard_enabled`]).
    discard_enabled: bool,
    /// The device's length now ([`FaultStorage::grow`]); reported once
    /// [`Storage::refresh_len`] measures it.
    device_bytes: u64,
    plan: FaultPlan,
    writes_seen: u64,
    flushes_seen: u64,
    reads_seen: u64,
    failed: bool,
}

/// An in-memory device that can crash and fail on demand.
pub struct FaultStorage {
    name: String,
    /// As last measured (at creation, or by [`Storage::refresh_len`]).
    len_bytes: AtomicU64,
    state: Mutex<State>,
    counters: IoCounters,
    /// Where writes and flushes are recorded, and this device's number there.
    log: Option<(Arc<IoLog>, usize)>,
}

impl FaultStorage {
    /// A zero-filled device of `len_bytes`.
    pub fn new(name: &str, len_bytes: u64) -> Self {
        Self::from_pages(name, Image::zeroed(len_bytes))
    }

    /// A device whose durable content is `image`.
    pub fn from_image(name: &str, image: Vec<u8>) -> Self {
        Self::from_pages(name, Image::from_bytes(&image))
    }

    /// A device whose durable content is `image` (shared, not copied).
    pub fn from_pages(name: &str, image: Image) -> Self {
        let written: Vec<bool> = image.allocated_pages();
        FaultStorage {
            name: name.to_string(),
            len_bytes: AtomicU64::new(image.len_bytes()),
            state: Mutex::new(State {
                written_pages: written.iter().filter(|w| **w).count() as u64,
                written,
                discard_enabled: true,
                device_bytes: image.len_bytes(),
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
            log: None,
        }
    }

    /// Record every write and flush that returns into `log`, as device `device`.
    pub fn record_into(mut self, log: Arc<IoLog>, device: usize) -> Self {
        self.log = Some((log, device));
        self
    }

    /// Install a fault plan; its counts start now.
    pub fn set_plan(&self, plan: FaultPlan) {
        let mut s = self.state.lock();
        s.plan = plan;
        s.writes_seen = 0;
        s.flushes_seen = 0;
        s.reads_seen = 0;
    }

    /// Give the device room for `space_bytes` of written pages (`None`: no limit), as
    /// [`FaultPlan::space_bytes`] does, leaving the rest of the plan and its counts
    /// alone: a file system whose space was freed, a thin pool extended.
    pub fn set_space_bytes(&self, space_bytes: Option<u64>) {
        self.state.lock().plan.space_bytes = space_bytes;
    }

    /// Bytes of written pages the device holds now (4 KiB each): a sparse file's
    /// allocated size. Discards lower it.
    pub fn written_bytes(&self) -> u64 {
        self.state.lock().written_pages * PAGE_BYTES as u64
    }

    /// The device grows to `len_bytes` (not shorter than it is), as a file extended
    /// with `truncate` or a grown logical volume: the new bytes are zeros, durable
    /// at once. Requests are checked against the old length until
    /// [`Storage::refresh_len`] measures the new one. A log replay does not see the
    /// growth: give it base images of the grown length.
    pub fn grow(&self, len_bytes: u64) {
        let mut s = self.state.lock();
        assert!(len_bytes >= s.device_bytes, "a device only grows");
        s.device_bytes = len_bytes;
        s.durable.grow(len_bytes);
        s.live.grow(len_bytes);
        let pages = s.live.page_count();
        s.written.resize(pages, false);
    }

    /// The image a crash would leave now, under `mode`.
    pub fn crash_image(&self, mode: CrashMode) -> Vec<u8> {
        self.crash_pages(mode).to_bytes()
    }

    /// The image a crash would leave now, under `mode`, as shared pages.
    pub fn crash_pages(&self, mode: CrashMode) -> Image {
        let s = self.state.lock();
        let mut image = s.durable.clone();
        let writes = s
            .unflushed
            .iter()
            .map(|(off, data)| (*off, data.as_slice()));
        apply_survivors(&mut image, writes, mode);
        image
    }

    /// Crash now, and come back: the device holds what `mode` keeps of its unflushed
    /// writes (as [`FaultStorage::crash_pages`] makes it), nothing is unflushed, and
    /// injected faults are cleared. Recorded in the log as [`IoEvent::Crash`].
    pub fn crash_in_place(&self, mode: CrashMode) {
        let mut s = self.state.lock();
        let writes = std::mem::take(&mut s.unflushed);
        let mut image = s.durable.clone();
        apply_survivors(
            &mut image,
            writes.iter().map(|(off, data)| (*off, data.as_slice())),
            mode,
        );
        s.written = image.allocated_pages();
        s.written_pages = s.written.iter().filter(|w| **w).count() as u64;
        s.live = image.clone();
        s.durable = image;
        s.plan = FaultPlan::default();
        s.failed = false;
        if let Some((log, device)) = &self.log {
            log.push(IoEvent::Crash {
                device: *device,
                mode,
            });
        }
    }

    /// What a flush has made durable so far.
    pub fn durable_pages(&self) -> Image {
        self.state.lock().durable.clone()
    }

    fn check_bounds(
        &self,
        op: IoOp,
        offset_bytes: u64,
        len_bytes: u64,
    ) -> Result<(), StorageError> {
        let device_bytes = self.len_bytes.load(Relaxed);
        check_bounds(&self.name, op, offset_bytes, len_bytes, device_bytes)
    }

    fn fail(&self, s: &mut State, op: IoOp) -> StorageError {
        s.failed = true;
        StorageError::Injected {
            device: self.name.clone(),
            op,
        }
    }
}

impl Storage for FaultStorage {
    fn read_at(&self, buf: &mut [u8], offset_bytes: u64) -> Result<(), StorageError> {
        self.check_bounds(IoOp::Read, offset_bytes, buf.len() as u64)?;
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
        s.live.read(buf, offset_bytes);
        if let Some(flip) = s.plan.flip_read {
            let at = flip.offset_bytes.checked_sub(offset_bytes);
            if let Some(b) = at.and_then(|a| buf.get_mut(usize::try_from(a).ok()?)) {
                *b ^= flip.mask;
            }
        }
        self.counters.count_read(buf.len());
        Ok(())
    }

    /// Memory never waits: the same as `read_at` (faults included).
    fn read_at_cached(&self, buf: &mut [u8], offset_bytes: u64) -> Result<bool, StorageError> {
        self.read_at(buf, offset_bytes).map(|()| true)
    }

    fn write_at(&self, buf: &[u8], offset_bytes: u64) -> Result<(), StorageError> {
        self.check_bounds(IoOp::Write, offset_bytes, buf.len() as u64)?;
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
        if let Some(flip) = s.plan.flip_read {
            if (offset_bytes..offset_bytes + buf.len() as u64).contains(&flip.offset_bytes) {
                s.plan.flip_read = None;
            }
        }
        let device_bytes = self.len_bytes.load(Relaxed);
        let offset_bytes = match s.plan.misdirect_write {
            Some((i, to)) if i == index && to.saturating_add(buf.len() as u64) <= device_bytes => {
                to
            }
            _ => offset_bytes,
        };
        let pages = pages_of(offset_bytes, buf.len() as u64);
        let new_pages = s
            .written
            .get(pages.clone())
            .map_or(0, |w| w.iter().filter(|w| !**w).count() as u64);
        if let Some(space_bytes) = s.plan.space_bytes {
            if (s.written_pages + new_pages) * PAGE_BYTES as u64 > space_bytes {
                return Err(StorageError::NoSpace {
                    device: self.name.clone(),
                    op: IoOp::Write,
                    offset_bytes,
                    len_bytes: buf.len() as u64,
                    source: std::io::Error::from_raw_os_error(libc::ENOSPC),
                });
            }
        }
        if let Some(written) = s.written.get_mut(pages) {
            written.fill(true);
        }
        s.written_pages += new_pages;
        s.live.write(buf, offset_bytes);
        s.unflushed.push((offset_bytes, buf.to_vec()));
        // Under the device's lock, so the log holds this device's writes in its order.
        if let Some((log, device)) = &self.log {
            log.push(IoEvent::Write {
                device: *device,
                offset_bytes,
                data: buf.to_vec(),
            });
        }
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
            s.durable.write(&data, off);
        }
        if let Some((log, device)) = &self.log {
            log.push(IoEvent::Flush { device: *device });
        }
        self.counters.count_flush();
        Ok(())
    }

    fn discard(&self, offset_bytes: u64, len_bytes: u64) -> Result<DiscardOutcome, StorageError> {
        self.check_bounds(IoOp::Discard, offset_bytes, len_bytes)?;
        let mut s = self.state.lock();
        if s.failed {
            return Err(self.fail(&mut s, IoOp::Discard));
        }
        if !s.discard_enabled {
            return Ok(DiscardOutcome::Disabled);
        }
        if s.plan.discard_unsupported {
            return Ok(DiscardOutcome::Unsupported);
        }
        let Some((offset, len)) = discard_pages(offset_bytes, len_bytes) else {
            return Ok(DiscardOutcome::Discarded);
        };
        let pages = pages_of(offset, len);
        if let Some(written) = s.written.get_mut(pages) {
            let freed = written.iter().filter(|w| **w).count() as u64;
            written.fill(false);
            s.written_pages -= freed;
        }
        s.live.zero(offset, len);
        let zeros = vec![0u8; len as usize];
        // Under the device's lock, as a write: the log keeps this device's order.
        if let Some((log, device)) = &self.log {
            log.push(IoEvent::Write {
                device: *device,
                offset_bytes: offset,
                data: zeros.clone(),
            });
        }
        s.unflushed.push((offset, zeros));
        self.counters.count_discard(len);
        Ok(DiscardOutcome::Discarded)
    }

    fn set_discard_enabled(&self, enabled: bool) {
        self.state.lock().discard_enabled = enabled;
    }

    fn len_bytes(&self) -> u64 {
        self.len_bytes.load(Relaxed)
    }

    fn refresh_len(&self) -> Result<u64, StorageError> {
        let device_bytes = self.state.lock().device_bytes;
        self.len_bytes.store(device_bytes, Relaxed);
        Ok(device_bytes)
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn counters(&self) -> &IoCounters {
        &self.counters
    }
}

/// The 4 KiB pages `[offset_bytes, offset_bytes+len_bytes)` touches, as indices.
fn pages_of(offset_bytes: u64, len_bytes: u64) -> std::ops::Range<usize> {
    let page = PAGE_BYTES as u64;
    let first = offset_bytes / page;
    let end = offset_bytes.saturating_add(len_bytes).div_ceil(page);
    first as usize..end.max(first) as usize
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

    #[test]
    fn a_discard_reads_zeros_and_a_crash_before_the_flush_may_undo_it() {
        let dev = FaultStorage::new("t", 4 * 4096);
        dev.write_at(&[5; 3 * 4096], 0).unwrap();
        dev.flush().unwrap();
        // Rounded inward: only page 1 lies whole inside [100, 100 + 2*4096).
        let outcome = dev.discard(100, 2 * 4096).unwrap();
        assert_eq!(outcome, DiscardOutcome::Discarded);
        let mut buf = vec![0u8; 3 * 4096];
        dev.read_at(&mut buf, 0).unwrap();
        assert!(
            buf[..4096].iter().all(|b| *b == 5),
            "page 0 is outside the whole pages"
        );
        assert!(
            buf[4096..8192].iter().all(|b| *b == 0),
            "the discarded page reads zeros"
        );
        assert!(
            buf[8192..].iter().all(|b| *b == 5),
            "page 2 is outside the whole pages"
        );
        assert_eq!(
            dev.crash_image(CrashMode::DropAll)[4096],
            5,
            "not flushed: undone"
        );
        assert_eq!(dev.crash_image(CrashMode::KeepAll)[4096], 0, "or done");
        for seed in 0..16 {
            let image = dev.crash_image(CrashMode::Random(seed));
            assert!(
                image[4096..8192].iter().all(|b| *b == 0 || *b == 5),
                "seed {seed}"
            );
        }
        dev.flush().unwrap();
        assert_eq!(
            dev.crash_image(CrashMode::DropAll)[4096],
            0,
            "flushed: done"
        );
        let io = dev.counters().snapshot();
        assert_eq!((io.discards, io.discard_bytes), (1, 4096));
        assert_eq!(io.writes, 1, "a discard is not counted as a write");
    }

    #[test]
    fn a_discard_is_logged_as_a_write_of_zeros_and_replayed() {
        let log = IoLog::new();
        let dev = FaultStorage::new("a", 2 * 4096).record_into(log.clone(), 0);
        dev.write_at(&[7; 8192], 0).unwrap();
        dev.flush().unwrap();
        dev.discard(0, 8192).unwrap();
        let events = log.take();
        assert_eq!(
            events.last(),
            Some(&IoEvent::Write {
                device: 0,
                offset_bytes: 0,
                data: vec![0; 8192]
            })
        );
        let mut replay = LogReplay::new(vec![Image::zeroed(2 * 4096)], &events);
        replay.seek(events.len());
        assert_eq!(
            replay.crash_images(CrashMode::DropAll)[0].to_bytes(),
            vec![7; 8192]
        );
        assert_eq!(
            replay.crash_images(CrashMode::KeepAll)[0].to_bytes(),
            vec![0; 8192]
        );
    }

    #[test]
    fn a_device_with_discards_off_or_unsupported_keeps_its_bytes() {
        let dev = FaultStorage::new("t", 4096);
        dev.write_at(&[1; 4096], 0).unwrap();
        dev.set_discard_enabled(false);
        assert_eq!(dev.discard(0, 4096).unwrap(), DiscardOutcome::Disabled);
        dev.set_discard_enabled(true);
        dev.set_plan(FaultPlan {
            discard_unsupported: true,
            ..FaultPlan::default()
        });
        assert_eq!(dev.discard(0, 4096).unwrap(), DiscardOutcome::Unsupported);
        let mut buf = [0u8; 4096];
        dev.read_at(&mut buf, 0).unwrap();
        assert_eq!(buf, [1; 4096]);
        assert_eq!(dev.counters().snapshot().discards, 0);
        assert!(dev.discard(4096, 1).is_err(), "past the end");
    }

    #[test]
    fn a_full_device_refuses_new_pages_until_space_returns() {
        let dev = FaultStorage::new("t", 8 * 4096);
        dev.set_plan(FaultPlan {
            space_bytes: Some(2 * 4096),
            ..FaultPlan::default()
        });
        dev.write_at(&[1; 8192], 0).unwrap();
        let err = dev.write_at(&[2; 512], 2 * 4096).unwrap_err();
        assert!(err.is_no_space(), "{err}");
        dev.write_at(&[3; 512], 4096).unwrap();
        dev.flush().unwrap();
        let mut buf = [9u8; 512];
        dev.read_at(&mut buf, 2 * 4096).unwrap();
        assert_eq!(buf, [0; 512], "the refused write changed nothing");
        // A discard gives a page back, and the write goes through.
        dev.discard(0, 4096).unwrap();
        assert_eq!(dev.written_bytes(), 4096);
        dev.write_at(&[2; 512], 2 * 4096).unwrap();
        assert!(dev.write_at(&[4; 512], 3 * 4096).unwrap_err().is_no_space());
        // More room, as when the host's file system was given space.
        dev.set_space_bytes(None);
        dev.write_at(&[4; 512], 3 * 4096).unwrap();
        dev.flush().unwrap();
        assert_eq!(dev.written_bytes(), 3 * 4096);
    }

    #[test]
    fn a_grown_device_is_seen_after_refresh() {
        let dev = FaultStorage::new("t", 4096);
        dev.write_at(&[1; 4096], 0).unwrap();
        dev.grow(3 * 4096);
        assert_eq!(dev.len_bytes(), 4096, "not measured yet");
        assert!(dev.write_at(&[2; 4096], 4096).is_err(), "past the old end");
        assert_eq!(dev.refresh_len().unwrap(), 3 * 4096);
        dev.write_at(&[2; 4096], 2 * 4096).unwrap();
        let image = dev.crash_image(CrashMode::KeepAll);
        assert_eq!(
            (image.len(), image[0], image[4096], image[8192]),
            (3 * 4096, 1, 0, 2)
        );
    }

    #[test]
    fn a_replayed_log_rebuilds_the_image_a_crash_leaves() {
        // Two devices recording into one log; a crash at each position must leave
        // what the live devices would have left had they crashed there.
        let log = IoLog::new();
        let devs = [
            FaultStorage::new("a", 2 * 4096).record_into(log.clone(), 0),
            FaultStorage::new("b", 4096).record_into(log.clone(), 1),
        ];
        let mut expected = vec![[
            devs[0].crash_pages(CrashMode::KeepAll).to_bytes(),
            devs[1].crash_pages(CrashMode::KeepAll).to_bytes(),
        ]];
        let steps: [(usize, Option<(u64, u8)>); 6] = [
            (0, Some((0, 1))),
            (1, Some((512, 2))),
            (0, None),
            (0, Some((4096, 3))),
            (1, None),
            (1, Some((1024, 4))),
        ];
        let mut durable_expected = vec![[
            devs[0].durable_pages().to_bytes(),
            devs[1].durable_pages().to_bytes(),
        ]];
        for (d, what) in steps {
            match what {
                Some((off, v)) => devs[d].write_at(&[v; 1024], off).unwrap(),
                None => devs[d].flush().unwrap(),
            }
            expected.push([
                devs[0].crash_pages(CrashMode::KeepAll).to_bytes(),
                devs[1].crash_pages(CrashMode::KeepAll).to_bytes(),
            ]);
            durable_expected.push([
                devs[0].durable_pages().to_bytes(),
                devs[1].durable_pages().to_bytes(),
            ]);
        }
        let events = log.take();
        assert_eq!(events.len(), steps.len());
        let bases = vec![Image::zeroed(2 * 4096), Image::zeroed(4096)];
        let mut replay = LogReplay::new(bases, &events);
        for at in 0..=events.len() {
            replay.seek(at);
            let all = replay.crash_images(CrashMode::KeepAll);
            let none = replay.crash_images(CrashMode::DropAll);
            for d in 0..2 {
                assert_eq!(
                    all[d].to_bytes(),
                    expected[at][d],
                    "keep all, position {at}"
                );
                assert_eq!(
                    none[d].to_bytes(),
                    durable_expected[at][d],
                    "drop all, position {at}"
                );
            }
        }
    }

    #[test]
    fn a_replayed_log_follows_a_crash_in_place() {
        let log = IoLog::new();
        let dev = FaultStorage::new("a", 4 * 4096).record_into(log.clone(), 0);
        let mut expected = vec![dev.crash_pages(CrashMode::KeepAll).to_bytes()];
        for round in 0..4u8 {
            for i in 0..4u64 {
                dev.write_at(&[round * 4 + i as u8 + 1; 1536], i * 2048)
                    .unwrap();
                expected.push(dev.crash_pages(CrashMode::KeepAll).to_bytes());
            }
            if round == 1 {
                dev.flush().unwrap();
                expected.push(dev.crash_pages(CrashMode::KeepAll).to_bytes());
            }
            dev.crash_in_place(CrashMode::Random(u64::from(round)));
            expected.push(dev.crash_pages(CrashMode::KeepAll).to_bytes());
        }
        let events = log.take();
        let mut replay = LogReplay::new(vec![Image::zeroed(4 * 4096)], &events);
        for (at, image) in expected.iter().enumerate() {
            replay.seek(at);
            assert!(
                replay.crash_images(CrashMode::KeepAll)[0].to_bytes() == *image,
                "position {at}"
            );
        }
    }
}
