//! What a volume's block map names, block by block, and where two volumes' maps
//! differ: what a send stream is made of (`volume send` in the CLI, docs/stream.md).
//!
//! Two entries are the same when both read as zeros (unmapped or zero) or both name
//! the same stored object: a clone starts with its source's entries, so the blocks a
//! clone and its source still share compare equal without reading them. A damaged
//! map page (`map_damage.rs`) has no known entries: its blocks always differ, so a
//! send reads them and meets the damage's error rather than skip them.

use crate::block_map::{VolumeState, ENTRIES_PER_PAGE};
use crate::BlockSource;
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

/// A page's entries as a send compares them: `None` for a damaged page (every
/// block differs), zeros for a page never written or not in memory.
fn page_entries(vol: &VolumeState, p: u64) -> Option<Box<[u64; MAP_ENTRIES_PER_PAGE]>> {
    let pages = vol.map_pages();
    let mut out = Box::new([0u64; MAP_ENTRIES_PER_PAGE]);
    if let Some(page) = pages.get(p) {
        let page = page.lock();
        if page.is_damaged() {
            return None;
        }
        if let Some(entries) = page.encoded_entries() {
            for (o, raw) in out.iter_mut().zip(entries.iter()) {
                // Unmapped (0) and zero (1) read alike.
                *o = if *raw == MapEntry::Zero.encode() {
                    0
                } else {
                    *raw
                };
            }
        }
    }
    Some(out)
}

/// The runs of blocks of `vol` whose entries differ from `base`'s, in order, each
/// run as a block range; `base`'s blocks past its end read as zeros. Only pages
/// either volume holds in memory are compared (a page neither holds reads as zeros in
/// both), so the time follows the pages written, not the volumes' sizes.
pub(crate) fn changed_runs(vol: &VolumeState, base: &VolumeState) -> Vec<Range<u64>> {
    let size_blocks = vol.size_blocks();
    let base_blocks = base.size_blocks();
    let pages: std::collections::BTreeSet<u64> = {
        let ours = vol.map_pages();
        let theirs = base.map_pages();
        ours.iter()
            .map(|(p, _)| p)
            .chain(theirs.iter().map(|(p, _)| p))
            .filter(|p| p * ENTRIES_PER_PAGE < size_blocks)
            .collect()
    };
    let mut runs: Vec<Range<u64>> = Vec::new();
    let mut push = |lbn: u64| match runs.last_mut() {
        Some(run) if run.end == lbn => run.end += 1,
        _ => runs.push(lbn..lbn + 1),
    };
    for p in pages {
        let first = p * ENTRIES_PER_PAGE;
        let ours = page_entries(vol, p);
        let theirs = page_entries(base, p);
        let end = (first + ENTRIES_PER_PAGE).min(size_blocks);
        for lbn in first..end {
            let i = (lbn - first) as usize;
            let ours = ours.as_ref().map(|e| e.get(i).copied().unwrap_or(0));
            let theirs = if lbn >= base_blocks {
                Some(0)
            } else {
                theirs.as_ref().map(|e| e.get(i).copied().unwrap_or(0))
            };
            let same = matches!((ours, theirs), (Some(a), Some(b)) if a == b);
            if !same {
                push(lbn);
            }
        }
    }
    runs
}
