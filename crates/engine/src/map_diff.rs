//! What a volume's block map names, block by block, and where two volumes' maps
//! differ: what a send stream is made of (`volume send` in the CLI, docs/stream.md).
//!
//! Two entries are the same when both read as zeros (unmapped or zero) or both name
//! the same stored object: a clone starts with its source's entries, so the blocks a
//! clone and its source still share compare equal without reading them. A damaged
//! range (`map_damage.rs`) has no known entries: its blocks always differ, so a send
//! or a backup reads them and meets the damage's error rather than skip them.

use crate::block_map::{VolumeState, ENTRIES_PER_PAGE};
use crate::map_pages::MapPages;
use crate::{BlockSource, ChangedExtent};
use fewerbytes_format::BLOCK_BYTES;

const BLOCK: u64 = BLOCK_BYTES as u64;
use fewerbytes_format::location::MapEntry;
use fewerbytes_format::page::MAP_ENTRIES_PER_PAGE;
use std::ops::Range;

/// The source of each block `first_lbn ..` of `vol`, one per element of `out` (the
/// caller checked the range lies inside the volume and outside any damage).
pub(crate) fn block_sources(vol: &VolumeState, first_lbn: u64, out: &mut [BlockSource]) {
    let pages = vol.map_pages();
    let mut lbn = first_lbn;
    let mut i = 0usize;
    while i < out.len() {
        let p = lbn / ENTRIES_PER_PAGE;
        let in_page = (lbn % ENTRIES_PER_PAGE) as usize;
        let n = (MAP_ENTRIES_PER_PAGE - in_page).min(out.len() - i);
        let page = pages.get(p).map(|page| page.lock());
        for (k, slot) in out.iter_mut().skip(i).take(n).enumerate() {
            *slot = match &page {
                Some(page) => source_of(page.get(in_page + k)),
                None => BlockSource::Zero,
            };
        }
        i += n;
        lbn += n as u64;
    }
}

fn source_of(entry: MapEntry) -> BlockSource {
    match entry {
        MapEntry::Unmapped | MapEntry::Zero => BlockSource::Zero,
        MapEntry::Object(id) => BlockSource::Stored(id.0),
    }
}

/// The runs of `[offset, end)` of `vol` that differ from `old`
/// ([`crate::Volume::changed_extents`]); the caller holds the gate. Work follows the
/// map pages either volume holds in memory (and its damaged ranges), not the range's
/// size.
pub(crate) fn changed_extents(
    vol: &VolumeState,
    old: &VolumeState,
    offset_bytes: u64,
    end: u64,
) -> Vec<ChangedExtent> {
    let (pages, old_pages) = (vol.map_pages(), old.map_pages());
    let old_blocks = old.size_blocks();
    let mut out: Vec<ChangedExtent> = Vec::new();
    let mut at = offset_bytes;
    while at < end {
        let lbn = at / BLOCK;
        let p = lbn / ENTRIES_PER_PAGE;
        let (changed, run_end) = if vol.damage_in(lbn, lbn + 1).is_some()
            || (lbn < old_blocks && old.damage_in(lbn, lbn + 1).is_some())
        {
            (true, ((lbn + 1) * BLOCK).min(end))
        } else if pages.get(p).is_none() && (lbn >= old_blocks || old_pages.get(p).is_none()) {
            // Zeros on both sides up to the next page either holds, or the next
            // damaged range: a jump, so the work follows the pages written.
            let next_page = [pages.next_in_memory(p + 1), old_pages.next_in_memory(p + 1)]
                .into_iter()
                .flatten()
                .min();
            let mut to = next_page.map_or(end, |q| (q * ENTRIES_PER_PAGE * BLOCK).min(end));
            let to_lbn = to.div_ceil(BLOCK);
            let damage = [
                vol.damage_in(lbn, to_lbn)
                    .map(|d| d.lbns(vol.size_blocks()).start),
                old.damage_in(lbn, to_lbn.min(old_blocks))
                    .map(|d| d.lbns(old_blocks).start),
            ];
            for first in damage.into_iter().flatten() {
                to = to.min(first.max(lbn + 1) * BLOCK);
            }
            (false, to)
        } else if let Some(to) = same_page([vol, old], [&pages, &old_pages], p, lbn, end) {
            (false, to)
        } else {
            let was = if lbn < old_blocks {
                old.get(lbn)
            } else {
                MapEntry::Unmapped
            };
            (
                !crate::block_map::reads_alike(vol.get(lbn), was),
                ((lbn + 1) * BLOCK).min(end),
            )
        };
        let len = run_end - at;
        match out.last_mut() {
            Some(last) if last.changed == changed => last.len_bytes += len,
            _ => out.push(ChangedExtent {
                len_bytes: len,
                changed,
            }),
        }
        at = run_end;
    }
    out
}

/// When page `p` of `vol` and of `old` hold the same entries in memory (a page a
/// snapshot or clone shares, neither changed since), with no damage over it: where
/// the unchanged run from `lbn` ends (the page's end, or `end`). One comparison
/// per shared page, so a diff's work follows the pages changed. Each page's lock is
/// taken alone; the maps' locks are the caller's.
fn same_page(
    [vol, old]: [&VolumeState; 2],
    [pages, old_pages]: [&MapPages; 2],
    p: u64,
    lbn: u64,
    end: u64,
) -> Option<u64> {
    let to = ((p + 1) * ENTRIES_PER_PAGE * BLOCK).min(end);
    let to_lbn = to.div_ceil(BLOCK);
    if to_lbn > old.size_blocks()
        || vol.damage_in(lbn, to_lbn).is_some()
        || old.damage_in(lbn, to_lbn).is_some()
    {
        return None;
    }
    let mine = pages.get(p)?.lock().shared_entries()?;
    let theirs = old_pages.get(p)?.lock().shared_entries()?;
    std::sync::Arc::ptr_eq(&mine, &theirs).then_some(to)
}

/// The runs of blocks of `vol`, whole, whose entries differ from `base`'s, in order,
/// each as a block range ([`changed_extents`] in blocks; the caller holds the gate).
pub(crate) fn changed_blocks(vol: &VolumeState, base: &VolumeState) -> Vec<Range<u64>> {
    let mut runs = Vec::new();
    let mut at = 0u64;
    for run in changed_extents(vol, base, 0, vol.size_blocks() * BLOCK) {
        if run.changed {
            runs.push(at / BLOCK..(at + run.len_bytes) / BLOCK);
        }
        at += run.len_bytes;
    }
    runs
}
