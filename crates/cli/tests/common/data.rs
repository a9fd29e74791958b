//! Deterministic test data: a seeded generator, compressible blocks, mixed raw images
//! and file trees, so that any failure reproduces.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::soak;

/// Deterministic pseudo-random bytes (xorshift64*), so failures reproduce.
pub struct Rng(u64);

impl Rng {
    /// Seeded generator; a zero seed is replaced by a fixed odd constant.
    pub fn new(seed: u64) -> Rng {
        Rng(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Fills `buf` with random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    /// A value in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A 4 KiB block of text-like, compressible content, different for each `seed`.
pub fn compressible_block(seed: u64) -> Vec<u8> {
    const WORDS: [&str; 12] = [
        "block ",
        "volume ",
        "pool ",
        "dedup ",
        "journal ",
        "slab ",
        "fewerbytes ",
        "qemu ",
        "guest ",
        "flush ",
        "\n",
        "4096 ",
    ];
    let mut rng = Rng::new(seed.wrapping_mul(2_654_435_761).wrapping_add(1));
    let mut out = Vec::with_capacity(4096);
    out.extend_from_slice(format!("seed {seed:016x} ").as_bytes());
    while out.len() < 4096 {
        let word = WORDS[usize::try_from(rng.below(WORDS.len() as u64)).expect("small index")];
        out.extend_from_slice(word.as_bytes());
    }
    out.truncate(4096);
    out
}

/// A raw image of `blocks` 4 KiB blocks mixing zeros, duplicates of a few template
/// blocks, compressible text and random data, in runs so that both large and small
/// extents of each kind occur.
pub fn mixed_image(blocks: u64, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut templates = Vec::new();
    for t in 0..8 {
        let mut block = vec![0u8; 4096];
        if t % 2 == 0 {
            rng.fill(&mut block);
        } else {
            block = compressible_block(seed ^ (1000 + t));
        }
        templates.push(block);
    }
    let mut image = Vec::with_capacity(usize::try_from(blocks * 4096).expect("image fits memory"));
    let mut lbn = 0;
    while lbn < blocks {
        let run = (1 + rng.below(64)).min(blocks - lbn);
        let kind = rng.below(4);
        for _ in 0..run {
            match kind {
                0 => image.extend_from_slice(&[0u8; 4096]),
                1 => {
                    let t =
                        usize::try_from(rng.below(templates.len() as u64)).expect("small index");
                    image.extend_from_slice(&templates[t]);
                }
                2 => image.extend_from_slice(&compressible_block(rng.next_u64())),
                _ => {
                    let mut block = vec![0u8; 4096];
                    rng.fill(&mut block);
                    image.extend_from_slice(&block);
                }
            }
        }
        lbn += run;
    }
    image
}

/// A tree of generated files: text, random, duplicates of each other, sparse-ish
/// zeros, nested directories. Returns the relative path and content of each.
pub fn generated_tree(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut rng = Rng::new(0x00E7_4000);
    let mut files = BTreeMap::new();
    let file_count = if soak() { 2000 } else { 400 };
    for i in 0..file_count {
        let rel = PathBuf::from(format!("d{}/s{}/f{i:04}.bin", i % 7, i % 13));
        let len = usize::try_from(match i % 5 {
            0 => rng.below(4096),
            1 => 4096 * (1 + rng.below(16)),
            2 => rng.below(300_000),
            3 => 1 + rng.below(64 * 1024),
            _ => 512 * (1 + rng.below(1024)),
        })
        .expect("small length");
        let content: Vec<u8> = match i % 4 {
            0 => {
                let mut v = vec![0u8; len];
                rng.fill(&mut v);
                v
            }
            1 => (0..len.div_ceil(4096))
                .flat_map(|b| compressible_block(i * 31 + b as u64))
                .take(len)
                .collect(),
            // Duplicates of an earlier file's start (dedup within the file system).
            2 => files.values().next().map_or_else(
                || vec![7u8; len],
                |v: &Vec<u8>| v.iter().copied().cycle().take(len).collect(),
            ),
            _ => vec![0u8; len],
        };
        let path = root.join(&rel);
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir in ext4");
        std::fs::write(&path, &content).expect("write file in ext4");
        files.insert(rel, content);
    }
    files
}

/// Checks every file of `files` under `root` has its content; `when` names the moment.
pub fn assert_tree(root: &Path, files: &BTreeMap<PathBuf, Vec<u8>>, when: &str) {
    for (rel, content) in files {
        let got = std::fs::read(root.join(rel))
            .unwrap_or_else(|e| panic!("{when}: cannot read {}: {e}", rel.display()));
        assert!(
            got == *content,
            "{when}: {} differs ({} bytes read, {} expected)",
            rel.display(),
            got.len(),
            content.len()
        );
    }
}
