//! Opening a mutated pool image through the engine, on an in-memory device.
//!
//! Input: a `PoolImage` (see `fewerbytes_fuzz::PoolImage`). Opening must succeed or
//! fail with an error; with flag `IMAGE_READ_VOLUMES`, every volume's first blocks
//! and extents are read too, and the pool is closed.
#![no_main]

use fewerbytes_engine::{OpenOptions, Pool};
use fewerbytes_fuzz::{PoolImage, IMAGE_READ_VOLUMES};
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;

/// Bytes read from the start of each volume.
const READ_BYTES: u64 = 256 << 10;

fuzz_target!(|data: &[u8]| {
    let image = PoolImage::parse(data);
    let storage = Arc::new(image.to_storage("fuzz.pool"));
    let opts = OpenOptions {
        threads: Some(1),
        ..OpenOptions::default()
    };
    let Ok(pool) = Pool::open_devices(storage, None, &opts) else {
        return;
    };
    if image.flags & IMAGE_READ_VOLUMES != 0 {
        for (name, size) in pool.volume_sizes() {
            let Ok(volume) = pool.open_volume(&name) else {
                continue;
            };
            let len = size.min(READ_BYTES);
            let mut buf = vec![0u8; len as usize];
            let _ = volume.read(0, &mut buf);
            let _ = volume.extents(0, len);
        }
    }
    let _ = pool.close();
});
