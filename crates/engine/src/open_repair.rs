//! What an open for repair (`check --repair`) may restore, and what it restored:
//! the open restores a count the block maps contradict instead of refusing the pool
//! (`repair.rs`), and the repair reports each change.

use parking_lot::Mutex;

/// What an open for repair may do, and what it did (reported by the repair).
pub(crate) struct OpenRepair {
    /// Opened by `Pool::open_for_repair`.
    enabled: bool,
    /// Counts the open restored, one sentence each.
    restored: Mutex<Vec<String>>,
}

impl OpenRepair {
    /// An open that may restore counts (`enabled`), or one that refuses them.
    pub(crate) fn new(enabled: bool) -> OpenRepair {
        OpenRepair {
            enabled,
            restored: Mutex::new(Vec::new()),
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

    /// The counts restored so far, one sentence each; the list is emptied.
    pub(crate) fn take_restored(&self) -> Vec<String> {
        std::mem::take(&mut *self.restored.lock())
    }
}
