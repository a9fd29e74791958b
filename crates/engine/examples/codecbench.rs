//! CPU per 4 KiB block of the give-up test (`looks_incompressible`) and of each codec,
//! on random blocks, the seed's mix (each 512-byte chunk half random, half zeros) and
//! text-like blocks: what the early give-up saves on random data, and what it costs on
//! data it lets through. One thread; the best of five rounds of BLOCKS blocks.
//!
//!   cargo run --release -p fewerbytes-engine --example codecbench -- 20000

use fewerbytes_engine::looks_incompressible;
use rand::{rngs::StdRng, Rng, RngCore, SeedableRng};
use std::hint::black_box;
use std::time::Instant;

fn blocks(kind: &str, n: usize) -> Vec<Vec<u8>> {
    let mut rng = StdRng::seed_from_u64(1);
    (0..n)
        .map(|_| {
            let mut b = vec![0u8; 4096];
            match kind {
                "random" => rng.fill_bytes(&mut b),
                "mix" => b
                    .chunks_mut(512)
                    .for_each(|c| rng.fill_bytes(&mut c[..256])),
                _ => {
                    let words = ["pool ", "volume ", "block ", "the ", "error ", "flush "];
                    let mut text = Vec::new();
                    while text.len() < 4096 {
                        text.extend_from_slice(words[rng.gen_range(0..words.len())].as_bytes());
                        text.extend_from_slice(rng.gen_range(0..10_000u32).to_string().as_bytes());
                    }
                    b.copy_from_slice(&text[..4096]);
                }
            }
            b
        })
        .collect()
}

/// Best-of-five nanoseconds per block of `f`.
fn ns_per_block(data: &[Vec<u8>], mut f: impl FnMut(&[u8]) -> usize) -> f64 {
    (0..5)
        .map(|_| {
            let start = Instant::now();
            for b in data {
                black_box(f(b));
            }
            start.elapsed().as_nanos() as f64 / data.len() as f64
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(20000);
    let mut out = vec![0u8; 8192];
    let zstd = |level: i32| {
        use zstd::stream::raw::CParameter;
        let mut c = zstd::bulk::Compressor::new(level).expect("zstd context");
        c.set_parameter(CParameter::ContentSizeFlag(false))
            .expect("parameter");
        c
    };
    let (mut z1, mut z3) = (zstd(1), zstd(3));
    println!("| blocks | give-up test | says incompressible | LZ4 | zstd:1 | zstd:3 |");
    println!("|---|---|---|---|---|---|");
    for kind in ["random", "mix", "text"] {
        let data = blocks(kind, n);
        let test = ns_per_block(&data, |b| usize::from(looks_incompressible(b)));
        let given_up = data.iter().filter(|b| looks_incompressible(b)).count();
        let lz4 = ns_per_block(&data, |b| {
            lz4_flex::block::compress_into(b, &mut out).unwrap_or(0)
        });
        let zstd1 = ns_per_block(&data, |b| {
            z1.compress_to_buffer(b, &mut out[..3584]).unwrap_or(0)
        });
        let zstd3 = ns_per_block(&data, |b| {
            z3.compress_to_buffer(b, &mut out[..3584]).unwrap_or(0)
        });
        println!(
            "| {kind} | {:.2} µs | {given_up} of {n} | {:.2} µs | {:.2} µs | {:.2} µs |",
            test / 1000.0,
            lz4 / 1000.0,
            zstd1 / 1000.0,
            zstd3 / 1000.0
        );
    }
}
