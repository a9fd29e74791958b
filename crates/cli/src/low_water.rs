//! The low-water mark of a served pool (`serve --warn-at PERCENT`): a thread looks at
//! the pool's Use% every few seconds and logs one warning when it reaches the mark, and one line when it falls back below (after which the
//! next crossing warns again). `stats` through the server shows the mark and whether
//! it is crossed. A full pool pauses guests (ENOSPC); this is the notice before.
//!
//! Use% here is plain `stats`' Use%: Used of Size, where Used is everything but
//! Available (what thin writes can still take). So a thick volume that reserves the
//! rest of the pool, which leaves thin volumes no room on a nearly empty device (their
//! writes fail as on a full one), crosses the mark too. But only while some volume
//! can write past its reservation (a thin one, or one reserving less than its size):
//! when every volume's reservation covers its size, no write can meet ENOSPC
//! however full the pool is, and there is nothing to warn about (the default pool,
//! one thick volume reserving all of it, would otherwise warn at every start).

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

/// The pool's Use%, as plain `stats` and the mark see it: Used of Size, rounded up.
pub fn used_percent(stats: &PoolStats) -> u64 {
    percent_rounded_up(stats.space.used_bytes, stats.space.size_bytes)
}

/// Whether some volume can write past what it reserved (a thin volume, or one
/// reserving less than its size): only such writes take Available, and meet ENOSPC
/// when it is gone.
pub fn writes_past_reservations(stats: &PoolStats) -> bool {
    stats
        .volumes
        .iter()
        .any(|v| v.reserved_bytes < v.size_bytes)
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
        let above = used >= u64::from(self.percent) && writes_past_reservations(stats);
        if self.crossed.swap(above, Ordering::Relaxed) == above {
            return;
        }
        if above {
            tracing::warn!(
                "pool {} is {used}% used, at or past --warn-at {}%: Available {} (what \
                 writes no reservation covers can still take), Used {} of Size {}, of \
                 which reservations hold back {} unused. When Available is gone, those \
                 writes fail with ENOSPC (QEMU pauses its guests) until space is freed: \
                 make thick volumes thin or reserve less (`volume set NAME --thin` or \
                 `--reserve SIZE`), delete or trim volumes, or grow the pool (`pool grow`)",
                stats.path,
                self.percent,
                crate::size::format_size(stats.space.available_bytes),
                crate::size::format_size(stats.space.used_bytes),
                crate::size::format_size(stats.space.size_bytes),
                crate::size::format_size(stats.space.reserved_unused_bytes)
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
