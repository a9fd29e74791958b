//! Raw write throughput of `RbdStorage` (docs/benchmarks.md): THREADS threads each
//! write their own part of the first TOTAL_MIB MiB of the image in BLOCK_BYTES
//! writes (random order within the part), then one flush; prints MiB/s counted to
//! the flush's return. With FLUSH_FIRST=1 set, one flush comes first (librbd's
//! cache then writes back instead of through).
//!
//!   cargo run --release -p fewerbytes-storage --example rbd_write -- CONF POOL IMAGE BLOCK_BYTES TOTAL_MIB THREADS

use fewerbytes_storage::open_rbd;
use std::path::Path;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [conf, pool, image, block, total_mib, threads] = args.as_slice() else {
        return Err("usage: rbd_write CONF POOL IMAGE BLOCK_BYTES TOTAL_MIB THREADS".into());
    };
    let block: usize = block.parse()?;
    let total = total_mib.parse::<u64>()? << 20;
    let threads: u64 = threads.parse()?;
    let dev = open_rbd(pool, image, None, None, Some(Path::new(conf)))?;
    if total > dev.len_bytes() {
        return Err(format!(
            "the image holds {} bytes, fewer than {total}",
            dev.len_bytes()
        )
        .into());
    }
    let per_thread = total / threads / block as u64;
    if per_thread == 0 || per_thread.is_multiple_of(7919) {
        return Err(format!("{per_thread} blocks per thread: pick another size").into());
    }
    let buf: Vec<u8> = (0..block).map(|i| (i * 7 + 1) as u8).collect();
    if std::env::var_os("FLUSH_FIRST").is_some() {
        // librbd's cache writes through until the image's first flush
        // (rbd_cache_writethrough_until_flush); the engine flushes at open, so
        // this is the mode a pool runs in.
        dev.flush()?;
    }
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (dev, buf) = (&dev, &buf);
            s.spawn(move || {
                // A fixed permutation of the part's blocks: a prime stride
                // modulo a count it does not divide visits each once.
                let n = per_thread;
                for i in 0..n {
                    let j = (i * 7919) % n;
                    let at = (t * per_thread + j) * block as u64;
                    dev.write_at(buf, at).expect("write");
                }
            });
        }
    });
    dev.flush()?;
    let secs = started.elapsed().as_secs_f64();
    let bytes = per_thread * threads * block as u64;
    println!(
        "rbd_write bs={block} threads={threads}: {} MiB in {secs:.2} s = {:.1} MiB/s, {:.0} IOPS",
        bytes >> 20,
        bytes as f64 / secs / (1 << 20) as f64,
        (bytes / block as u64) as f64 / secs
    );
    Ok(())
}
