//! The block write path: one whole block, zero-checked, fingerprinted, deduplicated
//! against the index's advice or stored new (compressed and packed, or whole), its
//! map entry set and journalled.

use crate::block_map::{VolumeState, ENTRIES_PER_PAGE};
use crate::counters::add;
use crate::inner::Inner;
use crate::{EngineError, Result};
use fewerbytes_format::journal::Record;
use fewerbytes_format::location::{Location, MapEntry, ObjectId};
use fewerbytes_format::BLOCK_BYTES;
use std::cell::{Cell, RefCell};
use std::sync::atomic::Ordering;

/// A compressed form is kept only if it saves at least an eighth of the block.
pub const COMPRESSED_BYTES_MAX: usize = BLOCK_BYTES - BLOCK_BYTES / 8;

thread_local! {
    static ZONE: Cell<usize> = const { Cell::new(usize::MAX) };
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(vec![0u8; lz4_flex::block::get_maximum_output_size(BLOCK_BYTES)]);
}

static NEXT_ZONE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The zone (packer and preferred slabs) of the calling thread: threads spread
/// over zones round-robin so their packers and slabs do not contend.
fn my_zone(zones: usize) -> usize {
    ZONE.with(|z| {
        if z.get() == usize::MAX {
            z.set(NEXT_ZONE.fetch_add(1, Ordering::Relaxed));
        }
        z.get() % zones
    })
}

fn is_zero(block: &[u8]) -> bool {
    let (prefix, words, suffix) = unsafe {
        // SAFETY: any byte pattern is a valid u64; align_to only reinterprets the aligned middle.
        block.align_to::<u64>()
    };
    prefix.iter().all(|b| *b == 0)
        && words.iter().all(|w| *w == 0)
        && suffix.iter().all(|b| *b == 0)
}

/// Store a new block (compressed or whole) with one reference; journals it.
/// Counted in the pool's and the writing volume's counters.
fn store_new(
    inner: &Inner,
    block: &[u8],
    fp: &[u8; 32],
    vol_counters: &crate::counters::Counters,
) -> Result<ObjectId> {
    let zone = my_zone(inner.zones.count());
    let compressed = SCRATCH.with(|scratch| -> Result<Option<(ObjectId, Location)>> {
        let mut scratch = scratch.borrow_mut();
        let n = lz4_flex::block::compress_into(block, &mut scratch).unwrap_or(usize::MAX);
        if n > COMPRESSED_BYTES_MAX {
            return Ok(None);
        }
        match inner.zones.pack(
            &inner.space(),
            zone,
            crate::error::within(&scratch, 0..n, "a compressed block")?,
            fp,
        ) {
            Ok(v) => Ok(Some(v)),
            Err(EngineError::NoSpace(_)) => Ok(None),
            Err(e) => Err(e),
        }
    })?;
    let (object, location) = match compressed {
        Some(v) => {
            add(&inner.counters.compressed_writes, 1);
            add(&vol_counters.compressed_writes, 1);
            v
        }
        None => {
            let (object, pbn) = inner.zones.store_whole(&inner.space(), zone, block, fp)?;
            add(&inner.counters.uncompressed_writes, 1);
            add(&vol_counters.uncompressed_writes, 1);
            (object, Location::Block { pbn })
        }
    };
    // Journalled before anyone can find it in the index, so a reference to it
    // can never be durable before the object itself.
    inner.journal.append(&Record::NewObject {
        object: object.0,
        location: location.encode(),
        fingerprint: *fp,
    });
    inner.depot.index().insert(fp, object);
    Ok(object)
}

/// Write one whole block of a volume. Caller holds the gate and the block's stripe.
///
/// With `expect`, the map is updated only if the block's entry still reads like
/// it (`block_map::reads_alike`); otherwise nothing changes and the result is
/// `false` (a read-modify-write lost a race with a range operation).
pub(crate) fn write_block(
    inner: &Inner,
    vol: &VolumeState,
    lbn: u64,
    block: &[u8],
    expect: Option<MapEntry>,
) -> Result<bool> {
    add(&inner.counters.blocks_written, 1);
    add(&vol.counters().blocks_written, 1);
    let entry = if is_zero(block) {
        add(&inner.counters.zero_blocks_written, 1);
        add(&vol.counters().zero_blocks_written, 1);
        MapEntry::Zero
    } else {
        let fp = inner.geometry.fingerprint(block);
        let (found, stale) = inner.depot.take_duplicate(&fp);
        add(&inner.counters.advice_stale, stale);
        add(&vol.counters().advice_stale, stale);
        if found.is_some() {
            add(&inner.counters.advice_valid, 1);
            add(&vol.counters().advice_valid, 1);
        }
        match found {
            Some(o) => {
                add(&inner.counters.dedup_hits, 1);
                add(&vol.counters().dedup_hits, 1);
                MapEntry::Object(o)
            }
            None => MapEntry::Object(store_new(inner, block, &fp, vol.counters())?),
        }
    };
    let old = {
        let pages = vol.map_pages();
        let Some(page) = pages.get((lbn / ENTRIES_PER_PAGE) as usize) else {
            drop(pages);
            if let Some(o) = entry.object() {
                inner.depot.release_object(&inner.devices, o)?;
            }
            return Err(EngineError::VolumeGone(vol.name()));
        };
        let mut page = page.lock();
        let i = (lbn % ENTRIES_PER_PAGE) as usize;
        if expect.is_some_and(|e| !crate::block_map::reads_alike(page.get(i), e)) {
            drop(page);
            drop(pages);
            if let Some(o) = entry.object() {
                inner.depot.release_object(&inner.devices, o)?;
            }
            return Ok(false);
        }
        let old = page.set(i, entry, inner.checkpointer.dirty_pages());
        // Appended under the page lock: journal order matches map order per block.
        inner.journal.append(&Record::MapSet {
            volume: vol.slot(),
            lbn,
            entry,
        });
        old
    };
    vol.account(old, entry);
    if let Some(o) = old.object() {
        inner.depot.release_object(&inner.devices, o)?;
    }
    Ok(true)
}
