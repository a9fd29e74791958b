//! What the server serves: the [`Export`] a connection reads and writes, and the
//! [`ExportProvider`] that names, lists and opens exports. The NBD code knows
//! nothing else of the store behind them.

use std::sync::Arc;

/// `NBD_EPERM`: operation not permitted (write to a read-only export).
pub const EPERM: u32 = 1;
/// `NBD_EIO`: input/output error.
pub const EIO: u32 = 5;
/// `NBD_ENOMEM`: out of memory.
pub const ENOMEM: u32 = 12;
/// `NBD_EINVAL`: invalid argument (malformed or out-of-range request).
pub const EINVAL: u32 = 22;
/// `NBD_ENOSPC`: no space left (also: write past the end of the export).
pub const ENOSPC: u32 = 28;
/// `NBD_EOVERFLOW`: value too large.
pub const EOVERFLOW: u32 = 75;
/// `NBD_ENOTSUP`: operation not supported.
pub const ENOTSUP: u32 = 95;
/// `NBD_ESHUTDOWN`: the export is going away (e.g. the volume was deleted).
pub const ESHUTDOWN: u32 = 108;

/// A per-connection backend handle. Errors are NBD errno values (EPERM 1, EIO 5,
/// ENOMEM 12, EINVAL 22, ENOSPC 28, EOVERFLOW 75, ENOTSUP 95, ESHUTDOWN 108).
///
/// Methods are called from several worker threads at once. Offsets and lengths
/// are any byte values inside the size the server last read (the server
/// advertises a minimum block size of 1); the size may shrink in between, so an
/// implementation still checks its bounds.
pub trait Export: Send + Sync {
    /// Current size in bytes (read again for every request: volumes can be resized).
    fn size_bytes(&self) -> u64;
    /// The full name of the base a dirty bitmap named `base` compares with (for a
    /// volume, its own snapshot `base` when it has one).
    fn base_name(&self, base: &str) -> String {
        base.to_string()
    }
    /// Whether the export is never written (a snapshot): served with
    /// `NBD_FLAG_READ_ONLY`, and its writes answer EPERM.
    fn read_only(&self) -> bool {
        false
    }
    /// Fill `buf` from `offset`.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), u32>;
    /// Fill `buf` from `offset` only if that needs no wait (for a disk, a lock held
    /// across I/O, ...): `true` when done. `false`: nothing was done (`buf` is
    /// unspecified) and [`Export::read`] will be called on a worker thread, which
    /// also reports any error. The server calls this on the thread that received the
    /// request, saving the hand-over to a worker. The default never reads here.
    fn read_cached(&self, offset: u64, buf: &mut [u8]) -> bool {
        let _ = (offset, buf);
        false
    }
    /// Write `data` at `offset`; with `fua`, durable before returning.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), u32>;
    /// Make `[offset, offset+len)` read as zeros.
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), u32>;
    /// Discard `[offset, offset+len)`; it reads as zeros afterwards.
    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), u32>;
    /// Make every acknowledged write durable, whichever connection made it.
    fn flush(&self) -> Result<(), u32>;
    /// Runs covering [offset, offset+len): (len_bytes, is_data). Non-data = hole|zero.
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>, u32>;
    /// The blocks changed since export `base` of the same store (a snapshot taken
    /// earlier), for the `qemu:dirty-bitmap:BASE` metadata context; `Err`: a sentence
    /// saying why there is none. The server checks first that the client may open
    /// `base` itself (else the bitmap would tell it about bytes it may not read). The
    /// default offers none.
    fn dirty_bitmap(&self, base: &str) -> Result<Arc<dyn Bitmap>, String> {
        Err(format!("no dirty bitmap '{base}' on this export"))
    }
}

/// Which bytes of an export differ from its base: `qemu:dirty-bitmap:BASE`.
pub trait Bitmap: Send + Sync {
    /// Runs covering [offset, offset+len): (len_bytes, dirty).
    fn runs(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>, u32>;
}

/// One export as `NBD_OPT_LIST` and `NBD_OPT_INFO` describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportDesc {
    /// The name clients ask for.
    pub name: String,
    /// Text for a person (`NBD_INFO_DESCRIPTION`).
    pub description: String,
    /// Size in bytes when listed.
    pub size_bytes: u64,
}

/// The set of exports a server offers.
pub trait ExportProvider: Send + Sync {
    /// Every export, for `NBD_OPT_LIST`.
    fn list(&self) -> Vec<ExportDesc>;
    /// The export the empty name "" means (the only volume, or a configured one).
    fn default_name(&self) -> Option<String>;
    /// Open a handle on an export; the error is a sentence for the client.
    fn open(&self, name: &str) -> Result<Arc<dyn Export>, String>;
}
