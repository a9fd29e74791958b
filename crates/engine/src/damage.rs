//! Damaged volume bytes, named one way in every message that reports them (`check
//! --verify-data`, `scrub`, a read's error, `volume export`): the volume's byte range,
//! first and last byte, with the pool block that holds them in parentheses —
//! `volume 'vm1' bytes 409600..413695 (pool block 10340)`. A *pool block* is a 4 KiB
//! block of the pool's data device, counted from the device's start.

use crate::EngineError;

/// Where a read's damage lies, as far as the error says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DamagedAt {
    /// The stored block at this pool block fails its fingerprint (or cannot be
    /// decoded from it).
    PoolBlock(u64),
    /// The engine marks the bytes damaged without a stored block to name (a
    /// block-map page that was lost, say).
    Unknown,
}

/// Whether a read's error says the bytes read are damaged (so a copy may write zeros
/// in their place and name them), rather than out of reach. The one place that
/// decides it: stored data that fails its fingerprint or its decoding, and a range
/// whose block-map page was lost (`EngineError::Damaged`). Every other error is not
/// damage.
pub fn read_damage(error: &EngineError) -> Option<DamagedAt> {
    match error {
        EngineError::Corrupt {
            region: "data",
            block,
            ..
        } => Some(DamagedAt::PoolBlock(*block)),
        EngineError::Damaged { .. } => Some(DamagedAt::Unknown),
        _ => None,
    }
}

/// `volume 'vm1' bytes 409600..413695 (pool block 10340)`: `len` bytes of `volume` at
/// `offset`, and where they are stored.
pub fn volume_range(volume: &str, offset: u64, len: u64, at: DamagedAt) -> String {
    let last = offset + len.max(1) - 1;
    match at {
        DamagedAt::PoolBlock(block) => {
            format!("volume '{volume}' bytes {offset}..{last} (pool block {block})")
        }
        DamagedAt::Unknown => {
            format!("volume '{volume}' bytes {offset}..{last} (pool block unknown)")
        }
    }
}

/// The reason of a data error without its leading `pool block N: `, to follow a
/// volume range that names the block already.
pub(crate) fn cause(reason: &str, block: u64) -> &str {
    reason
        .strip_prefix(&format!("pool block {block}: "))
        .unwrap_or(reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_names_first_and_last_byte_and_its_pool_block() {
        assert_eq!(
            volume_range("vm1", 409600, 4096, DamagedAt::PoolBlock(10340)),
            "volume 'vm1' bytes 409600..413695 (pool block 10340)"
        );
        let e = EngineError::Corrupt {
            region: "data",
            block: 10340,
            device: "data",
            reason: "pool block 10340: object 5: stored data does not match its fingerprint".into(),
        };
        assert_eq!(read_damage(&e), Some(DamagedAt::PoolBlock(10340)));
        assert_eq!(
            e.to_string(),
            "damaged data: pool block 10340: object 5: stored data does not match its \
             fingerprint"
        );
        let journal = EngineError::Corrupt {
            region: "journal",
            block: 3,
            device: "metadata",
            reason: "bad".into(),
        };
        assert_eq!(read_damage(&journal), None);
    }
}
