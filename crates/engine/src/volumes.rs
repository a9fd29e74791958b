//! The volume list: each volume's state by its catalog slot, and the id the next
//! volume takes. A volume operation (create, clone, resize, rename, delete: `volume_ops.rs`)
//! changes the list with the pool's gate held exclusively, so a checkpoint's snapshot
//! sees it whole; request threads only look volumes up. Each volume's reservation
//! is kept beside the list (`reservation.rs`).

use crate::block_map::VolumeState;
use crate::page_share::Shares;
use crate::reservation::Reservations;
use crate::{EngineError, Result};
use fewerbytes_format::catalog::MAX_VOLUMES;
use parking_lot::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Every volume of the pool, by catalog slot.
pub(crate) struct Volumes {
    slots: RwLock<Vec<Option<Arc<VolumeState>>>>,
    next_id: AtomicU64,
    reservations: Reservations,
    /// The durable map pages several volumes' trees reach.
    shares: Shares,
}

impl Volumes {
    /// No volumes; the first takes id 1.
    pub(crate) fn new() -> Self {
        Volumes {
            slots: RwLock::new(Vec::new()),
            next_id: AtomicU64::new(1),
            reservations: Reservations::default(),
            shares: Shares::default(),
        }
    }

    /// The durable map pages several volumes' trees reach (`page_share.rs`).
    pub(crate) fn shares(&self) -> &Shares {
        &self.shares
    }

    /// Every volume's reservation.
    pub(crate) fn reservations(&self) -> &Reservations {
        &self.reservations
    }

    /// The volume named `name`, or the snapshot `VOLUME@SNAPSHOT` names.
    pub(crate) fn by_name(&self, name: &str) -> Result<Arc<VolumeState>> {
        let vols = self.slots.read();
        let volume = |n: &str| {
            vols.iter()
                .flatten()
                .find(|v| !v.is_snapshot() && v.is_named(n))
        };
        let found = match name.split_once('@') {
            None => volume(name),
            Some((of, snapshot)) => volume(of).and_then(|o| {
                vols.iter()
                    .flatten()
                    .find(|v| v.origin() == Some(o.id()) && v.is_named(snapshot))
            }),
        };
        found
            .cloned()
            .ok_or_else(|| EngineError::VolumeNotFound(name.to_string()))
    }

    /// The base a comparison of volume `name` names as `from`: its own snapshot
    /// `from` when it has one (`name@from`), else the volume or snapshot `from`
    /// names in full.
    pub(crate) fn base_of(&self, name: &str, from: &str) -> Result<Arc<VolumeState>> {
        if !from.contains('@') {
            if let Ok(snapshot) = self.by_name(&format!("{name}@{from}")) {
                return Ok(snapshot);
            }
        }
        self.by_name(from)
    }

    /// Whether a volume (or, for `VOLUME@SNAPSHOT`, a snapshot) is named `name`.
    pub(crate) fn exists(&self, name: &str) -> bool {
        self.by_name(name).is_ok()
    }

    /// The snapshots of the volume with id `origin`, oldest first.
    pub(crate) fn snapshots_of(&self, origin: u64) -> Vec<Arc<VolumeState>> {
        let mut found: Vec<Arc<VolumeState>> = self
            .slots
            .read()
            .iter()
            .flatten()
            .filter(|v| v.origin() == Some(origin))
            .cloned()
            .collect();
        found.sort_by_key(|v| v.id());
        found
    }

    /// The name a person and the NBD export use: the volume's, or for a snapshot
    /// `VOLUME@SNAPSHOT`.
    pub(crate) fn full_name(&self, vol: &VolumeState) -> String {
        let Some(origin) = vol.origin() else {
            return vol.name();
        };
        let of = self
            .slots
            .read()
            .iter()
            .flatten()
            .find(|v| v.id() == origin)
            .map_or_else(|| format!("#{origin}"), |v| v.name());
        format!("{of}@{}", vol.name())
    }

    /// Every volume, in slot order.
    pub(crate) fn all(&self) -> Vec<Arc<VolumeState>> {
        self.slots.read().iter().flatten().cloned().collect()
    }

    /// The slot table as it is now (an empty slot is `None`): replay names volumes by slot.
    pub(crate) fn by_slot(&self) -> Vec<Option<Arc<VolumeState>>> {
        self.slots.read().clone()
    }

    /// Names and sizes in bytes of every volume, cheaply (no per-block work).
    pub(crate) fn sizes(&self, block_bytes: u64) -> Vec<(String, u64)> {
        self.slots
            .read()
            .iter()
            .flatten()
            .filter(|v| !v.is_snapshot())
            .map(|v| (v.name(), v.size_blocks() * block_bytes))
            .collect()
    }

    /// Blocks the volumes' sizes add up to.
    pub(crate) fn allocated_blocks(&self) -> u64 {
        self.slots
            .read()
            .iter()
            .flatten()
            .map(|v| v.size_blocks())
            .sum()
    }

    /// A new volume's state in the first free slot, with the next id; not yet listed
    /// (see [`Self::insert`]).
    pub(crate) fn make(&self, name: &str, size_blocks: u64) -> Result<Arc<VolumeState>> {
        let vols = self.slots.read();
        let slot = match vols.iter().position(Option::is_none) {
            Some(s) => s as u16,
            None if vols.len() < MAX_VOLUMES => vols.len() as u16,
            None => {
                return Err(EngineError::Refused(format!(
                    "a pool holds at most {MAX_VOLUMES} volumes"
                )))
            }
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        Ok(Arc::new(VolumeState::new(
            slot,
            id,
            name.to_string(),
            size_blocks,
        )))
    }

    /// A new snapshot's state (see [`Self::make`]) of the volume with id `origin`,
    /// with identity `guid`.
    pub(crate) fn make_snapshot(
        &self,
        name: &str,
        size_blocks: u64,
        origin: u64,
        guid: u64,
    ) -> Result<Arc<VolumeState>> {
        let vol = self.make(name, size_blocks)?;
        let vol = Arc::into_inner(vol)
            .ok_or_else(|| EngineError::Invariant("a volume just made is held elsewhere".into()))?;
        // Only a snapshot records when it was made (what replication compares), so
        // a pool without snapshots or shared pages keeps the plain catalog.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX));
        Ok(Arc::new(vol.with_origin(origin, guid).made_at(now)))
    }

    /// List a volume in its slot.
    pub(crate) fn insert(&self, vol: Arc<VolumeState>) {
        let mut vols = self.slots.write();
        let slot = vol.slot() as usize;
        if vols.len() <= slot {
            vols.resize(slot + 1, None);
        }
        if let Some(v) = vols.get_mut(slot) {
            *v = Some(vol);
        }
    }

    /// Unlist the volume in `slot`, and forget its reservation.
    pub(crate) fn remove(&self, slot: u16) {
        if let Some(v) = self.slots.write().get_mut(usize::from(slot)) {
            if let Some(vol) = v.take() {
                self.reservations.remove(vol.id());
            }
        }
    }

    /// The id the next volume takes (the catalog records it).
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.load(Ordering::Relaxed)
    }

    /// Continue ids from a loaded catalog.
    pub(crate) fn set_next_id(&self, id: u64) {
        self.next_id.store(id.max(1), Ordering::Relaxed);
    }
}
