//! Reading the journal for replay: where it ends, which bad sectors are damage
//! rather than its torn end, and rebuilding a bad sector from its group's parity.
//!
//! The commit thread writes a commit's sectors, syncs, and only then writes the next
//! commit (`journal.rs`). So when a sector of a commit that began after sector *b*
//! is found whole, every sector before it was durable, and a bad sector *b* is
//! damage, not a torn tail; a bad sector inside the last commit found is its torn
//! end. Sectors say where their commit began (their index in it) only in pools with
//! the journal-commits flag; without it the first bad sector is the end, as it was.
//!
//! The ring window (`journal_sectors` from `replay_seq`) is read once and each
//! sector classified; the walk then applies commits in order, rebuilding one bad
//! record sector per parity group from the group's other sectors (read again: rare).

use crate::error::within_mut;
use crate::journal::open_gen_continues;
use crate::{EngineError, Result};
use fewerbytes_format::journal::{
    decode_parity, decode_sector, is_parity, rebuild_sector, Record, PARITY_GROUP_SECTORS,
};
use fewerbytes_format::{BLOCK_BYTES, SECTOR_BYTES};
use fewerbytes_storage::Storage;

/// Sectors read at once.
const CHUNK_SECTORS: u64 = 2048;

/// Where the ring is and what a sector must carry to be read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ring {
    /// The pool's nonce.
    pub nonce: u64,
    /// First block of the ring on the metadata device.
    pub start_block: u64,
    /// Sectors in the ring.
    pub sectors: u64,
    /// First sequence number to replay.
    pub replay_seq: u64,
    /// The open generation of the super block replayed from: sectors carry it or a
    /// later one, never going down along the sequence (`journal.rs:
    /// open_gen_continues`: a replay from the older super block copy reads through
    /// sectors of the opens after it).
    pub open_gen: u32,
    /// Sectors carry their commit and are covered by parity (super block flag).
    pub commits: bool,
}

impl Ring {
    fn offset_bytes(&self, seq: u64) -> u64 {
        self.start_block * BLOCK_BYTES as u64 + (seq % self.sectors) * SECTOR_BYTES as u64
    }
}

/// A journal sector that could be neither read nor rebuilt although a later commit
/// is whole: flushed changes in it are lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LostSector {
    /// Its sequence number.
    pub seq: u64,
    /// Its byte offset on the metadata device.
    pub offset_bytes: u64,
    /// Why it could not be read.
    pub why: String,
}

/// What the journal holds.
#[derive(Debug, Default)]
pub(crate) struct JournalRead {
    /// Records to replay, in order (without those of lost sectors).
    pub records: Vec<Record>,
    /// The sequence number after the last sector read.
    pub next_seq: u64,
    /// Sectors rebuilt from parity.
    pub rebuilt: Vec<u64>,
    /// Durable sectors lost (damage): empty unless the journal was damaged beyond
    /// what its parity rebuilds.
    pub lost: Vec<LostSector>,
    /// The last sequence number found whole (for the message on damage).
    pub last_whole_seq: u64,
}

impl JournalRead {
    /// The error an open that may not lose changes returns for lost sectors.
    pub(crate) fn damage(&self) -> Option<EngineError> {
        let first = self.lost.first()?;
        // A person reads it: the first few, and how many more.
        const NAMED_MAX: usize = 8;
        let mut seqs: Vec<String> = self
            .lost
            .iter()
            .take(NAMED_MAX)
            .map(|l| l.seq.to_string())
            .collect();
        if self.lost.len() > NAMED_MAX {
            seqs.push(format!("and {} more", self.lost.len() - NAMED_MAX));
        }
        Some(EngineError::Corrupt {
            region: "journal",
            block: first.offset_bytes / BLOCK_BYTES as u64,
            device: "metadata",
            reason: format!(
                "journal sector(s) seq {} (the first at byte {} of the metadata device: {}) \
                 cannot be read or rebuilt from parity, while commits written after them \
                 (up to seq {}) are whole: flushed changes are lost, not a torn end; \
                 `fewerbytes check --repair` replays the rest and lists what was lost",
                seqs.join(", "),
                first.offset_bytes,
                first.why,
                self.last_whole_seq
            ),
        })
    }
}

/// One sector of the window, as read.
enum Slot {
    /// A record sector with the expected sequence and a generation that continues.
    Records {
        index: u16,
        records: Vec<Record>,
        gen: u32,
    },
    /// A parity sector with the expected sequence and a generation that continues.
    Parity { index: u16, covers: u16, gen: u32 },
    /// Neither: torn, stale, damaged; why.
    Bad(String),
}

impl Slot {
    /// Offset in the window of the first sector of this sector's commit.
    fn commit_start(&self, pos: u64) -> Option<u64> {
        match self {
            Slot::Records { index, .. } | Slot::Parity { index, .. } => {
                pos.checked_sub(u64::from(*index))
            }
            Slot::Bad(_) => None,
        }
    }

    /// The open generation of a whole sector.
    fn gen(&self) -> Option<u32> {
        match self {
            Slot::Records { gen, .. } | Slot::Parity { gen, .. } => Some(*gen),
            Slot::Bad(_) => None,
        }
    }
}

/// Read the journal from `ring.replay_seq`.
pub(crate) fn read_journal(meta: &dyn Storage, ring: &Ring) -> Result<JournalRead> {
    if !ring.commits {
        return read_plain(meta, ring);
    }
    let mut slots = classify(meta, ring)?;
    // later_start[p]: the latest commit start among whole sectors at p or after.
    let mut later_start = vec![None::<u64>; slots.len() + 1];
    for p in (0..slots.len()).rev() {
        let here = slots.get(p).and_then(|s| s.commit_start(p as u64));
        let after = later_start.get(p + 1).copied().flatten();
        if let Some(dst) = later_start.get_mut(p) {
            *dst = here.max(after);
        }
    }
    let mut walk = Walk::default();
    let mut out = JournalRead::default();
    let mut pos = 0u64;
    while pos < slots.len() as u64 {
        let accepted = walk.accepts(&slots, pos);
        if !accepted {
            if let Some(rebuilt) = try_rebuild(meta, ring, &slots, &walk, pos)? {
                out.rebuilt.push(ring.replay_seq + pos);
                tracing::warn!(
                    "journal sector seq {} was bad and is rebuilt from its parity",
                    ring.replay_seq + pos
                );
                set_slot(&mut slots, pos, rebuilt);
                continue;
            }
            if walk.lost_parity(&slots, pos) {
                walk.group = 0;
                pos += 1;
                continue;
            }
            // Damage when a commit that began after this sector is whole.
            let later = later_start.get(pos as usize + 1).copied().flatten();
            if later.is_none_or(|start| start <= pos) {
                break;
            }
            let why = match slots.get(pos as usize) {
                Some(Slot::Bad(why)) => why.clone(),
                _ => "a whole sector out of its commit's order".to_string(),
            };
            out.lost.push(LostSector {
                seq: ring.replay_seq + pos,
                offset_bytes: ring.offset_bytes(ring.replay_seq + pos),
                why,
            });
            walk.resync = true;
            pos += 1;
            continue;
        }
        if let Some(Slot::Records { records, .. }) = slots.get_mut(pos as usize) {
            out.records.append(records);
        }
        out.last_whole_seq = ring.replay_seq + pos;
        pos += 1;
    }
    out.next_seq = ring.replay_seq + pos;
    Ok(out)
}

/// The walk's place: the commit it is in and its open parity group.
#[derive(Default)]
struct Walk {
    /// Offset of the current commit's first sector; `None` before the first.
    commit: Option<u64>,
    /// Record sectors since the current group's parity (0: the group is closed, and
    /// the commit may end here).
    group: usize,
    /// A lost sector came before: the next whole sector of a commit that began at or
    /// after the one before it is taken as it stands.
    resync: bool,
}

impl Walk {
    /// Whether the sector at `pos` continues the journal; if so, the walk moves past it.
    fn accepts(&mut self, slots: &[Slot], pos: u64) -> bool {
        let Some(slot) = slots.get(pos as usize) else {
            return false;
        };
        let Some(start) = slot.commit_start(pos) else {
            return false;
        };
        let group_place = |index: u16| usize::from(index) % (PARITY_GROUP_SECTORS + 1);
        if self.resync {
            if self.commit.is_some_and(|c| start < c) {
                return false;
            }
            self.resync = false;
            self.commit = Some(start);
            self.group = match slot {
                Slot::Records { index, .. } => group_place(*index) + 1,
                _ => 0,
            };
            return true;
        }
        let same = self.commit == Some(start);
        let new_commit = start == pos && self.group == 0;
        match slot {
            Slot::Records { .. } if new_commit => {
                self.commit = Some(start);
                self.group = 1;
                true
            }
            Slot::Records { .. } if same && self.group < PARITY_GROUP_SECTORS => {
                self.group += 1;
                true
            }
            Slot::Parity { covers, .. }
                if same && self.group > 0 && usize::from(*covers) == self.group =>
            {
                self.group = 0;
                true
            }
            _ => false,
        }
    }

    /// Whether the bad sector at `pos` can only have been its group's parity, all of
    /// whose record sectors were read: a full group, or a commit that ends there (a
    /// commit begins at the next sector: that sector is whole, or a whole sector
    /// later says its commit began there, while the first may be torn). Nothing is
    /// lost with it.
    fn lost_parity(&self, slots: &[Slot], pos: u64) -> bool {
        if self.commit.is_none() || self.group == 0 {
            return false;
        }
        if self.group == PARITY_GROUP_SECTORS {
            return true;
        }
        let next = pos + 1;
        slots
            .iter()
            .enumerate()
            .skip(next as usize)
            .any(|(p, slot)| slot.commit_start(p as u64) == Some(next))
    }
}

fn set_slot(slots: &mut [Slot], pos: u64, slot: Slot) {
    if let Some(dst) = slots.get_mut(pos as usize) {
        *dst = slot;
    }
}

/// Read the sectors of the window from `seq` on, as many as `buf` holds, up to the
/// ring's wrap and the window's end (one read).
fn read_run<'b>(meta: &dyn Storage, ring: &Ring, buf: &'b mut [u8], seq: u64) -> Result<&'b [u8]> {
    let run = CHUNK_SECTORS
        .min(ring.sectors - seq % ring.sectors)
        .min(ring.sectors - (seq - ring.replay_seq));
    let chunk = within_mut(buf, 0..run as usize * SECTOR_BYTES, "a journal read chunk")?;
    meta.read_at(chunk, ring.offset_bytes(seq))?;
    Ok(chunk)
}

/// Read and classify every sector of the window.
fn classify(meta: &dyn Storage, ring: &Ring) -> Result<Vec<Slot>> {
    let mut slots = Vec::with_capacity(ring.sectors as usize);
    let mut buf = vec![0u8; CHUNK_SECTORS as usize * SECTOR_BYTES];
    while (slots.len() as u64) < ring.sectors {
        let seq = ring.replay_seq + slots.len() as u64;
        let chunk = read_run(meta, ring, &mut buf, seq)?;
        for (k, sector) in chunk.chunks(SECTOR_BYTES).enumerate() {
            slots.push(classify_one(sector, ring, seq + k as u64));
        }
    }
    demote_stale(&mut slots);
    Ok(slots)
}

/// A whole sector whose open generation is below one found before it is stale: an
/// earlier open wrote it, and a later open's sectors came before it in the
/// sequence, so it was never overwritten but is past where the later open wrote.
/// It must count neither as the journal's continuation nor as a later whole commit
/// (which would make the bad sector before it look like damage).
fn demote_stale(slots: &mut [Slot]) {
    let mut newest = 0u32;
    for slot in slots.iter_mut() {
        let Some(gen) = slot.gen() else { continue };
        if open_gen_continues(newest, gen) {
            newest = gen;
        } else {
            *slot = Slot::Bad(format!(
                "a stale sector of open generation {gen} after one of generation {newest}"
            ));
        }
    }
}

fn classify_one(sector: &[u8], ring: &Ring, seq: u64) -> Slot {
    if is_parity(sector) {
        return match decode_parity(sector, ring.nonce) {
            Ok(h) if h.seq == seq && open_gen_continues(ring.open_gen, h.open_gen) => {
                Slot::Parity {
                    index: h.index,
                    covers: h.covers,
                    gen: h.open_gen,
                }
            }
            Ok(h) => Slot::Bad(format!(
                "a parity sector of seq {} and open generation {}",
                h.seq, h.open_gen
            )),
            Err(e) => Slot::Bad(e.to_string()),
        };
    }
    match decode_sector(sector, ring.nonce) {
        Ok((h, records)) if h.seq == seq && open_gen_continues(ring.open_gen, h.open_gen) => {
            Slot::Records {
                index: h.index,
                records,
                gen: h.open_gen,
            }
        }
        Ok((h, _)) => Slot::Bad(format!(
            "a sector of seq {} and open generation {}",
            h.seq, h.open_gen
        )),
        Err(e) => Slot::Bad(e.to_string()),
    }
}

/// Rebuild the bad sector at `pos` from the parity of its group, if the group's
/// parity and every other sector of it are whole and the result passes its crc
/// and stands where its index says.
fn try_rebuild(
    meta: &dyn Storage,
    ring: &Ring,
    slots: &[Slot],
    walk: &Walk,
    pos: u64,
) -> Result<Option<Slot>> {
    if !matches!(slots.get(pos as usize), Some(Slot::Bad(_))) {
        return Ok(None);
    }
    // The group's parity is among the next PARITY_GROUP_SECTORS sectors.
    let parity =
        (pos + 1..=pos + PARITY_GROUP_SECTORS as u64).find_map(|q| match slots.get(q as usize) {
            Some(Slot::Parity { index, covers, gen })
                if q.checked_sub(u64::from(*covers))
                    .is_some_and(|first| first <= pos) =>
            {
                Some((
                    q,
                    q.checked_sub(u64::from(*index))?,
                    u64::from(*covers),
                    *gen,
                ))
            }
            _ => None,
        });
    let Some((q, start, covers, gen)) = parity else {
        return Ok(None);
    };
    // Where the walk is, this sector continues its commit or begins the next.
    let fits = match walk.commit {
        _ if walk.resync => true,
        Some(c) if walk.group > 0 => start == c,
        Some(c) => start == c || start == pos,
        None => start == pos,
    };
    let others_whole = (q - covers..q).filter(|&p| p != pos).all(|p| {
        matches!(slots.get(p as usize), Some(Slot::Records { index, .. })
            if p.checked_sub(u64::from(*index)) == Some(start))
    });
    if !fits || !others_whole || pos < start {
        return Ok(None);
    }
    let group = read_sectors(meta, ring, q - covers, covers + 1)?;
    let Some((parity_bytes, records)) = group.split_last() else {
        return Ok(None);
    };
    let others = records
        .iter()
        .enumerate()
        .filter(|(k, _)| q - covers + *k as u64 != pos)
        .map(|(_, s)| s);
    let seq = ring.replay_seq + pos;
    let bytes = rebuild_sector(parity_bytes, others, ring.nonce, seq, gen);
    Ok(match decode_sector(&bytes, ring.nonce) {
        Ok((h, records)) if u64::from(h.index) == pos - start => Some(Slot::Records {
            index: h.index,
            records,
            gen,
        }),
        _ => None,
    })
}

/// `count` sectors from window offset `from` (at most two runs: the ring may wrap).
fn read_sectors(
    meta: &dyn Storage,
    ring: &Ring,
    from: u64,
    count: u64,
) -> Result<Vec<[u8; SECTOR_BYTES]>> {
    let mut out = Vec::with_capacity(count as usize);
    for k in 0..count {
        let mut sector = [0u8; SECTOR_BYTES];
        meta.read_at(&mut sector, ring.offset_bytes(ring.replay_seq + from + k))?;
        out.push(sector);
    }
    Ok(out)
}

/// A pool without the journal-commits flag: its sectors do not say where their
/// commit began, so the first sector that fails its checks or carries another
/// sequence or generation is the end (damage cannot be told from a torn end).
/// Parity sectors are passed over: the newer super block copy of a pool opened
/// since the flag came may be lost, and the older one, without the flag, replays
/// the sectors written after it.
fn read_plain(meta: &dyn Storage, ring: &Ring) -> Result<JournalRead> {
    let mut out = JournalRead::default();
    let mut seq = ring.replay_seq;
    let mut last_gen = ring.open_gen;
    let mut buf = vec![0u8; CHUNK_SECTORS as usize * SECTOR_BYTES];
    'outer: while seq - ring.replay_seq < ring.sectors {
        let chunk = read_run(meta, ring, &mut buf, seq)?;
        for sector in chunk.chunks(SECTOR_BYTES) {
            // Sectors written since the pool took the journal-commits flag (a replay
            // from the older super block copy, written before it, reads them too):
            // their parity sectors carry nothing to replay.
            if is_parity(sector) {
                match decode_parity(sector, ring.nonce) {
                    Ok(h) if h.seq == seq && open_gen_continues(last_gen, h.open_gen) => {
                        last_gen = h.open_gen;
                        seq += 1;
                        continue;
                    }
                    _ => break 'outer,
                }
            }
            match decode_sector(sector, ring.nonce) {
                Ok((h, mut records))
                    if h.seq == seq && open_gen_continues(last_gen, h.open_gen) =>
                {
                    last_gen = h.open_gen;
                    out.records.append(&mut records);
                    out.last_whole_seq = seq;
                    seq += 1;
                }
                _ => break 'outer,
            }
        }
    }
    out.next_seq = seq;
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::journal::Journal;
    use fewerbytes_format::location::MapEntry;
    use fewerbytes_storage::FaultStorage;

    const NONCE: u64 = 7;
    const SECTORS: u64 = 512;
    const GEN: u32 = 3;

    fn ring() -> Ring {
        Ring {
            nonce: NONCE,
            start_block: 0,
            sectors: SECTORS,
            replay_seq: 0,
            open_gen: GEN,
            commits: true,
        }
    }

    /// Commits of `records[i]` MapSet records each (30 fill a sector); the sequence
    /// number each commit began at.
    fn commits(meta: &FaultStorage, records: &[u64]) -> Vec<u64> {
        let j = Journal::new(NONCE, 0, SECTORS, 0, GEN);
        let mut lbn = 0;
        let mut starts = Vec::new();
        for &n in records {
            for _ in 0..n {
                j.append(&Record::MapSet {
                    volume: 0,
                    lbn,
                    entry: MapEntry::Zero,
                });
                lbn += 1;
            }
            let batch = j.take_batch();
            starts.push(j.next_seq());
            let (sectors, _) = j.write_batch(meta, &batch).unwrap();
            j.batch_durable(&batch, sectors);
        }
        starts
    }

    fn spoil(meta: &FaultStorage, seq: u64) {
        meta.write_at(&[0xff; 8], seq * SECTOR_BYTES as u64 + 100)
            .unwrap();
    }

    #[test]
    fn a_bad_sector_is_rebuilt_and_two_in_a_group_before_a_later_commit_are_damage() {
        let meta = FaultStorage::new("meta", SECTORS * SECTOR_BYTES as u64);
        // 40 sectors of records (two full groups and one of 8): 43 sectors; then
        // a second commit of one sector and its parity.
        let starts = commits(&meta, &[40 * 30, 30]);
        assert_eq!(starts, vec![0, 43]);
        let whole = read_journal(&meta, &ring()).unwrap();
        assert_eq!(whole.records.len(), 41 * 30);
        assert_eq!(whole.next_seq, 45);

        spoil(&meta, 5);
        let one = read_journal(&meta, &ring()).unwrap();
        assert_eq!(one.records, whole.records);
        assert_eq!(one.rebuilt, vec![5]);

        spoil(&meta, 6);
        let two = read_journal(&meta, &ring()).unwrap();
        let lost: Vec<u64> = two.lost.iter().map(|l| l.seq).collect();
        assert_eq!(lost, vec![5, 6], "damage, not the end: commit 43 is whole");
        assert_eq!(two.records.len(), 39 * 30, "every other record is read");
        assert!(two.damage().is_some());
    }

    #[test]
    fn bad_sectors_in_the_last_commit_are_its_torn_end() {
        let meta = FaultStorage::new("meta", SECTORS * SECTOR_BYTES as u64);
        commits(&meta, &[30, 20 * 30]);
        // The last commit: sectors 2.. (record sectors 2–17, parity 18, 19–22, 23).
        spoil(&meta, 4);
        spoil(&meta, 5);
        let torn = read_journal(&meta, &ring()).unwrap();
        assert!(torn.lost.is_empty(), "{:?}", torn.lost);
        assert_eq!(
            torn.records.len(),
            3 * 30,
            "the commit before, and its prefix"
        );
        assert_eq!(torn.next_seq, 4);
        // A bad parity sector loses nothing.
        let meta = FaultStorage::new("meta", SECTORS * SECTOR_BYTES as u64);
        commits(&meta, &[30, 20 * 30, 30]);
        spoil(&meta, 18);
        spoil(&meta, 23);
        let read = read_journal(&meta, &ring()).unwrap();
        assert!(read.lost.is_empty() && read.rebuilt.is_empty());
        assert_eq!(read.records.len(), 22 * 30);
    }

    #[test]
    fn a_bad_parity_before_a_torn_commit_loses_nothing() {
        // Commit 0: sector 0 and its parity 1; commit 2: sectors 2–3, parity 4. The
        // parity ending commit 0 rots, and a crash tore commit 2 (only its sector 3
        // landed): sector 3 says a commit began at 2, so sector 1 ended commit 0 and
        // was its parity, whose records were all read.
        let meta = FaultStorage::new("meta", SECTORS * SECTOR_BYTES as u64);
        let starts = commits(&meta, &[30, 2 * 30]);
        assert_eq!(starts, vec![0, 2]);
        for torn in [1, 2, 4] {
            spoil(&meta, torn);
        }
        let read = read_journal(&meta, &ring()).unwrap();
        assert!(
            read.lost.is_empty(),
            "a parity sector holds no record: {:?}",
            read.lost
        );
        assert_eq!(read.records.len(), 30, "commit 0, then the torn end");
        assert_eq!(read.next_seq, 2);
    }

    #[test]
    fn sectors_of_an_earlier_open_or_lap_end_the_journal() {
        let meta = FaultStorage::new("meta", SECTORS * SECTOR_BYTES as u64);
        commits(&meta, &[30 * 30]);
        // Another open generation's reader sees nothing of it, and nothing lost.
        let other = read_journal(
            &meta,
            &Ring {
                open_gen: GEN + 1,
                ..ring()
            },
        )
        .unwrap();
        assert!(other.records.is_empty() && other.lost.is_empty());
        // A replay point past it (a later lap): its sectors are stale, not damage.
        let later = read_journal(
            &meta,
            &Ring {
                replay_seq: 100,
                ..ring()
            },
        )
        .unwrap();
        assert!(later.records.is_empty() && later.lost.is_empty());
    }
}
