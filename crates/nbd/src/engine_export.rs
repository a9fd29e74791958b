//! The adapter from the engine's `Pool` and `Volume` to [`ExportProvider`] and
//! [`Export`]: each NBD connection opens its own `Volume` handle, and engine
//! errors become NBD error values here ([`errno_of`]): the engine knows no protocol.

use crate::export::{
    Bitmap, Export, ExportDesc, ExportProvider, EINVAL, EIO, ENOSPC, EPERM, ESHUTDOWN,
};
use fewerbytes_engine::{EngineError, Pool, Volume};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// At most one ENOSPC line per volume in this long: a guest retrying a full disk
/// refuses thousands of writes a second, and one line with a count says as much.
const NO_SPACE_LOG_EVERY: Duration = Duration::from_secs(10);

/// Serve a pool's volumes: adapter from fewerbytes_engine::{Pool, Volume}.
///
/// `default_export` names the volume the empty export name means; without it, a
/// pool with exactly one volume serves that one, and any other pool has no default.
pub fn pool_exports(pool: Arc<Pool>, default_export: Option<String>) -> Arc<dyn ExportProvider> {
    Arc::new(PoolExports {
        pool,
        default_export,
        no_space: Arc::new(NoSpaceLog::default()),
    })
}

struct PoolExports {
    pool: Arc<Pool>,
    default_export: Option<String>,
    no_space: Arc<NoSpaceLog>,
}

/// What to do about a no-space refusal: room in the pool, or on the device below it
/// (which the pool cannot make: writes resume once its owner does).
fn no_space_hint(e: &EngineError) -> &'static str {
    match e {
        EngineError::Io(_) => {
            "The device below the pool is full: free space on it (the host file system, \
             the thin pool; for an rbd: image, raise the Ceph pool's quota or free space \
             in the cluster); writes resume by themselves once there is room"
        }
        _ => {
            "Make room for thin writes: make thick volumes thin (`volume set NAME --thin`) \
             or reserve less (`--reserve SIZE`), trim or delete volumes, or grow the pool \
             (`pool grow`)"
        }
    }
}

/// The server's ENOSPC lines, rate-limited per volume: a refused write is logged at
/// warn (the guest sees only ENOSPC, and QEMU may pause it), then at most once per
/// [`NO_SPACE_LOG_EVERY`] with the count of those not logged.
#[derive(Default)]
struct NoSpaceLog {
    /// Per volume: when its last line was logged, and refusals since not logged.
    last: Mutex<HashMap<String, (Instant, u64)>>,
}

impl NoSpaceLog {
    /// A write (`op`) to `volume` refused with `e`, a no-space error.
    fn refused(&self, volume: &str, op: &str, e: &EngineError) {
        let Some(suppressed) = self.due(volume, Instant::now()) else {
            return;
        };
        let also = if suppressed > 0 {
            format!(" ({suppressed} more refused since the last such line)")
        } else {
            String::new()
        };
        let hint = no_space_hint(e);
        tracing::warn!("a {op} to volume '{volume}' was refused with ENOSPC{also}: {e}. {hint}");
    }

    /// Whether a refusal for `volume` at `now` gets a line: `Some(refusals not
    /// logged since its last line)`, or `None` within [`NO_SPACE_LOG_EVERY`] of it
    /// (counted for the next line).
    fn due(&self, volume: &str, now: Instant) -> Option<u64> {
        let mut last = self.last.lock();
        match last.get_mut(volume) {
            Some((at, n)) if now.saturating_duration_since(*at) < NO_SPACE_LOG_EVERY => {
                *n += 1;
                None
            }
            Some((at, n)) => {
                *at = now;
                Some(std::mem::take(n))
            }
            None => {
                last.insert(volume.to_string(), (now, 0));
                Some(0)
            }
        }
    }
}

impl ExportProvider for PoolExports {
    fn list(&self) -> Vec<ExportDesc> {
        // `volume_sizes`, not `list_volumes`: the latter walks every block map, and
        // clients list exports on every connection (`nbdinfo --list`, INFO).
        self.pool
            .volume_sizes()
            .into_iter()
            .map(|(name, size_bytes)| ExportDesc {
                description: format!("fewerbytes volume '{name}', {size_bytes} bytes"),
                name,
                size_bytes,
            })
            .collect()
    }

    fn default_name(&self) -> Option<String> {
        if let Some(name) = &self.default_export {
            return Some(name.clone());
        }
        match self.pool.volume_sizes().as_slice() {
            [(only, _)] => Some(only.clone()),
            _ => None,
        }
    }

    fn open(&self, name: &str) -> Result<Arc<dyn Export>, String> {
        if self.pool.volume_incomplete(name) == Some(true) {
            // A cut-short import: a guest booted from it would read part of a disk.
            let why = incomplete_refusal(name);
            tracing::warn!("{why}");
            return Err(why);
        }
        match self.pool.open_volume(name) {
            Ok(volume) => Ok(Arc::new(VolumeExport {
                volume: Arc::new(volume),
                pool: Arc::clone(&self.pool),
                no_space: Arc::clone(&self.no_space),
            })),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// Why a volume marked incomplete is not served, and what makes it servable.
pub fn incomplete_refusal(name: &str) -> String {
    format!(
        "volume '{name}' is not served: it is marked incomplete (an import into it was \
         cut short, so it may hold only part of its image); stop the server, then finish \
         it with `fewerbytes volume import {name} FILE --resume` or take it as it is with \
         `fewerbytes volume import {name} --force`"
    )
}

/// One connection's handle on a volume.
struct VolumeExport {
    volume: Arc<Volume>,
    /// Its pool, where a dirty bitmap's base is found.
    pool: Arc<Pool>,
    no_space: Arc<NoSpaceLog>,
}

/// `qemu:dirty-bitmap:BASE` of a volume: the blocks whose map entries differ from
/// volume BASE's (a snapshot of it). It holds BASE open, so BASE cannot be deleted
/// (but by `--force`) while a client reads the bitmap.
struct VolumeBitmap {
    volume: Arc<Volume>,
    base: Volume,
}

impl Bitmap for VolumeBitmap {
    fn runs(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>, u32> {
        self.volume
            .changed_extents(&self.base, offset, len)
            .map(|runs| runs.into_iter().map(|x| (x.len_bytes, x.changed)).collect())
            .map_err(|e| errno("dirty bitmap", e))
    }
}

/// The NBD error value a client sees for an engine error: a refused write on a
/// read-only pool is EPERM, a request past the end EINVAL, a full pool or a full
/// device below it ENOSPC (QEMU's `werror=enospc` pauses the guest on it), a
/// deleted volume ESHUTDOWN, and anything else (a device error, corruption, a
/// damaged block-map range) EIO.
pub fn errno_of(e: &EngineError) -> u32 {
    match e {
        e if e.is_no_space() => ENOSPC,
        EngineError::ReadOnly(_) => EPERM,
        EngineError::OutOfRange { .. } => EINVAL,
        EngineError::VolumeGone(_) => ESHUTDOWN,
        _ => EIO,
    }
}

/// Log an engine error (its text is lost in the errno) and map it.
fn errno(op: &'static str, e: EngineError) -> u32 {
    let code = errno_of(&e);
    if code == EIO {
        tracing::warn!(op, error = %e, "engine request failed");
    } else {
        tracing::debug!(op, error = %e, "engine request refused");
    }
    code
}

impl VolumeExport {
    /// [`errno`], and a write refused for want of space logged (rate-limited).
    fn write_errno(&self, op: &'static str, e: EngineError) -> u32 {
        if e.is_no_space() {
            self.no_space.refused(&self.volume.name(), op, &e);
        }
        errno(op, e)
    }
}

impl Export for VolumeExport {
    fn size_bytes(&self) -> u64 {
        self.volume.size_bytes()
    }

    fn read_only(&self) -> bool {
        self.volume.is_snapshot()
    }

    fn base_name(&self, base: &str) -> String {
        self.pool
            .base_name(&self.volume.name(), base)
            .unwrap_or_else(|_| base.to_string())
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        self.volume.read(offset, buf).map_err(|e| errno("read", e))
    }

    fn read_cached(&self, offset: u64, buf: &mut [u8]) -> bool {
        // An error here is reported by the ordinary read that follows.
        self.volume.read_cached(offset, buf).unwrap_or(false)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), u32> {
        self.volume
            .write(offset, data, fua)
            .map_err(|e| self.write_errno("write", e))
    }

    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), u32> {
        self.volume
            .write_zeroes(offset, len, fua)
            .map_err(|e| self.write_errno("write zeroes", e))
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), u32> {
        self.volume
            .trim(offset, len, fua)
            .map_err(|e| errno("trim", e))
    }

    fn flush(&self) -> Result<(), u32> {
        self.volume.flush().map_err(|e| errno("flush", e))
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>, u32> {
        self.volume
            .extents(offset, len)
            .map(|runs| runs.into_iter().map(|x| (x.len_bytes, x.data)).collect())
            .map_err(|e| errno("extents", e))
    }

    fn dirty_bitmap(&self, base: &str) -> Result<Arc<dyn Bitmap>, String> {
        if base == self.volume.name() {
            return Err("a volume is not its own snapshot".into());
        }
        let base = self.pool.open_volume(base).map_err(|e| e.to_string())?;
        Ok(Arc::new(VolumeBitmap {
            volume: Arc::clone(&self.volume),
            base,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_map_to_the_errno_a_client_acts_on() {
        let cases = [
            (EngineError::ReadOnly("latched".into()), EPERM),
            (
                EngineError::OutOfRange {
                    volume: "a".into(),
                    op: "read",
                    offset_bytes: 1 << 30,
                    len_bytes: 4096,
                    size_bytes: 1 << 20,
                },
                EINVAL,
            ),
            (EngineError::NoSpace("full".into()), ENOSPC),
            (
                EngineError::Io(fewerbytes_engine::storage::StorageError::from_os(
                    "pool",
                    fewerbytes_engine::storage::IoOp::Write,
                    0,
                    4096,
                    std::io::Error::from_raw_os_error(28),
                )),
                ENOSPC,
            ),
            (EngineError::VolumeGone("a".into()), ESHUTDOWN),
            (EngineError::Invariant("count below zero".into()), EIO),
            (EngineError::Refused("no".into()), EIO),
        ];
        for (e, want) in cases {
            assert_eq!(errno_of(&e), want, "{e}");
        }
    }

    #[test]
    fn a_full_device_below_the_pool_is_told_apart_from_a_full_pool() {
        let device = EngineError::Io(fewerbytes_engine::storage::StorageError::from_os(
            "rbd:vms/pool0",
            fewerbytes_engine::storage::IoOp::Write,
            0,
            4096,
            std::io::Error::from_raw_os_error(122),
        ));
        assert!(device.is_no_space());
        assert!(no_space_hint(&device).contains("raise the Ceph pool's quota"));
        let pool = EngineError::NoSpace("no free data blocks left".into());
        assert!(no_space_hint(&pool).contains("grow the pool"));
    }

    #[test]
    fn enospc_lines_are_one_per_volume_per_interval_with_the_count_left_out() {
        let log = NoSpaceLog::default();
        let t0 = Instant::now();
        let later = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(log.due("a", t0), Some(0));
        assert_eq!(log.due("a", later(1)), None);
        assert_eq!(log.due("a", later(9)), None);
        // Another volume has its own line.
        assert_eq!(log.due("b", later(9)), Some(0));
        // Past the interval: a line again, with the two left out.
        assert_eq!(log.due("a", later(10)), Some(2));
        assert_eq!(log.due("a", later(11)), None);
        assert_eq!(log.due("a", later(30)), Some(1));
    }
}
