//! Compression: how a new block is compressed (the pool's setting, after a cheap
//! test that gives up early on blocks that look incompressible) and how a fragment
//! is decoded (by the codec its location records, whatever the pool's setting is
//! now, so one pool may hold LZ4 and zstd fragments side by side).

use crate::EngineError;
use fewerbytes_format::location::Codec;
use fewerbytes_format::superblock::{
    COMPRESSION_LZ4, COMPRESSION_NONE, COMPRESSION_ZSTD, ZSTD_LEVEL_MAX, ZSTD_LEVEL_MIN,
};
use fewerbytes_format::BLOCK_BYTES;
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, Ordering};

/// A compressed form is kept only if it saves at least an eighth of the block.
pub const COMPRESSED_BYTES_MAX: usize = BLOCK_BYTES - BLOCK_BYTES / 8;
/// zstd's own default level, and what `zstd` without a level means (OpenZFS's
/// `compression=zstd` is level 3 too).
pub const ZSTD_LEVEL_DEFAULT: i32 = 3;

/// How a pool compresses new blocks (`pool create --compression`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Compression {
    /// Every new block stored whole.
    None,
    /// LZ4 (fast; the default).
    #[default]
    Lz4,
    /// zstd at a level (-7 to 22; higher stores less and costs more CPU).
    Zstd {
        /// The zstd level.
        level: i32,
    },
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Compression::None => write!(f, "none"),
            Compression::Lz4 => write!(f, "lz4"),
            Compression::Zstd { level } => write!(f, "zstd:{level}"),
        }
    }
}

impl std::str::FromStr for Compression {
    type Err = String;
    /// `none`, `lz4`, `zstd` (level 3) or `zstd:LEVEL`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad_level = || {
            format!(
                "'{s}': a zstd level is a whole number from {ZSTD_LEVEL_MIN} to {ZSTD_LEVEL_MAX}"
            )
        };
        match s.split_once(':') {
            None if s == "none" => Ok(Compression::None),
            None if s == "lz4" => Ok(Compression::Lz4),
            None if s == "zstd" => Ok(Compression::Zstd {
                level: ZSTD_LEVEL_DEFAULT,
            }),
            Some(("zstd", level)) => {
                let level: i32 = level.parse().map_err(|_| bad_level())?;
                let range = i32::from(ZSTD_LEVEL_MIN)..=i32::from(ZSTD_LEVEL_MAX);
                if !range.contains(&level) || level == 0 {
                    return Err(bad_level());
                }
                Ok(Compression::Zstd { level })
            }
            _ => Err(format!(
                "unknown compression '{s}': lz4, zstd, zstd:LEVEL or none"
            )),
        }
    }
}

impl From<Compression> for String {
    fn from(c: Compression) -> String {
        c.to_string()
    }
}

impl TryFrom<String> for Compression {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl Compression {
    /// The super block's `compression` and `compression_level` (docs/format.md).
    pub(crate) fn to_super(self) -> (u8, i8) {
        match self {
            Compression::None => (COMPRESSION_NONE, 0),
            Compression::Lz4 => (COMPRESSION_LZ4, 0),
            Compression::Zstd { level } => (
                COMPRESSION_ZSTD,
                level.clamp(i32::from(ZSTD_LEVEL_MIN), i32::from(ZSTD_LEVEL_MAX)) as i8,
            ),
        }
    }

    /// From a decoded super block: 0 is a pool made before the field, LZ4. A codec
    /// no version wrote is [`EngineError::Corrupt`] in the super block, never read as
    /// LZ4 (its new blocks would be written with a codec the pool never chose).
    pub(crate) fn from_super(codec: u8, level: i8) -> Result<Self, EngineError> {
        Ok(match codec {
            0 | COMPRESSION_LZ4 => Compression::Lz4,
            COMPRESSION_NONE => Compression::None,
            COMPRESSION_ZSTD if level == 0 => Compression::Zstd {
                level: ZSTD_LEVEL_DEFAULT,
            },
            COMPRESSION_ZSTD => Compression::Zstd {
                level: i32::from(level),
            },
            _ => {
                return Err(EngineError::Corrupt {
                    region: "super block",
                    block: 0,
                    device: "metadata",
                    reason: format!("unknown compression {codec} (level {level})"),
                })
            }
        })
    }

    fn pack(self) -> u32 {
        let (codec, level) = self.to_super();
        u32::from(codec) << 8 | u32::from(level as u8)
    }

    /// The setting `pack` stored: only `pack` writes the word, so a codec it does
    /// not know is a broken invariant (asserted), not a default.
    fn unpack(word: u32) -> Self {
        match Compression::from_super((word >> 8) as u8, word as u8 as i8) {
            Ok(setting) => setting,
            Err(e) => panic!("the pool's compression setting {word:#x} was never packed: {e}"),
        }
    }
}

/// The pool's compression setting, read by every new block and changed by
/// `Pool::set_compression`.
pub(crate) struct PoolCodec {
    setting: AtomicU32,
}

impl PoolCodec {
    /// A pool compressing with `setting`.
    pub(crate) fn new(setting: Compression) -> Self {
        PoolCodec {
            setting: AtomicU32::new(setting.pack()),
        }
    }

    /// What new blocks are compressed with.
    pub(crate) fn get(&self) -> Compression {
        Compression::unpack(self.setting.load(Ordering::Relaxed))
    }

    /// Compress new blocks with `setting` from now on.
    pub(crate) fn set(&self, setting: Compression) {
        self.setting.store(setting.pack(), Ordering::Relaxed);
    }
}

/// Room for any codec's output on one block (LZ4's worst case is the larger).
const SCRATCH_BYTES: usize = BLOCK_BYTES + BLOCK_BYTES / 255 + 64;

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(vec![0u8; SCRATCH_BYTES.max(lz4_flex::block::get_maximum_output_size(BLOCK_BYTES))]);
    /// A zstd compression context per thread and level: making one costs far more
    /// than compressing a block.
    static ZSTD_COMPRESSOR: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(None) };
    static ZSTD_DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// Bytes apart of the bytes `looks_incompressible` samples: odd, so the sample
/// meets every byte lane of 2-, 4- and 8-byte records alike (a stride of 4 would
/// see only the low bytes of an array of small u32s and take it for noise).
const SAMPLE_STRIDE: usize = 7;
/// The give-up threshold on the sample's chi-square statistic against uniform
/// bytes. Uniform (random) bytes give 255 ± 23 over 256 byte values; 400 is six
/// standard deviations above, so random data is given up on almost always, while a
/// sample this close to uniform has a byte entropy above ~7.8 bits (under 2.5% for
/// an entropy coder to save, far from the eighth a fragment must save).
const CHI_SQUARE_GIVE_UP: u64 = 400;

/// Whether a block's bytes look like noise (encrypted or already compressed data):
/// a histogram of every 7th byte (586 of 4,096) close to uniform. Such a block is
/// stored whole without trying a codec. A block whose bytes are uniform but repeat
/// (a random 2 KiB written twice) would compress and is missed: rare on disks, and
/// the cost is one block stored whole. Public for `examples/codecbench.rs`.
pub fn looks_incompressible(block: &[u8]) -> bool {
    let mut counts = [0u32; 256];
    let mut n = 0u64;
    for b in block.iter().step_by(SAMPLE_STRIDE) {
        if let Some(c) = counts.get_mut(usize::from(*b)) {
            *c += 1;
        }
        n += 1;
    }
    let sum_squares: u64 = counts.iter().map(|c| u64::from(*c) * u64::from(*c)).sum();
    // chi² = 256 × Σc² / n − n; compared without division.
    256 * sum_squares < n * (n + CHI_SQUARE_GIVE_UP)
}

/// Compress one block with `setting`; calls `keep` with the codec and the
/// compressed bytes if they save at least an eighth of the block, and returns what
/// it returns (`None`: store the block whole).
pub(crate) fn compress<T>(
    setting: Compression,
    block: &[u8],
    keep: impl FnOnce(Codec, &[u8]) -> T,
) -> Option<T> {
    if setting == Compression::None || looks_incompressible(block) {
        return None;
    }
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let (codec, n) = match setting {
            Compression::None => return None,
            Compression::Lz4 => (
                Codec::Lz4,
                lz4_flex::block::compress_into(block, &mut scratch).ok()?,
            ),
            Compression::Zstd { level } => {
                (Codec::Zstd, zstd_compress(level, block, &mut scratch)?)
            }
        };
        if n > COMPRESSED_BYTES_MAX {
            return None;
        }
        Some(keep(codec, scratch.get(..n)?))
    })
}

/// Compress one block as a new block of a pool with `setting` would be (the same
/// give-up test, the same codecs, kept only if it saves an eighth): the codec and
/// the compressed bytes, or `None` to send the block whole. For `volume send`.
pub fn compress_block(setting: Compression, block: &[u8]) -> Option<(Codec, Vec<u8>)> {
    compress(setting, block, |codec, bytes| (codec, bytes.to_vec()))
}

/// Decode a block compressed by [`compress_block`] into `out` (one block); the
/// error says why, and a decoded length other than `out`'s is one.
pub fn decompress_block(codec: Codec, src: &[u8], out: &mut [u8]) -> Result<(), String> {
    let n = decompress(codec, src, out)?;
    if n != out.len() {
        return Err(format!("decodes to {n} bytes, not {}", out.len()));
    }
    Ok(())
}

fn zstd_compress(level: i32, block: &[u8], out: &mut [u8]) -> Option<usize> {
    ZSTD_COMPRESSOR.with(|cell| {
        let mut cell = cell.borrow_mut();
        if cell.as_ref().is_none_or(|(l, _)| *l != level) {
            *cell = Some((level, new_zstd_compressor(level)?));
        }
        let (_, compressor) = cell.as_mut()?;
        let limit = out.get_mut(..COMPRESSED_BYTES_MAX)?;
        // A form that does not fit the limit is not kept: zstd says so as an error.
        compressor.compress_to_buffer(block, limit).ok()
    })
}

/// A context writing the frames docs/format.md describes: no checksum (the stored
/// fingerprint checks a fragment), no content size (always 4,096), no dictionary id.
fn new_zstd_compressor(level: i32) -> Option<zstd::bulk::Compressor<'static>> {
    use zstd::stream::raw::CParameter;
    let mut c = zstd::bulk::Compressor::new(level).ok()?;
    c.set_parameter(CParameter::ChecksumFlag(false)).ok()?;
    c.set_parameter(CParameter::ContentSizeFlag(false)).ok()?;
    c.set_parameter(CParameter::DictIdFlag(false)).ok()?;
    Some(c)
}

/// Decode a fragment written with `codec` into `out` (one block); the error says
/// why, for the caller's corruption report.
pub(crate) fn decompress(codec: Codec, src: &[u8], out: &mut [u8]) -> Result<usize, String> {
    match codec {
        Codec::Lz4 => lz4_flex::block::decompress_into(src, out)
            .map_err(|e| format!("LZ4 fragment does not decode: {e}")),
        Codec::Zstd => ZSTD_DECOMPRESSOR.with(|cell| {
            let mut cell = cell.borrow_mut();
            if cell.is_none() {
                *cell = Some(
                    zstd::bulk::Decompressor::new()
                        .map_err(|e| format!("no zstd decompression context: {e}"))?,
                );
            }
            let d = cell
                .as_mut()
                .ok_or_else(|| "no zstd decompression context".to_string())?;
            d.decompress_to_buffer(src, out)
                .map_err(|e| format!("zstd fragment does not decode: {e}"))
        }),
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    reason = "tests fail loudly by design"
)]
mod tests {
    use super::*;
    use rand::{RngCore, SeedableRng};

    fn random_block(seed: u64) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK_BYTES];
        rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut b);
        b
    }

    /// The seed's mix: each 512-byte chunk half random, half zeros.
    fn mix_block(seed: u64) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut b = vec![0u8; BLOCK_BYTES];
        for c in b.chunks_mut(512) {
            rng.fill_bytes(&mut c[..256]);
        }
        b
    }

    #[test]
    fn settings_parse_and_print_back() {
        for s in ["none", "lz4", "zstd:1", "zstd:19", "zstd:-5"] {
            assert_eq!(s.parse::<Compression>().unwrap().to_string(), s);
        }
        assert_eq!(
            "zstd".parse::<Compression>().unwrap(),
            Compression::Zstd { level: 3 }
        );
        for bad in ["zstd:0", "zstd:23", "zstd:x", "gzip", "lz4:1"] {
            assert!(bad.parse::<Compression>().is_err(), "{bad}");
        }
        for c in [
            Compression::None,
            Compression::Lz4,
            Compression::Zstd { level: -7 },
            Compression::Zstd { level: 22 },
        ] {
            let (codec, level) = c.to_super();
            assert_eq!(Compression::from_super(codec, level).unwrap(), c);
            assert_eq!(Compression::unpack(c.pack()), c);
        }
        assert_eq!(Compression::from_super(0, 0).unwrap(), Compression::Lz4);
    }

    // An unknown codec in the super block used to become LZ4.
    #[test]
    fn an_unknown_codec_in_the_super_block_is_corruption_not_lz4() {
        for codec in [4u8, 9, 255] {
            match Compression::from_super(codec, 0) {
                Err(EngineError::Corrupt { region, reason, .. }) => {
                    assert_eq!(region, "super block");
                    assert!(reason.contains(&codec.to_string()), "{reason}");
                }
                other => panic!("compression {codec} read as {other:?}"),
            }
        }
    }

    #[test]
    fn random_blocks_are_given_up_on_and_mixed_ones_are_not() {
        let given_up = (0..1000)
            .filter(|s| looks_incompressible(&random_block(*s)))
            .count();
        assert!(given_up >= 990, "{given_up} of 1000 random blocks");
        for s in 0..1000 {
            assert!(!looks_incompressible(&mix_block(s)), "mix block {s}");
        }
        // Small counters in u32 lanes: random low bytes, zero high bytes.
        let mut lanes = random_block(7);
        for (i, b) in lanes.iter_mut().enumerate() {
            if i % 4 != 0 {
                *b = 0;
            }
        }
        assert!(!looks_incompressible(&lanes));
    }

    #[test]
    fn every_codec_round_trips_a_mixed_block() {
        let block = mix_block(3);
        for c in [
            Compression::Lz4,
            Compression::Zstd { level: 1 },
            Compression::Zstd { level: 3 },
        ] {
            let (codec, bytes) = compress(c, &block, |codec, b| (codec, b.to_vec())).unwrap();
            assert!(bytes.len() <= COMPRESSED_BYTES_MAX);
            let mut out = vec![0u8; BLOCK_BYTES];
            assert_eq!(decompress(codec, &bytes, &mut out).unwrap(), BLOCK_BYTES);
            assert_eq!(out, block, "{c}");
        }
        assert!(compress(Compression::None, &block, |_, _| ()).is_none());
        assert!(compress(Compression::Lz4, &random_block(1), |_, _| ()).is_none());
    }

    #[test]
    fn corrupt_zstd_fragments_are_errors_not_panics() {
        let block = mix_block(5);
        let bytes = compress(Compression::Zstd { level: 3 }, &block, |_, b| b.to_vec()).unwrap();
        let mut out = vec![0u8; BLOCK_BYTES];
        for i in 0..bytes.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut bad = bytes.clone();
                bad[i] ^= flip;
                let _ = decompress(Codec::Zstd, &bad, &mut out);
            }
            let _ = decompress(Codec::Zstd, &bytes[..i], &mut out);
        }
        let err = decompress(Codec::Zstd, &[0u8; 40], &mut out).unwrap_err();
        assert!(err.contains("zstd fragment does not decode"), "{err}");
    }
}
