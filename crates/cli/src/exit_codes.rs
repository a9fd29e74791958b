//! Exit codes beyond 0 and 1: those of `check`, as fsck(8) has them (`volume export`
//! uses `DAMAGE_LEFT` for damage found too), and that of a command stopped by
//! SIGINT or SIGTERM. `serve`'s own is `serve::EXIT_NOT_OWNER`.

/// No damage found.
pub const CLEAN: u8 = 0;
/// Damage found and repaired.
pub const REPAIRED: u8 = 1;
/// Damage left: found without `--repair`, beyond what a repair changes, or
/// metadata that does not load at all.
pub const DAMAGE_LEFT: u8 = 4;
/// The check could not run (no pool there, held by another process, served
/// while `--repair` was asked, an I/O error).
pub const NOT_CHECKED: u8 = 8;
/// A command stopped by a signal exits 128 + the signal's number (130 for SIGINT,
/// 143 for SIGTERM), as a shell reports a process the signal killed, so a script
/// sees the same code whether the command stopped cleanly or was killed.
pub const INTERRUPTED_BASE: u8 = 128;
/// The code of a command Ctrl-C stopped (the man pages list it).
pub const INTERRUPTED_BY_SIGINT: u8 = INTERRUPTED_BASE + libc::SIGINT as u8;

/// The exit code of a command stopped by `signal`.
pub fn interrupted(signal: i32) -> u8 {
    // SIGINT and SIGTERM are 2 and 15: the sum fits a byte.
    INTERRUPTED_BASE.saturating_add(u8::try_from(signal).unwrap_or(u8::MAX - INTERRUPTED_BASE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_by_signal_exits_as_a_shell_reports_a_death_by_it() {
        assert_eq!(interrupted(libc::SIGINT), 130);
        assert_eq!(interrupted(libc::SIGTERM), 143);
        assert_eq!(INTERRUPTED_BY_SIGINT, interrupted(libc::SIGINT));
    }
}
