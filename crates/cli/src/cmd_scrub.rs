//! `scrub`: read and verify every page and stored block of a pool while it serves
//! (ZFS's `zpool scrub`), through the server's control socket; on a pool no server
//! holds, this process opens it and runs the scrub to its end.
//!
//! The scrub's state lives in the server's memory: a restarted server forgets a
//! paused scrub and reports `idle`.

use anyhow::{bail, Result};
use fewerbytes_engine::{ScrubState, ScrubStatus, SCRUB_RATE_DEFAULT_BYTES_PER_S};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use crate::control::{inspect_pool, with_pool, Answer, PoolHandle, Request};
use crate::output::print_json;
use crate::size::{format_size, parse_size_arg};

/// How often `--wait` asks the scrub how far it is.
const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// `scrub`.
#[derive(clap::Args)]
pub struct ScrubArgs {
    #[command(subcommand)]
    action: Option<ScrubAction>,
    /// Read rate limit in bytes per second (K, M, G suffixes; 0: unthrottled).
    /// Default 64M: guests keep most of the device.
    #[arg(long, global = true, value_parser = parse_size_arg, value_name = "R")]
    rate: Option<u64>,
    /// Wait until the scrub is done, print its report, and exit with status 1 if it
    /// found damage it could not repair (a pool no server holds always waits).
    #[arg(long, global = true)]
    wait: bool,
    /// Print the scrub's status as JSON.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(clap::Subcommand, Clone, Copy)]
enum ScrubAction {
    /// Start a scrub (the default).
    Start,
    /// Pause the running scrub where it is (in memory: a server restart forgets it).
    Pause,
    /// Resume a paused scrub.
    Resume,
    /// Progress and the last report.
    Status,
}

/// Run `scrub`.
pub fn run(args: ScrubArgs, pool_path: &Path) -> Result<ExitCode> {
    let action = args.action.unwrap_or(ScrubAction::Start);
    if args.rate.is_some() && !matches!(action, ScrubAction::Start) {
        bail!("--rate applies to `scrub start` only");
    }
    if matches!(action, ScrubAction::Start) || args.wait {
        // Before the open: a signal during it is seen by the first poll.
        crate::interrupt::install_for_command()?;
    }
    // A status needs no write: a pool no server holds is opened read-only for it.
    match action {
        ScrubAction::Status => inspect_pool(pool_path, |pool| drive(pool, action, &args)),
        _ => with_pool(pool_path, |pool| drive(pool, action, &args)),
    }
}

/// Send the action, wait if asked (or if this process holds the pool), report.
fn drive(pool: &PoolHandle, action: ScrubAction, args: &ScrubArgs) -> Result<ExitCode> {
    let served = matches!(pool, PoolHandle::Served(_));
    let request = match action {
        ScrubAction::Start => Request::ScrubStart {
            rate_bytes_per_s: args.rate.unwrap_or(SCRUB_RATE_DEFAULT_BYTES_PER_S),
        },
        ScrubAction::Pause | ScrubAction::Resume if !served => bail!(
            "no server holds the pool, so no scrub runs in the background to pause \
             or resume (`fewerbytes scrub` on a pool no server holds runs to its end)"
        ),
        ScrubAction::Pause => Request::ScrubPause,
        ScrubAction::Resume => Request::ScrubResume,
        ScrubAction::Status => Request::ScrubStatus,
    };
    // This process's own open ends with the command: the scrub must finish first,
    // unless a signal stops it (the pool's close ends the scrub thread).
    let mut status = call(pool, &request)?;
    let wait = args.wait || (!served && matches!(action, ScrubAction::Start));
    if wait {
        while matches!(status.state, ScrubState::Running | ScrubState::Paused) {
            let result = crate::interrupt::check().map_err(Into::into);
            crate::interrupt::explain(result, || stopped_sentence(&status, served))?;
            std::thread::sleep(POLL_INTERVAL);
            status = call(pool, &Request::ScrubStatus)?;
        }
    }
    if args.json {
        print_json(&status)?;
    } else if wait {
        print_report(&status);
    } else {
        println!("{}", summary(&status));
    }
    Ok(
        if wait && (status.unrepaired() > 0 || status.stopped.is_some()) {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        },
    )
}

/// What a signal during the wait left: a scrub of this process's pool stops with
/// it; a server's goes on.
fn stopped_sentence(status: &ScrubStatus, served: bool) -> String {
    if served {
        return "stopped waiting for the scrub, which goes on in the server \
                (`fewerbytes scrub status`)"
            .into();
    }
    format!(
        "the scrub stopped at {} of {} verified with {} errors found so far (stopping it \
         changed nothing; `fewerbytes scrub` starts again from the beginning)",
        format_size(status.bytes_verified),
        format_size(status.bytes_total),
        status.errors_found
    )
}

fn call(pool: &PoolHandle, request: &Request) -> Result<ScrubStatus> {
    match pool.call(request)? {
        Answer::Scrub(status) => Ok(status),
        other => bail!("unexpected answer to {}: {other:?}", request.in_words()),
    }
}

/// One line: state, progress, errors (as `stats` and `pool info` show it).
pub fn summary(s: &ScrubStatus) -> String {
    let percent = (s.bytes_verified.min(s.bytes_total) * 100)
        .checked_div(s.bytes_total)
        .unwrap_or(0);
    let rate = if s.rate_bytes_per_s == 0 {
        "unthrottled".to_string()
    } else {
        format!("at most {}/s", format_size(s.rate_bytes_per_s))
    };
    let times = match (&s.started, &s.finished) {
        (Some(a), Some(b)) => format!(", started {a}, finished {b}"),
        (Some(a), None) => format!(", started {a}"),
        _ => String::new(),
    };
    match s.state {
        ScrubState::Idle => "idle (no scrub since the pool was opened)".into(),
        _ => format!(
            "{}, {} of {} verified ({percent}%), {} errors found, {} repaired, {rate}{times}{}",
            s.state,
            format_size(s.bytes_verified),
            format_size(s.bytes_total),
            s.errors_found,
            s.repaired,
            s.stopped
                .as_ref()
                .map(|why| format!(" ({why})"))
                .unwrap_or_default()
        ),
    }
}

/// The final report: the summary, then each finding.
fn print_report(s: &ScrubStatus) {
    println!("Scrub: {}", summary(s));
    println!(
        "Verified: {} pages, {} stored objects",
        s.pages_verified, s.objects_verified
    );
    for f in &s.findings {
        let fate = if f.repaired {
            "repaired"
        } else {
            "NOT repaired"
        };
        println!("  {} ({fate}): {}", f.region, f.what);
        for v in &f.volumes {
            println!("    mapped by {v}");
        }
    }
    if s.findings.len() < s.errors_found as usize {
        println!(
            "  ... and {} more (the first {} are kept)",
            s.errors_found as usize - s.findings.len(),
            s.findings.len()
        );
    }
    if s.unrepaired() > 0 {
        println!(
            "{} damaged and not repaired: reads of the data named above fail; {}",
            s.unrepaired(),
            crate::export::how_to_clear(None)
        );
    }
}
