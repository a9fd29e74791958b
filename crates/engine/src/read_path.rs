//! The block read path: a block through its map entry to its object and the bytes
//! its location names, verified by checksum and fingerprint where it was stored.

use crate::block_map::{reads_alike, VolumeState};
use crate::error::within_mut;
use crate::inner::{Inner, Wait};
use crate::slab::ObjRec;
use crate::{EngineError, Result};
use fewerbytes_format::location::{Location, MapEntry, ObjectId};
use fewerbytes_format::BLOCK_BYTES;

const BLOCK: u64 = BLOCK_BYTES as u64;

/// Read one block into `out` (4096 bytes). Caller holds the gate and no stripe
/// lock. Returns false (with `Wait::No`) if the block's bytes are not at hand
/// without waiting.
///
/// A write of the block may drop the object being read between the map lookup
/// and the read of its record (its record is cleared; its bytes stay until a
/// checkpoint, which the gate holds off). That is a race, not corruption: the
/// read starts again under the block's stripe lock, where no write of the block
/// runs, and a range operation can only leave it reading as zeros
/// (`read_object_settled`).
pub(crate) fn read_block(
    inner: &Inner,
    vol: &VolumeState,
    lbn: u64,
    out: &mut [u8],
    wait: Wait,
) -> Result<bool> {
    let entry = vol.get(lbn);
    let first = match entry {
        MapEntry::Unmapped | MapEntry::Zero => {
            out.fill(0);
            return Ok(true);
        }
        MapEntry::Object(o) => read_object(inner, o, out, wait),
    };
    match first {
        Err(e) if reads_alike(vol.get(lbn), entry) => Err(in_volume(e, vol, lbn)),
        Err(_) => {
            let stripe = inner.locks.stripe(vol.id(), lbn);
            let _held = match wait {
                Wait::Yes => stripe.lock(),
                Wait::No => match stripe.try_lock() {
                    Some(held) => held,
                    None => return Ok(false),
                },
            };
            read_object_settled(inner, vol, lbn, out, wait)
                .map(|read| read.0)
                .map_err(|e| in_volume(e, vol, lbn))
        }
        done => done,
    }
}

/// A stored object whose bytes (or record) fail their checks, named by the data
/// block its location starts at (`location`, its record's raw location word),
/// or by its slab's first block when the location itself is bad.
fn corrupt_object(inner: &Inner, o: ObjectId, location: u64, reason: String) -> EngineError {
    let (s, _) = inner.depot.split_object(o);
    let data_first_block = inner.geometry.data_offset_bytes() / BLOCK;
    let (block, what) = match Location::decode(location) {
        Ok(loc) => {
            let pbn = loc.blocks().0;
            let what = match loc {
                Location::Block { .. } => format!("object {}", o.0),
                Location::Fragment { len_bytes, .. } => {
                    format!("object {} (a {len_bytes}-byte fragment)", o.0)
                }
            };
            (data_first_block + pbn, what)
        }
        Err(_) => (
            data_first_block + u64::from(s) * u64::from(crate::geometry::SLAB_BLOCKS),
            format!("object {} of slab {s}", o.0),
        ),
    };
    EngineError::Corrupt {
        region: "data",
        block,
        device: "data",
        reason: format!("pool block {block}: {what}: {reason}"),
    }
}

/// The blocks a location touches (at most two), each with the zone whose packer
/// still holds it open.
type OpenBlocks = [(u64, Option<usize>); 2];

/// An object's record, and the blocks its location touches.
fn locate(inner: &Inner, o: ObjectId) -> Result<(ObjRec, OpenBlocks)> {
    let (s, i) = inner.depot.split_object(o);
    let slab = inner.depot.slab(s).lock();
    let rec = slab.rec(i);
    let loc = Location::decode(rec.location)
        .map_err(|e| corrupt_object(inner, o, rec.location, e.to_string()))?;
    // Live records were checked at open; a map entry naming a free one (whose
    // location nothing checked) is found damaged here, not read off its slab.
    if !inner.depot.valid_location(s, loc) {
        return Err(corrupt_object(
            inner,
            o,
            rec.location,
            format!("its location lies outside slab {s}"),
        ));
    }
    let (first, count) = loc.blocks();
    // A location touches at most two blocks: no allocation on the read path.
    let mut open: OpenBlocks = [(first, None), (first + 1, None)];
    for (b, zone) in open.iter_mut().take(count as usize) {
        *zone = slab.open_zone((*b - slab.first_pbn()) as u32);
    }
    Ok((rec, open))
}

/// Read a stored object's 4,096 bytes without checking them against its
/// fingerprint: for replay, which computes the fingerprint of a block a
/// `NewStored` record names from them (`recovery.rs`), after checking their crc.
pub(crate) fn read_object_unchecked(inner: &Inner, o: ObjectId, out: &mut [u8]) -> Result<()> {
    let (rec, open) = locate(inner, o)?;
    read_location(inner, o, &rec, open, out, Wait::Yes).map(|_| ())
}

pub(crate) fn read_object(inner: &Inner, o: ObjectId, out: &mut [u8], wait: Wait) -> Result<bool> {
    let (rec, open) = locate(inner, o)?;
    if rec.refcount == 0 {
        return Err(corrupt_object(
            inner,
            o,
            rec.location,
            "mapped but has no references".into(),
        ));
    }
    let read = match read_location(inner, o, &rec, open, out, wait) {
        Ok(false) => return Ok(false),
        Ok(true) if inner.geometry.fingerprint(out) == rec.fingerprint => return Ok(true),
        // Every stored block keeps its fingerprint: a block that no longer matches it
        // is reported, never returned (1.8 µs per block on these machines).
        Ok(true) => corrupt_object(
            inner,
            o,
            rec.location,
            "stored data does not match its fingerprint".into(),
        ),
        Err(e) => e,
    };
    if let EngineError::Corrupt { reason, .. } = &read {
        // Known damaged now: a write of its good data heals it (`heal.rs`).
        inner
            .depot
            .damaged()
            .note(o, &rec.fingerprint, reason.clone());
    }
    Err(read)
}

/// Read data-device bytes; with `Wait::No`, only if they are cached (false if not).
/// A failed read fails its request and does not latch the pool: nothing was
/// changed, and a bad sector under one block must not stop writes to the rest.
fn read_data(inner: &Inner, buf: &mut [u8], offset_bytes: u64, wait: Wait) -> Result<bool> {
    let r = match wait {
        Wait::Yes => inner
            .devices
            .data()
            .read_at(buf, offset_bytes)
            .map(|()| true),
        Wait::No => inner.devices.data().read_at_cached(buf, offset_bytes),
    };
    Ok(r?)
}

fn read_location(
    inner: &Inner,
    o: ObjectId,
    rec: &ObjRec,
    open: OpenBlocks,
    out: &mut [u8],
    wait: Wait,
) -> Result<bool> {
    let s = inner.depot.split_object(o).0;
    let slab_first = u64::from(s) * u64::from(crate::geometry::SLAB_BLOCKS);
    let location = Location::decode(rec.location)
        .map_err(|e| corrupt_object(inner, o, rec.location, e.to_string()))?;
    let (_, blocks) = location.blocks();
    match location {
        Location::Block { pbn } => {
            let zone = open.first().and_then(|(_, z)| *z);
            if zone.is_some_and(|z| {
                inner
                    .zones
                    .read_open_block(z, s, (pbn - slab_first) as u32, 0, out)
            }) {
                return Ok(true);
            }
            read_data(
                inner,
                out,
                inner.geometry.data_offset_bytes() + pbn * BLOCK,
                wait,
            )
        }
        Location::Fragment {
            addr_bytes,
            len_bytes,
            codec,
        } => {
            let len = usize::from(len_bytes);
            let mut packed = [0u8; BLOCK_BYTES];
            let mut done = 0usize;
            // Bytes past the first block are always within `len`, so at most
            // `blocks` (1 or 2) entries of `open` are used.
            for (b, zone) in open.into_iter().take(blocks as usize) {
                let block_start = b * BLOCK;
                let from = (addr_bytes + done as u64 - block_start) as usize;
                let n = (BLOCK_BYTES - from).min(len - done);
                let dst = within_mut(&mut packed, done..done + n, "a fragment's bytes")?;
                let from_packer = zone.is_some_and(|z| {
                    inner
                        .zones
                        .read_open_block(z, s, (b - slab_first) as u32, from, dst)
                });
                if !from_packer
                    && !read_data(
                        inner,
                        dst,
                        inner.geometry.data_offset_bytes() + block_start + from as u64,
                        wait,
                    )?
                {
                    return Ok(false);
                }
                done += n;
            }
            let n = crate::codec::decompress(
                codec,
                crate::error::within(&packed, 0..len, "a fragment's bytes")?,
                out,
            )
            .map_err(|why| corrupt_object(inner, o, rec.location, why))?;
            if n != BLOCK_BYTES {
                return Err(corrupt_object(
                    inner,
                    o,
                    rec.location,
                    format!("fragment decodes to {n} bytes, not {BLOCK_BYTES}"),
                ));
            }
            Ok(true)
        }
    }
}

/// A data corruption error with the volume and offset it was read for.
fn in_volume(e: EngineError, vol: &VolumeState, lbn: u64) -> EngineError {
    match e {
        EngineError::Corrupt {
            region: "data",
            block,
            device,
            reason,
        } => EngineError::Corrupt {
            region: "data",
            block,
            device,
            // What clears it, for the server's log and the client's error message
            // (`heal.rs`: this read made the block known damaged).
            reason: format!(
                "{}: {} (writing this block's good data back heals it in every volume)",
                crate::damage::volume_range(
                    &vol.name(),
                    lbn * BLOCK,
                    BLOCK,
                    crate::damage::DamagedAt::PoolBlock(block)
                ),
                crate::damage::cause(&reason, block)
            ),
        },
        other => other,
    }
}

/// Attempts one read-modify-write makes before it reports a failure. Two suffice:
/// only a range operation can change the entry under the stripe lock, and after one
/// has, the entry reads as zeros and any further range operation leaves it reading
/// as zeros, which `reads_alike` accepts. The third is a margin for an argument
/// that should never fail; the fourth would be a bug, reported rather than looped on.
pub(crate) const RMW_ATTEMPTS_MAX: u32 = 3;

/// Read block `lbn` into `block` while holding its stripe lock: only a range
/// operation can change the entry meanwhile, and only to one that reads as zeros,
/// so a read that lost that race is tried again once at most (within
/// `RMW_ATTEMPTS_MAX`). Returns whether it read everything (false only with
/// `Wait::No`) and the entry it read.
pub(crate) fn read_object_settled(
    inner: &Inner,
    vol: &VolumeState,
    lbn: u64,
    block: &mut [u8],
    wait: Wait,
) -> Result<(bool, MapEntry)> {
    let mut base = vol.get(lbn);
    let mut attempts = 1;
    loop {
        let read = match base {
            MapEntry::Unmapped | MapEntry::Zero => {
                block.fill(0);
                Ok(true)
            }
            MapEntry::Object(o) => read_object(inner, o, block, wait),
        };
        match read {
            Ok(done) => return Ok((done, base)),
            Err(e) => {
                // A range operation may have dropped the object's last reference
                // between the two looks; then read what it left.
                let now = vol.get(lbn);
                if reads_alike(now, base) || attempts >= RMW_ATTEMPTS_MAX {
                    return Err(e);
                }
                base = now;
                attempts += 1;
            }
        }
    }
}
