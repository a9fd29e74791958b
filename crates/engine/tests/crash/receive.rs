//! The crash simulation's receive workload: a receive's engine steps as
//! crates/cli/src/receive.rs takes them, beside writers. An in-place receive into
//! `v0` from its snapshot `v0@s` and a receive of a new `v2` from the live `v1`
//! each freeze their base as an internal clone, clone a hidden partial volume from
//! it and write the stream's records (new data, and blocks read from the frozen
//! base) into it, while clients write `v0` and `v1`; then `v2` is the partial
//! renamed, and `v0` is rolled to its partial in one step refused when `v0` was
//! written since the frozen base (some runs with a writer racing that step).
//!
//! The internal volumes are no volumes of the model: a crash point finds them in
//! no user listing (a leaked one fails the volume check), and `v0` after any crash
//! holds, block for block, its old contents and acknowledged writes or what the
//! partial held at the final step, never a mix (`Model::check_volumes` reads the
//! whole volume against one barrier or the other).

use crate::common::BLOCK;
use crate::workload::{byte_range, data_of, random_bytes, Workload, VOL_BLOCKS};
use fewerbytes_engine::{InternalName, Pool, Provisioning};
use rand::{rngs::StdRng, Rng};
use std::sync::Arc;

/// Workloads whose seed is this modulo 8 run a receive beside writers first
/// (neither a full pool's class nor a tiny page store's).
pub(crate) const RECEIVE_SEED_CLASS: u64 = 3;
/// The most steps (records, writes, flushes) between a receive's start and its end.
const RECEIVE_STEPS_MAX: usize = 10;

/// One receive's hidden volumes and the model's incarnation of its partial.
struct Receiving {
    frozen: InternalName,
    partial: InternalName,
    partial_inc: u32,
    /// What the frozen base holds.
    base: Vec<u8>,
}

impl Workload<'_> {
    /// The receive workload (the module's header): on a pool holding `v0` and `v1`.
    pub(crate) fn receive(&mut self, rng: &mut StdRng, pool: &Arc<Pool>) {
        for name in ["v0", "v1"] {
            let data = data_of(rng, 16 * BLOCK);
            self.write(
                pool,
                name,
                rng.gen_range(0..VOL_BLOCKS - 16) * BLOCK as u64,
                data,
                false,
            );
        }
        let op = self.run("snapshot v0@s", true, |op| {
            pool.snapshot_volume("v0", "s").expect("snapshot");
            op
        });
        self.model.clone_volume(op, "v0", "v0@s");
        self.settle();
        let onto = self.begin_receive(pool, "v0@s", "v0");
        let new = self.begin_receive(pool, "v1", "v2");
        let write_target = rng.gen_bool(0.5);
        for _ in 0..rng.gen_range(1..=RECEIVE_STEPS_MAX) {
            let into = if rng.gen_bool(0.5) { &onto } else { &new };
            match rng.gen_range(0..6) {
                0 => self.base_ref(rng, pool, into),
                1 => self.run("flush", true, |_| pool.flush().expect("flush")),
                2 if write_target => self.client_write(rng, pool, "v0"),
                2 | 3 => self.client_write(rng, pool, "v1"),
                _ => self.record(rng, pool, into),
            }
        }
        self.finish_new(pool, &new, "v2");
        self.finish_in_place(rng, pool, &onto, "v0");
        for name in ["v0", "v2"] {
            let (inc, _) = self.model.volumes[name];
            let got = crate::common::read_all(pool, name);
            assert!(
                got == self.model.bytes[&inc],
                "volume {name} after its receive differs from the model"
            );
        }
    }

    /// A receive's first steps into `of`: the frozen copy of `base`, and the
    /// partial cloned from it.
    fn begin_receive(&mut self, pool: &Arc<Pool>, base: &str, of: &str) -> Receiving {
        let frozen = InternalName::new("base", of).expect("internal name");
        let partial = InternalName::new("receiving", of).expect("internal name");
        let internal = pool.internal();
        self.run(
            &format!("freeze {base} as {}", frozen.as_str()),
            true,
            |_| {
                internal
                    .clone(base, &frozen, Provisioning::THIN)
                    .expect("freeze the base")
            },
        );
        let op = self.run(
            &format!("clone the partial {}", partial.as_str()),
            true,
            |op| {
                internal
                    .clone(frozen.as_str(), &partial, Provisioning::THIN)
                    .expect("the partial volume");
                op
            },
        );
        // The partial is an incarnation of the model no volume set names.
        let (base_inc, blocks) = self.model.volumes[base];
        let partial_inc = self.model.create(partial.as_str(), blocks);
        self.model.volumes.remove(partial.as_str());
        let bytes = self.model.bytes[&base_inc].clone();
        self.model.change(op, partial_inc, 0, &bytes, false);
        Receiving {
            frozen,
            partial,
            partial_inc,
            base: bytes,
        }
    }

    /// A record of new data written to a partial.
    fn record(&mut self, rng: &mut StdRng, pool: &Arc<Pool>, into: &Receiving) {
        let (offset, len) = byte_range(rng, VOL_BLOCKS);
        let data = data_of(rng, len as usize);
        self.partial_write(pool, into, offset, data, "record");
    }

    /// A base reference: blocks read from the frozen base into the partial.
    fn base_ref(&mut self, rng: &mut StdRng, pool: &Arc<Pool>, into: &Receiving) {
        let lbn = rng.gen_range(0..VOL_BLOCKS);
        let len = rng.gen_range(1..=8u64).min(VOL_BLOCKS - lbn) as usize * BLOCK;
        let at = lbn as usize * BLOCK;
        let mut copy = vec![0u8; len];
        let frozen = pool
            .internal()
            .open(into.frozen.as_str())
            .expect("frozen base");
        frozen
            .read(at as u64, &mut copy)
            .expect("read the frozen base");
        assert!(
            copy == into.base[at..at + len],
            "the frozen base {} reads otherwise than when it was frozen",
            into.frozen.as_str()
        );
        self.partial_write(pool, into, at as u64, copy, "base reference");
    }

    fn partial_write(
        &mut self,
        pool: &Arc<Pool>,
        into: &Receiving,
        offset: u64,
        data: Vec<u8>,
        kind: &str,
    ) {
        let what = format!("{kind} {} {offset}+{}", into.partial.as_str(), data.len());
        let op = self.run(&what, false, |op| {
            let v = pool
                .internal()
                .open(into.partial.as_str())
                .expect("partial");
            v.write(offset, &data, false).expect("write the partial");
            op
        });
        self.model
            .change(op, into.partial_inc, offset, &data, false);
    }

    /// A client's write to `name` while the receives run.
    fn client_write(&mut self, rng: &mut StdRng, pool: &Arc<Pool>, name: &str) {
        let (offset, len) = byte_range(rng, VOL_BLOCKS);
        let data = data_of(rng, len as usize);
        self.write(pool, name, offset, data, false);
    }

    /// The new volume's end: the partial renamed to `of`, the frozen base deleted.
    fn finish_new(&mut self, pool: &Arc<Pool>, r: &Receiving, of: &str) {
        let internal = pool.internal();
        self.run(
            &format!("rename {} to {of}", r.partial.as_str()),
            true,
            |_| {
                internal
                    .rename(r.partial.as_str(), of)
                    .expect("rename the partial")
            },
        );
        self.model
            .volumes
            .insert(of.to_string(), (r.partial_inc, VOL_BLOCKS));
        self.settle();
        self.delete_internal(pool, &r.frozen);
    }

    fn delete_internal(&mut self, pool: &Arc<Pool>, name: &InternalName) {
        self.run(&format!("delete {}", name.as_str()), true, |_| {
            pool.internal()
                .delete(name.as_str(), false)
                .expect("delete an internal volume")
        });
    }
}

impl Workload<'_> {
    /// The in-place end: `of` rolled to the partial in one step refused when `of`
    /// was written since the frozen base, in some runs with a client's write of a
    /// fresh block racing the step; then the receive's hidden volumes are deleted
    /// (its end, or its abandon). A write is never lost: when the step is taken,
    /// the racing write came after it (before, it would have refused).
    fn finish_in_place(&mut self, rng: &mut StdRng, pool: &Arc<Pool>, r: &Receiving, of: &str) {
        let (old_inc, _) = self.model.volumes[of];
        let written = self.model.bytes[&old_inc] != r.base;
        let racing = rng.gen_bool(0.5).then(|| {
            (
                rng.gen_range(0..VOL_BLOCKS) * BLOCK as u64,
                random_bytes(rng, 1),
            )
        });
        let (partial, frozen) = (r.partial.as_str(), r.frozen.as_str());
        let what = format!("roll {of} to {partial} unless written since {frozen}");
        let log = self.log;
        let start = log.len();
        let internal = pool.internal();
        let step = || (internal.rollback(of, partial, Some(frozen)), log.len());
        let ((step, step_end), write_end) = match &racing {
            None => (step(), start),
            Some((offset, data)) => std::thread::scope(|s| {
                let writer = s.spawn(|| {
                    let v = pool.open_volume(of).expect("volume");
                    v.write(*offset, data, false)
                        .expect("a write racing the step");
                    drop(v);
                    log.len()
                });
                let stepped = step();
                (stepped, writer.join().expect("writer"))
            }),
        };
        let taken = step.is_ok();
        assert!(
            !(taken && written),
            "the final step was taken over writes made to {of} since its base was frozen"
        );
        assert!(
            taken || written || racing.is_some(),
            "the final step refused {of}, which nobody wrote since its base was frozen: {:?}",
            step.err()
        );
        let op = self.note(&what, start, step_end, taken);
        if taken {
            let bytes = self.model.bytes[&r.partial_inc].clone();
            let inc = self.model.create(of, VOL_BLOCKS);
            self.model.change(op, inc, 0, &bytes, false);
            self.settle();
        }
        if let Some((offset, data)) = racing {
            let (inc, _) = self.model.volumes[of];
            let what = format!("write {of} {offset}+{} (racing the final step)", data.len());
            let op = self.note(&what, start, write_end, false);
            self.model.change(op, inc, offset, &data, false);
        }
        self.delete_internal(pool, &r.partial);
        self.delete_internal(pool, &r.frozen);
    }
}
