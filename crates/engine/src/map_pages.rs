//! A block map's pages in memory: one page of 504 entries ([`MapPage`]), and the
//! sparse set of a volume's pages ([`MapPages`]), whose memory follows what was
//! written, not the volume's size.
//!
//! The map of a volume of `size_blocks` has `⌈size_blocks ÷ 504⌉` pages (its length,
//! from which the directory tree's shape follows, `docs/format.md` "Directory
//! trees"), but only the pages written are in memory: in chunks of [`CHUNK_PAGES`]
//! page slots, kept in an ordered map by chunk number and made on the first write
//! into one of them. A page never written has no entries (all unmapped) and no
//! durable copy, in memory or on disk. So a thin volume of 4 PiB with a few blocks
//! written takes a few chunks and pages, and every walk over a map (checkpoint,
//! load, delete, clone, resize, repair, recovery, usage counts) visits the chunks
//! in memory, never the volume's length.

use crate::page_share::Shares;
use crate::{EngineError, Result};
use fewerbytes_format::location::{MapEntry, ObjectId};
use fewerbytes_format::page::{PageRef, MAP_ENTRIES_PER_PAGE};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A page's entries, encoded. Volumes whose trees reach the same durable page
/// share one copy in memory; a change copies it first (`Arc::make_mut`).
pub type Entries = Arc<[u64; MAP_ENTRIES_PER_PAGE]>;

/// Page slots per chunk: a quarter of a level-1 directory page's 252 references, so
/// a chunk (63 × 40 bytes, 2.5 KiB) costs less than one written page's entries
/// (4,032 bytes): a map written at scattered places takes at most about 1.6 times
/// its pages' entries, and a map written densely about 1.01 times. A page lookup is
/// one search of the ordered map (a few thousand chunks for a TiB written) and an
/// index into the chunk.
pub const CHUNK_PAGES: u64 = 63;

/// One page of a block map.
#[derive(Default)]
pub struct MapPage {
    /// Encoded entries; `None` while the page has never been written (all unmapped).
    entries: Option<Entries>,
    /// Changed since the last checkpoint snapshot.
    dirty: bool,
    /// Its durable copy (none: never written).
    durable: PageRef,
    /// The durable copy failed its checks at open (`map_damage.rs`): no entries
    /// are known, and `durable` is kept as it is until the damage is cleared.
    damaged: bool,
    /// Its durable copy may be reached from other volumes' trees too
    /// (`page_share.rs`): never dirty, and made this volume's own
    /// ([`MapPage::make_own`]) before anything changes it.
    shared: bool,
}

impl MapPage {
    /// Entry `i` of the page.
    pub fn get(&self, i: usize) -> MapEntry {
        MapEntry::decode(
            self.entries
                .as_ref()
                .and_then(|e| e.get(i).copied())
                .unwrap_or(0),
        )
    }

    /// Set entry `i`; returns the old entry. A page that turns dirty counts in
    /// `dirty_pages`. A shared page must be made its volume's own first.
    pub fn set(&mut self, i: usize, entry: MapEntry, dirty_pages: &AtomicU64) -> Result<MapEntry> {
        self.refuse_shared()?;
        let entries = Arc::make_mut(
            self.entries
                .get_or_insert_with(|| Arc::new([0; MAP_ENTRIES_PER_PAGE])),
        );
        let old = entries
            .get(i)
            .copied()
            .map(MapEntry::decode)
            .unwrap_or(MapEntry::Unmapped);
        if let Some(e) = entries.get_mut(i) {
            *e = entry.encode();
        }
        self.turn_dirty(dirty_pages);
        Ok(old)
    }

    /// The error a change of a shared page is: every change makes the page its
    /// volume's own first ([`MapPage::make_own`]).
    fn refuse_shared(&self) -> Result<()> {
        if self.shared {
            return Err(EngineError::Invariant(format!(
                "a change to the shared map page at {:?} before it was made its volume's own",
                self.durable
            )));
        }
        Ok(())
    }

    /// Whether the page's durable copy may be reached from other trees too.
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// The page's durable copy is reached from other volumes' trees too (a clone
    /// or snapshot took it, or the open found it in several trees).
    pub fn mark_shared(&mut self) {
        self.shared = true;
    }

    /// Make the page its volume's own before it changes. When other trees still
    /// reach its durable copy, it leaves them that copy: from now on it is a new page
    /// (dirty, no durable copy) whose mapped objects each gain a reference, which
    /// are returned (once per entry) for the caller to add. When no other tree does
    /// any more (they were made their own, or deleted), it keeps its durable copy.
    pub fn make_own(&mut self, shares: &Shares, dirty_pages: &AtomicU64) -> Vec<ObjectId> {
        if !self.shared {
            return Vec::new();
        }
        self.shared = false;
        if !shares.leave(self.durable) {
            return Vec::new();
        }
        self.durable = PageRef::NONE;
        self.turn_dirty(dirty_pages);
        self.objects()
    }

    /// The page's entries as held in memory (shared with the pages of other trees
    /// that reach the same durable copy), if it was ever written.
    pub fn shared_entries(&self) -> Option<Entries> {
        self.entries.clone()
    }

    /// The objects the page's entries name, once per entry.
    pub fn objects(&self) -> Vec<ObjectId> {
        self.entries
            .iter()
            .flat_map(|e| e.iter())
            .filter_map(|e| MapEntry::decode(*e).object())
            .collect()
    }

    /// A tree stops reaching this page (its volume is deleted, shrunk past it or
    /// rolled back): the durable copy to free and the objects whose references to
    /// drop, once per entry, when no other tree reaches it; nothing when others do.
    pub fn leave(&mut self, shares: &Shares) -> (Option<PageRef>, Vec<ObjectId>) {
        if self.shared && shares.leave(self.durable) {
            return (None, Vec::new());
        }
        let durable = Some(self.durable).filter(|d| !d.is_none());
        (durable, self.objects())
    }

    /// A page for another volume's tree that reaches the same durable copy: the
    /// entries shared in memory and both pages marked shared; the caller counts the
    /// new referrer of the copy in the shares table (`Shares::join_all`). Only a
    /// clean page with a durable copy can be shared; `None` otherwise (the caller
    /// copies it instead).
    pub fn share(&mut self) -> Option<MapPage> {
        if self.dirty || self.damaged || self.durable.is_none() || self.entries.is_none() {
            return None;
        }
        self.shared = true;
        Some(MapPage {
            entries: self.entries.clone(),
            dirty: false,
            durable: self.durable,
            damaged: false,
            shared: true,
        })
    }

    fn turn_dirty(&mut self, dirty_pages: &AtomicU64) {
        if !self.dirty {
            self.dirty = true;
            dirty_pages.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The durable copy failed its checks (a scrub found it damaged): dirty, so the
    /// next checkpoint writes the entries in memory, the good copy, to a fresh slot.
    /// A shared page must be made its volume's own first.
    pub fn mark_dirty(&mut self, dirty_pages: &AtomicU64) -> Result<()> {
        self.refuse_shared()?;
        self.turn_dirty(dirty_pages);
        Ok(())
    }

    /// Whether the page was ever written (else every entry is unmapped).
    pub fn is_written(&self) -> bool {
        self.entries.is_some()
    }

    /// The encoded entries, if the page was ever written.
    pub fn encoded_entries(&self) -> Option<&[u64; MAP_ENTRIES_PER_PAGE]> {
        self.entries.as_deref()
    }

    /// Whether the page changed since the last checkpoint snapshot.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Its durable copy (none: never written).
    pub fn durable(&self) -> PageRef {
        self.durable
    }

    /// A checkpoint wrote the page at `at`: that is its durable copy now.
    pub fn written(&mut self, at: PageRef) {
        self.durable = at;
        self.dirty = false;
    }

    /// The page as loaded from its durable copy at `from`.
    pub fn loaded(&mut self, entries: Entries, from: PageRef) {
        self.entries = Some(entries);
        self.durable = from;
        self.dirty = false;
    }

    /// The page's durable copy at `from` failed its checks at open: its entries are
    /// unknown. Not dirty, so every checkpoint keeps `from` as it is.
    pub fn loaded_damaged(&mut self, from: PageRef) {
        self.entries = None;
        self.durable = from;
        self.dirty = false;
        self.damaged = true;
    }

    /// Whether the page's durable copy failed its checks at open.
    pub fn is_damaged(&self) -> bool {
        self.damaged
    }

    /// A repair clears the damage: every entry unmapped, dirty, so the next
    /// checkpoint writes the page afresh and retires the failed copy. A shared page
    /// must be made its volume's own first.
    pub fn clear_damage(&mut self, dirty_pages: &AtomicU64) -> Result<()> {
        self.refuse_shared()?;
        self.entries = Some(Arc::new([0; MAP_ENTRIES_PER_PAGE]));
        self.damaged = false;
        self.turn_dirty(dirty_pages);
        Ok(())
    }

    /// The page has no durable copy any more (a version-1 pool's upgrade writes every
    /// page afresh): dirty if it holds entries.
    pub fn forget_durable(&mut self) {
        self.durable = PageRef::NONE;
        self.dirty = self.entries.is_some();
    }

    /// A clone's page that cannot share `from`'s durable copy (changed since the
    /// last checkpoint): its entries (in memory still shared), dirty, its own page.
    pub fn copy_from(&mut self, from: &MapPage, dirty_pages: &AtomicU64) {
        if let Some(entries) = &from.entries {
            self.entries = Some(entries.clone());
            self.turn_dirty(dirty_pages);
        }
    }
}

/// One chunk of page slots.
type Chunk = [Mutex<MapPage>; CHUNK_PAGES as usize];

/// The pages of one block map in memory: its length, and the chunks written into.
#[derive(Default)]
pub struct MapPages {
    /// Pages the map has: `⌈size_blocks ÷ 504⌉`, whether written or not.
    len: u64,
    /// Chunks by number (chunk `c` holds pages `c × CHUNK_PAGES ..`), each made on the
    /// first write into one of its pages. None reaches past `len`.
    chunks: BTreeMap<u64, Box<Chunk>>,
}

impl MapPages {
    /// A map of `len` pages, none in memory.
    pub fn new(len: u64) -> Self {
        MapPages {
            len,
            chunks: BTreeMap::new(),
        }
    }

    /// Pages the map has (written or not): its directory tree's table length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Page `p`, if its chunk is in memory (a page of a chunk may itself be unwritten:
    /// [`MapPage::is_written`]). `None` past the map's end.
    pub fn get(&self, p: u64) -> Option<&Mutex<MapPage>> {
        if p >= self.len {
            return None;
        }
        self.chunks
            .get(&(p / CHUNK_PAGES))?
            .get((p % CHUNK_PAGES) as usize)
    }

    /// Make page `p`'s chunk, if it is not in memory. Returns whether `p` is a page
    /// of the map (false past its end: nothing is made).
    pub fn make(&mut self, p: u64) -> bool {
        if p >= self.len {
            return false;
        }
        self.chunks
            .entry(p / CHUNK_PAGES)
            .or_insert_with(|| Box::new(std::array::from_fn(|_| Mutex::default())));
        true
    }

    /// The pages in memory from page `first` on, in order, with their numbers.
    pub fn iter_from(&self, first: u64) -> impl Iterator<Item = (u64, &Mutex<MapPage>)> + '_ {
        let len = self.len;
        self.chunks
            .range(first / CHUNK_PAGES..)
            .flat_map(|(c, chunk)| {
                chunk
                    .iter()
                    .enumerate()
                    .map(move |(i, page)| (c * CHUNK_PAGES + i as u64, page))
            })
            .skip_while(move |(p, _)| *p < first)
            .take_while(move |(p, _)| *p < len)
    }

    /// Every page in memory, in order, with its number.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Mutex<MapPage>)> + '_ {
        self.iter_from(0)
    }

    /// The first page in memory at or after `p`, if any: a walk over a range skips
    /// from there to it (everything between is unwritten).
    pub fn next_in_memory(&self, p: u64) -> Option<u64> {
        let (c, _) = self.chunks.range(p / CHUNK_PAGES..).next()?;
        Some((c * CHUNK_PAGES).max(p)).filter(|&q| q < self.len)
    }

    /// Page slots in memory (whole chunks), the pages of them written, and of
    /// those the pages whose entries no other map shares in memory.
    pub fn memory(&self) -> (u64, u64, u64) {
        let slots = self.chunks.len() as u64 * CHUNK_PAGES;
        let (mut written, mut alone) = (0, 0);
        for page in self.chunks.values().flat_map(|chunk| chunk.iter()) {
            if let Some(entries) = &page.lock().entries {
                written += 1;
                alone += u64::from(Arc::strong_count(entries) == 1);
            }
        }
        (slots, written, alone)
    }

    /// Bytes of memory a chunk of slots takes.
    pub fn chunk_bytes() -> u64 {
        std::mem::size_of::<Chunk>() as u64
    }

    /// Change the map's length to `len` pages. Pages past it leave memory (the caller
    /// unmapped their entries and retired their durable copies first), so a later
    /// growth finds them unwritten.
    pub fn set_len(&mut self, len: u64) {
        drop(self.chunks.split_off(&len.div_ceil(CHUNK_PAGES)));
        if let Some(chunk) = self.chunks.get_mut(&(len / CHUNK_PAGES)) {
            for page in chunk.iter_mut().skip((len % CHUNK_PAGES) as usize) {
                *page.get_mut() = MapPage::default();
            }
        }
        self.len = len;
    }

    /// A clone's, snapshot's or rollback's map: every written page of `from`,
    /// sharing its durable copy when it has one and is clean (`MapPage::share`:
    /// nothing is copied and no reference taken, whatever the map's size), else
    /// copied, dirty. Returns the objects the copied pages' entries name, once per
    /// entry (each gains a reference).
    pub fn share_from(
        &mut self,
        from: &MapPages,
        shares: &Shares,
        dirty_pages: &AtomicU64,
    ) -> Vec<ObjectId> {
        let mut copied = Vec::new();
        let mut joined = Vec::new();
        // Chunk by chunk: one lookup per 63 pages, and the shares table locked once.
        for (&c, chunk) in &from.chunks {
            let first = c * CHUNK_PAGES;
            if first >= self.len {
                break;
            }
            let target = self
                .chunks
                .entry(c)
                .or_insert_with(|| Box::new(std::array::from_fn(|_| Mutex::default())));
            for (i, (source, page)) in chunk.iter().zip(target.iter_mut()).enumerate() {
                if first + i as u64 >= self.len {
                    break;
                }
                let mut source = source.lock();
                if !source.is_written() {
                    continue;
                }
                let page = page.get_mut();
                match source.share() {
                    Some(shared) => {
                        joined.push(shared.durable);
                        *page = shared;
                    }
                    None => {
                        page.copy_from(&source, dirty_pages);
                        copied.extend(source.objects());
                    }
                }
            }
        }
        shares.join_all(&joined);
        copied
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests fail loudly by design")]
mod tests {
    use super::*;

    fn write(pages: &mut MapPages, p: u64, dirty: &AtomicU64) {
        assert!(pages.make(p));
        pages
            .get(p)
            .unwrap()
            .lock()
            .set(0, MapEntry::Object(ObjectId(p + 1)), dirty)
            .unwrap();
    }

    #[test]
    fn only_the_chunks_written_into_are_in_memory() {
        // The largest map: 2,181,570,691 pages, three written.
        let len = 2_181_570_691;
        let dirty = AtomicU64::new(0);
        let mut pages = MapPages::new(len);
        for p in [0, len / 2, len - 1] {
            write(&mut pages, p, &dirty);
        }
        assert_eq!(pages.memory(), (3 * CHUNK_PAGES, 3, 3));
        let numbers: Vec<u64> = pages
            .iter()
            .filter(|(_, page)| page.lock().is_written())
            .map(|(p, _)| p)
            .collect();
        assert_eq!(numbers, [0, len / 2, len - 1]);
        assert!(!pages.make(len), "past the end nothing is made");
        assert!(pages.get(len).is_none());
        assert_eq!(pages.next_in_memory(1), Some(1), "chunk 0 is in memory");
        assert_eq!(
            pages.next_in_memory(CHUNK_PAGES),
            Some(len / 2 / CHUNK_PAGES * CHUNK_PAGES)
        );
        assert_eq!(pages.next_in_memory(len), None);
    }

    #[test]
    fn a_shrink_forgets_the_pages_past_the_end_and_a_growth_finds_them_unwritten() {
        let dirty = AtomicU64::new(0);
        let mut pages = MapPages::new(1000);
        for p in [10, 70, 71, 999] {
            write(&mut pages, p, &dirty);
        }
        pages.set_len(71);
        assert_eq!(pages.memory(), (2 * CHUNK_PAGES, 2, 2));
        pages.set_len(1000);
        assert!(!pages.get(71).unwrap().lock().is_written());
        assert!(pages.get(999).is_none());
        // Pages changed since the last checkpoint are copied, not shared.
        let mut clone = MapPages::new(1000);
        let copied = clone.share_from(&pages, &Shares::default(), &dirty);
        assert_eq!(copied, [ObjectId(11), ObjectId(71)]);
        assert_eq!(clone.memory(), (2 * CHUNK_PAGES, 2, 0));
    }

    #[test]
    fn a_clone_shares_clean_pages_and_a_change_or_a_delete_leaves_them_to_the_other_tree() {
        let dirty = AtomicU64::new(0);
        let shares = Shares::default();
        let mut pages = MapPages::new(100);
        write(&mut pages, 3, &dirty);
        let at = PageRef {
            address: 500,
            ..PageRef::NONE
        };
        pages.get(3).unwrap().lock().written(at);
        let mut clone = MapPages::new(100);
        assert!(clone.share_from(&pages, &shares, &dirty).is_empty());
        assert_eq!(shares.referrers(at), 2);
        let mut mine = clone.get(3).unwrap().lock();
        assert!(mine.is_shared() && !mine.is_dirty());
        assert!(
            mine.set(1, MapEntry::Zero, &dirty).is_err(),
            "shared: made own first"
        );
        // Made its own: a new page, whose object gains a reference.
        assert_eq!(mine.make_own(&shares, &dirty), [ObjectId(4)]);
        assert!(mine.is_dirty() && mine.durable().is_none());
        mine.set(1, MapEntry::Zero, &dirty).unwrap();
        assert_eq!(mine.get(0), MapEntry::Object(ObjectId(4)));
        drop(mine);
        // The source's page is its alone again: it keeps its durable copy, and a
        // delete frees it and drops its reference.
        let mut theirs = pages.get(3).unwrap().lock();
        assert_eq!(
            theirs.get(1),
            MapEntry::Unmapped,
            "the change stayed in the clone"
        );
        assert!(theirs.make_own(&shares, &dirty).is_empty());
        assert_eq!(theirs.durable(), at);
        assert_eq!(theirs.leave(&shares), (Some(at), vec![ObjectId(4)]));
    }
}
