//! The scrubber's state: whether a scrub runs, is paused or done, its progress and
//! findings, the rate it reads at, and the wake-up of its thread. The walk itself
//! (which pages and objects, how each is verified and repaired) is `scrub.rs`.
//!
//! Held in memory only: a pool reopened (a server restarted) reports `idle` and a
//! paused scrub is forgotten; `scrub start` begins again from the first page.

use crate::api::{ScrubFinding, ScrubState, ScrubStatus, SCRUB_FINDINGS_MAX};
use crate::{EngineError, Result};
use parking_lot::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// What the scrubber keeps between steps.
pub(crate) struct Scrubber {
    status: Mutex<ScrubStatus>,
    /// Wakes a paused or throttled scrub (resume, close).
    wake: Condvar,
}

/// Longest a throttled or paused scrub sleeps before it looks at its state again
/// (a close or a pause is seen within it).
const NAP: Duration = Duration::from_millis(100);

impl Scrubber {
    pub(crate) fn new() -> Self {
        Scrubber {
            status: Mutex::new(ScrubStatus::default()),
            wake: Condvar::new(),
        }
    }

    /// Progress and report now.
    pub(crate) fn status(&self) -> ScrubStatus {
        self.status.lock().clone()
    }

    /// Begin a scrub at `rate_bytes_per_s` (0: unthrottled); refused while one runs
    /// or is paused.
    pub(crate) fn begin(&self, rate_bytes_per_s: u64) -> Result<()> {
        let mut s = self.status.lock();
        if matches!(s.state, ScrubState::Running | ScrubState::Paused) {
            return Err(EngineError::Refused(format!(
                "a scrub is already {} ({} of {} bytes verified): pause or resume it, or \
                 wait for it to finish",
                s.state, s.bytes_verified, s.bytes_total
            )));
        }
        *s = ScrubStatus {
            state: ScrubState::Running,
            rate_bytes_per_s,
            started: Some(iso8601_now()),
            ..ScrubStatus::default()
        };
        Ok(())
    }

    /// The bytes this scrub will read, counted when it starts.
    pub(crate) fn set_total(&self, bytes: u64) {
        self.status.lock().bytes_total = bytes;
    }

    /// Pause a running scrub (it stops at its next step).
    pub(crate) fn pause(&self) -> Result<()> {
        let mut s = self.status.lock();
        if s.state != ScrubState::Running {
            return Err(EngineError::Refused(format!(
                "no scrub is running (it is {}): nothing to pause",
                s.state
            )));
        }
        s.state = ScrubState::Paused;
        Ok(())
    }

    /// Resume a paused scrub where it stopped.
    pub(crate) fn resume(&self) -> Result<()> {
        let mut s = self.status.lock();
        if s.state != ScrubState::Paused {
            return Err(EngineError::Refused(format!(
                "no scrub is paused (it is {}): nothing to resume",
                s.state
            )));
        }
        s.state = ScrubState::Running;
        self.wake.notify_all();
        Ok(())
    }

    /// Wake the scrub thread (the pool closes).
    pub(crate) fn wake(&self) {
        let _guard = self.status.lock();
        self.wake.notify_all();
    }

    /// `bytes` more read and verified, of a page or an object.
    pub(crate) fn verified(&self, bytes: u64, page: bool) {
        let mut s = self.status.lock();
        s.bytes_verified += bytes;
        if page {
            s.pages_verified += 1;
        } else {
            s.objects_verified += 1;
        }
    }

    /// A failure found; the report keeps the first [`SCRUB_FINDINGS_MAX`].
    pub(crate) fn found(&self, finding: ScrubFinding) {
        let mut s = self.status.lock();
        s.errors_found += 1;
        if finding.repaired {
            s.repaired += 1;
        }
        if s.findings.len() < SCRUB_FINDINGS_MAX {
            s.findings.push(finding);
        }
    }

    /// Whether the report keeps another finding (fewer than [`SCRUB_FINDINGS_MAX`]).
    pub(crate) fn keeps_more(&self) -> bool {
        self.status.lock().findings.len() < SCRUB_FINDINGS_MAX
    }

    /// The scrub ended: finished, or stopped early for `stopped`.
    pub(crate) fn finish(&self, stopped: Option<String>) {
        let mut s = self.status.lock();
        s.state = ScrubState::Done;
        s.finished = Some(iso8601_now());
        s.stopped = stopped;
        self.wake.notify_all();
    }

    /// Wait while paused, and until `bytes_read` since `since` (the last resume) fits
    /// the rate. Returns the time the rate is counted from now (reset by a pause, so
    /// a long pause does not buy a burst), or `None` once `closed` holds.
    pub(crate) fn pace(
        &self,
        since: (Instant, u64),
        closed: impl Fn() -> bool,
    ) -> Option<(Instant, u64)> {
        let mut s = self.status.lock();
        let mut since = since;
        loop {
            if closed() {
                return None;
            }
            if s.state == ScrubState::Paused {
                self.wake.wait_for(&mut s, NAP);
                since = (Instant::now(), s.bytes_verified);
                continue;
            }
            let rate = s.rate_bytes_per_s;
            if rate == 0 {
                return Some(since);
            }
            let read = s.bytes_verified.saturating_sub(since.1);
            let due = Duration::from_secs_f64(read as f64 / rate as f64);
            let elapsed = since.0.elapsed();
            if elapsed >= due {
                return Some(since);
            }
            self.wake.wait_for(&mut s, (due - elapsed).min(NAP));
        }
    }
}

/// Now as ISO 8601 in UTC (`2026-12-02T18:22:15Z`).
pub(crate) fn iso8601_now() -> String {
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    iso8601(unix)
}

/// Unix seconds as ISO 8601 in UTC (`2026-12-02T18:22:15Z`), by the civil-from-days
/// rule (no time zone data): how every time shown to people is written.
pub fn iso8601(unix: u64) -> String {
    let days = unix / 86_400;
    let secs = unix % 86_400;
    // Howard Hinnant's days_from_civil inverse, for days since 1970-01-01.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3_600,
        secs % 3_600 / 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::iso8601;

    #[test]
    fn iso8601_of_known_instants() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso8601(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(iso8601(1_796_235_735), "2026-12-02T18:22:15Z");
    }
}
