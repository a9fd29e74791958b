//! Volume operations: create, clone, resize, set (what a volume reserves), rename,
//! delete, rollback, and a volume's usage.
//! Each runs alone (the checkpointer's serial lock) with the gate held exclusively,
//! and ends with a checkpoint taken under that gate, so a crash leaves the pool
//! before the operation or after it. The block read and write paths are apart
//! (`read_path.rs`, `write_path.rs`); `Pool` (pool.rs) hands these on.

use crate::block_map::VolumeState;
use crate::geometry::human_bytes;
use crate::inner::Inner;
use crate::page_store::page_addresses;
use crate::{api::*, EngineError, Result};
use fewerbytes_format::catalog::validate_name;
use fewerbytes_format::dir_tree::MAX_DEPTH;
use fewerbytes_format::dir_tree::MAX_VOLUME_BYTES;
use fewerbytes_format::BLOCK_BYTES;

pub(crate) fn info(inner: &Inner, v: &VolumeState) -> VolumeInfo {
    let block = BLOCK_BYTES as u64;
    let mut exclusive = 0u64;
    let mut own: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
    // An object is the volume's alone when every reference to it is from a page
    // only this volume's tree reaches.
    v.for_each_held_alone(inner.volumes.shares(), |_, e| {
        if let Some(o) = e.object() {
            *own.entry(o.0).or_insert(0) += 1;
        }
    });
    for (o, n) in own {
        let (s, i) = (
            (o / u64::from(inner.geometry.objects_per_slab())) as u32,
            (o % u64::from(inner.geometry.objects_per_slab())) as u32,
        );
        let rec = inner.depot.slab(s).lock().rec(i);
        if rec.refcount == n {
            if let Ok(loc) = fewerbytes_format::location::Location::decode(rec.location) {
                exclusive += loc.stored_bytes();
            }
        }
    }
    let (reserved_bytes, reserved_unused_bytes, thin) =
        crate::reservation::volume_figures(inner.volumes.reservations().of(v.id()), v);
    let (map_pages, map_memory_bytes) = v.map_memory();
    let snapshot_of = v.origin().map(|_| {
        let full = inner.volumes.full_name(v);
        full.split_once('@')
            .map_or(full.clone(), |(of, _)| of.to_string())
    });
    // A snapshot is limited exactly as its volume is now (`Pool::volume_limited`).
    let limited = snapshot_of
        .as_deref()
        .and_then(|of| inner.volumes.by_name(of).ok())
        .map_or(v.limited(), |of| of.limited());
    VolumeInfo {
        name: inner.volumes.full_name(v),
        id: v.id(),
        size_bytes: v.size_blocks() * block,
        logical_used_bytes: v.mapped_blocks() * block,
        zero_bytes: v.zero_blocks() * block,
        exclusive_stored_bytes: exclusive,
        users: v.users(),
        reserved_bytes,
        reserved_unused_bytes,
        thin,
        map_pages,
        map_memory_bytes,
        limited,
        incomplete: v.incomplete(),
        no_space_refusals: v.counters().no_space_refusals(),
        damaged_ranges: v.damaged_ranges(),
        snapshot_of,
        created: u64::from(v.created()),
        guid: (v.guid() != 0).then(|| format!("{:016x}", v.guid())),
    }
}

/// Refuse an operation that would walk a volume's damaged entries (`map_damage.rs`):
/// a clone would copy unknown entries as zeros, a resize may rewrite the directory
/// page over a damaged range. Deleting is allowed: the lost entries' objects stay
/// counted (a leak `check --repair` frees).
fn refuse_if_damaged(vol: &VolumeState, what: &str) -> Result<()> {
    match vol.damaged_ranges().first() {
        Some(range) => Err(EngineError::Refused(format!(
            "volume '{}' cannot be {what} while it has damaged ranges ({} in all; the \
             first: {}): `fewerbytes check --repair` clears them first",
            vol.name(),
            vol.damaged_ranges().len(),
            range.describe()
        ))),
        None => Ok(()),
    }
}

/// Refuse to change a snapshot (a point in time is never changed; it is cloned,
/// rolled back to, or deleted).
fn refuse_snapshot(inner: &Inner, vol: &VolumeState, what: &str) -> Result<()> {
    if vol.is_snapshot() {
        return Err(EngineError::Refused(format!(
            "'{}' is a snapshot: a snapshot is not {what} (clone it to get a volume)",
            inner.volumes.full_name(vol)
        )));
    }
    Ok(())
}

/// Names and sizes of all volumes, cheaply (no per-block work): for frontends
/// that list exports on every connection.
pub(crate) fn sizes(inner: &Inner) -> Vec<(String, u64)> {
    inner.volumes.sizes(BLOCK_BYTES as u64)
}

/// All volumes, with their usage (walks every block map: for management, not per request).
pub(crate) fn list(inner: &Inner) -> Vec<VolumeInfo> {
    // Snapshots are listed by `snapshots`, beside their volume.
    let vols = inner.volumes.all();
    vols.iter()
        .filter(|v| !v.is_snapshot())
        .map(|v| info(inner, v))
        .collect()
}

/// Refuse a reservation the pool cannot honour (`reservation.rs`): volume `id`
/// (none if new) of `size_blocks`, mapping `used_blocks`, asking for `p`.
fn check_reservation(
    inner: &Inner,
    what: &str,
    id: Option<u64>,
    size_blocks: u64,
    used_blocks: u64,
    p: Provisioning,
) -> Result<()> {
    inner.volumes.reservations().check_honour(
        &inner.volumes.all(),
        &inner.depot,
        &inner.geometry,
        &inner.page_room(),
        what,
        id,
        size_blocks,
        used_blocks,
        p,
    )
}

fn size_blocks_of(size_bytes: u64) -> Result<u64> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(BLOCK_BYTES as u64) {
        return Err(EngineError::Refused(format!(
            "a volume size must be a positive multiple of 4096 bytes, not {size_bytes}"
        )));
    }
    if size_bytes > MAX_VOLUME_BYTES {
        return Err(EngineError::Refused(format!(
            "a volume is at most {} (journal records address 2^40 blocks), not {}",
            human_bytes(MAX_VOLUME_BYTES),
            human_bytes(size_bytes)
        )));
    }
    Ok(size_bytes / BLOCK_BYTES as u64)
}

/// Create a volume reserving as `p` says; refused when the pool cannot honour the
/// reservation (never when thin).
pub(crate) fn create(
    inner: &Inner,
    name: &str,
    size_bytes: u64,
    p: Provisioning,
) -> Result<VolumeInfo> {
    validate_name(name).map_err(EngineError::Refused)?;
    create_named(inner, name, size_bytes, p)
}

/// [`create`] under a name the caller checked (a user's, or an internal one:
/// `internal.rs`).
pub(crate) fn create_named(
    inner: &Inner,
    name: &str,
    size_bytes: u64,
    p: Provisioning,
) -> Result<VolumeInfo> {
    let size_blocks = size_blocks_of(size_bytes)?;
    let i = inner;
    i.devices.ensure_writable()?;
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    if i.volumes.exists(name) {
        return Err(EngineError::VolumeExists(name.to_string()));
    }
    check_reservation(
        inner,
        &format!("volume '{name}' of {}", human_bytes(size_bytes)),
        None,
        size_blocks,
        0,
        p,
    )?;
    room_for_new_volume(inner, (0, 0))?;
    let vol = i.volumes.make(name, size_blocks)?;
    i.volumes.reservations().set(vol.id(), p);
    i.volumes.insert(vol.clone());
    crate::checkpoint::checkpoint_locked(i, gate, true)?;
    Ok(info(inner, &vol))
}

/// Before a volume takes `source`'s map: when pages of it changed since the last
/// checkpoint, a checkpoint (the gate held), so that every page is durable and the
/// new tree shares it rather than a copy (`MapPage::share`).
fn settle_pages(inner: &Inner, source: &VolumeState) -> Result<()> {
    if written_pages(source).1 > 0 {
        crate::checkpoint::checkpoint_held(inner)?;
    }
    Ok(())
}

/// The map pages of `vol` that hold entries, and of those the ones changed since
/// the last checkpoint (which a clone copies: `MapPage::share`).
fn written_pages(vol: &VolumeState) -> (u64, u64) {
    let (mut written, mut dirty) = (0, 0);
    for (_, page) in vol.map_pages().iter() {
        let page = page.lock();
        if page.is_written() {
            written += 1;
            dirty += u64::from(page.is_dirty() || page.durable().is_none());
        }
    }
    (written, dirty)
}

/// Before a volume taking `source`'s map is put in memory: the no-space error when
/// its checkpoint would be refused for want of room. The refusal comes before
/// anything changed, so nothing of the volume stays behind for a later checkpoint
/// to make durable. The pages it copies (those of `source` changed since the last
/// checkpoint: the others it shares), a directory page over each 252 of `source`'s
/// written pages, and a tree's worth of directory pages, each directory page twice
/// (format version 3).
fn room_for_new_volume(inner: &Inner, (map_pages, dirty): (u64, u64)) -> Result<()> {
    inner.checkpoint_space()?;
    let directories =
        crate::metadata_room::DIR_PAGE_COPIES * (map_pages.div_ceil(252) + 2 * MAX_DEPTH as u64);
    inner.metadata_room_with(dirty + directories)
}

/// Delete a volume; refused while handles are open unless `force`.
pub(crate) fn delete(inner: &Inner, name: &str, force: bool) -> Result<()> {
    let i = inner;
    i.devices.ensure_writable()?;
    i.ensure_space()?;
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    let vol = i.volumes.by_name(name)?;
    let users = vol.users();
    if users > 0 && !force {
        return Err(EngineError::VolumeInUse {
            name: name.to_string(),
            users,
        });
    }
    let snapshots = i.volumes.snapshots_of(vol.id());
    if !snapshots.is_empty() {
        let names: Vec<String> = snapshots.iter().map(|s| s.name()).collect();
        return Err(EngineError::Refused(format!(
            "volume '{name}' has {} snapshot(s) ({}): delete them first \
             (`volume snapshot delete {name} SNAPSHOT`)",
            names.len(),
            names.join(", ")
        )));
    }
    let released = unlist(i, &vol);
    i.depot.release_objects(&i.devices, &released)?;
    crate::checkpoint::checkpoint_locked(i, gate, true)
}

/// Take a volume out of the pool in memory (its handles fail from now on, its map
/// and directory pages are freed after the next checkpoint, its slot and
/// reservation are forgotten): the objects its entries name, once per entry, for
/// the caller to release. Gate held exclusively; the caller's checkpoint makes it
/// durable.
fn unlist(i: &Inner, vol: &VolumeState) -> Vec<fewerbytes_format::location::ObjectId> {
    vol.mark_deleted();
    // Pages other trees reach stay theirs (`page_share.rs`).
    let (pages, released) = vol.leave_map(i.volumes.shares());
    let mut free: Vec<u64> = pages.iter().flat_map(page_addresses).collect();
    free.extend(vol.dirs().slots());
    i.checkpointer.free_after_next(free);
    i.volumes.remove(vol.slot());
    released
}

/// Grow a volume (or shrink with `allow_shrink`).
pub(crate) fn resize(
    inner: &Inner,
    name: &str,
    size_bytes: u64,
    allow_shrink: bool,
) -> Result<VolumeInfo> {
    let size_blocks = size_blocks_of(size_bytes)?;
    let i = inner;
    i.devices.ensure_writable()?;
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    let vol = i.volumes.by_name(name)?;
    refuse_snapshot(inner, &vol, "resized")?;
    refuse_if_damaged(&vol, "resized")?;
    let old = vol.size_blocks();
    if size_blocks > old {
        check_reservation(
            inner,
            &format!("growing '{name}' to {}", human_bytes(size_bytes)),
            Some(vol.id()),
            size_blocks,
            vol.mapped_blocks(),
            i.volumes.reservations().of(vol.id()),
        )?;
    } else if size_blocks < old {
        if !allow_shrink {
            return Err(EngineError::Refused(format!(
                "shrinking '{name}' from {} to {} discards its data past the new end; pass --shrink to do it",
                human_bytes(old * BLOCK_BYTES as u64),
                human_bytes(size_bytes)
            )));
        }
        let unmapped = vol.unmap_from(
            size_blocks,
            i.volumes.shares(),
            i.checkpointer.dirty_pages(),
        )?;
        i.checkpointer
            .free_after_next(unmapped.retired.iter().flat_map(page_addresses));
        i.depot.add_references(&i.devices, &unmapped.gained)?;
        i.depot.release_objects(&i.devices, &unmapped.released)?;
    }
    vol.set_size(size_blocks);
    crate::checkpoint::checkpoint_locked(i, gate, true)?;
    Ok(info(inner, &vol))
}

/// Clone a volume: shares every block by reference, and reserves as `p` says. The
/// clone maps what its source maps, so it has used that much of its reservation
/// already (`reservation.rs`).
pub(crate) fn clone(inner: &Inner, src: &str, dst: &str, p: Provisioning) -> Result<VolumeInfo> {
    validate_name(dst).map_err(EngineError::Refused)?;
    clone_named(inner, src, dst, p)
}

/// [`clone`] to a name the caller checked (a user's, or an internal one:
/// `internal.rs`).
pub(crate) fn clone_named(
    inner: &Inner,
    src: &str,
    dst: &str,
    p: Provisioning,
) -> Result<VolumeInfo> {
    let i = inner;
    i.devices.ensure_writable()?;
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    let source = i.volumes.by_name(src)?;
    refuse_if_damaged(&source, "cloned")?;
    if i.volumes.exists(dst) {
        return Err(EngineError::VolumeExists(dst.to_string()));
    }
    let size_blocks = source.size_blocks();
    check_reservation(
        inner,
        &format!(
            "clone '{dst}' of {}",
            human_bytes(size_blocks * BLOCK_BYTES as u64)
        ),
        None,
        size_blocks,
        source.mapped_blocks(),
        p,
    )?;
    settle_pages(inner, &source)?;
    room_for_new_volume(inner, written_pages(&source))?;
    let vol = i.volumes.make(dst, size_blocks)?;
    // The copy holds the same bytes: it keeps its source's limit.
    vol.set_limited(source.limited());
    vol.set_incomplete(source.incomplete());
    let copied = vol.share_map_from(&source, i.volumes.shares(), i.checkpointer.dirty_pages());
    i.depot.add_references(&i.devices, &copied)?;
    i.volumes.reservations().set(vol.id(), p);
    i.volumes.insert(vol.clone());
    crate::checkpoint::checkpoint_locked(i, gate, true)?;
    Ok(info(inner, &vol))
}

/// Roll volume `name` back to `from` (a snapshot, or any other volume): `name` then
/// maps what `from` maps, at `from`'s size, and what it alone held is freed. One
/// durable step (one checkpoint): a crash leaves the volume as it was or as `from`,
/// never without it. Refused while `name` has open handles. The volume keeps its
/// name, id, snapshots, reservation's kind and limit; it takes `from`'s map pages
/// as a clone does (`page_share.rs`), so the step costs the same at any size. With
/// `unchanged_since`, refused in the same step when `name` reads differently from
/// that volume ([`written_since`]): a write acknowledged before the step is never
/// discarded by it.
pub(crate) fn rollback(
    inner: &Inner,
    name: &str,
    from: &str,
    unchanged_since: Option<&str>,
) -> Result<VolumeInfo> {
    let i = inner;
    i.devices.ensure_writable()?;
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    let vol = i.volumes.by_name(name)?;
    let source = i.volumes.base_of(name, from)?;
    if vol.id() == source.id() {
        return Err(EngineError::Refused(format!(
            "volume '{name}' cannot be rolled back to itself"
        )));
    }
    if vol.is_snapshot() {
        return Err(EngineError::Refused(format!(
            "'{name}' is a snapshot: a snapshot is never changed"
        )));
    }
    refuse_if_damaged(&source, "rolled back to")?;
    // A running guest would see its disk change under it: a volume is rolled back
    // while nothing uses it, as Proxmox rolls back a stopped VM's disk.
    let users = vol.users();
    if users > 0 {
        return Err(EngineError::Refused(format!(
            "volume '{name}' is open by {users} client(s): disconnect them to roll it back"
        )));
    }
    if let Some(since) = unchanged_since {
        if differs(&vol, &*i.volumes.by_name(since)?) {
            return Err(EngineError::Refused(format!(
                "volume '{name}' was written since '{since}' was taken of it"
            )));
        }
    }
    let size_blocks = source.size_blocks();
    let p = i.volumes.reservations().of(vol.id());
    check_reservation(
        inner,
        &format!(
            "rolling '{name}' back to '{from}' of {}",
            human_bytes(size_blocks * BLOCK_BYTES as u64)
        ),
        Some(vol.id()),
        size_blocks,
        source.mapped_blocks(),
        p,
    )?;
    settle_pages(inner, &source)?;
    room_for_new_volume(inner, written_pages(&source))?;
    // The volume leaves its map and its directory pages (freed after the
    // checkpoint), then takes the source's pages. The source's references are taken
    // before the old map's are dropped, so a block both map is never free between.
    let shares = i.volumes.shares();
    let (pages, released) = vol.leave_map(shares);
    let mut free: Vec<u64> = pages.iter().flat_map(page_addresses).collect();
    {
        let mut dirs = vol.dirs();
        free.extend(dirs.slots());
        *dirs = crate::dir_tree::DirTree::default();
    }
    i.checkpointer.free_after_next(free);
    vol.set_size(size_blocks);
    let copied = vol.share_map_from(&source, shares, i.checkpointer.dirty_pages());
    i.depot.add_references(&i.devices, &copied)?;
    i.depot.release_objects(&i.devices, &released)?;
    crate::checkpoint::checkpoint_locked(i, gate, true)?;
    Ok(info(inner, &vol))
}

/// Whether `vol` reads differently from `since`: another size, or a block whose
/// entry reads otherwise (`map_diff.rs`; the caller holds the gate).
fn differs(vol: &VolumeState, since: &VolumeState) -> bool {
    let end = vol.size_blocks() * BLOCK_BYTES as u64;
    vol.size_blocks() != since.size_blocks()
        || crate::map_diff::changed_extents(vol, since, 0, end)
            .iter()
            .any(|e| e.changed)
}

/// Whether volume `name` reads differently from volume `since` (any two volumes).
pub(crate) fn written_since(inner: &Inner, name: &str, since: &str) -> Result<bool> {
    let _gate = inner.locks.shared();
    let (vol, old) = (inner.volumes.by_name(name)?, inner.volumes.by_name(since)?);
    Ok(differs(&vol, &old))
}

/// Take snapshot `snapshot` of volume `name`: a read-only point in time, reached
/// as `name@snapshot`, that shares every map page of the volume (`page_share.rs`),
/// so it costs the same at any size. Taken with the gate held exclusively (no
/// write is half done) and made durable by one checkpoint. It reserves nothing: it
/// holds blocks only as the volume overwrites them, which the pool's space shows.
pub(crate) fn snapshot(
    inner: &Inner,
    name: &str,
    snapshot: &str,
    guid: Option<u64>,
) -> Result<VolumeInfo> {
    validate_name(snapshot).map_err(EngineError::Refused)?;
    let i = inner;
    i.devices.ensure_writable()?;
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    let source = i.volumes.by_name(name)?;
    if source.is_snapshot() {
        return Err(EngineError::Refused(format!(
            "'{name}' is a snapshot: take a snapshot of its volume instead"
        )));
    }
    refuse_if_damaged(&source, "snapshotted")?;
    let full = format!("{name}@{snapshot}");
    if i.volumes.exists(&full) {
        return Err(EngineError::VolumeExists(full));
    }
    settle_pages(inner, &source)?;
    room_for_new_volume(inner, written_pages(&source))?;
    // A snapshot taken here gets an identity no other pool's can have, which no one
    // can compute without the pool's secret (`PoolGeometry::snapshot_guid`). A
    // received one keeps the sender's.
    let id = i.volumes.next_id();
    let guid = guid.unwrap_or_else(|| inner.geometry.snapshot_guid(id));
    let vol = i
        .volumes
        .make_snapshot(snapshot, source.size_blocks(), source.id(), guid)?;
    vol.set_limited(source.limited());
    vol.set_incomplete(source.incomplete());
    let copied = vol.share_map_from(&source, i.volumes.shares(), i.checkpointer.dirty_pages());
    i.depot.add_references(&i.devices, &copied)?;
    i.volumes.reservations().set(vol.id(), Provisioning::THIN);
    i.volumes.insert(vol.clone());
    crate::checkpoint::checkpoint_locked(i, gate, true)?;
    Ok(info(inner, &vol))
}

/// The snapshots of volume `name`, oldest first.
pub(crate) fn snapshots(inner: &Inner, name: &str) -> Result<Vec<VolumeInfo>> {
    let vol = inner.volumes.by_name(name)?;
    Ok(inner
        .volumes
        .snapshots_of(vol.id())
        .iter()
        .map(|s| info(inner, s))
        .collect())
}

/// Change what a volume reserves (`volume set`): refused, with nothing changed, when
/// the pool cannot honour it. Durable on return, as every volume change.
pub(crate) fn set_provisioning(inner: &Inner, name: &str, p: Provisioning) -> Result<VolumeInfo> {
    let i = inner;
    i.devices.ensure_writable()?;
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    let vol = i.volumes.by_name(name)?;
    refuse_snapshot(inner, &vol, "given a reservation")?;
    check_reservation(
        inner,
        &format!("volume '{name}'"),
        Some(vol.id()),
        vol.size_blocks(),
        vol.mapped_blocks(),
        p,
    )?;
    let before = i.volumes.reservations().of(vol.id());
    i.volumes.reservations().set(vol.id(), p);
    if let Err(e) = crate::checkpoint::checkpoint_locked(i, gate, true) {
        i.volumes.reservations().set(vol.id(), before);
        return Err(e);
    }
    Ok(info(inner, &vol))
}

/// Limit a volume to the allow list's identities, or not (`volume allow`). Durable
/// on return, as every volume change; on a failed checkpoint the flag is as before.
pub(crate) fn set_limited(inner: &Inner, name: &str, limited: bool) -> Result<VolumeInfo> {
    let i = inner;
    i.devices.ensure_writable()?;
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    let vol = i.volumes.by_name(name)?;
    let before = vol.limited();
    if before == limited {
        return Ok(info(inner, &vol));
    }
    vol.set_limited(limited);
    if let Err(e) = crate::checkpoint::checkpoint_locked(i, gate, true) {
        vol.set_limited(before);
        return Err(e);
    }
    Ok(info(inner, &vol))
}

/// Mark a volume incomplete (an import into it begins), or complete (the import
/// ended, or is taken as it is). Durable on return, as every volume change, so a
/// killed import leaves the mark; on a failed checkpoint the flag is as before.
pub(crate) fn set_incomplete(inner: &Inner, name: &str, incomplete: bool) -> Result<VolumeInfo> {
    let i = inner;
    i.devices.ensure_writable()?;
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    let vol = i.volumes.by_name(name)?;
    if incomplete {
        refuse_snapshot(inner, &vol, "imported into")?;
    }
    let before = vol.incomplete();
    if before == incomplete {
        return Ok(info(inner, &vol));
    }
    vol.set_incomplete(incomplete);
    if let Err(e) = crate::checkpoint::checkpoint_locked(i, gate, true) {
        vol.set_incomplete(before);
        return Err(e);
    }
    Ok(info(inner, &vol))
}

/// Rename a volume. Nothing moves: the catalog names it anew, made durable by a
/// checkpoint taken with the gate held, as every volume operation is, so a crash
/// leaves the old name or the new one, never both. A volume with open handles
/// (NBD clients) is refused: they attached it by the old name.
pub(crate) fn rename(inner: &Inner, name: &str, new_name: &str) -> Result<VolumeInfo> {
    validate_name(new_name).map_err(EngineError::Refused)?;
    let i = inner;
    i.devices.ensure_writable()?;
    let _ck = i.checkpointer.serialize();
    let gate = i.locks.exclusive();
    let vol = i.volumes.by_name(name)?;
    refuse_snapshot(inner, &vol, "renamed")?;
    if i.volumes.exists(new_name) {
        return Err(EngineError::VolumeExists(new_name.to_string()));
    }
    // A client attached the volume by its old name (its NBD export): a disk is
    // renamed while nothing uses it, as Proxmox renames a stopped VM's disk.
    let users = vol.users();
    if users > 0 {
        return Err(EngineError::Refused(format!(
            "volume '{name}' is open by {users} client(s): disconnect them to rename it"
        )));
    }
    vol.rename(new_name);
    crate::checkpoint::checkpoint_locked(i, gate, true)?;
    Ok(info(inner, &vol))
}
