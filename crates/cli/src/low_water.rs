//! The low-water mark of a served pool (`serve --warn-at PERCENT`): a thread looks at
//! the pool's Use% every few seconds and logs one warning when it reaches the mark, and one line when it falls back below (after which the
//! next crossing warns again). `stats` through the server shows the mark and whether
//! it is crossed. A full pool pauses guests (ENOSPC); this is the notice before.
//!
//! Use% here is the larger of the device's fill (plain `stats`' Use%) and how much
//! of the pool thin writes can no longer use (`thin_writable_bytes`): a thick volume
//! that reserves the rest of the pool leaves thin volumes no room on a nearly empty
//! device, and their writes fail as on a full one.

use anyhow::{bail, Result};
use fewerbytes_engine::{Pool, PoolStats};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::output::percent_rounded_up;

/// `--warn-at`'s default: vdo's and thin-pool monitors' usual 80–90% warnings; the
/// upper one, since a pool that dedups well fills slowly.
pub const DEFAULT_WARN_AT_PERCENT: u8 = 90;
/// How often the watcher looks. Stats lock every slab briefly, so not on every
/// write; a pool fills far slower than this at any rate a drive can write.
const CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// The mark and whether the pool is past it (`stats`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct WarnAt {
    /// Use% at which the server warns.
    pub percent: u8,
    /// Whether the pool's Use% is at or above it (as of the last look).
    pub crossed: bool,
}

/// Parse `--warn-at`: a percentage from 1 to 100, with or without `%`.
pub fn parse_percent(text: &str) -> Result<u8> {
    let digits = text.trim().trim_end_matches('%');
    let Ok(percent) = digits.parse::<u8>() else {
        bail!("'{text}' is not a percentage (say 90 or 90%)");
    };
    if !(1..=100).contains(&percent) {
        bail!("--warn-at must be from 1% to 100%, not {percent}%");
    }
    Ok(percent)
}

/// The pool's Use% as the mark sees it: the larger of the device's fill (metadata
/// counts as used) and the part of it thin writes cannot use (everything but
/// `thin_writable_bytes`).
pub fn used_percent(stats: &PoolStats) -> u64 {
    let size = stats.data_bytes + stats.metadata_bytes;
    let filled = percent_rounded_up(stats.data_used_bytes + stats.metadata_bytes, size);
    let closed_to_thin = percent_rounded_up(size.saturating_sub(stats.thin_writable_bytes), size);
    filled.max(closed_to_thin)
}

/// The mark and its state.
pub struct LowWater {
    percent: u8,
    crossed: AtomicBool,
}

impl LowWater {
    /// A mark at `percent`, not crossed.
    pub fn new(percent: u8) -> Self {
        LowWater {
            percent,
            crossed: AtomicBool::new(false),
        }
    }

    /// The mark and whether it is crossed.
    pub fn status(&self) -> WarnAt {
        WarnAt {
            percent: self.percent,
            crossed: self.crossed.load(Ordering::Relaxed),
        }
    }

    /// Look at the pool's use; log when it crosses the mark either way.
    pub fn observe(&self, stats: &PoolStats) {
        let used = used_percent(stats);
        let above = used >= u64::from(self.percent);
        if self.crossed.swap(above, Ordering::Relaxed) == above {
            return;
        }
        if above {
            tracing::warn!(
                "pool {} is {used}% used, at or past --warn-at {}%: {} free, of which thin \
                 writes can use {} (reservations hold back {}). When that is gone, writes \
                 no reservation covers fail with ENOSPC (QEMU pauses its guests) until \
                 space is freed: make thick volumes thin or reserve less (`volume set \
                 NAME --thin` or `--reserve SIZE`), delete or trim volumes, or grow the \
                 pool (`pool grow`)",
                stats.path,
                self.percent,
                crate::size::format_size(stats.data_free_bytes),
                crate::size::format_size(stats.thin_writable_bytes),
                crate::size::format_size(stats.reserved_unused_bytes)
            );
        } else {
            tracing::info!(
                "pool {} is {used}% used, below --warn-at {}% again",
                stats.path,
                self.percent
            );
        }
    }

    /// Watch `pool` until the returned watcher is stopped.
    pub fn watch(self: &Arc<Self>, pool: Arc<Pool>) -> Result<Watcher> {
        let (stop, stopped) = channel::<()>();
        let mark = Arc::clone(self);
        let thread = std::thread::Builder::new()
            .name("fewerbytes-warn-at".into())
            .spawn(move || loop {
                mark.observe(&pool.stats());
                match stopped.recv_timeout(CHECK_INTERVAL) {
                    Err(RecvTimeoutError::Timeout) => continue,
                    _ => return,
                }
            })?;
        Ok(Watcher {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

/// The watching thread; stopped (and joined) when dropped.
pub struct Watcher {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages_parse_with_or_without_the_sign() {
        assert_eq!(parse_percent("90").unwrap(), 90);
        assert_eq!(parse_percent("75%").unwrap(), 75);
        assert!(parse_percent("0").is_err());
        assert!(parse_percent("101%").is_err());
        assert!(parse_percent("ninety").is_err());
    }
}
