//! Compaction: packed blocks whose fragments have mostly died are emptied by moving
//! their live fragments into fresh blocks of the same slab, so overwritten
//! compressed data does not hold on to space (packing waste) for ever.
//!
//! A moved fragment keeps its object (and every reference to it); only the object's
//! location changes, journalled as a `NewObject` record with the new location. The
//! new block is written before any record points at it, and the old blocks become
//! pending-free like any freed block, reusable only after the next checkpoint, so a
//! crash finds either location intact.

use crate::inner::Inner;
use crate::{EngineError, Result};
use fewerbytes_format::journal::Record;
use fewerbytes_format::location::Location;
use fewerbytes_format::BLOCK_BYTES;
use std::time::Duration;

/// How often the compactor looks for freed fragments.
pub const COMPACT_INTERVAL: Duration = Duration::from_millis(500);

/// A packed block is compacted when less than this share of it is live (percent):
/// rewriting up to three quarters of a block to reclaim the rest bounds the waste
/// left in steady state to about a quarter of the packed bytes.
pub const COMPACT_LIVE_PERCENT_MAX: u64 = 75;
/// Victim blocks chosen per round (per slab).
pub const COMPACT_BLOCKS_PER_ROUND: usize = 64;
/// Fragments moved per round at most: bounds the time a round holds the gate
/// shared and the journal space it reserves (one 48-byte record each).
pub const COMPACT_FRAGMENTS_PER_ROUND: usize = 256;

struct Victim {
    object: u32,
    location: Location,
}

/// One compaction round over slab `s`: returns the number of blocks emptied.
pub(crate) fn compact_slab(inner: &Inner, s: u32) -> Result<u64> {
    // Journal space for the worst case: every fragment of every victim moves.
    let reserve =
        (COMPACT_FRAGMENTS_PER_ROUND * fewerbytes_format::journal::RECORD_BYTES_MAX) as u64;
    inner.journal.reserve(reserve)?;
    let result = compact_slab_reserved(inner, s);
    inner.journal.unreserve(reserve);
    result
}

fn compact_slab_reserved(inner: &Inner, s: u32) -> Result<u64> {
    inner.devices.ensure_writable()?;
    let _gate = inner.locks.shared();
    let victims = find_victims(inner, s);
    if victims.is_empty() {
        return Ok(0);
    }
    // Read every victim fragment's bytes (victim blocks are closed, so on the device).
    let mut moved: Vec<(Victim, Vec<u8>)> = Vec::with_capacity(victims.len());
    for v in victims {
        if let Location::Fragment {
            addr_bytes,
            len_bytes,
            ..
        } = v.location
        {
            let mut bytes = vec![0u8; usize::from(len_bytes)];
            // A failed read ends this round without latching the pool: nothing
            // was changed yet (see `read_data`).
            inner
                .devices
                .data()
                .read_at(&mut bytes, inner.geometry.data_offset_bytes() + addr_bytes)?;
            moved.push((v, bytes));
        }
    }
    // Pack them byte-contiguously into runs of consecutive fresh blocks of the same
    // slab (a fragment may span blocks of a run, as the packer's do).
    let mut emptied_before = 0u64;
    let mut i = 0;
    while i < moved.len() {
        let remaining: usize = moved.iter().skip(i).map(|(_, b)| b.len()).sum();
        let want = remaining.div_ceil(BLOCK_BYTES) as u32;
        let (first_block, run_len) = {
            let mut slab = inner.depot.slab(s).lock();
            let Some(first) = slab.alloc_block() else {
                break;
            };
            let mut len = 1;
            while len < want && slab.alloc_block_at(first + len) {
                len += 1;
            }
            for b in first..first + len {
                inner.devices.check_invariant(slab.hold_block(b))?; // the compactor's hold until records point here
            }
            (first, len)
        };
        let capacity = run_len as usize * BLOCK_BYTES;
        let mut buf = vec![0u8; capacity];
        let mut fill = 0usize;
        let start = i;
        while let Some((_, bytes)) = moved.get(i) {
            if fill + bytes.len() > capacity {
                break;
            }
            if let Some(dst) = buf.get_mut(fill..fill + bytes.len()) {
                dst.copy_from_slice(bytes);
            }
            fill += bytes.len();
            i += 1;
        }
        let run_pbn = inner.depot.pbn(s, first_block);
        let r = inner.devices.data().write_at(
            &buf,
            inner.geometry.data_offset_bytes() + run_pbn * BLOCK_BYTES as u64,
        );
        // A device with no space fails the round and changes nothing (no record
        // points at the run yet): no latch.
        if let Err(e) = inner.devices.check_write_or_no_space(r) {
            let mut slab = inner.depot.slab(s).lock();
            for b in first_block..first_block + run_len {
                // The write's error is the one returned (the pool is latched
                // already, unless the device had no space).
                if let Err(broken) = slab.drop_block(b) {
                    tracing::error!("{broken}");
                }
            }
            return Err(e);
        }
        let mut slab = inner.depot.slab(s).lock();
        let slab_first = slab.first_pbn();
        let mut at = 0u64;
        for (v, bytes) in moved.iter().take(i).skip(start) {
            // A fragment moves with the codec it was written with. Only fragments are
            // chosen to move: a whole block here would be rewritten as a fragment of
            // a codec it never had, and read back as garbage.
            let codec = match v.location {
                Location::Fragment { codec, .. } => codec,
                Location::Block { pbn } => {
                    return inner
                        .devices
                        .check_invariant(Err(EngineError::Invariant(format!(
                            "object {} of slab {s} (the whole block {pbn}) was chosen to move \
                         as a fragment",
                            v.object
                        ))))
                }
            };
            let new = Location::Fragment {
                addr_bytes: run_pbn * BLOCK_BYTES as u64 + at,
                len_bytes: bytes.len() as u16,
                codec,
            };
            at += bytes.len() as u64;
            let rec = slab.rec(v.object);
            // The object may have been freed or moved since it was chosen.
            if rec.refcount == 0 || rec.location != v.location.encode() {
                continue;
            }
            let (new_first, new_count) = new.blocks();
            for b in new_first..new_first + new_count {
                inner
                    .devices
                    .check_invariant(slab.hold_block((b - slab_first) as u32))?;
            }
            let object = v.object;
            let r = slab.rec_mut(object).ok_or_else(|| {
                EngineError::Invariant(format!("object {object} of slab {s} has no record"))
            });
            inner.devices.check_invariant(r)?.location = new.encode();
            let (first, count) = v.location.blocks();
            for b in first..first + count {
                let local = (b - slab_first) as u32;
                let before = slab.holders(local);
                inner.devices.check_invariant(slab.drop_block(local))?;
                if before == 1 {
                    emptied_before += 1;
                }
            }
            // Under the slab lock: a free of this object cannot come between the
            // move and its record.
            inner.journal.append(&Record::NewObject {
                object: u64::from(s) * u64::from(inner.geometry.objects_per_slab())
                    + u64::from(v.object),
                location: new.encode(),
                fingerprint: rec.fingerprint,
            });
        }
        for b in first_block..first_block + run_len {
            inner.devices.check_invariant(slab.drop_block(b))?;
        }
    }
    inner.compactor.emptied(emptied_before);
    Ok(emptied_before)
}

/// Fragments touching closed packed blocks of slab `s` that are less than
/// `COMPACT_LIVE_PERCENT_MAX` live, up to `COMPACT_BLOCKS_PER_ROUND` blocks.
fn find_victims(inner: &Inner, s: u32) -> Vec<Victim> {
    let slab = inner.depot.slab(s).lock();
    // By block of the slab: (live bytes, holds a whole block).
    let mut live: Vec<(u64, bool)> = vec![(0, false); slab.block_count() as usize];
    let mut fragments: Vec<Victim> = Vec::new();
    for i in slab.objects_in_memory() {
        let rec = slab.rec(i);
        if rec.refcount == 0 {
            continue;
        }
        let Ok(loc) = Location::decode(rec.location) else {
            continue;
        };
        let (first, count) = loc.blocks();
        for b in first..first + count {
            let Some(e) = live.get_mut((b - slab.first_pbn()) as usize) else {
                continue;
            };
            // A block stored new whose record a write step has yet to journal
            // (`slab.rs: FINGERPRINT_IN_FLIGHT`) stays where the record will say.
            if rec.fingerprint == crate::slab::FINGERPRINT_IN_FLIGHT {
                e.1 = true;
                continue;
            }
            match loc {
                Location::Block { .. } => e.1 = true,
                Location::Fragment {
                    addr_bytes,
                    len_bytes,
                    ..
                } => {
                    let start = addr_bytes.max(b * BLOCK_BYTES as u64);
                    let end = (addr_bytes + u64::from(len_bytes)).min((b + 1) * BLOCK_BYTES as u64);
                    e.0 += end - start;
                }
            }
        }
        if matches!(loc, Location::Fragment { .. }) {
            fragments.push(Victim {
                object: i,
                location: loc,
            });
        }
    }
    // A packed block with some live bytes, but few.
    let is_victim = |b: u32| {
        live.get(b as usize).is_some_and(|&(bytes, whole)| {
            !whole
                && bytes > 0
                && bytes * 100 < BLOCK_BYTES as u64 * COMPACT_LIVE_PERCENT_MAX
                && !slab.is_open(b)
        })
    };
    let mut chosen: Vec<u32> = (0..live.len() as u32).filter(|b| is_victim(*b)).collect();
    chosen.truncate(COMPACT_BLOCKS_PER_ROUND);
    let chosen: std::collections::HashSet<u32> = chosen.into_iter().collect();
    // Every fragment touching a victim moves, so victims end up empty (a fragment
    // that also touches another closed block just leaves it).
    // A fragment reaching into a block a packer still has open is left alone: its
    // bytes there are only in memory.
    fragments.retain(|v| {
        let (first, count) = v.location.blocks();
        let mut blocks = (first..first + count).map(|b| (b - slab.first_pbn()) as u32);
        let touches_victim = blocks.clone().any(|b| chosen.contains(&b));
        touches_victim && !blocks.any(|b| slab.is_open(b))
    });
    fragments.truncate(COMPACT_FRAGMENTS_PER_ROUND);
    fragments
}

/// Compact every slab once; returns the blocks emptied.
pub(crate) fn compact_all(inner: &Inner) -> Result<u64> {
    let mut total = 0;
    // A slab never touched holds no fragment.
    let touched: Vec<u32> = inner.depot.touched().map(|(s, _)| s).collect();
    for s in touched {
        if inner.devices.is_closed() {
            break;
        }
        total += compact_slab(inner, s)?;
    }
    Ok(total)
}

/// The compactor thread: after fragments were freed, a round over the slabs that
/// freed some (a slab's scan reads every object record with the slab locked, so
/// a round over every slab of a large pool, every half second of a busy write
/// load, cost a tenth of the server's CPU).
pub(crate) fn compact_loop(inner: &Inner) {
    // A round empties a bounded number of blocks per slab: a slab that still had
    // work is looked at again next round without waiting for new frees.
    let mut again: std::collections::BTreeSet<u32> = Default::default();
    while !inner.devices.is_closed() {
        // Closing the pool wakes this sleep.
        inner
            .compactor
            .sleep(COMPACT_INTERVAL, || inner.devices.is_closed());
        if inner.devices.is_closed() {
            break;
        }
        if inner.depot.take_fragment_frees() == 0 && again.is_empty() {
            continue;
        }
        // Only slabs touched can hold fragments (one never touched is not made
        // here).
        let touched: Vec<u32> = inner.depot.touched().map(|(s, _)| s).collect();
        for s in touched {
            if inner.devices.is_closed() {
                break;
            }
            let freed = inner.depot.slab(s).lock().take_fragments_freed();
            if !freed && !again.contains(&s) {
                continue;
            }
            match compact_slab(inner, s) {
                Ok(emptied) if emptied > 0 => {
                    again.insert(s);
                }
                Ok(_) => {
                    again.remove(&s);
                }
                Err(e) => {
                    tracing::debug!("compaction stopped: {e}");
                    again.remove(&s);
                    break;
                }
            }
        }
    }
}
