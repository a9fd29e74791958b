//! What an open for repair (`check --repair`) may restore, and what it restored:
//! the open restores a count the block maps contradict instead of refusing the pool,
//! and replays a damaged journal around the sectors it lost (`repair.rs`); the
//! repair reports each change.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// What an open for repair may do, and what it did (reported by the repair).
pub(crate) struct OpenRepair {
    /// Opened by `Pool::open_for_repair`.
    enabled: bool,
    /// Counts the open restored, one sentence each.
    restored: Mutex<Vec<String>>,
    /// Bytes of volume data the open found lost (and set to read as zeros).
    lost_bytes: AtomicU64,
}

impl OpenRepair {
    /// An open that may restore counts (`enabled`), or one that refuses them.
    pub(crate) fn new(enabled: bool) -> OpenRepair {
        OpenRepair {
            enabled,
            restored: Mutex::new(Vec::new()),
            lost_bytes: AtomicU64::new(0),
        }
    }

    /// Whether this open may restore counts.
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// Note one count restored.
    pub(crate) fn record(&self, sentence: String) {
        self.restored.lock().push(sentence);
    }

    /// Note `bytes` of volume data lost.
    pub(crate) fn lost(&self, bytes: u64) {
        self.lost_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The bytes noted lost so far; the count is emptied.
    pub(crate) fn take_lost_bytes(&self) -> u64 {
        self.lost_bytes.swap(0, Ordering::Relaxed)
    }

    /// The counts restored so far, one sentence each; the list is emptied.
    pub(crate) fn take_restored(&self) -> Vec<String> {
        std::mem::take(&mut *self.restored.lock())
    }
}
