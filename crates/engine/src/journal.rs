//! The recovery journal: mapping changes between checkpoints, committed in groups.
//!
//! Request threads append encoded records to an in-memory tail under one short
//! lock (a memcpy). The commit thread takes the whole tail at once, makes the data
//! it refers to durable, writes it as fresh 512-byte sectors of the ring and
//! syncs: one journal write and two syncs for every request that arrived meanwhile
//! (group commit). A flush waits until its record number is durable.
//!
//! Space: every request reserves the bytes it may append before entering the
//! pool's gate, so a full ring makes requests wait for a checkpoint instead of
//! deadlocking inside it. The ring keeps every sector since the *older* super block
//! copy's replay point, not only the newest's: a pool whose newest copy is damaged
//! opens from the older one and replays from there (docs/format.md, "Recovery
//! journal"), so a checkpoint frees ring space up to the previous checkpoint's
//! replay point.

use crate::error::within;
use crate::{EngineError, Result};
use fewerbytes_format::journal::{
    encode_sector, record_len, seal_parity, xor_into_parity, ParityHeader, Record, SectorHeader,
    COMMIT_SECTORS_MAX, PARITY_GROUP_SECTORS, RECORD_BYTES_MAX, RUN_BLOCKS_MAX,
    SECTOR_PAYLOAD_BYTES,
};
use fewerbytes_format::location::Location;
use fewerbytes_format::{Writer, BLOCK_BYTES, SECTOR_BYTES};
use fewerbytes_storage::Storage;
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Usable record bytes per sector in the worst case: a sector may leave unused one
/// byte less than the largest record (`format::journal::RECORD_BYTES_MAX`).
const SECTOR_RECORD_BYTES_MIN: u64 = (SECTOR_PAYLOAD_BYTES - (RECORD_BYTES_MAX - 1)) as u64;
/// Usable record bytes per ring sector in the worst case: a parity sector follows
/// every [`PARITY_GROUP_SECTORS`] record sectors. (The last group of a commit may be
/// shorter: one sector more per commit, as a commit's last sector may be nearly
/// empty; the ring's spare eighth covers both for the one commit in flight.)
const RING_RECORD_BYTES_MIN: u64 =
    SECTOR_RECORD_BYTES_MIN * PARITY_GROUP_SECTORS as u64 / (PARITY_GROUP_SECTORS as u64 + 1);
/// Record sectors one commit holds at most: whole parity groups whose sectors fit
/// the 16-bit indexes of a commit ([`COMMIT_SECTORS_MAX`]).
const DATA_SECTORS_PER_COMMIT_MAX: usize =
    COMMIT_SECTORS_MAX / (PARITY_GROUP_SECTORS + 1) * PARITY_GROUP_SECTORS;
/// Pending bytes that make the commit thread write without waiting for a flush:
/// keeps the in-memory tail (and the work of one commit) bounded.
pub const COMMIT_BYTES_THRESHOLD: u64 = 256 * 1024;
/// Ring fill (percent) since the last checkpoint at which the commit thread takes a
/// checkpoint. The ring also holds the interval before it (kept for the older super
/// block copy), so at 40% each the two stay under the seven eighths writes may use
/// (`room_bytes`) without waiting.
pub const CHECKPOINT_RING_PERCENT: u64 = 40;
/// How often a commit that found a device full is tried again without a flush
/// asking: how soon a pool resumes by itself once space is freed.
pub const STALLED_RETRY: Duration = Duration::from_secs(1);
/// `NewStored` records since the last checkpoint at which the commit thread takes a
/// checkpoint: replay reads each such block back to compute its fingerprint, so this
/// bounds what an open after a crash reads (4 GiB of blocks; twice that when the
/// newest super block copy is lost and the older one replays from further back).
pub const STORED_RECORDS_PER_CHECKPOINT: u64 = 1 << 20;

struct State {
    pending: Vec<u8>,
    appended: u64,
    durable: u64,
    requested: u64,
    reserved_bytes: u64,
    /// Bytes taken by a commit or checkpoint and not yet durable: not in `pending`
    /// and not yet in `next_seq`, but about to use ring space.
    inflight_bytes: u64,
    next_seq: u64,
    /// The replay point of the last checkpoint (the newest super block copy).
    replay_seq: u64,
    /// The replay point of the checkpoint before it (the older copy): ring space is
    /// free only before this one.
    keep_seq: u64,
    open_gen: u32,
    failed: Option<String>,
    /// The last commit found a device full: why. Its batch went back to the tail,
    /// nothing durable changed, and commits are retried (`next_work`).
    stalled: Option<String>,
    /// Commits that found a device full since open: a flush waiting when one
    /// fails is told so (ENOSPC) rather than left waiting for space.
    stalls: u64,
    shutdown: bool,
    checkpoint_requested: bool,
    /// `NewStored` records appended since open, and their count when the last
    /// checkpoint was taken.
    stored_records: u64,
    stored_at_checkpoint: u64,
}

/// The journal's in-memory side and ring geometry.
pub struct Journal {
    state: Mutex<State>,
    /// Held by a commit from taking its batch until it is durable, and by a
    /// checkpoint while it chooses its replay point (`checkpoint.rs`).
    commit_lock: Mutex<()>,
    /// Group commits done since open.
    commits: AtomicU64,
    /// `State::stalled` is set: kept beside it (written under the state lock) so that
    /// the write path's question takes no lock.
    stalled_now: AtomicBool,
    /// Journal bytes written since open.
    written_bytes: AtomicU64,
    /// Signalled when durability advances, space frees up, or the journal fails.
    progress: Condvar,
    /// Wakes the commit thread.
    wake: Condvar,
    nonce: u64,
    start_bytes: u64,
    sectors: u64,
    /// The pool's super block has `FLAG_SLIM_RECORDS`: a block stored new is
    /// journalled as one `NewStored` record (set at open, before any append).
    slim: AtomicBool,
    /// Blocks the open's replay read back for their fingerprints, and of them the
    /// damaged (`recovery.rs: fingerprint_fresh`).
    replayed_blocks: AtomicU64,
    replayed_damaged: AtomicU64,
}

/// What one commit takes from the tail; only the journal looks inside.
pub struct Batch {
    /// Encoded records.
    bytes: Vec<u8>,
    /// Record number this batch makes durable.
    target: u64,
    /// First sector sequence it is written at.
    first_seq: u64,
}

/// What the commit thread should do next.
pub enum Work {
    /// Write the tail.
    Commit,
    /// Take a checkpoint.
    Checkpoint,
    /// Nothing asked for a second: the commit thread's chance for periodic work.
    Idle,
    /// Stop.
    Shutdown,
}

/// The first record to write for `records` and how many of them it stands for: a
/// `NewStoredRun` for two or more leading `NewStored` records of one volume that
/// store consecutive blocks (logical block, object and PBN each one more than the
/// last) whole, else the first record as it is.
fn runs(records: &[Record]) -> (Record, usize) {
    let Some(&first) = records.first() else {
        unreachable!("runs of no records")
    };
    let Record::NewStored {
        volume,
        lbn,
        object,
        location,
        crc,
    } = first
    else {
        return (first, 1);
    };
    let Ok(Location::Block { pbn }) = Location::decode(location) else {
        return (first, 1);
    };
    let mut crcs = [crc; RUN_BLOCKS_MAX];
    let mut count = 1usize;
    for (k, next) in (1u64..).zip(records.iter().skip(1).take(RUN_BLOCKS_MAX - 1)) {
        match *next {
            Record::NewStored {
                volume: v,
                lbn: l,
                object: o,
                location: loc,
                crc,
            } if v == volume
                && l == lbn + k
                && o == object + k
                && loc == (Location::Block { pbn: pbn + k }).encode() =>
            {
                if let Some(slot) = crcs.get_mut(count) {
                    *slot = crc;
                }
                count += 1;
            }
            _ => break,
        }
    }
    if count < 2 {
        return (first, 1);
    }
    for unused in crcs.iter_mut().skip(count) {
        *unused = 0;
    }
    let run = Record::NewStoredRun {
        volume,
        lbn,
        object,
        pbn,
        count: count as u8,
        crcs,
    };
    (run, count)
}

impl Journal {
    /// A journal over the ring at `start_block` of `sectors` sectors, opened from a
    /// super block whose replay point is `replay_seq`; [`Journal::replayed`] sets
    /// where new sectors go once the replay found the journal's end.
    pub fn new(nonce: u64, start_block: u64, sectors: u64, replay_seq: u64, open_gen: u32) -> Self {
        Journal {
            state: Mutex::new(State {
                pending: Vec::new(),
                appended: 0,
                durable: 0,
                requested: 0,
                reserved_bytes: 0,
                inflight_bytes: 0,
                next_seq: replay_seq,
                replay_seq,
                keep_seq: replay_seq,
                open_gen,
                failed: None,
                stalled: None,
                stalls: 0,
                shutdown: false,
                checkpoint_requested: false,
                stored_records: 0,
                stored_at_checkpoint: 0,
            }),
            commit_lock: Mutex::new(()),
            commits: AtomicU64::new(0),
            stalled_now: AtomicBool::new(false),
            written_bytes: AtomicU64::new(0),
            progress: Condvar::new(),
            wake: Condvar::new(),
            nonce,
            start_bytes: start_block * BLOCK_BYTES as u64,
            sectors,
            slim: AtomicBool::new(false),
            replayed_blocks: AtomicU64::new(0),
            replayed_damaged: AtomicU64::new(0),
        }
    }

    /// The open's replay read back `blocks` blocks stored new for their fingerprints,
    /// `damaged` of which did not read back as written.
    pub fn note_replayed_blocks(&self, blocks: u64, damaged: u64) {
        self.replayed_blocks.store(blocks, Ordering::Relaxed);
        self.replayed_damaged.store(damaged, Ordering::Relaxed);
    }

    /// Blocks the open's replay read back, and of them the damaged.
    pub fn replayed_blocks(&self) -> (u64, u64) {
        (
            self.replayed_blocks.load(Ordering::Relaxed),
            self.replayed_damaged.load(Ordering::Relaxed),
        )
    }

    /// The super block of this open generation has `FLAG_SLIM_RECORDS`: blocks stored
    /// new are journalled as `NewStored` records from now on.
    pub fn use_slim_records(&self) {
        self.slim.store(true, Ordering::Release);
    }

    /// Whether a block stored new is journalled as one `NewStored` record.
    pub fn slim_records(&self) -> bool {
        self.slim.load(Ordering::Acquire)
    }

    /// The replay at open read the journal up to `next_seq` (its end): new sectors
    /// follow it, so the sectors replayed stay in the ring for as long as the super
    /// block copy they were replayed from is one of the two.
    pub fn replayed(&self, next_seq: u64) {
        let mut s = self.state.lock();
        s.next_seq = next_seq;
    }

    /// The open generation new sectors carry.
    pub fn open_gen(&self) -> u32 {
        self.state.lock().open_gen
    }

    fn room_bytes(&self, s: &State) -> u64 {
        let used = s.next_seq - s.keep_seq;
        // Keep an eighth of the ring spare so a checkpoint's own commit always fits.
        // Saturating, both: that commit may use the spare eighth, and records
        // appended under a reservation count twice until it ends (see `unreserve`),
        // so what is taken may honestly exceed what is usable; the room is then none.
        let usable = (self.sectors - self.sectors / 8).saturating_sub(used);
        (usable * RING_RECORD_BYTES_MIN)
            .saturating_sub(s.pending.len() as u64 + s.reserved_bytes + s.inflight_bytes)
    }

    /// Reserve room for `bytes` of records, waiting for a checkpoint if the ring is full.
    pub fn reserve(&self, bytes: u64) -> Result<()> {
        let mut s = self.state.lock();
        loop {
            if let Some(why) = &s.failed {
                return Err(EngineError::ReadOnly(why.clone()));
            }
            if self.room_bytes(&s) >= bytes {
                s.reserved_bytes += bytes;
                return Ok(());
            }
            if s.shutdown {
                return Err(EngineError::ReadOnly("the pool is closing".into()));
            }
            if let Some(why) = &s.stalled {
                // No checkpoint can free the ring while commits find a device full
                // (a request waiting here when the stall began, or records of trims
                // taken meanwhile): refuse with ENOSPC rather than wait for space.
                return Err(EngineError::NoSpace(format!(
                    "the journal is full and waits for space on the device below: {why}"
                )));
            }
            s.checkpoint_requested = true;
            self.wake.notify_one();
            self.progress.wait_for(&mut s, Duration::from_millis(100));
        }
    }

    /// Reserve `bytes` only if the ring has room now, without waiting: for a caller
    /// holding the gate (a heal inside a write step), which a checkpoint freeing the
    /// ring would need. False: nothing reserved.
    pub fn try_reserve(&self, bytes: u64) -> bool {
        let mut s = self.state.lock();
        if s.failed.is_some() || s.shutdown || self.room_bytes(&s) < bytes {
            return false;
        }
        s.reserved_bytes += bytes;
        true
    }

    /// End a reservation. Records appended under it are counted as pending from the
    /// moment they are appended (counted twice until here, which only errs on the
    /// safe side), so the whole reservation is given back.
    pub fn unreserve(&self, bytes: u64) {
        let mut s = self.state.lock();
        match s.reserved_bytes.checked_sub(bytes) {
            Some(left) => s.reserved_bytes = left,
            None => {
                let why = format!(
                    "journal reservations below zero: {bytes} bytes returned, {} reserved",
                    s.reserved_bytes
                );
                self.broken(&mut s, why);
            }
        }
    }

    /// The journal's accounting is wrong (a count below zero): it fails, so every
    /// later reservation and commit reports why, instead of promising ring space
    /// that may not be there.
    fn broken(&self, s: &mut State, why: String) {
        let why = EngineError::Invariant(why).to_string();
        tracing::error!("{why}");
        s.failed.get_or_insert(why);
        self.progress.notify_all();
    }

    /// Append one record; the caller holds a reservation covering it. Returns its number.
    pub fn append(&self, record: &Record) -> u64 {
        self.append_all(std::slice::from_ref(record))
    }

    /// Append `records` together, in order: runs of `NewStored` records that store
    /// consecutive blocks whole (`runs`) are written as `NewStoredRun` records.
    /// Returns the number of the last record appended.
    pub fn append_all(&self, records: &[Record]) -> u64 {
        let mut s = self.state.lock();
        let mut rest = records;
        while !rest.is_empty() {
            let (record, taken) = runs(rest);
            rest = rest.get(taken..).unwrap_or_default();
            let len = record.encoded_len();
            let at = s.pending.len();
            s.pending.resize(at + len, 0);
            let Some(dst) = s.pending.get_mut(at..) else {
                unreachable!("the tail was just grown to {} bytes", at + len)
            };
            record.encode(&mut Writer::new(dst));
            if matches!(
                record,
                Record::NewStored { .. } | Record::NewStoredRun { .. }
            ) {
                s.stored_records += taken as u64;
            }
            s.appended += 1;
        }
        if s.stored_records - s.stored_at_checkpoint >= STORED_RECORDS_PER_CHECKPOINT
            && !s.checkpoint_requested
        {
            s.checkpoint_requested = true;
            self.wake.notify_one();
        }
        if s.pending.len() as u64 >= COMMIT_BYTES_THRESHOLD {
            self.wake.notify_one();
        }
        s.appended
    }

    /// The number of the last record appended.
    pub fn appended(&self) -> u64 {
        self.state.lock().appended
    }

    /// Wait until record `target` is durable.
    pub fn wait_durable(&self, target: u64) -> Result<()> {
        let mut s = self.state.lock();
        if s.requested < target {
            s.requested = target;
            self.wake.notify_one();
        }
        let stalls = s.stalls;
        loop {
            if s.durable >= target {
                return Ok(());
            }
            if let Some(why) = &s.failed {
                return Err(EngineError::ReadOnly(why.clone()));
            }
            if s.stalls != stalls {
                let why = s.stalled.clone().unwrap_or_default();
                return Err(EngineError::NoSpace(why));
            }
            self.progress.wait(&mut s);
        }
    }

    /// Commit thread: wait for something to do.
    pub fn next_work(&self) -> Work {
        let mut s = self.state.lock();
        loop {
            if s.shutdown {
                return Work::Shutdown;
            }
            if s.stalled.is_some() && s.failed.is_none() {
                // Retry once a second, or at once when a flush asks: space may
                // have been freed (a file deleted on the host file system).
                self.wake.wait_for(&mut s, STALLED_RETRY);
                if s.shutdown {
                    return Work::Shutdown;
                }
                return Work::Commit;
            }
            if s.failed.is_none() {
                if s.checkpoint_requested {
                    return Work::Checkpoint;
                }
                if s.requested > s.durable || s.pending.len() as u64 >= COMMIT_BYTES_THRESHOLD {
                    return Work::Commit;
                }
            }
            if self
                .wake
                .wait_for(&mut s, Duration::from_secs(1))
                .timed_out()
            {
                return Work::Idle;
            }
        }
    }

    /// Ask the commit thread for a checkpoint.
    pub fn request_checkpoint(&self) {
        let mut s = self.state.lock();
        s.checkpoint_requested = true;
        self.wake.notify_one();
    }

    /// Whether the ring is full enough for a checkpoint.
    pub fn wants_checkpoint(&self) -> bool {
        let s = self.state.lock();
        (s.next_seq - s.replay_seq) * 100 >= self.sectors * CHECKPOINT_RING_PERCENT
    }

    /// One group commit: the data the batch refers to made durable first
    /// (`data_durable`: the packers' unwritten bytes, then a sync of the data
    /// device), then the batch's sectors written to the ring and synced. Every
    /// request that appended meanwhile becomes durable with one journal write. On an
    /// error nothing is marked durable, and the caller latches the pool.
    pub fn commit(
        &self,
        meta: &dyn Storage,
        separate_metadata: bool,
        data_durable: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let _commit = self.commit_lock.lock();
        self.commit_held(meta, separate_metadata, data_durable)
    }

    /// [`Journal::commit`] with the commit lock already held (by a checkpoint,
    /// `pause_commits`): a checkpoint writes the tail to the ring before it chooses
    /// its replay point, so the older super block copy's journal holds every record
    /// the newer checkpoint's image holds.
    pub fn commit_held(
        &self,
        meta: &dyn Storage,
        separate_metadata: bool,
        data_durable: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let batch = self.take_batch();
        let sectors = (|| -> Result<u64> {
            data_durable()?;
            if batch.bytes.is_empty() {
                return Ok(0);
            }
            let (sectors, bytes) = self.write_batch(meta, &batch)?;
            self.written_bytes.fetch_add(bytes, Ordering::Relaxed);
            if separate_metadata || sectors > 0 {
                meta.flush()?;
            }
            Ok(sectors)
        })();
        let sectors = match sectors {
            Ok(n) => n,
            Err(e) if e.is_no_space() => {
                self.stall(batch, &e);
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        self.batch_durable(&batch, sectors);
        let mut s = self.state.lock();
        let resumed = s.stalled.take().is_some();
        self.stalled_now.store(false, Ordering::Release);
        drop(s);
        if resumed {
            tracing::info!("space is back: commits go on");
        }
        self.commits.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Stop commits until the guard drops: a checkpoint choosing its replay point
    /// must not race a commit whose records the image already holds.
    pub fn pause_commits(&self) -> MutexGuard<'_, ()> {
        self.commit_lock.lock()
    }

    /// Group commits done since open.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Journal bytes written since open.
    pub fn written_bytes(&self) -> u64 {
        self.written_bytes.load(Ordering::Relaxed)
    }

    /// Take the tail for a commit.
    pub fn take_batch(&self) -> Batch {
        let mut s = self.state.lock();
        let bytes = std::mem::take(&mut s.pending);
        s.inflight_bytes += bytes.len() as u64;
        Batch {
            bytes,
            target: s.appended,
            first_seq: s.next_seq,
        }
    }

    /// Encode a batch into sectors and write them to the ring. Returns the number of
    /// sectors written and the bytes. A batch is one commit (no sync here: the
    /// caller syncs) unless it needs more sectors than a commit may hold
    /// ([`COMMIT_SECTORS_MAX`]); then each commit but the last is synced before the
    /// next is written, as the format's commits require (docs/format.md).
    pub fn write_batch(&self, meta: &dyn Storage, batch: &Batch) -> Result<(u64, u64)> {
        let open_gen = self.state.lock().open_gen;
        let payloads = cut_records(&batch.bytes)?;
        let mut seq = batch.first_seq;
        let mut written_bytes = 0u64;
        let commits = payloads.chunks(DATA_SECTORS_PER_COMMIT_MAX);
        let last = commits.len().saturating_sub(1);
        for (n, commit) in commits.enumerate() {
            let sectors = self.encode_commit(&batch.bytes, commit, seq, open_gen)?;
            let count = (sectors.len() / SECTOR_BYTES) as u64;
            self.write_ring(meta, seq, &sectors)?;
            if n < last {
                meta.flush()?;
            }
            seq += count;
            written_bytes += sectors.len() as u64;
        }
        Ok((seq - batch.first_seq, written_bytes))
    }

    /// One commit's sectors from its record payloads (ranges of `bytes`): each
    /// group of up to [`PARITY_GROUP_SECTORS`] record sectors followed by its parity
    /// sector, every sector numbered by its place in the commit.
    fn encode_commit(
        &self,
        bytes: &[u8],
        payloads: &[Range<usize>],
        first_seq: u64,
        open_gen: u32,
    ) -> Result<Vec<u8>> {
        let groups = payloads.len().div_ceil(PARITY_GROUP_SECTORS);
        let total = payloads.len() + groups;
        assert!(
            total <= COMMIT_SECTORS_MAX,
            "a journal commit of {total} sectors is more than its 16-bit indexes number"
        );
        let mut out = Vec::with_capacity(total * SECTOR_BYTES);
        // The place in the commit of the next sector: its index, and its sequence
        // number less `first_seq`. Below 2^16 (asserted above).
        let place = |out: &Vec<u8>| out.len() / SECTOR_BYTES;
        for group in payloads.chunks(PARITY_GROUP_SECTORS) {
            let mut parity = [0u8; SECTOR_BYTES];
            for range in group {
                let records = within(bytes, range.clone(), "a journal batch's records")?;
                let header = SectorHeader {
                    nonce: self.nonce,
                    seq: first_seq + place(&out) as u64,
                    open_gen,
                    used: records.len() as u16,
                    index: place(&out) as u16,
                };
                let mut sector = [0u8; SECTOR_BYTES];
                encode_sector(&header, records, &mut sector);
                xor_into_parity(&mut parity, &sector);
                out.extend_from_slice(&sector);
            }
            let header = ParityHeader {
                seq: first_seq + place(&out) as u64,
                open_gen,
                index: place(&out) as u16,
                covers: group.len() as u16,
            };
            seal_parity(&header, self.nonce, &mut parity);
            out.extend_from_slice(&parity);
        }
        Ok(out)
    }

    /// Write `sectors` to the ring from sequence `first_seq`, in at most two runs
    /// (the ring may wrap).
    fn write_ring(&self, meta: &dyn Storage, first_seq: u64, sectors: &[u8]) -> Result<()> {
        let count = (sectors.len() / SECTOR_BYTES) as u64;
        let mut written = 0u64;
        while written < count {
            let at = (first_seq + written) % self.sectors;
            let run = (count - written).min(self.sectors - at);
            let from = (written as usize) * SECTOR_BYTES;
            let to = from + run as usize * SECTOR_BYTES;
            meta.write_at(
                within(sectors, from..to, "a journal batch's sectors")?,
                self.start_bytes + at * SECTOR_BYTES as u64,
            )?;
            written += run;
        }
        Ok(())
    }

    /// After the batch's sectors are durable.
    pub fn batch_durable(&self, batch: &Batch, sectors: u64) {
        let mut s = self.state.lock();
        // A checkpoint's batch (no sectors) may complete after later commits.
        s.next_seq = s.next_seq.max(batch.first_seq + sectors);
        match s.inflight_bytes.checked_sub(batch.bytes.len() as u64) {
            Some(left) => s.inflight_bytes = left,
            None => {
                let why = format!(
                    "journal bytes in flight below zero: a batch of {} bytes made durable, {} in flight",
                    batch.bytes.len(),
                    s.inflight_bytes
                );
                self.broken(&mut s, why);
            }
        }
        s.durable = s.durable.max(batch.target);
        self.progress.notify_all();
    }

    /// A commit found a device full before its batch was durable: the batch goes back
    /// to the front of the tail, to be written again by the next commit (at the same
    /// sequence numbers; sectors it wrote hold records whose data was already
    /// durable, so a crash replaying them is a crash during a commit), and waiting
    /// flushes are told. Not a failure: the journal takes records and commits again.
    fn stall(&self, batch: Batch, e: &EngineError) {
        let mut s = self.state.lock();
        let mut bytes = batch.bytes;
        match s.inflight_bytes.checked_sub(bytes.len() as u64) {
            Some(left) => s.inflight_bytes = left,
            None => {
                let why = format!(
                    "journal bytes in flight below zero: a stalled batch of {} bytes given \
                     back, {} in flight",
                    bytes.len(),
                    s.inflight_bytes
                );
                self.broken(&mut s, why);
            }
        }
        bytes.append(&mut s.pending);
        s.pending = bytes;
        if s.stalled.is_none() {
            tracing::warn!("a commit found no space; writes wait for space: {e}");
        }
        s.stalled = Some(e.to_string());
        self.stalled_now.store(true, Ordering::Release);
        s.stalls += 1;
        self.progress.notify_all();
    }

    /// Why the last commit found no space, while commits are stalled for it.
    /// Every write asks, so the usual answer (not stalled) reads one atomic flag and
    /// takes no lock.
    pub fn stalled(&self) -> Option<String> {
        if !self.stalled_now.load(Ordering::Acquire) {
            return None;
        }
        self.state.lock().stalled.clone()
    }

    /// A batch failed: everything not durable fails, and the journal stays failed.
    pub fn fail(&self, why: String) {
        let mut s = self.state.lock();
        s.failed.get_or_insert(why);
        self.progress.notify_all();
    }

    /// The failure, if any.
    pub fn failure(&self) -> Option<String> {
        self.state.lock().failed.clone()
    }

    /// The next sector sequence (the replay point of a checkpoint taken now).
    pub fn next_seq(&self) -> u64 {
        self.state.lock().next_seq
    }

    /// A checkpoint whose replay point is `replay_seq` is durable: the ring before
    /// the previous checkpoint's replay point is free (the previous checkpoint is now
    /// the older super block copy, and opening from it replays from there).
    pub fn checkpointed(&self, replay_seq: u64) {
        let mut s = self.state.lock();
        s.keep_seq = s.replay_seq;
        s.replay_seq = replay_seq;
        s.checkpoint_requested = false;
        s.stored_at_checkpoint = s.stored_records;
        self.progress.notify_all();
    }

    /// Stop the commit thread.
    pub fn shutdown(&self) {
        let mut s = self.state.lock();
        s.shutdown = true;
        self.wake.notify_all();
        self.progress.notify_all();
    }

    /// Ring usage: (sectors held: since the older super block copy's replay point,
    /// ring sectors).
    pub fn usage(&self) -> (u64, u64) {
        let s = self.state.lock();
        (s.next_seq - s.keep_seq, self.sectors)
    }
}

/// Whether a sector of open generation `sector` may follow one of generation `last`
/// (at first: the super block's `open_gen`) in a replay. Generations never go down
/// along the sequence: sectors written after the newer super block copy carry that
/// open's generation, higher than the older copy's, and a replay from the older copy
/// must read through them; a stale sector left by an earlier open carries a lower
/// generation than the sectors before it, because every open takes a generation
/// above every sector in the ring (`pool.rs: next_open_gen`) and writes from the end
/// of its replay on. docs/format.md, "Recovery journal", has the argument.
pub fn open_gen_continues(last: u32, sector: u32) -> bool {
    sector >= last
}

/// Cut a batch's encoded records into sector payloads at record boundaries: each
/// range as many whole records as fit a sector.
fn cut_records(bytes: &[u8]) -> Result<Vec<Range<usize>>> {
    let mut payloads = Vec::with_capacity(bytes.len() / SECTOR_RECORD_BYTES_MIN as usize + 1);
    let mut pos = 0usize;
    while pos < bytes.len() {
        let mut end = pos;
        while let Some(rest) = bytes.get(end..).filter(|rest| !rest.is_empty()) {
            let len = record_len(rest).ok_or_else(|| {
                EngineError::Invariant(format!(
                    "a journal batch holds an unknown record at byte {end}"
                ))
            })?;
            if end + len - pos > SECTOR_PAYLOAD_BYTES {
                break;
            }
            end += len;
        }
        payloads.push(pos..end);
        pos = end;
    }
    Ok(payloads)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use fewerbytes_format::location::MapEntry;

    fn record() -> Record {
        Record::MapSet {
            volume: 0,
            lbn: 1,
            entry: MapEntry::Zero,
        }
    }

    // Regression: appends used to consume the reservation and `unreserve` then took
    // it again, so the journal under-counted what others had reserved and could
    // promise ring space that was not there.
    #[test]
    fn reservations_are_returned_exactly_once() {
        let j = Journal::new(1, 2, 64, 0, 1);
        let empty = j.room_bytes(&j.state.lock());
        j.reserve(160).unwrap();
        j.reserve(160).unwrap();
        for _ in 0..10 {
            j.append(&record());
        }
        j.unreserve(160);
        // The second reservation is still held; the appended records are pending.
        assert_eq!(j.room_bytes(&j.state.lock()), empty - 160 - 160);
        j.unreserve(160);
        let batch = j.take_batch();
        assert_eq!(
            j.room_bytes(&j.state.lock()),
            empty - 160,
            "a batch in flight still takes ring space"
        );
        j.batch_durable(&batch, 1);
        j.checkpointed(1);
        assert!(
            j.room_bytes(&j.state.lock()) < empty,
            "the sector stays for the older super block copy"
        );
        j.checkpointed(1);
        assert_eq!(j.room_bytes(&j.state.lock()), empty);
    }

    fn stored(lbn: u64, object: u64, location: Location) -> Record {
        Record::NewStored {
            volume: 3,
            lbn,
            object,
            location: location.encode(),
            crc: lbn as u32 * 7,
        }
    }

    /// Decode a tail of encoded records.
    fn decoded(bytes: &[u8]) -> Vec<Record> {
        let mut r = fewerbytes_format::Reader::new("test", bytes);
        let mut out = Vec::new();
        while r.pos() < bytes.len() {
            out.push(Record::decode(&mut r).unwrap());
        }
        out
    }

    #[test]
    fn consecutive_whole_blocks_stored_new_are_journalled_as_runs_of_eight() {
        let j = Journal::new(1, 2, 64, 0, 1);
        let block = |pbn| Location::Block { pbn };
        // 19 consecutive blocks, then one whose object is not the next, a map change,
        // a fragment, and two consecutive blocks of another volume's numbering.
        let mut records: Vec<Record> = (0..19)
            .map(|k| stored(100 + k, 500 + k, block(9000 + k)))
            .collect();
        records.push(stored(119, 600, block(9019)));
        records.push(record());
        let fragment = Location::Fragment {
            addr_bytes: 4096 * 77,
            len_bytes: 1000,
            codec: fewerbytes_format::location::Codec::Lz4,
        };
        records.push(stored(120, 601, fragment));
        records.push(stored(121, 602, block(50)));
        records.push(stored(122, 603, block(51)));
        j.append_all(&records);
        let pending = j.state.lock().pending.clone();
        let got = decoded(&pending);
        let run = |k: u64, count: u8| {
            let mut crcs = [0u32; RUN_BLOCKS_MAX];
            for (i, c) in crcs.iter_mut().take(usize::from(count)).enumerate() {
                *c = (100 + k as u32 + i as u32) * 7;
            }
            Record::NewStoredRun {
                volume: 3,
                lbn: 100 + k,
                object: 500 + k,
                pbn: 9000 + k,
                count,
                crcs,
            }
        };
        let mut crcs = [0u32; RUN_BLOCKS_MAX];
        crcs[0] = 121 * 7;
        crcs[1] = 122 * 7;
        assert_eq!(
            got,
            vec![
                run(0, 8),
                run(8, 8),
                run(16, 3),
                records[19],
                records[20],
                records[21],
                Record::NewStoredRun {
                    volume: 3,
                    lbn: 121,
                    object: 602,
                    pbn: 50,
                    count: 2,
                    crcs,
                },
            ]
        );
        // The runs are what replay needs and no more: 22 bytes and 4 a block.
        assert_eq!(pending.len(), 3 * 22 + 19 * 4 + 27 + 16 + 27 + 22 + 2 * 4);
    }
}
