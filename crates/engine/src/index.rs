//! The dedup index: advice, in bounded memory, on where a fingerprint was stored.
//!
//! A set-associative table of (fingerprint prefix, object) pairs, split into shards
//! (hash zones) each behind its own lock. A full bucket evicts an entry, so the
//! index remembers at most `entries` distinct blocks: that is the dedup window.
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
pub const ENTRY_BYTES: u64 = 16;

#[derive(Clone, Copy, Default)]
struct Entry {
    /// Fingerprint prefix; 0 marks an empty entry (a real prefix of 0 is stored as 1).
    tag: u64,
    object: u64,
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

fn tag_of(fp: &[u8; 32]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(fp.get(..8).unwrap_or(&[0; 8]));
    u64::from_le_bytes(b).max(1)
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

    fn place(&self, tag: u64) -> (usize, usize) {
        let shard = (tag as usize) % INDEX_SHARDS;
        let bucket = ((tag >> 8) % self.buckets_per_shard) as usize;
        (shard, bucket)
    }

    /// Candidate objects for `fp` (at most `BUCKET_ENTRIES`).
    pub fn lookup(&self, fp: &[u8; 32]) -> ([Option<ObjectId>; BUCKET_ENTRIES], usize) {
        let tag = tag_of(fp);
        let (s, b) = self.place(tag);
        let mut out = [None; BUCKET_ENTRIES];
        let mut n = 0;
        if let Some(shard) = self.shards.get(s) {
            let shard = shard.lock();
            if let Some(bucket) = shard.buckets.get(b) {
                for e in bucket.iter().filter(|e| e.tag == tag) {
                    if let Some(slot) = out.get_mut(n) {
                        *slot = Some(ObjectId(e.object));
                        n += 1;
                    }
                }
            }
        }
        (out, n)
    }

    /// Remember that `fp` is stored as `object`.
    pub fn insert(&self, fp: &[u8; 32], object: ObjectId) {
        let tag = tag_of(fp);
        let (s, b) = self.place(tag);
        let Some(shard) = self.shards.get(s) else {
            return;
        };
        let mut shard = shard.lock();
        let victim = shard.next_victim;
        let Some(bucket) = shard.buckets.get_mut(b) else {
            return;
        };
        let pos = bucket
            .iter()
            .position(|e| e.tag == tag && e.object == object.0)
            .or_else(|| bucket.iter().position(|e| e.tag == 0));
        let i = pos.unwrap_or(victim % BUCKET_ENTRIES);
        if let Some(e) = bucket.get_mut(i) {
            *e = Entry {
                tag,
                object: object.0,
            };
        }
        if pos.is_none() {
            shard.next_victim = shard.next_victim.wrapping_add(1);
        }
    }

    /// Forget `object` under `fp` (it was freed).
    pub fn remove(&self, fp: &[u8; 32], object: ObjectId) {
        let tag = tag_of(fp);
        let (s, b) = self.place(tag);
        let Some(shard) = self.shards.get(s) else {
            return;
        };
        let mut shard = shard.lock();
        if let Some(bucket) = shard.buckets.get_mut(b) {
            for e in bucket
                .iter_mut()
                .filter(|e| e.tag == tag && e.object == object.0)
            {
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
                    .filter(|e| e.tag != 0)
                    .count()
            })
            .sum();
        assert!(held as u64 <= idx.capacity());
    }
}
