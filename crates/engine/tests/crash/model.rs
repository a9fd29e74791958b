//! The crash simulation's model: every content each block of each volume was given,
//! by operation, and the log positions of the operations; what a pool opened after a
//! crash at a log position may hold.

use crate::common::BLOCK;
use crate::mix;
use fewerbytes_engine::Pool;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// A volume up to this many blocks is read whole after every crash; of a larger one,
/// the blocks written since the barrier and one in [`SAMPLE_ONE_IN`] of the others.
pub(crate) const WHOLE_VOLUME_BLOCKS_MAX: u64 = 1024;
/// See [`WHOLE_VOLUME_BLOCKS_MAX`].
pub(crate) const SAMPLE_ONE_IN: u64 = 32;

/// A volume as the model knows it: which incarnation of a name, and its size.
pub(crate) type VolumeSet = BTreeMap<String, (u32, u64)>;

/// One operation of a workload, placed in the log.
pub(crate) struct OpRecord {
    pub(crate) what: String,
    /// Log length when it was called and when it returned.
    pub(crate) start: usize,
    pub(crate) end: usize,
    /// Everything before it is durable once it returned (flush, volume operation, close).
    pub(crate) barrier: bool,
    /// The volumes after it.
    pub(crate) volumes: VolumeSet,
}

/// A block's content after an operation; `fua` if that operation was a FUA request.
pub(crate) struct Version {
    pub(crate) op: usize,
    pub(crate) fua: bool,
    pub(crate) bytes: Arc<Vec<u8>>,
}

/// The workload's model: the bytes of every volume now, and for each block of each
/// volume incarnation every content it was given, by operation.
#[derive(Default)]
pub(crate) struct Model {
    pub(crate) ops: Vec<OpRecord>,
    pub(crate) volumes: VolumeSet,
    pub(crate) next_incarnation: u32,
    pub(crate) bytes: HashMap<u32, Vec<u8>>,
    pub(crate) history: HashMap<(u32, u64), Vec<Version>>,
}

impl Model {
    pub(crate) fn block(&self, inc: u32, lbn: u64) -> Vec<u8> {
        let at = lbn as usize * BLOCK;
        self.bytes[&inc][at..at + BLOCK].to_vec()
    }

    /// Operation `op` wrote `data` at `offset` of incarnation `inc`.
    pub(crate) fn change(&mut self, op: usize, inc: u32, offset: u64, data: &[u8], fua: bool) {
        if data.is_empty() {
            return;
        }
        let at = offset as usize;
        self.bytes.get_mut(&inc).expect("volume")[at..at + data.len()].copy_from_slice(data);
        let first = offset / BLOCK as u64;
        let last = (offset + data.len() as u64 - 1) / BLOCK as u64;
        for lbn in first..=last {
            let bytes = Arc::new(self.block(inc, lbn));
            self.history
                .entry((inc, lbn))
                .or_default()
                .push(Version { op, fua, bytes });
        }
    }

    /// Operation `op` wrote whole blocks `blocks` from `lbn` on: `change` for
    /// contents shared between versions (a churn writes the same few blocks often).
    pub(crate) fn change_shared(
        &mut self,
        op: usize,
        inc: u32,
        lbn: u64,
        blocks: &[&Arc<Vec<u8>>],
    ) {
        let bytes = self.bytes.get_mut(&inc).expect("volume");
        for (i, block) in blocks.iter().enumerate() {
            let at = (lbn as usize + i) * BLOCK;
            bytes[at..at + BLOCK].copy_from_slice(block);
            self.history
                .entry((inc, lbn + i as u64))
                .or_default()
                .push(Version {
                    op,
                    fua: false,
                    bytes: Arc::clone(block),
                });
        }
    }

    /// A new volume `name` of `blocks`, all zeros: a new incarnation of the name.
    pub(crate) fn create(&mut self, name: &str, blocks: u64) -> u32 {
        let inc = self.next_incarnation;
        self.next_incarnation += 1;
        self.bytes.insert(inc, vec![0; blocks as usize * BLOCK]);
        self.volumes.insert(name.to_string(), (inc, blocks));
        inc
    }

    /// Operation `op` cloned `src` to `dst`: `dst`'s blocks start as `src`'s now.
    pub(crate) fn clone_volume(&mut self, op: usize, src: &str, dst: &str) {
        let (src_inc, blocks) = self.volumes[src];
        let inc = self.create(dst, blocks);
        let bytes = self.bytes[&src_inc].clone();
        self.change(op, inc, 0, &bytes, false);
    }

    /// Operation `op` resized `name` to `blocks`.
    pub(crate) fn resize(&mut self, op: usize, name: &str, blocks: u64) {
        let (inc, old) = self.volumes[name];
        if blocks < old {
            // The blocks past the new end are dropped; grown again, they read zeros.
            let zeros = vec![0u8; (old - blocks) as usize * BLOCK];
            self.change(op, inc, blocks * BLOCK as u64, &zeros, false);
        }
        self.bytes
            .get_mut(&inc)
            .expect("volume")
            .resize(blocks as usize * BLOCK, 0);
        self.volumes.insert(name.to_string(), (inc, blocks));
    }
}

impl Model {
    /// Check the volumes of a pool opened after a crash at `at`, and every block of
    /// them, against what the model allows.
    pub(crate) fn check_volumes(&self, pool: &Arc<Pool>, at: usize) -> Result<(), String> {
        let durable = self.barrier_kept(pool, at)?;
        let kept = self.check_barrier(pool, at, durable);
        // A volume operation under way that changes no name and no size (a rollback
        // to a volume of the same size) may have landed: the pool's volumes cannot
        // tell, their contents do.
        match (kept, self.under_way(at)) {
            (Err(before), Some(i)) if Some(i) != durable && self.ops[i].barrier => self
                .check_barrier(pool, at, Some(i))
                .map_err(|after| format!("{before}; nor as after '{}': {after}", self.ops[i].what)),
            (kept, _) => kept,
        }
    }

    /// The volume operation under way at `at`, if any.
    fn under_way(&self, at: usize) -> Option<usize> {
        self.ops.iter().position(|o| o.start < at && at < o.end)
    }

    /// Check every volume and block against barrier `durable` kept.
    fn check_barrier(
        &self,
        pool: &Arc<Pool>,
        at: usize,
        durable: Option<usize>,
    ) -> Result<(), String> {
        let empty = VolumeSet::new();
        for (name, (inc, blocks)) in durable.map_or(&empty, |i| &self.ops[i].volumes) {
            self.check_volume(pool, at, durable, name, *inc, *blocks)?;
        }
        Ok(())
    }

    /// The barrier a crash at `at` keeps: the last that returned before it, or a
    /// volume operation under way whose volumes the pool shows (it landed). Volumes
    /// other than one of those two sets are a failure.
    fn barrier_kept(&self, pool: &Arc<Pool>, at: usize) -> Result<Option<usize>, String> {
        let ops = &self.ops;
        let durable = ops.iter().rposition(|o| o.barrier && o.end <= at);
        let under_way = self.under_way(at);
        let mut got: BTreeMap<String, u64> = pool
            .volume_sizes()
            .into_iter()
            .map(|(name, bytes)| (name, bytes / BLOCK as u64))
            .collect();
        // And each volume's snapshots (`NAME@SNAPSHOT`), which the sizes leave out.
        for name in got.keys().cloned().collect::<Vec<_>>() {
            for s in pool.snapshots(&name).map_err(|e| e.to_string())? {
                got.insert(s.name, s.size_bytes / BLOCK as u64);
            }
        }
        let sizes = |set: &VolumeSet| -> BTreeMap<String, u64> {
            set.iter().map(|(n, (_, b))| (n.clone(), *b)).collect()
        };
        let before = durable.map_or_else(BTreeMap::new, |i| sizes(&ops[i].volumes));
        if got == before {
            return Ok(durable);
        }
        match under_way {
            Some(i) if ops[i].barrier && got == sizes(&ops[i].volumes) => Ok(Some(i)),
            _ => Err(format!(
                "volumes are {got:?}, expected {before:?}{}",
                under_way
                    .map(|i| format!(" or {:?} ({})", sizes(&ops[i].volumes), ops[i].what))
                    .unwrap_or_default()
            )),
        }
    }

    /// What block `lbn` of incarnation `inc` may hold after a crash at `at` that kept
    /// barrier `durable`: its *floor* (the content at the barrier, or a later completed
    /// FUA write's; none: zeros since its creation), and the contents given to it
    /// since by operations begun before the crash.
    fn allowed(
        &self,
        inc: u32,
        lbn: u64,
        durable: Option<usize>,
        at: usize,
    ) -> (Option<&Version>, Vec<&Version>) {
        let ops = &self.ops;
        let versions = self
            .history
            .get(&(inc, lbn))
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let floor = versions
            .iter()
            .rposition(|v| durable.is_some_and(|d| v.op <= d) || (v.fua && ops[v.op].end <= at));
        let later = versions[floor.map_or(0, |f| f + 1)..]
            .iter()
            .filter(|v| ops[v.op].start < at)
            .collect();
        (floor.map(|f| &versions[f]), later)
    }

    /// Check one volume's blocks. A small volume is read whole; of a large one (a
    /// full pool's), every block written since the barrier and a sample of the others.
    fn check_volume(
        &self,
        pool: &Arc<Pool>,
        at: usize,
        durable: Option<usize>,
        name: &str,
        inc: u32,
        blocks: u64,
    ) -> Result<(), String> {
        let vol = pool
            .open_volume(name)
            .map_err(|e| format!("opening volume {name}: {e}"))?;
        let whole = blocks <= WHOLE_VOLUME_BLOCKS_MAX;
        let mut bytes = vec![0u8; if whole { blocks as usize } else { 1 } * BLOCK];
        if whole {
            vol.read(0, &mut bytes)
                .map_err(|e| format!("reading volume {name}: {e}"))?;
        }
        let zeros = vec![0u8; BLOCK];
        for lbn in 0..blocks {
            let (floor, later) = self.allowed(inc, lbn, durable, at);
            let block = if whole {
                &bytes[lbn as usize * BLOCK..(lbn as usize + 1) * BLOCK]
            } else if !later.is_empty() || mix(at as u64, lbn).is_multiple_of(SAMPLE_ONE_IN) {
                vol.read(lbn * BLOCK as u64, &mut bytes)
                    .map_err(|e| format!("reading volume {name} block {lbn}: {e}"))?;
                &bytes[..]
            } else {
                continue;
            };
            let floor_bytes = floor.map_or(zeros.as_slice(), |v| v.bytes.as_slice());
            let mut allowed =
                std::iter::once(floor_bytes).chain(later.iter().map(|v| v.bytes.as_slice()));
            if !allowed.any(|a| a == block) {
                let ops = &self.ops;
                let later: Vec<&str> = later.iter().map(|v| ops[v.op].what.as_str()).collect();
                return Err(format!(
                    "volume {name} block {lbn} reads none of its allowed contents: the one at {} or those of {later:?}{}",
                    floor.map_or("its creation".to_string(), |v| format!("'{}'", ops[v.op].what)),
                    if block == zeros.as_slice() { " (it reads zeros)" } else { "" }
                ));
            }
        }
        Ok(())
    }

    /// After operation `op` recovered from a crash: every block now holds what the
    /// pool reads (one of the contents the model allowed), durably.
    pub(crate) fn adopt(&mut self, pool: &Arc<Pool>, op: usize) {
        for (name, (inc, blocks)) in self.volumes.clone() {
            let mut bytes = vec![0u8; blocks as usize * BLOCK];
            pool.open_volume(&name)
                .and_then(|v| v.read(0, &mut bytes))
                .expect("read after recovery");
            for lbn in 0..blocks {
                let block = &bytes[lbn as usize * BLOCK..(lbn as usize + 1) * BLOCK];
                if *block != *self.block(inc, lbn) {
                    self.change(op, inc, lbn * BLOCK as u64, block, false);
                }
            }
        }
    }
}
