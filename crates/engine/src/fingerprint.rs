//! Fingerprints of many 4 KiB blocks at once: keyed BLAKE3-256, the same bytes as
//! `blake3::keyed_hash` of each block, computed for a whole write step together.
//!
//! Why: one 4 KiB block is four BLAKE3 chunks, so hashing it alone fills four lanes
//! of the CPU's vector unit (AVX-512 has sixteen, AVX2 eight) and then runs its three
//! parent compressions one at a time. A 128 KiB write spent 25–28% of the server's
//! CPU there. Hashing the same chunk of up to sixteen blocks side by side fills the
//! lanes, and their parents go sixteen at a time too.
//!
//! How: the `blake3` crate's own SIMD kernel (`blake3_hash_many_avx512`, or
//! `blake3_hash_many_avx2`: the assembly it builds and links on x86-64 Unix) with
//! the tree of a 4,096-byte input spelled out: chunk `i` (1,024 bytes, counter `i`)
//! of every block, then two parents per block, then the root (a parent with the
//! ROOT flag, whose first 32 output bytes are the hash). Anywhere else, and on CPUs
//! without those instructions, each block is hashed alone with `blake3::keyed_hash`.
//! A test compares both on random blocks and keys.

use fewerbytes_format::BLOCK_BYTES;

/// A fingerprint: keyed BLAKE3-256 of a block.
pub(crate) type Fingerprint = [u8; 32];

/// Blocks hashed side by side at most: sixteen fill AVX-512's lanes.
pub(crate) const LANES_MAX: usize = 16;

/// Keyed BLAKE3-256 of each block of `blocks` (each exactly [`BLOCK_BYTES`] long)
/// into `out` (as long as `blocks`).
pub(crate) fn keyed_many(key: &[u8; 32], blocks: &[&[u8]], out: &mut [Fingerprint]) {
    debug_assert_eq!(blocks.len(), out.len());
    #[cfg(all(target_arch = "x86_64", unix))]
    {
        if let Some(kernel) = simd::kernel() {
            for (blocks, out) in blocks.chunks(LANES_MAX).zip(out.chunks_mut(LANES_MAX)) {
                if blocks.iter().all(|b| b.len() == BLOCK_BYTES) {
                    simd::keyed_4k(kernel, key, blocks, out);
                } else {
                    one_by_one(key, blocks, out);
                }
            }
            return;
        }
    }
    one_by_one(key, blocks, out);
}

fn one_by_one(key: &[u8; 32], blocks: &[&[u8]], out: &mut [Fingerprint]) {
    for (block, fp) in blocks.iter().zip(out.iter_mut()) {
        *fp = *blake3::keyed_hash(key, block).as_bytes();
    }
}

#[cfg(all(target_arch = "x86_64", unix))]
mod simd {
    use super::{Fingerprint, LANES_MAX};
    use fewerbytes_format::BLOCK_BYTES;
    use std::sync::OnceLock;

    /// BLAKE3's flags (the specification, section 2.1).
    const CHUNK_START: u8 = 1;
    const CHUNK_END: u8 = 2;
    const PARENT: u8 = 4;
    const ROOT: u8 = 8;
    const KEYED_HASH: u8 = 16;
    /// A chunk's bytes and its 64-byte blocks.
    const CHUNK_BYTES: usize = 1024;
    const CHUNK_BLOCKS: usize = CHUNK_BYTES / 64;
    /// Chunks in a 4 KiB block: its tree is two parents under one root.
    const CHUNKS: usize = BLOCK_BYTES / CHUNK_BYTES;
    const _: () = assert!(CHUNKS == 4, "the tree below is spelled out for 4 chunks");

    /// The signature of the `blake3` crate's `blake3_hash_many_*` kernels
    /// (`c/blake3_impl.h`): hash `num_inputs` inputs of `blocks` 64-byte blocks each,
    /// writing one 32-byte chaining value per input to `out`.
    pub(super) type HashMany = unsafe extern "C" fn(
        inputs: *const *const u8,
        num_inputs: usize,
        blocks: usize,
        key: *const u32,
        counter: u64,
        increment_counter: bool,
        flags: u8,
        flags_start: u8,
        flags_end: u8,
        out: *mut u8,
    );

    extern "C" {
        fn blake3_hash_many_avx512(
            inputs: *const *const u8,
            num_inputs: usize,
            blocks: usize,
            key: *const u32,
            counter: u64,
            increment_counter: bool,
            flags: u8,
            flags_start: u8,
            flags_end: u8,
            out: *mut u8,
        );
        fn blake3_hash_many_avx2(
            inputs: *const *const u8,
            num_inputs: usize,
            blocks: usize,
            key: *const u32,
            counter: u64,
            increment_counter: bool,
            flags: u8,
            flags_start: u8,
            flags_end: u8,
            out: *mut u8,
        );
    }

    /// The widest kernel this CPU runs (the `blake3` crate's own tests for each),
    /// or `None` (then blocks are hashed one by one).
    pub(super) fn kernel() -> Option<HashMany> {
        static KERNEL: OnceLock<Option<HashMany>> = OnceLock::new();
        *KERNEL.get_or_init(|| {
            if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512vl")
            {
                Some(blake3_hash_many_avx512 as HashMany)
            } else if std::is_x86_feature_detected!("avx2") {
                Some(blake3_hash_many_avx2 as HashMany)
            } else {
                None
            }
        })
    }

    /// Hash up to [`LANES_MAX`] blocks of exactly 4 KiB.
    #[expect(
        clippy::indexing_slicing,
        reason = "indices below n ≤ LANES_MAX into arrays of LANES_MAX, and chunk offsets inside 4,096-byte blocks (asserted)"
    )]
    pub(super) fn keyed_4k(
        kernel: HashMany,
        key: &[u8; 32],
        blocks: &[&[u8]],
        out: &mut [Fingerprint],
    ) {
        let n = blocks.len().min(LANES_MAX).min(out.len());
        // The kernel reads a whole chunk behind each pointer: never past a block.
        assert!(blocks.iter().all(|b| b.len() == BLOCK_BYTES));
        let mut key_words = [0u32; 8];
        for (word, bytes) in key_words.iter_mut().zip(key.chunks_exact(4)) {
            *word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        }
        // cvs[b] holds block b's four chunk chaining values, which are also its two
        // parents' 64-byte inputs; parents[b] its two parents' values, the root's input.
        let mut cvs = [[0u8; 32 * CHUNKS]; LANES_MAX];
        let mut parents = [[0u8; 64]; LANES_MAX];
        let mut chunk_out = [0u8; 32 * LANES_MAX];
        let mut inputs = [std::ptr::null::<u8>(); 2 * LANES_MAX];
        for chunk in 0..CHUNKS {
            for (input, block) in inputs.iter_mut().zip(&blocks[..n]) {
                *input = block[chunk * CHUNK_BYTES..].as_ptr();
            }
            // SAFETY: `inputs[..n]` point at `CHUNK_BYTES` readable bytes each (chunk
            // `chunk` of a 4,096-byte block that outlives the call), `key_words` at 8
            // words, and `chunk_out` has room for `n` ≤ LANES_MAX values of 32 bytes.
            // The signature is the kernel's (see `HashMany`).
            unsafe {
                kernel(
                    inputs.as_ptr(),
                    n,
                    CHUNK_BLOCKS,
                    key_words.as_ptr(),
                    chunk as u64,
                    false,
                    KEYED_HASH,
                    CHUNK_START,
                    CHUNK_END,
                    chunk_out.as_mut_ptr(),
                );
            }
            for (b, cv) in chunk_out.chunks_exact(32).take(n).enumerate() {
                cvs[b][chunk * 32..chunk * 32 + 32].copy_from_slice(cv);
            }
        }
        // Parents: (chunk 0, chunk 1) and (chunk 2, chunk 3) of each block, 64 bytes each.
        for (b, cv) in cvs.iter().take(n).enumerate() {
            inputs[2 * b] = cv.as_ptr();
            inputs[2 * b + 1] = cv[64..].as_ptr();
        }
        let mut parent_out = [0u8; 64 * LANES_MAX];
        // SAFETY: `inputs[..2n]` point at 64 readable bytes each inside `cvs`;
        // `parent_out` has room for 2n values of 32 bytes.
        unsafe {
            kernel(
                inputs.as_ptr(),
                2 * n,
                1,
                key_words.as_ptr(),
                0,
                false,
                KEYED_HASH | PARENT,
                0,
                0,
                parent_out.as_mut_ptr(),
            );
        }
        for (b, pair) in parent_out.chunks_exact(64).take(n).enumerate() {
            parents[b].copy_from_slice(pair);
        }
        for (input, parent) in inputs.iter_mut().zip(parents.iter().take(n)) {
            *input = parent.as_ptr();
        }
        let mut root_out = [0u8; 32 * LANES_MAX];
        // SAFETY: `inputs[..n]` point at 64 readable bytes each inside `parents`;
        // `root_out` has room for n values of 32 bytes. A root compression's first
        // 32 output bytes are its chaining value, which the kernel writes.
        unsafe {
            kernel(
                inputs.as_ptr(),
                n,
                1,
                key_words.as_ptr(),
                0,
                false,
                KEYED_HASH | PARENT | ROOT,
                0,
                0,
                root_out.as_mut_ptr(),
            );
        }
        for (fp, root) in out.iter_mut().zip(root_out.chunks_exact(32)).take(n) {
            fp.copy_from_slice(root);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn many_at_once_equal_keyed_blake3_one_by_one() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(14);
        for count in [1usize, 2, 3, 15, 16, 17, 33, 64] {
            let mut key = [0u8; 32];
            rng.fill(&mut key[..]);
            let data: Vec<Vec<u8>> = (0..count)
                .map(|i| {
                    let mut b = vec![0u8; BLOCK_BYTES];
                    // Random, and some with long runs (compressible-looking data).
                    rng.fill(&mut b[..]);
                    if i % 3 == 0 {
                        b.iter_mut().take(2048).for_each(|x| *x = i as u8);
                    }
                    b
                })
                .collect();
            let blocks: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            let mut got = vec![[0u8; 32]; count];
            keyed_many(&key, &blocks, &mut got);
            for (block, fp) in blocks.iter().zip(&got) {
                assert_eq!(
                    fp,
                    blake3::keyed_hash(&key, block).as_bytes(),
                    "{count} blocks"
                );
            }
        }
    }
}
