//! The dedup index: advice, in bounded memory, on where a fingerprint was stored.
//!
//! A bucketized cuckoo table of bit-packed 30-bit slots, split into shards (hash
//! zones) each behind its own lock. A slot holds a short fingerprint tag and a
//! *group*: the object id, or for pools of more than 2^24 objects the object id
//! shifted right so that it fits in 24 bits (a group of 2, 4, … consecutive objects,
//! which the caller scans). The first 8 bytes of the fingerprint pick the shard and
//! the first bucket; the tag (from the next bytes) picks the second bucket
//! (partial-key cuckoo hashing: `second = (hash(tag) − first) mod buckets`, so an
//! entry can move between its two buckets knowing only its tag). A lookup reads 16
//! slots; a full pair of buckets moves entries to their other bucket, so nothing is
//! dropped until the table is nearly full.
//!
//! The window — the distinct blocks whose second copy is found — is the slots times
//! [`HONEST_LOAD_PERMILLE`]: below that load no insert was ever seen to fail (see
//! `the_window_holds_every_entry` and docs/benchmarks.md). 30 bits per slot at 95%
//! load is 3.95 bytes of memory per 4 KiB block of window (0.99 GiB per TiB).
//!
//! Past its window (a smaller `--index-memory`, or more distinct data than the
//! window) the index degrades gracefully: every new fingerprint still enters, and
//! the entry a failed move leaves without a place — a random older one — is
//! dropped. The index then holds a sample of the stored blocks (recent ones the
//! likeliest), as many as its slots hold, and is *lossy*: the slab depot then also
//! tries the objects stored just after a thread's latest hits (`take_duplicate`), so a
//! second copy of data written in order is found from a sampled hit onwards, as
//! dm-vdo's sparse index finds a chapter from a sampled entry.
//!
//! **Sparse mode** (`pool create --index sparse`, super block byte 212): only
//! *hooks* — fingerprints whose bits 128–128+k are zero, 1 in 2^k of them
//! ([`crate::index_mode::SPARSE_SAMPLE_SHIFT`]: k = 4) — enter the table; the window is then the
//! table's times 2^k (16 TiB of window a GiB of memory instead of 1 TiB). A non-hook
//! is never in the table: it is found next to a hook's hit (the slab depot's
//! `advice.rs`: the objects after a recent hit, and in a write step the objects
//! before the step's first hook hit). Past the window a sparse table is lossy
//! like a dense one, at 2^k times the data.
//!
//! Advice is never trusted: the caller compares the full fingerprint stored in the
//! object records and checks the object is live, so a false tag match costs a
//! compare and a lost entry a missed dedup, never a wrong one. A clean close saves
//! the table to a file beside the pool, which the next read-write open loads when
//! it matches the pool's state (`index_save.rs`); otherwise the open rebuilds it
//! from the slab object records in the background while the pool serves
//! (`index_build.rs`). A read-only open never builds it.

use fewerbytes_format::location::ObjectId;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::index_mode::IndexMode;

/// Shards (hash zones); a power of two so the shard is a mask of the key.
pub const INDEX_SHARDS: usize = 64;
/// The index's memory when `pool create` is given no `--index-memory`: a dense
/// window of about 256 GiB of stored blocks. Bounded, never "the whole device": an
/// index sized for a large device took its RAM whatever the pool stored (14 GiB for
/// an empty 15 TiB pool). Pools smaller than the window get one entry per block.
pub const INDEX_MEMORY_DEFAULT_BYTES: u64 = 256 << 20;
/// Slots per bucket.
pub const BUCKET_SLOTS: usize = 8;
/// Bits of memory per slot: tag and group.
pub const SLOT_BITS: u32 = 30;
/// Load (per mille of the slots) up to which the table keeps every entry: the
/// window it reports. Measured: inserting random fingerprints, the first failed
/// move came at 97.6–98.4% load (`the_window_holds_every_entry` prints it).
pub const HONEST_LOAD_PERMILLE: u64 = 975;
/// Most bits a slot gives the group; the rest (at least 6) are the tag.
const GROUP_BITS_MAX: u32 = 24;
/// Load (per mille of a shard's slots) past which an insert tries only a few moves.
const FULL_PERMILLE: u64 = 995;
/// Moves an insert tries before dropping an entry, below and above `FULL_PERMILLE`.
const MAX_KICKS: usize = 500;
const KICKS_PAST_WINDOW: usize = 16;
/// Words of a shard a saved index keeps together (`index_save.rs`): a 4 KiB page of
/// memory; runs of zeros are not saved, and not written when loaded.
pub const SAVED_RUN_WORDS: usize = 512;
/// Candidates a lookup returns at most: the slots of two buckets.
pub const MAX_CANDIDATES: usize = 2 * BUCKET_SLOTS;

struct Shard {
    /// The slots, bit-packed, `SLOT_BITS` each; one spare word at the end.
    words: Vec<u64>,
    /// Slots in use.
    held: u64,
    /// Entries dropped for want of a place.
    dropped: u64,
    /// xorshift state for the random walk.
    rng: u64,
}

impl Shard {
    fn get(&self, slot: u64) -> u64 {
        let bit = slot * u64::from(SLOT_BITS);
        let (w, sh) = ((bit / 64) as usize, (bit % 64) as u32);
        let lo = self.words.get(w).copied().unwrap_or(0) >> sh;
        let hi = if sh + SLOT_BITS > 64 {
            self.words.get(w + 1).copied().unwrap_or(0) << (64 - sh)
        } else {
            0
        };
        (lo | hi) & SLOT_MASK
    }

    fn set(&mut self, slot: u64, value: u64) {
        let bit = slot * u64::from(SLOT_BITS);
        let (w, sh) = ((bit / 64) as usize, (bit % 64) as u32);
        if let Some(word) = self.words.get_mut(w) {
            *word = (*word & !(SLOT_MASK << sh)) | (value << sh);
        }
        if sh + SLOT_BITS > 64 {
            let spill = sh + SLOT_BITS - 64;
            if let Some(word) = self.words.get_mut(w + 1) {
                *word = (*word & !((1u64 << spill) - 1)) | (value >> (64 - sh));
            }
        }
    }

    /// Put `value` in an empty slot of `bucket`; false when the bucket is full.
    fn put(&mut self, bucket: u64, value: u64) -> bool {
        let first = bucket * BUCKET_SLOTS as u64;
        for slot in first..first + BUCKET_SLOTS as u64 {
            if self.get(slot) == 0 {
                self.set(slot, value);
                return true;
            }
        }
        false
    }

    /// Whether a slot of `bucket` holds exactly `value`.
    fn holds(&self, bucket: u64, value: u64) -> bool {
        let first = bucket * BUCKET_SLOTS as u64;
        (first..first + BUCKET_SLOTS as u64).any(|slot| self.get(slot) == value)
    }

    fn random(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }
}

const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;

/// The index.
pub struct DedupIndex {
    shards: Vec<Mutex<Shard>>,
    /// Whether an entry was ever dropped since open (the index holds a sample).
    lossy: AtomicBool,
    /// Dedup hits found next to an earlier hit rather than in the index.
    neighbour_hits: AtomicU64,
    buckets_per_shard: u64,
    /// Objects of the pool (object ids are below this).
    objects: u64,
    /// log2 of the objects per group.
    group_shift: u32,
    /// Bits of a slot holding the group (+ 1, so an empty slot is 0).
    group_bits: u32,
    /// log2 of the sampling: only hooks (1 in 2^this fingerprints) enter (0: dense).
    sample_shift: u32,
    /// Each shard's words as an address and a length, for [`DedupIndex::prefetch`]
    /// (read without the shard's lock; a shard's words are never reallocated).
    words_at: Vec<(usize, usize)>,
}

/// The random walk's first state in shard `s`.
fn initial_rng(s: usize) -> u64 {
    0x9e37_79b9_7f4a_7c15 ^ (s as u64 + 1)
}

/// Bits needed to write `x`.
fn bits_of(x: u64) -> u32 {
    64 - x.leading_zeros()
}

impl DedupIndex {
    /// A dense index holding at least `entries` fingerprints (the super block's
    /// `index_entries`), for a pool of `objects` object slots.
    #[cfg(test)]
    pub fn new(entries: u64, objects: u64) -> Self {
        Self::with_mode(entries, objects, IndexMode::Dense)
    }

    /// An index of `mode` whose table holds at least `entries` fingerprints (of
    /// hooks only, when sparse).
    pub fn with_mode(entries: u64, objects: u64, mode: IndexMode) -> Self {
        Self::with_buckets(Self::buckets_for_window(entries), objects, mode)
    }

    /// An index of `mode` taking at most `bytes` of memory (at least one bucket a
    /// shard), and no more than a window of `objects` blocks needs.
    pub fn with_memory(bytes: u64, objects: u64, mode: IndexMode) -> Self {
        let needed = objects >> mode.sample_shift();
        let buckets = Self::buckets_for_memory(bytes).min(Self::buckets_for_window(needed));
        Self::with_buckets(buckets, objects, mode)
    }

    /// The entries (fingerprints; hooks when sparse) a table of at most `bytes` of
    /// memory holds: the window of a dense index.
    pub fn window_for_memory(bytes: u64) -> u64 {
        Self::window_of_slots(Self::buckets_for_memory(bytes) * SLOTS_PER_SHARD_BUCKET)
    }

    /// The entries of the table an index recording `entries` builds at open (at
    /// least `entries`: the table rounds up to whole buckets).
    pub fn entries_of_table_for(entries: u64) -> u64 {
        Self::window_of_slots(Self::buckets_for_window(entries) * SLOTS_PER_SHARD_BUCKET)
    }

    /// Buckets per shard in at most `bytes` (at least one).
    fn buckets_for_memory(bytes: u64) -> u64 {
        // Each shard has a spare word and rounds up to a word.
        let words = (bytes / 8).saturating_sub(2 * INDEX_SHARDS as u64);
        let slots = words * 64 / u64::from(SLOT_BITS);
        (slots / SLOTS_PER_SHARD_BUCKET).max(1)
    }

    /// The window of a table of `slots`: the blocks that, spread over the shards
    /// by their fingerprints, leave every shard below [`HONEST_LOAD_PERMILLE`] —
    /// the mean per shard plus two standard deviations (a shard's share is
    /// binomial), which matters only for small tables.
    fn window_of_slots(slots: u64) -> u64 {
        let limit = (slots / INDEX_SHARDS as u64 * HONEST_LOAD_PERMILLE) as f64 / 1000.0;
        // m + 2√m = limit, for m the mean per shard.
        let root = -1.0 + (1.0 + limit).sqrt();
        (root * root) as u64 * INDEX_SHARDS as u64
    }

    /// Buckets per shard whose window is at least `window`.
    fn buckets_for_window(window: u64) -> u64 {
        let mean = window.max(1).div_ceil(INDEX_SHARDS as u64) as f64;
        let limit = mean + 2.0 * mean.sqrt();
        let slots = (limit * 1000.0 / HONEST_LOAD_PERMILLE as f64).ceil() as u64;
        let mut buckets = slots.div_ceil(BUCKET_SLOTS as u64).max(1);
        while Self::window_of_slots(buckets * SLOTS_PER_SHARD_BUCKET) < window {
            buckets += 1;
        }
        buckets
    }

    fn with_buckets(buckets_per_shard: u64, objects: u64, mode: IndexMode) -> Self {
        let bits = buckets_per_shard * BUCKET_SLOTS as u64 * u64::from(SLOT_BITS);
        let words = bits.div_ceil(64) as usize + 1;
        let objects = objects.max(1);
        let mut group_shift = 0;
        while bits_of(objects.div_ceil(1 << group_shift)) > GROUP_BITS_MAX {
            group_shift += 1;
        }
        let group_bits = bits_of(objects.div_ceil(1 << group_shift));
        let shards: Vec<Mutex<Shard>> = (0..INDEX_SHARDS)
            .map(|s| {
                Mutex::new(Shard {
                    words: vec![0; words],
                    held: 0,
                    dropped: 0,
                    rng: initial_rng(s),
                })
            })
            .collect();
        let words_at = shards
            .iter()
            .map(|shard| {
                let shard = shard.lock();
                (shard.words.as_ptr().expose_provenance(), shard.words.len())
            })
            .collect();
        DedupIndex {
            shards,
            words_at,
            lossy: AtomicBool::new(false),
            neighbour_hits: AtomicU64::new(0),
            buckets_per_shard,
            objects,
            group_shift,
            group_bits,
            sample_shift: mode.sample_shift(),
        }
    }

    /// The window: distinct blocks the index covers, every one found again (when
    /// sparse, every hook, and the rest next to a hook's hit).
    pub fn capacity(&self) -> u64 {
        self.entries() << self.sample_shift
    }

    /// Fingerprints the table holds below its honest load (hooks, when sparse).
    pub fn entries(&self) -> u64 {
        Self::window_of_slots(self.slots())
    }

    /// log2 of the sampling (0: dense).
    pub fn sample_shift(&self) -> u32 {
        self.sample_shift
    }

    /// Which fingerprints enter the index.
    pub fn mode(&self) -> IndexMode {
        if self.sample_shift == 0 {
            IndexMode::Dense
        } else {
            IndexMode::Sparse {
                shift: self.sample_shift,
            }
        }
    }

    /// Whether `fp` enters the index: always when dense; when sparse, if its bits
    /// 128 onwards (apart from those the shard, bucket and tag use) are zero for
    /// the sample shift. A fingerprint is a keyed hash: hooks are a fixed uniform
    /// sample of the blocks, the same for every copy of a block.
    pub fn is_hook(&self, fp: &[u8; 32]) -> bool {
        let mut b = [0u8; 8];
        b.copy_from_slice(fp.get(16..24).unwrap_or(&[0; 8]));
        u64::from_le_bytes(b) & ((1u64 << self.sample_shift) - 1) == 0
    }

    /// Slots of the table.
    pub fn slots(&self) -> u64 {
        self.buckets_per_shard * SLOTS_PER_SHARD_BUCKET
    }

    /// Bytes of memory the table takes.
    pub fn memory_bytes(&self) -> u64 {
        self.shards
            .first()
            .map_or(0, |s| s.lock().words.len() as u64 * 8)
            * INDEX_SHARDS as u64
    }

    /// What a saved table must match to be loaded into this one: buckets per
    /// shard, objects, the group's shift and bits, the sample shift, and the words
    /// of a shard.
    pub(crate) fn shape(&self) -> [u64; 6] {
        [
            self.buckets_per_shard,
            self.objects,
            u64::from(self.group_shift),
            u64::from(self.group_bits),
            u64::from(self.sample_shift),
            self.shards
                .first()
                .map_or(0, |s| s.lock().words.len() as u64),
        ]
    }

    /// Hand each shard's state to `f` in order (`index_save.rs`): held, dropped,
    /// the random walk's state, and the slots' words.
    pub(crate) fn each_shard<E>(
        &self,
        mut f: impl FnMut([u64; 3], &[u64]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        for shard in &self.shards {
            let shard = shard.lock();
            f([shard.held, shard.dropped, shard.rng], &shard.words)?;
        }
        Ok(())
    }

    /// Set shard `k`, still empty, from a saved one (`index_save.rs`, before any
    /// insert): its state, and the runs of [`SAVED_RUN_WORDS`] words that are not
    /// all zero, each copied at run number `run` into the table's own words (never
    /// reallocated: `prefetch` reads them by address). The runs of zeros are left
    /// as they are, untouched memory: an empty table costs no RAM once loaded.
    /// False when `k` does not exist, the shard is not empty, or a run does not fit.
    pub(crate) fn restore_shard<'a>(
        &self,
        k: usize,
        state: [u64; 3],
        runs: impl IntoIterator<Item = (u64, &'a [u64])>,
    ) -> bool {
        let Some(shard) = self.shards.get(k) else {
            return false;
        };
        let mut shard = shard.lock();
        if shard.held != 0 {
            return false;
        }
        for (run, words) in runs {
            let start = run as usize * SAVED_RUN_WORDS;
            match shard.words.get_mut(start..start + words.len()) {
                Some(dst) => dst.copy_from_slice(words),
                None => return false,
            }
        }
        let [held, dropped, rng] = state;
        shard.held = held;
        shard.dropped = dropped;
        shard.rng = rng;
        true
    }

    /// Empty every shard, as a new table (a saved one that failed half-way). Only
    /// runs that hold something are written, so untouched memory stays untouched.
    pub(crate) fn clear(&self) {
        for (s, shard) in self.shards.iter().enumerate() {
            let mut shard = shard.lock();
            for run in shard.words.chunks_mut(SAVED_RUN_WORDS) {
                if run.iter().any(|&w| w != 0) {
                    run.fill(0);
                }
            }
            shard.held = 0;
            shard.dropped = 0;
            shard.rng = initial_rng(s);
        }
        self.lossy.store(false, Ordering::Relaxed);
    }

    /// Mark the table lossy (a saved one was).
    pub(crate) fn set_lossy(&self) {
        self.lossy.store(true, Ordering::Relaxed);
    }

    /// Entries held now, and entries dropped for want of a place since open.
    pub fn held_and_dropped(&self) -> (u64, u64) {
        self.shards.iter().fold((0, 0), |(h, d), s| {
            let s = s.lock();
            (h + s.held, d + s.dropped)
        })
    }

    /// Objects per group: a candidate names this many consecutive objects.
    pub fn group_objects(&self) -> u64 {
        1 << self.group_shift
    }

    /// The objects of group `g` (clipped to the pool's objects).
    pub fn objects_of(&self, g: u64) -> std::ops::Range<u64> {
        let first = g << self.group_shift;
        first.min(self.objects)..(first + self.group_objects()).min(self.objects)
    }

    fn tag_bits(&self) -> u32 {
        SLOT_BITS - self.group_bits
    }

    /// Shard, first bucket and tag of a fingerprint.
    fn place(&self, fp: &[u8; 32]) -> (usize, u64, u64) {
        let mut b = [0u8; 8];
        b.copy_from_slice(fp.get(..8).unwrap_or(&[0; 8]));
        let key = u64::from_le_bytes(b);
        b.copy_from_slice(fp.get(8..16).unwrap_or(&[0; 8]));
        let tag = u64::from_le_bytes(b) & ((1 << self.tag_bits()) - 1);
        let shard = (key as usize) % INDEX_SHARDS;
        let bucket = (key >> 6) % self.buckets_per_shard;
        (shard, bucket, tag)
    }

    /// The other bucket of an entry with `tag` in `bucket`.
    fn other(&self, bucket: u64, tag: u64) -> u64 {
        let h = tag.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20;
        let n = self.buckets_per_shard;
        (h % n + n - bucket) % n
    }

    fn value(&self, tag: u64, object: ObjectId) -> Option<u64> {
        (object.0 < self.objects)
            .then(|| (tag << self.group_bits) | ((object.0 >> self.group_shift) + 1))
    }

    fn tag_of(&self, value: u64) -> u64 {
        value >> self.group_bits
    }

    /// Start loading into the CPU's cache the two buckets a lookup of `fp` reads: a
    /// write step hashes its blocks together and prefetches them all before looking
    /// any up, so the lookups' cache misses (the index was 13% of the CPU of 128k
    /// writes of new data) overlap instead of following one another. Reads nothing.
    pub fn prefetch(&self, fp: &[u8; 32]) {
        #[cfg(target_arch = "x86_64")]
        if self.is_hook(fp) {
            let (s, b1, tag) = self.place(fp);
            let Some(&(at, len)) = self.words_at.get(s) else {
                return;
            };
            for bucket in [b1, self.other(b1, tag)] {
                let word = (bucket * BUCKET_SLOTS as u64 * u64::from(SLOT_BITS) / 64) as usize;
                if word < len {
                    let p = std::ptr::with_exposed_provenance::<u64>(at).wrapping_add(word);
                    // SAFETY: a prefetch is a hint: it reads nothing into the program
                    // and never faults, whatever the address (here one inside the
                    // shard's words).
                    unsafe {
                        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                            p.cast::<i8>(),
                        );
                    }
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = fp;
    }

    /// Candidate groups for `fp`, distinct (at most [`MAX_CANDIDATES`]): the
    /// objects each names are [`Self::objects_of`].
    pub fn lookup(&self, fp: &[u8; 32]) -> ([u64; MAX_CANDIDATES], usize) {
        let mut out = [0; MAX_CANDIDATES];
        let mut n = 0;
        if !self.is_hook(fp) {
            return (out, 0);
        }
        let (s, b1, tag) = self.place(fp);
        let b2 = self.other(b1, tag);
        let Some(shard) = self.shards.get(s) else {
            return (out, 0);
        };
        let shard = shard.lock();
        let group_mask = (1 << self.group_bits) - 1;
        for bucket in [b1, b2] {
            let first = bucket * BUCKET_SLOTS as u64;
            for slot in first..first + BUCKET_SLOTS as u64 {
                let v = shard.get(slot);
                if v == 0 || v >> self.group_bits != tag {
                    continue;
                }
                let g = (v & group_mask) - 1;
                if !out.iter().take(n).any(|&x| x == g) {
                    if let Some(o) = out.get_mut(n) {
                        *o = g;
                        n += 1;
                    }
                }
            }
            if b2 == b1 {
                break;
            }
        }
        (out, n)
    }

    /// Remember that `fp` is stored as `object` (if a hook, when sparse), even
    /// if that very entry is held already. Only tests use it: the pool always
    /// inserts through `insert_once`.
    #[cfg(test)]
    pub fn insert(&self, fp: &[u8; 32], object: ObjectId) {
        self.insert_as(fp, object, false);
    }

    /// Remember that `fp` is stored as `object`, unless that very entry is held
    /// already. The background rebuild (`index_build.rs`) and the writes that run
    /// beside it both insert the objects stored meanwhile: this keeps one entry
    /// each, so a free (which removes one) leaves none behind.
    pub fn insert_once(&self, fp: &[u8; 32], object: ObjectId) {
        self.insert_as(fp, object, true);
    }

    fn insert_as(&self, fp: &[u8; 32], object: ObjectId, once: bool) {
        if !self.is_hook(fp) {
            return;
        }
        let (s, b1, tag) = self.place(fp);
        let Some(mut value) = self.value(tag, object) else {
            return;
        };
        let Some(shard) = self.shards.get(s) else {
            return;
        };
        let mut shard = shard.lock();
        let b2 = self.other(b1, tag);
        if once && (shard.holds(b1, value) || shard.holds(b2, value)) {
            return;
        }
        shard.held += 1;
        if shard.put(b1, value) || shard.put(b2, value) {
            return;
        }
        // Both full: move entries to their other bucket (a random walk).
        let kicks =
            if shard.held * 1000 <= self.buckets_per_shard * BUCKET_SLOTS as u64 * FULL_PERMILLE {
                MAX_KICKS
            } else {
                KICKS_PAST_WINDOW
            };
        let mut bucket = if shard.random() & 1 == 0 { b1 } else { b2 };
        for _ in 0..kicks {
            let slot = bucket * BUCKET_SLOTS as u64 + shard.random() % BUCKET_SLOTS as u64;
            let evicted = shard.get(slot);
            shard.set(slot, value);
            value = evicted;
            bucket = self.other(bucket, self.tag_of(value));
            if shard.put(bucket, value) {
                return;
            }
        }
        // `value` has no place: dropped (past the window, a random older entry).
        shard.held -= 1;
        shard.dropped += 1;
        self.lossy.store(true, Ordering::Relaxed);
    }

    /// Entries that no object of `live` (every live object with its fingerprint)
    /// accounts for: advice naming objects that are free. The audit's check that
    /// frees, and the background build racing them, leave nothing behind (callers
    /// keep frees out meanwhile). An entry counts as accounted for when a live
    /// object of its group has its tag and one of its buckets is the entry's.
    pub fn entries_naming_no_live_object(
        &self,
        live: impl IntoIterator<Item = ([u8; 32], ObjectId)>,
    ) -> u64 {
        let key = |s: usize, bucket: u64, value: u64| {
            (s as u128) << 96 | u128::from(bucket) << 32 | u128::from(value)
        };
        let mut expected: Vec<u128> = Vec::new();
        for (fp, object) in live {
            let (s, b1, tag) = self.place(&fp);
            if let Some(value) = self.value(tag, object) {
                expected.push(key(s, b1, value));
                expected.push(key(s, self.other(b1, tag), value));
            }
        }
        expected.sort_unstable();
        let mut stale = 0;
        for (s, shard) in self.shards.iter().enumerate() {
            let shard = shard.lock();
            for bucket in 0..self.buckets_per_shard {
                let first = bucket * BUCKET_SLOTS as u64;
                for slot in first..first + BUCKET_SLOTS as u64 {
                    let v = shard.get(slot);
                    if v != 0 && expected.binary_search(&key(s, bucket, v)).is_err() {
                        stale += 1;
                    }
                }
            }
        }
        stale
    }

    /// Whether the index has dropped an entry since open: it then holds a sample
    /// of the stored blocks, not all of them.
    pub fn lossy(&self) -> bool {
        self.lossy.load(Ordering::Relaxed)
    }

    /// Count a dedup hit found next to an earlier one (the caller's lookup).
    pub fn count_neighbour_hit(&self) {
        self.neighbour_hits.fetch_add(1, Ordering::Relaxed);
    }

    /// Dedup hits found next to an earlier one since open.
    pub fn neighbour_hits(&self) -> u64 {
        self.neighbour_hits.load(Ordering::Relaxed)
    }

    /// Forget `object` under `fp` (it was freed). With groups of several objects,
    /// an identical entry of another object of the group may go instead: that one
    /// then names a group still holding `fp`'s twin, at worst a missed dedup.
    pub fn remove(&self, fp: &[u8; 32], object: ObjectId) {
        if !self.is_hook(fp) {
            return;
        }
        let (s, b1, tag) = self.place(fp);
        let Some(value) = self.value(tag, object) else {
            return;
        };
        let Some(shard) = self.shards.get(s) else {
            return;
        };
        let mut shard = shard.lock();
        for bucket in [b1, self.other(b1, tag)] {
            let first = bucket * BUCKET_SLOTS as u64;
            for slot in first..first + BUCKET_SLOTS as u64 {
                if shard.get(slot) == value {
                    shard.set(slot, 0);
                    shard.held -= 1;
                    return;
                }
            }
        }
    }
}

/// Slots per bucket of every shard (buckets per shard × this = slots).
const SLOTS_PER_SHARD_BUCKET: u64 = (BUCKET_SLOTS * INDEX_SHARDS) as u64;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::index_mode::SPARSE_SAMPLE_SHIFT;

    fn fp_of(i: u64, seed: u64) -> [u8; 32] {
        let mut fp = [0u8; 32];
        let mut x = i.wrapping_add(seed.wrapping_mul(0x2545_f491_4f6c_dd1d));
        for chunk in fp.chunks_mut(8) {
            // splitmix64
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            chunk.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
        }
        fp
    }

    fn finds(idx: &DedupIndex, fp: &[u8; 32], object: u64) -> bool {
        let (c, n) = idx.lookup(fp);
        c.iter()
            .take(n)
            .any(|&g| idx.objects_of(g).contains(&object))
    }

    #[test]
    fn inserted_advice_is_found_and_removed() {
        let idx = DedupIndex::new(1024, 1 << 20);
        let fp = [7u8; 32];
        idx.insert(&fp, ObjectId(42));
        let (c, n) = idx.lookup(&fp);
        assert_eq!((n, c[0]), (1, 42));
        idx.remove(&fp, ObjectId(42));
        assert_eq!(idx.lookup(&fp).1, 0);
        assert_eq!(idx.held_and_dropped(), (0, 0));
        // Inserted once by a write and once by the rebuild: one entry, which one
        // free removes.
        idx.insert_once(&fp, ObjectId(43));
        idx.insert_once(&fp, ObjectId(43));
        assert_eq!(idx.held_and_dropped(), (1, 0));
        idx.remove(&fp, ObjectId(43));
        assert_eq!(idx.lookup(&fp).1, 0);
        // The audit's check: an entry whose object is not live is counted.
        idx.insert(&fp, ObjectId(44));
        idx.insert(&[5; 32], ObjectId(45));
        assert_eq!(idx.entries_naming_no_live_object([(fp, ObjectId(44))]), 1);
        assert_eq!(
            idx.entries_naming_no_live_object([(fp, ObjectId(44)), ([5; 32], ObjectId(45))]),
            0
        );
    }

    #[test]
    fn slots_keep_tag_and_group_apart() {
        let mut shard = Shard {
            words: vec![0; 8],
            held: 0,
            dropped: 0,
            rng: 1,
        };
        for slot in 0..16 {
            shard.set(slot, (slot * 0x0123_4567 + 1) & SLOT_MASK);
        }
        for slot in 0..16 {
            assert_eq!(shard.get(slot), (slot * 0x0123_4567 + 1) & SLOT_MASK);
        }
        shard.set(2, SLOT_MASK);
        shard.set(2, 5);
        assert_eq!(
            (shard.get(1), shard.get(2), shard.get(3)),
            (
                (0x0123_4567 + 1) & SLOT_MASK,
                5,
                (3 * 0x0123_4567 + 1) & SLOT_MASK
            )
        );
        // Large pools: groups of objects, the tag never shorter than 6 bits.
        let big = DedupIndex::new(1024, 805_000_000);
        assert_eq!((big.group_objects(), big.tag_bits()), (64, 6));
        assert_eq!(big.objects_of(3), 192..256);
        let small = DedupIndex::new(1024, 1000);
        assert_eq!((small.group_objects(), small.tag_bits()), (1, 20));
        // Two fingerprints that differ only past the tag share buckets and a tag: both are offered.
        let idx = DedupIndex::new(1024, 1 << 20);
        let (a, mut b) = ([9u8; 32], [9u8; 32]);
        b[31] = 0;
        idx.insert(&a, ObjectId(1));
        idx.insert(&b, ObjectId(2));
        let (c, n) = idx.lookup(&a);
        assert_eq!(n, 2);
        assert!(c[..2].contains(&1) && c[..2].contains(&2));
        let mut other = a;
        other[8] ^= 1;
        assert_eq!(idx.lookup(&other).1, 0);
        // An object id past the pool's objects is never advised.
        idx.insert(&[3; 32], ObjectId(1 << 20));
        assert_eq!(idx.lookup(&[3; 32]).1, 0);
    }

    /// The window the index reports is honest: filled to it, every entry is found
    /// (but for at most 0.2% in tables of a few buckets a shard).
    /// Prints the load at the first dropped entry (the margin above the window).
    #[test]
    fn the_window_holds_every_entry() {
        for (window, objects, seed) in [
            (100_000, 1 << 20, 1),
            (400_000, 1 << 26, 2),
            (2_000_000, 1 << 26, 5),
            (3_000, 1 << 16, 4),
            (30_000, 1 << 16, 3),
        ] {
            let idx = DedupIndex::new(window, objects);
            let window = idx.capacity();
            for i in 0..window {
                idx.insert(&fp_of(i, seed), ObjectId(i % objects));
            }
            // Large tables drop nothing; a table of a few buckets a shard a few.
            let (held, dropped) = idx.held_and_dropped();
            assert!(
                held + dropped == window && dropped * 500 <= window,
                "{dropped} of {window}"
            );
            let found = (0..window)
                .filter(|&i| finds(&idx, &fp_of(i, seed), i % objects))
                .count() as u64;
            assert_eq!(found, held);
            if window >= 100_000 {
                assert_eq!(dropped, 0);
            }
            let mut i = window;
            while idx.held_and_dropped().1 == 0 {
                idx.insert(&fp_of(i, seed), ObjectId(i % objects));
                i += 1;
            }
            let per_shard = idx.buckets_per_shard * BUCKET_SLOTS as u64;
            let shard_load = idx
                .shards
                .iter()
                .map(|s| s.lock())
                .find(|s| s.dropped > 0)
                .map_or(0, |s| s.held + s.dropped);
            eprintln!(
                "{} slots ({per_shard} a shard): window {window} ({:.2}% load); first entry dropped at \
                 {:.2}% load, {:.2}% in its shard",
                idx.slots(),
                100.0 * window as f64 / idx.slots() as f64,
                100.0 * i as f64 / idx.slots() as f64,
                100.0 * shard_load as f64 / per_shard as f64,
            );
        }
    }

    /// Past the window, the index keeps about as many entries as it has slots, a
    /// uniform sample: half the slots' worth of data twice over finds about half.
    #[test]
    fn past_the_window_a_sample_is_kept() {
        let idx = DedupIndex::new(50_000, 1 << 22);
        let n = idx.slots() * 2;
        for i in 0..n {
            idx.insert(&fp_of(i, 7), ObjectId(i));
        }
        let (held, dropped) = idx.held_and_dropped();
        assert!(
            held <= idx.slots() && held >= idx.slots() * 97 / 100,
            "{held}"
        );
        assert_eq!(held + dropped, n);
        let found = (0..n).filter(|&i| finds(&idx, &fp_of(i, 7), i)).count() as u64;
        assert!(found * 100 >= n * 45 && found <= held, "{found} of {n}");
        // The first and the second half are sampled alike (no cliff for old data).
        let first = (0..n / 2).filter(|&i| finds(&idx, &fp_of(i, 7), i)).count() as u64;
        assert!(first * 100 >= (n / 2) * 35, "{first} of {}", n / 2);
    }

    /// Sparse: only hooks (1 in 16, by fingerprint bits) enter, so the same memory
    /// covers 16 times the window; a non-hook is never found in the table.
    #[test]
    fn a_sparse_index_holds_only_hooks_over_sixteen_times_the_window() {
        let bytes = 1 << 20;
        let dense = DedupIndex::with_memory(bytes, 1 << 30, IndexMode::Dense);
        let sparse = DedupIndex::with_memory(bytes, 1 << 30, IndexMode::SPARSE);
        assert_eq!(sparse.memory_bytes(), dense.memory_bytes());
        assert_eq!(sparse.entries(), dense.entries());
        assert_eq!(sparse.capacity(), dense.capacity() << SPARSE_SAMPLE_SHIFT);
        // 1 GiB of memory covers at least 10 TiB of window (4 KiB blocks).
        let gib = DedupIndex::window_for_memory(1 << 30) << SPARSE_SAMPLE_SHIFT;
        assert!(gib * 4096 >= 10 << 40, "{gib} blocks");
        // Filled to its window: every hook is found, no non-hook is, none dropped.
        let n = sparse.capacity();
        let mut hooks = 0;
        for i in 0..n {
            sparse.insert(&fp_of(i, 11), ObjectId(i));
            hooks += u64::from(sparse.is_hook(&fp_of(i, 11)));
        }
        assert_eq!(sparse.held_and_dropped(), (hooks, 0));
        assert!(
            hooks * 16 > n * 9 / 10 && hooks * 16 < n * 11 / 10,
            "{hooks} of {n}"
        );
        for i in (0..n).step_by(7) {
            let fp = fp_of(i, 11);
            assert_eq!(finds(&sparse, &fp, i), sparse.is_hook(&fp), "{i}");
        }
        // Only hooks are removed (a non-hook was never there).
        let hook = (0..n).find(|&i| sparse.is_hook(&fp_of(i, 11))).unwrap();
        sparse.remove(&fp_of(hook, 11), ObjectId(hook));
        assert_eq!(sparse.held_and_dropped(), (hooks - 1, 0));
        assert_eq!(dense.mode(), IndexMode::Dense);
        assert_eq!(sparse.mode(), IndexMode::Sparse { shift: 4 });
    }

    #[test]
    fn memory_is_under_four_bytes_per_block_of_window() {
        // Small tables pay more per block: the shards' shares vary more.
        for window in [1 << 20, 3 << 20] {
            let idx = DedupIndex::new(window, 1 << 24);
            assert!(idx.capacity() >= window);
            assert!(
                idx.memory_bytes() <= idx.capacity() * 4 + 16 * INDEX_SHARDS as u64,
                "{window}"
            );
        }
        let bytes = 4 << 20;
        let idx = DedupIndex::with_memory(bytes, 1 << 24, IndexMode::Dense);
        assert!(idx.memory_bytes() <= bytes);
        assert_eq!(idx.capacity(), DedupIndex::window_for_memory(bytes));
        assert!(idx.capacity() * 4 >= bytes * 99 / 100);
    }
}
