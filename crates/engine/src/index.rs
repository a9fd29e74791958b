//! The dedup index: advice, in bounded memory, on where a fingerprint was stored.
//!
//! A set-associative table of (fingerprint tag, object) pairs, split into shards
//! (hash zones) each behind its own lock. The first 8 bytes of the fingerprint pick
//! the shard and bucket; the next 3 are the entry's tag, so a lookup's 4 comparisons
//! find a wrong candidate about once in 4 million, and that costs only a refused
//! advice. An entry is 8 bytes: a 24-bit tag and a 40-bit object id (a trillion
//! objects). A full bucket evicts an entry, so the index remembers at most `entries`
//! distinct blocks: that is the dedup window.
//! Advice is never trusted: the caller compares the full fingerprint stored in the
//! object record and checks the object is live. The index is not persisted; it is
//! rebuilt from the slab object records at open.

use fewerbytes_format::location::ObjectId;
use parking_lot::Mutex;

/// Entries per bucket: a lookup compares at most this many prefixes.
pub const BUCKET_ENTRIES: usize = 4;
/// Shards (hash zones); a power of two so the shard is a mask of the prefix.
pub const INDEX_SHARDS: usize = 64;
/// Bytes of memory per entry.
pub const ENTRY_BYTES: u64 = 8;
/// Bits of an entry that hold the object id.
const OBJECT_BITS: u32 = 40;
const OBJECT_MASK: u64 = (1 << OBJECT_BITS) - 1;

/// `tag << 40 | object`; 0 marks an empty entry (tags are never 0).
#[derive(Clone, Copy, Default, PartialEq, Eq)]
struct Entry(u64);

impl Entry {
    /// `None` for an object id too large to fit (never advised, so never deduplicated
    /// against; pools that large do not exist).
    fn new(tag: u32, object: ObjectId) -> Option<Entry> {
        (object.0 <= OBJECT_MASK).then_some(Entry(u64::from(tag) << OBJECT_BITS | object.0))
    }
    fn tag(self) -> u32 {
        (self.0 >> OBJECT_BITS) as u32
    }
    fn object(self) -> ObjectId {
        ObjectId(self.0 & OBJECT_MASK)
    }
    fn is_empty(self) -> bool {
        self.0 == 0
    }
}

struct Shard {
    buckets: Vec<[Entry; BUCKET_ENTRIES]>,
    next_victim: usize,
}

/// The index.
pub struct DedupIndex {
    shards: Vec<Mutex<Shard>>,
    buckets_per_shard: u64,
}

/// Where a fingerprint lives (its first 8 bytes), and its tag (the next 3, never 0).
fn key_of(fp: &[u8; 32]) -> (u64, u32) {
    let mut b = [0u8; 8];
    b.copy_from_slice(fp.get(..8).unwrap_or(&[0; 8]));
    let mut t = [0u8; 4];
    t[..3].copy_from_slice(fp.get(8..11).unwrap_or(&[0; 3]));
    (u64::from_le_bytes(b), u32::from_le_bytes(t).max(1))
}

impl DedupIndex {
    /// An index remembering about `entries` blocks.
    pub fn new(entries: u64) -> Self {
        let buckets_total = (entries / BUCKET_ENTRIES as u64).max(INDEX_SHARDS as u64);
        let buckets_per_shard = buckets_total.div_ceil(INDEX_SHARDS as u64);
        let shards = (0..INDEX_SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    buckets: vec![[Entry::default(); BUCKET_ENTRIES]; buckets_per_shard as usize],
                    next_victim: 0,
                })
            })
            .collect();
        DedupIndex {
            shards,
            buckets_per_shard,
        }
    }

    /// Entries the index holds at most.
    pub fn capacity(&self) -> u64 {
        self.buckets_per_shard * INDEX_SHARDS as u64 * BUCKET_ENTRIES as u64
    }

    /// Bytes of memory it takes.
    pub fn memory_bytes(&self) -> u64 {
        self.capacity() * ENTRY_BYTES
    }

    fn place(&self, key: u64) -> (usize, usize) {
        let shard = (key as usize) % INDEX_SHARDS;
        let bucket = ((key >> 8) % self.buckets_per_shard) as usize;
        (shard, bucket)
    }

    /// Candidate objects for `fp` (at most `BUCKET_ENTRIES`).
    pub fn lookup(&self, fp: &[u8; 32]) -> ([Option<ObjectId>; BUCKET_ENTRIES], usize) {
        let (key, tag) = key_of(fp);
        let (s, b) = self.place(key);
        let mut out = [None; BUCKET_ENTRIES];
        let mut n = 0;
        if let Some(shard) = self.shards.get(s) {
            let shard = shard.lock();
            if let Some(bucket) = shard.buckets.get(b) {
                for e in bucket.iter().filter(|e| !e.is_empty() && e.tag() == tag) {
                    if let Some(slot) = out.get_mut(n) {
                        *slot = Some(e.object());
                        n += 1;
                    }
                }
            }
        }
        (out, n)
    }

    /// The entry `fp` → `object` would be, its shard (locked) and its bucket index;
    /// `None` for an object id too large for an entry.
    fn locate(
        &self,
        fp: &[u8; 32],
        object: ObjectId,
    ) -> Option<(Entry, parking_lot::MutexGuard<'_, Shard>, usize)> {
        let (key, tag) = key_of(fp);
        let entry = Entry::new(tag, object)?;
        let (s, b) = self.place(key);
        Some((entry, self.shards.get(s)?.lock(), b))
    }

    /// Remember that `fp` is stored as `object`.
    pub fn insert(&self, fp: &[u8; 32], object: ObjectId) {
        let Some((entry, mut shard, b)) = self.locate(fp, object) else {
            return;
        };
        let victim = shard.next_victim;
        let Some(bucket) = shard.buckets.get_mut(b) else {
            return;
        };
        let pos = bucket
            .iter()
            .position(|e| *e == entry)
            .or_else(|| bucket.iter().position(|e| e.is_empty()));
        let i = pos.unwrap_or(victim % BUCKET_ENTRIES);
        if let Some(e) = bucket.get_mut(i) {
            *e = entry;
        }
        if pos.is_none() {
            shard.next_victim = shard.next_victim.wrapping_add(1);
        }
    }

    /// Forget `object` under `fp` (it was freed).
    pub fn remove(&self, fp: &[u8; 32], object: ObjectId) {
        let Some((entry, mut shard, b)) = self.locate(fp, object) else {
            return;
        };
        if let Some(bucket) = shard.buckets.get_mut(b) {
            for e in bucket.iter_mut().filter(|e| **e == entry) {
                *e = Entry::default();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inserted_advice_is_found_and_removed() {
        let idx = DedupIndex::new(1024);
        let fp = [7u8; 32];
        idx.insert(&fp, ObjectId(42));
        let (c, n) = idx.lookup(&fp);
        assert_eq!(n, 1);
        assert_eq!(c[0], Some(ObjectId(42)));
        idx.remove(&fp, ObjectId(42));
        assert_eq!(idx.lookup(&fp).1, 0);
    }

    #[test]
    fn entries_keep_tag_and_object_apart() {
        let e = Entry::new(0xab_cdef, ObjectId(OBJECT_MASK)).expect("fits");
        assert_eq!((e.tag(), e.object()), (0xab_cdef, ObjectId(OBJECT_MASK)));
        assert!(Entry::new(1, ObjectId(OBJECT_MASK + 1)).is_none());
        // Two fingerprints that differ only past the tag share a bucket and a tag:
        // both are offered, and the caller's full comparison tells them apart.
        let idx = DedupIndex::new(1024);
        let (a, mut b) = ([9u8; 32], [9u8; 32]);
        b[31] = 0;
        idx.insert(&a, ObjectId(1));
        idx.insert(&b, ObjectId(2));
        let (c, n) = idx.lookup(&a);
        assert_eq!(n, 2);
        assert!(c.contains(&Some(ObjectId(1))) && c.contains(&Some(ObjectId(2))));
        // One whose tag differs is not offered.
        let mut other = a;
        other[9] ^= 1;
        assert_eq!(idx.lookup(&other).1, 0);
    }

    #[test]
    fn a_full_index_stays_within_its_capacity() {
        let idx = DedupIndex::new(256);
        for i in 0..10_000u64 {
            let mut fp = [0u8; 32];
            fp[..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
            idx.insert(&fp, ObjectId(i));
        }
        let held: usize = idx
            .shards
            .iter()
            .map(|s| {
                s.lock()
                    .buckets
                    .iter()
                    .flatten()
                    .filter(|e| !e.is_empty())
                    .count()
            })
            .sum();
        assert!(held as u64 <= idx.capacity());
    }
}
