//! The exit codes of `check`, as fsck(8) has them; `volume export` uses `DAMAGE_LEFT`
//! for damage found too.

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
