//! A damaged range of a volume as the engine reports it (`map_damage.rs` keeps and
//! enforces it): the blocks one failed block-map page or map directory page maps.
//! A leaf: the error type names it, so it names nothing of the engine.

use serde::{Deserialize, Serialize};

/// One damaged range of a volume: the blocks one failed page maps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DamagedRange {
    /// The volume's name.
    pub volume: String,
    /// First byte of the range in the volume.
    pub offset_bytes: u64,
    /// Bytes of the range.
    pub len_bytes: u64,
    /// The failed page: `block map page` or `directory page`.
    pub region: String,
    /// Its directory level (0: a block-map page itself).
    pub level: u8,
    /// The failed page's block on its device (from the device's start).
    pub block: u64,
    /// `data` or `metadata`.
    pub device: String,
    /// Why it failed its checks.
    pub reason: String,
}

impl DamagedRange {
    /// One line for a person: volume, bytes, page and why.
    pub fn describe(&self) -> String {
        format!(
            "volume '{}' bytes {}..{} ({} bytes) are damaged: the {}{} that maps them, \
             block {} of the {} device, failed its checks ({})",
            self.volume,
            self.offset_bytes,
            // The last byte, as every report of damage names a range
            // (`damage.rs: volume_range`).
            self.offset_bytes + self.len_bytes.max(1) - 1,
            self.len_bytes,
            self.region,
            if self.level > 0 {
                format!(" of level {}", self.level)
            } else {
                String::new()
            },
            self.block,
            self.device,
            self.reason
        )
    }

    /// Whether the range holds any byte of `[offset, offset + len)`.
    pub fn overlaps(&self, offset_bytes: u64, len_bytes: u64) -> bool {
        offset_bytes < self.offset_bytes + self.len_bytes
            && self.offset_bytes < offset_bytes.saturating_add(len_bytes.max(1))
    }
}
