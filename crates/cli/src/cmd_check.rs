//! `check`: whether a pool's reference counts, free space and block maps agree, and
//! with `--repair` making them agree, exiting as fsck does (docs/check.md).
//!
//! Plain `check` is the audit, run wherever the pool is (through a server's control
//! socket, or opened here). `--repair` and `--verify-data` hold the pool still for as
//! long as they take, so they run only on a pool this process opens, never through a
//! server: a served pool is refused, and the person stops the server first.

use anyhow::{bail, Context, Result};
use fewerbytes_engine::{
    AuditReport, EngineError, OpenOptions, RepairOptions, RepairPhase, RepairReport,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;

use crate::control::{
    inspect_pool, open_pool, open_pool_for_repair, run_and_close, Answer, ControlClient, Request,
};
use crate::exit_codes as exit;
use crate::output::print_json;
use crate::size::format_size;

/// `check`.
#[derive(clap::Args)]
pub struct CheckArgs {
    /// Repair what the block maps and object records can rebuild: reference counts,
    /// leaked objects, free space, map entries naming data that is not stored (set to
    /// zeros and listed as lost), damaged map ranges (cleared: they read as zeros,
    /// listed as lost). Needs the pool not served.
    #[arg(long)]
    repair: bool,
    /// Also read every stored block back and check it against its fingerprint (reads
    /// all stored data). Needs the pool not served.
    #[arg(long)]
    verify_data: bool,
    /// Print the audit as JSON (objects and map entries checked, every problem); the
    /// exit code is the same.
    #[arg(long, conflicts_with_all = ["repair", "verify_data"])]
    json: bool,
}

/// The exit code of a `check` that failed with `error`: damage when the pool's
/// metadata does not load, else "not checked".
pub fn error_code(error: &anyhow::Error) -> ExitCode {
    ExitCode::from(if is_damage(error) {
        exit::DAMAGE_LEFT
    } else {
        exit::NOT_CHECKED
    })
}

/// Whether `error` says the pool's metadata is damaged (rather than out of reach).
fn is_damage(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<EngineError>(),
            Some(EngineError::Corrupt { .. } | EngineError::Truncated { .. })
        )
    })
}

/// Run `check`.
pub fn run(args: CheckArgs, pool_path: &Path) -> Result<ExitCode> {
    if args.repair || args.verify_data {
        return repair(&args, pool_path);
    }
    let report: AuditReport =
        inspect_pool(pool_path, |pool| match pool.call(&Request::Audit)? {
            Answer::Audit(report) => Ok(report),
            other => bail!("unexpected answer to check: {other:?}"),
        })?;
    if args.json {
        print_json(&report)?;
        return Ok(ExitCode::from(if report.problems.is_empty() {
            exit::CLEAN
        } else {
            exit::DAMAGE_LEFT
        }));
    }
    println!(
        "Checked {} stored objects and {} map entries.",
        report.objects_checked, report.map_entries_checked
    );
    if report.problems.is_empty() {
        println!("No problems found.");
        return Ok(ExitCode::from(exit::CLEAN));
    }
    for problem in &report.problems {
        println!("problem: {problem}");
    }
    eprintln!(
        "fewerbytes: error: the audit found {} problem(s) in pool {}; `fewerbytes check \
         --repair` on the pool, not served, repairs what the block maps can rebuild",
        report.problems.len(),
        pool_path.display()
    );
    Ok(ExitCode::from(exit::DAMAGE_LEFT))
}

fn repair(args: &CheckArgs, pool_path: &Path) -> Result<ExitCode> {
    let what = if args.repair {
        "--repair"
    } else {
        "--verify-data"
    };
    if let Some(client) = ControlClient::probe(pool_path)? {
        let served = if args.verify_data {
            " (`fewerbytes scrub --wait` verifies every stored block while it serves)"
        } else {
            ""
        };
        bail!(
            "`check {what}` holds the pool still while it runs, so it does not run through a \
             server: stop the server holding {} (its control socket is {}) first, then run it \
             again{served}",
            pool_path.display(),
            client.path().display()
        );
    }
    let options = RepairOptions {
        apply: args.repair,
        verify_data: args.verify_data,
    };
    // Before the open: a signal during it is seen before the repair begins.
    crate::interrupt::install_for_command()?;
    let progress = PhaseProgress::new();
    let opened = if args.repair {
        open_pool_for_repair(pool_path, &OpenOptions::default())
    } else {
        open_pool(pool_path, &OpenOptions::default())
    };
    let report = opened
        .and_then(|pool| {
            run_and_close(pool_path, pool, |pool| {
                crate::interrupt::explain(crate::interrupt::check().map_err(Into::into), || {
                    format!("the `check {what}` stopped before it began: nothing was checked or changed")
                })?;
                pool.repair(&options, &|phase, done, total| {
                    progress.show(phase, done, total)
                })
                .context("the repair stopped")
            })
        })
        .map_err(|e| {
            if args.repair && is_damage(&e) {
                e.context(format!(
                    "pool {} cannot be repaired by `check --repair`: its metadata does not load",
                    pool_path.display()
                ))
            } else {
                e
            }
        });
    progress.finish();
    let report = report?;
    let code = print_repair(&report, args.repair, pool_path);
    if let Err(interrupted) = crate::interrupt::check() {
        // A repair changes the pool in memory and makes it durable in one checkpoint
        // at its end: stopped part-way, the close would checkpoint half of it.
        eprintln!(
            "{}fewerbytes: {interrupted}: `check {what}` is not stopped part-way (a repair \
             is made durable as one step at its end), so it ran to its end and its report \
             above is whole (a second signal exits at once, before that step, leaving the \
             pool as it was); pool {} closed cleanly.",
            crate::logging::warning_line_prefix(),
            pool_path.display()
        );
        return Ok(ExitCode::from(interrupted.exit_code()));
    }
    Ok(code)
}

/// Print what a repair found and did; the exit code it means.
fn print_repair(report: &RepairReport, applied: bool, pool_path: &Path) -> ExitCode {
    println!(
        "Checked {} stored objects and {} map entries.",
        report.objects_checked, report.map_entries_checked
    );
    let label = if applied { "repaired" } else { "problem" };
    for repair in &report.repairs {
        println!("{label}: {repair}");
    }
    for damage in &report.damage_left {
        println!("damage: {damage}");
    }
    if report.repairs.is_empty() && report.damage_left.is_empty() {
        println!("No problems found.");
        return ExitCode::from(exit::CLEAN);
    }
    let lost = if report.lost_bytes > 0 {
        format!(
            "; {} of volume data {} lost and {} as zeros",
            format_size(report.lost_bytes),
            if applied { "was" } else { "is" },
            if applied { "now reads" } else { "would read" }
        )
    } else {
        String::new()
    };
    if applied && !report.repairs.is_empty() {
        println!(
            "Repaired {} problem(s) in pool {}{lost}.",
            report.repairs.len(),
            pool_path.display()
        );
    }
    if !report.damage_left.is_empty() {
        eprintln!(
            "fewerbytes: error: {} stored block(s) in pool {} fail their fingerprint and no \
             other stored block holds their data (`check --repair --verify-data` heals a block \
             from one that does); they are left as they are (the volume bytes named above read \
             as errors); {}",
            report.damage_left.len(),
            pool_path.display(),
            crate::export::how_to_clear(None)
        );
        return ExitCode::from(exit::DAMAGE_LEFT);
    }
    if !applied {
        eprintln!(
            "fewerbytes: error: the check found {} problem(s) in pool {}{lost}; `fewerbytes \
             check --repair` repairs them",
            report.repairs.len(),
            pool_path.display()
        );
        return ExitCode::from(exit::DAMAGE_LEFT);
    }
    ExitCode::from(exit::REPAIRED)
}

/// A bar on stderr, when it is a terminal, naming the repair's phase.
struct PhaseProgress {
    bar: Option<ProgressBar>,
}

impl PhaseProgress {
    fn new() -> PhaseProgress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(1), ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template("{msg:24} {percent:>3}% [{bar:40}]")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
            bar.set_style(style);
            bar
        });
        PhaseProgress { bar }
    }

    fn show(&self, phase: RepairPhase, done: u64, total: u64) {
        if let Some(bar) = &self.bar {
            // Length and position first: a redraw between the calls then never shows
            // the new phase with the old phase's percentage.
            bar.set_length(total.max(1));
            bar.set_position(done);
            bar.set_message(phase.describe());
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
