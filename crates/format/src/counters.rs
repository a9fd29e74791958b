//! The counters page's payload (page kind 7, version 2): the pool's cumulative
//! counters, written at checkpoints so that `stats` after a restart goes on from the
//! last checkpoint, as vdostats does. Counter *i* means `COUNTER_NAMES[i]`; a reader
//! ignores values past those it knows, and a writer keeps them.

use crate::page::PAGE_PAYLOAD_BYTES;
use crate::{FormatError, Reader, Writer};

/// What each counter counts, in the order the page holds them (docs/format.md,
/// "Counters page"). New counters are only ever appended.
pub const COUNTER_NAMES: [&str; 12] = [
    "guest_bytes_written",
    "guest_bytes_read",
    "blocks_written",
    "zero_blocks_written",
    "dedup_hits",
    "advice_valid",
    "advice_stale",
    "compressed_writes",
    "uncompressed_writes",
    "trimmed_bytes",
    "write_zeroes_bytes",
    "flushes",
];

/// Counters this version knows.
pub const KNOWN_COUNTERS: usize = COUNTER_NAMES.len();

/// The most counters one page holds (8 bytes each).
pub const MAX_COUNTERS: usize = PAGE_PAYLOAD_BYTES / 8;

/// Encode `values` into a page payload; returns the page header's `count`.
/// Values past [`MAX_COUNTERS`] are not written (no version defines that many).
pub fn encode_counters(values: &[u64], payload: &mut [u8]) -> u32 {
    let n = values.len().min(MAX_COUNTERS).min(payload.len() / 8);
    let mut w = Writer::new(payload);
    for v in values.iter().take(n) {
        w.u64(*v);
    }
    n as u32
}

/// Decode the `count` counters of a page payload. A count past what a page holds is
/// corruption, not a shorter list.
pub fn decode_counters(count: u32, payload: &[u8]) -> Result<Vec<u64>, FormatError> {
    let n = count as usize;
    if n > MAX_COUNTERS {
        return Err(FormatError::Invalid {
            what: "counters page",
            reason: format!("holds {n} counters, a page has room for {MAX_COUNTERS}"),
        });
    }
    let mut r = Reader::new("counters page", payload);
    (0..n).map(|_| r.u64()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_round_trip_and_keep_unknown_ones() {
        let values: Vec<u64> = (1..=20).map(|i| i * 1000 + 7).collect();
        let mut payload = vec![0u8; PAGE_PAYLOAD_BYTES];
        let count = encode_counters(&values, &mut payload);
        assert_eq!(count, 20);
        assert_eq!(decode_counters(count, &payload), Ok(values));
    }

    #[test]
    fn a_count_past_the_page_is_corrupt() {
        let payload = vec![0u8; PAGE_PAYLOAD_BYTES];
        let err = decode_counters(MAX_COUNTERS as u32 + 1, &payload);
        assert!(matches!(err, Err(FormatError::Invalid { .. })), "{err:?}");
        // Three counters in 16 bytes: truncated.
        let short = [0u8; 16];
        assert!(decode_counters(3, &short).is_err());
    }
}
