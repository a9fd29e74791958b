//! Damaged block-map ranges: a block-map page, or a map directory page, that failed
//! its checks at open (bad checksum, stale, misdirected) when the older super block
//! copy could not stand in for it (the page is one both copies share, or there is
//! no usable older copy). The pool opens anyway: only the volume blocks that page
//! maps are lost, and they are marked DAMAGED.
//!
//! The rules, each kept where it applies:
//! - reads, writes, trims and zeroes that touch a damaged range fail with
//!   [`EngineError::Damaged`] (EIO over NBD): its entries are unknown, so neither
//!   their data nor zeros can be served, and a write there would have to drop a
//!   reference to an object it cannot name (`volume.rs: check`; a write reaching a
//!   damaged page regardless is an invariant error, `write_path.rs`);
//! - the objects the lost entries named keep the counts the count pages hold: a
//!   leak, never the free of something that may still be referenced;
//! - journal replay: a record into a damaged range changes no entry (the page
//!   stays as its durable copy failed); a `MapSet` adds the reference its new entry
//!   holds and drops none (the old entry is unknown), a `RangeSet` changes nothing
//!   there: counts may only end too high, never too low (`recovery.rs: replay`). A
//!   damaged range holding entries after replay is an invariant error
//!   ([`untouched_by_replay`]);
//! - the checkpoint keeps the damaged page's (or directory page's) reference as it
//!   is: the page is never dirtied, so no zero reference or empty page is written
//!   over the evidence (`checkpoint.rs` writes only dirty pages), and its slot stays
//!   held ([`LostPage::new`]);
//! - volume operations that would walk the lost entries (resize, clone) are refused
//!   until the range is cleared; a delete is allowed (the leak stays counted);
//! - `check` reports each range; `check --repair` clears it: its entries become
//!   unmapped (read as zeros), the counts are recomputed from the maps, which frees
//!   the leak, and the range is listed as lost ([`clear_for_repair`]); a
//!   version-1 pool is upgraded only past that ([`before_upgrade`]).

use crate::api::RepairReport;
use crate::block_map::VolumeState;
pub use crate::damaged_range::DamagedRange;
use crate::inner::Inner;
pub(crate) use crate::volume_damage::Damage;
use crate::{EngineError, Result};
use fewerbytes_format::page::{PageKind, PageRef};

/// Every damaged range of every volume and snapshot, by the name a person uses
/// (`VOLUME@SNAPSHOT` for a snapshot). A map page shared along a lineage fails for
/// every tree that reaches it: each is listed, so the report names them all.
pub(crate) fn pool_ranges(inner: &Inner) -> Vec<DamagedRange> {
    let mut ranges: Vec<DamagedRange> = inner
        .volumes
        .all()
        .iter()
        .flat_map(|v| named_ranges(inner, v))
        .collect();
    ranges.sort_by(|a, b| (&a.volume, a.offset_bytes).cmp(&(&b.volume, b.offset_bytes)));
    ranges
}

/// The damaged ranges of `vol`, named as a person names it.
fn named_ranges(inner: &Inner, vol: &VolumeState) -> Vec<DamagedRange> {
    let name = inner.volumes.full_name(vol);
    let mut ranges = vol.damaged_ranges();
    for range in &mut ranges {
        range.volume.clone_from(&name);
    }
    ranges
}

/// Mark volume `vol` (a map of `pages_len` pages) damaged where the pages in `lost`
/// failed at open ([`warn_lost`] names them once every volume is loaded).
pub(crate) fn record_lost(vol: &VolumeState, lost: Vec<LostPage>, pages_len: u64) {
    for page in lost {
        vol.add_damage(Damage {
            first_page: page.first_page.min(pages_len),
            end_page: page.first_page.saturating_add(page.pages).min(pages_len),
            level: page.level,
            reference: page.reference,
            block: page.block,
            device: page.device,
            reason: page.reason,
        });
    }
}

/// A warning for each damaged range the open found, once every volume is loaded
/// (a snapshot is named with its origin's name, `VOLUME@SNAPSHOT`).
pub(crate) fn warn_lost(inner: &Inner) {
    for range in pool_ranges(inner) {
        tracing::warn!(
            "{}: {}; the rest of the pool is served, and the range is refused (EIO) \
             until `fewerbytes check --repair` clears it",
            inner.devices.meta().name(),
            range.describe()
        );
    }
}

/// A map page or map directory page that failed its checks at an open past
/// damage: which page, the leaf pages under it, and the failure.
pub(crate) struct LostPage {
    level: u8,
    reference: PageRef,
    first_page: u64,
    pages: u64,
    block: u64,
    device: &'static str,
    reason: String,
}

impl LostPage {
    /// The page `reference` names (of `level`; 0: a map page) over
    /// leaf pages `first_page..first_page + pages`, which failed its checks at
    /// `block` of `device` for `reason`. Its addresses (both copies of a directory
    /// page) stay held in the page store when they are in it (every checkpoint keeps
    /// the reference until the damage is cleared), so no page is written over the
    /// evidence.
    pub(crate) fn new(
        inner: &Inner,
        level: u8,
        reference: PageRef,
        first_page: u64,
        pages: u64,
        (block, device, reason): (u64, &'static str, String),
    ) -> LostPage {
        let kind = if level == 0 {
            PageKind::Map
        } else {
            PageKind::Directory
        };
        // Both copies of a directory page (version 3): a freed twin address would be
        // reused, and the next open would find another page there.
        for address in reference.addresses() {
            if crate::page_read::page_place(inner, kind, address).is_ok() {
                inner.checkpointer.page_store().mark_address(address);
            }
        }
        LostPage {
            level,
            reference,
            first_page,
            pages,
            block,
            device,
            reason,
        }
    }
}

/// The rule of replay over damaged ranges, checked: no entry in one was set, so no
/// page under a damaged page holds entries a checkpoint would write over it.
pub(crate) fn untouched_by_replay(inner: &Inner) -> Result<()> {
    for vol in inner.volumes.all() {
        for d in vol.damage() {
            let pages = vol.map_pages();
            for (p, page) in pages.iter_from(d.first_page) {
                if p >= d.end_page {
                    break;
                }
                let page = page.lock();
                if page.is_written() || page.is_dirty() {
                    return Err(EngineError::Invariant(format!(
                        "map page {p} of volume '{}' lies in a damaged range but holds \
                         entries: replay must leave a damaged range untouched",
                        vol.name()
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Clear every damaged map range (`map_damage.rs`), with `apply`: its entries
/// become unmapped (read as zeros) and the next checkpoint writes its map page (or
/// the directory pages over it) afresh, retiring the failed page. Each range is
/// listed as lost; the counts its lost entries held are recomputed with the rest.
pub(crate) fn clear_for_repair(
    inner: &Inner,
    apply: bool,
    report: &mut RepairReport,
) -> Result<()> {
    for vol in inner.volumes.all() {
        let ranges = named_ranges(inner, &vol);
        if ranges.is_empty() {
            continue;
        }
        for range in &ranges {
            report.repairs.push(format!(
                "{}: its entries are lost and {} zeros",
                range.describe(),
                if apply {
                    "it now reads as"
                } else {
                    "it would read as"
                }
            ));
            report.lost_bytes += range.len_bytes;
        }
        if apply {
            vol.clear_damage(inner.volumes.shares(), inner.checkpointer.dirty_pages())?;
        }
    }
    Ok(())
}

/// A version-1 or version-2 pool with damaged map ranges is not upgraded as it is:
/// the upgrade rewrites pages afresh (from version 1 every page, from version 2
/// every directory page) and cannot carry a failed page's reference or write a
/// directory page whose children are unknown, so the range would turn into zeros
/// unlisted. An open for repair clears each range first (its entries unmapped,
/// listed as lost; the repair then recomputes the counts); any other read-write
/// open is refused.
pub(crate) fn before_upgrade(inner: &Inner, version: u32) -> Result<()> {
    let ranges = pool_ranges(inner);
    let Some(first) = ranges.first() else {
        return Ok(());
    };
    if !inner.repair.enabled() {
        return Err(EngineError::Refused(format!(
            "this format-version-{version} pool has {} damaged map range(s) (the first: \
             {}); its upgrade to version {} would lose them unlisted: open it read-only, or \
             run `fewerbytes check --repair`, which clears them (they then read as zeros) \
             and upgrades it",
            ranges.len(),
            first.describe(),
            fewerbytes_format::FORMAT_VERSION
        )));
    }
    for vol in inner.volumes.all() {
        vol.clear_damage(inner.volumes.shares(), inner.checkpointer.dirty_pages())?;
    }
    for range in ranges {
        let sentence = format!(
            "{}: its entries are lost and it now reads as zeros",
            range.describe()
        );
        tracing::warn!("{sentence}");
        inner.repair.record(sentence);
        inner.repair.lost(range.len_bytes);
    }
    Ok(())
}
