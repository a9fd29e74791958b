//! The fewerbytes pool engine.
//!
//! A pool stores the 4 KiB blocks of many volumes once each: zero blocks become a
//! map entry, duplicates a reference, new blocks an LZ4 or zstd fragment packed byte by byte
//! (or a whole block when compression saves less than an eighth). `Pool` owns the
//! devices; `Volume` is a handle that frontends read and write through.
//!
//! **Architecture invariant:** the engine knows no protocol; NBD and the CLI reach
//! it only through `Pool` and `Volume`.

#![deny(missing_docs)]
#![deny(clippy::unwrap_used, clippy::indexing_slicing)]

mod advice;
mod api;
mod block_map;
mod capacity;
mod checkpoint;
mod checkpointer;
mod codec;
mod compact;
mod compactor;
pub mod companion;
mod counters;
mod damage;
mod damage_hint;
mod damaged_range;
mod devices;
mod dir_copies;
mod dir_tree;
mod error;
mod fingerprint;
pub mod geometry;
mod grow;
mod heal;
mod index;
mod index_build;
mod index_mode;
mod index_save;
mod inner;
mod internal;
mod journal;
mod journal_read;
mod lbn_locks;
mod load;
mod map_damage;
mod map_diff;
mod map_pages;
mod metadata_room;
mod older_copy;
mod open_repair;
mod packer;
mod page_read;
mod page_share;
mod page_store;
mod partial;
mod pool;
mod read_path;
mod recovery;
mod repair;
mod reservation;
mod scrub;
mod scrubber;
mod slab;
mod slab_depot;
mod stats;
mod super_copies;
mod upgrade_v2;
mod volume;
mod volume_damage;
mod volume_ops;
mod volumes;
mod write_path;

pub use api::*;
pub use capacity::Capacity;
pub use codec::{compress_block, decompress_block, looks_incompressible, Compression};
pub use damage::{read_damage, volume_range, DamagedAt};
pub use damaged_range::DamagedRange;
pub use devices::{LatchListener, Latched};
pub use error::{EngineError, Result};
pub use fewerbytes_format::BLOCK_BYTES;
pub use fewerbytes_storage as storage;
pub use index_mode::{IndexMode, SPARSE_SAMPLE_SHIFT};
pub use index_save::{state_dir, STATE_DIR};
pub use internal::{is_internal_name, InternalName, InternalVolumes, INTERNAL_PREFIX};
/// Blocks in a run of whole blocks a zone writes at once (what a packer may hold
/// open beside one fragment block).
pub use packer::RUN_BLOCKS;
pub use pool::Pool;
pub use repair::{RepairOptions, RepairPhase};
pub use scrub::SCRUB_RATE_DEFAULT_BYTES_PER_S;
pub use scrubber::iso8601;
pub use volume::Volume;
