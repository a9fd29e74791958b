//! Which fingerprints enter the dedup index (`index.rs`): every one (dense), or only
//! *hooks*, 1 in 2^k (sparse); recorded in super block bytes 212–213.

use serde::{Deserialize, Serialize};

/// log2 of a sparse index's sampling: 1 in 16 fingerprints is a hook, so a GiB of
/// index memory covers 16.6 TiB of window (a dense one 1.04 TiB; 10 TiB needs 2^4).
pub const SPARSE_SAMPLE_SHIFT: u32 = 4;

/// Which fingerprints enter the index (super block bytes 212–213).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "kebab-case")]
pub enum IndexMode {
    /// Every stored block's: any second copy within the window is found.
    Dense,
    /// Only hooks', 1 in 2^`shift` fingerprints; the rest are found next to a hook's
    /// hit, so a second copy is found if written in runs (a clone, a copied image),
    /// over 2^`shift` times the window.
    Sparse {
        /// log2 of the sampling.
        shift: u32,
    },
}

impl IndexMode {
    /// The sparse mode this engine makes (1 in 2^[`SPARSE_SAMPLE_SHIFT`]).
    pub const SPARSE: IndexMode = IndexMode::Sparse {
        shift: SPARSE_SAMPLE_SHIFT,
    };

    /// log2 of the share of fingerprints that enter the index (0: all).
    pub fn sample_shift(self) -> u32 {
        match self {
            IndexMode::Dense => 0,
            IndexMode::Sparse { shift } => shift,
        }
    }

    /// Super block bytes 212 (mode) and 213 (sample shift).
    pub(crate) fn to_super(self) -> (u8, u8) {
        use fewerbytes_format::superblock::{INDEX_MODE_DENSE, INDEX_MODE_SPARSE};
        match self {
            IndexMode::Dense => (INDEX_MODE_DENSE, 0),
            IndexMode::Sparse { shift } => (INDEX_MODE_SPARSE, shift as u8),
        }
    }

    /// The mode a decoded super block records (0, unset: dense, as every pool made
    /// before the field). Decoding refused any other value, so one here is a bug.
    pub(crate) fn from_super(mode: u8, shift: u8) -> IndexMode {
        use fewerbytes_format::superblock::{
            INDEX_MODE_DENSE, INDEX_MODE_SPARSE, INDEX_MODE_UNSET,
        };
        match mode {
            INDEX_MODE_UNSET | INDEX_MODE_DENSE => IndexMode::Dense,
            INDEX_MODE_SPARSE => IndexMode::Sparse {
                shift: u32::from(shift),
            },
            other => unreachable!("the super block decoder refuses index mode {other}"),
        }
    }
}

impl std::fmt::Display for IndexMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IndexMode::Dense => write!(f, "dense"),
            IndexMode::Sparse { shift } => {
                write!(f, "sparse (1 in {} blocks sampled)", 1u64 << shift)
            }
        }
    }
}

impl std::str::FromStr for IndexMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "dense" => Ok(IndexMode::Dense),
            "sparse" => Ok(IndexMode::SPARSE),
            other => Err(format!("unknown index mode '{other}': dense or sparse")),
        }
    }
}
