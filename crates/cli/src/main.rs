//! `fewerbytes`: create pools and volumes, move raw images in and out, read the
//! statistics, and serve every volume over NBD.
//!
//! This file only parses the command line and reports errors; each command group
//! lives in its own file (`cmd_pool`, `cmd_volume`, `transfer`, `cmd_stats`, `serve`),
//! and management commands reach a pool through `control` (directly, or through the
//! server that holds it).

mod access;
mod banner;
mod cmd_check;
mod cmd_generate;
mod cmd_pool;
mod cmd_scrub;
mod cmd_stats;
mod cmd_volume;
mod cmd_volume_allow;
mod control;
mod control_server;
mod exit_codes;
mod export;
mod homes;
mod image_format;
mod interrupt;
mod logging;
mod low_water;
mod man_extra;
mod notify;
mod output;
mod receive;
mod send;
mod serve;
mod size;
mod socket_trust;
mod stream_request;
mod stream_serve;
mod stream_socket;
mod transfer;
mod volume_requests;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

/// The pool used when neither --pool nor FEWERBYTES_POOL names one.
pub const DEFAULT_POOL_PATH: &str = "./fewerbytes.pool";

/// The heading of the options every command takes: a command's `--help` lists its own
/// options first, under "Options", and these once, after them.
const GLOBAL_OPTIONS: &str = "Global options (every command)";

/// A deduplicating, compressing block store for VM disks, served over NBD.
#[derive(Parser)]
#[command(name = "fewerbytes", version, propagate_version = true)]
struct Cli {
    /// The pool: a file or block device by its path (or file:///PATH), or an RBD image,
    /// rbd:POOL/IMAGE[@CLUSTER] (Ceph config from $CEPH_CONF, client id from $CEPH_ID).
    /// Default: $FEWERBYTES_POOL, else ./fewerbytes.pool.
    #[arg(
        long,
        global = true,
        env = "FEWERBYTES_POOL",
        value_name = "NAME",
        help_heading = GLOBAL_OPTIONS
    )]
    pool: Option<PathBuf>,

    /// The control socket of a served pool [default: <pool>.ctl beside the pool; for
    /// an RBD pool, <pool-id>.ctl in $FEWERBYTES_RUN_DIR, else /run/fewerbytes]. The
    /// systemd unit serves with /run/fewerbytes/NAME.ctl: commands for that pool need
    /// the same path here (or in FEWERBYTES_CONTROL_SOCKET). Given without --pool, a
    /// command works on the pool the server on this socket holds, or fails if none
    /// answers.
    #[arg(
        long,
        global = true,
        env = "FEWERBYTES_CONTROL_SOCKET",
        value_name = "PATH",
        help_heading = GLOBAL_OPTIONS
    )]
    control_socket: Option<PathBuf>,

    /// The allow file: which TLS identities may open which volume [default:
    /// <pool>.allow.json beside the pool; for an RBD pool, <pool-id>.allow.json in
    /// $FEWERBYTES_STATE_DIR, else /var/lib/fewerbytes]. Written by `volume create --allow` and
    /// `volume allow`, read by `serve`.
    #[arg(
        long,
        global = true,
        env = "FEWERBYTES_ALLOW_FILE",
        value_name = "PATH",
        help_heading = GLOBAL_OPTIONS
    )]
    allow_file: Option<PathBuf>,

    /// Fail unless a server holds the pool and answers on its control socket; never
    /// open the pool in this process (what the Proxmox storage plugin uses).
    #[arg(long, global = true, help_heading = GLOBAL_OPTIONS)]
    require_server: bool,

    /// Least severe log level written to stderr [default: $FEWERBYTES_LOG, else
    /// $RUST_LOG, else info for serve and warn otherwise]; this flag wins over both
    /// variables.
    #[arg(long, global = true, value_name = "LEVEL", help_heading = GLOBAL_OPTIONS)]
    log_level: Option<logging::LogLevel>,

    /// How log lines look: text, or one JSON object per line.
    #[arg(
        long,
        global = true,
        env = "FEWERBYTES_LOG_FORMAT",
        value_name = "FORMAT",
        default_value = "text",
        help_heading = GLOBAL_OPTIONS
    )]
    log_format: logging::LogFormat,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a pool, or show its geometry.
    #[command(subcommand)]
    Pool(cmd_pool::PoolCommand),
    /// Create, list, show, resize, clone, rename, delete, import, export, send and receive volumes.
    #[command(subcommand)]
    Volume(cmd_volume::VolumeCommand),
    /// Space used and saved, like vdostats: Size = Used + Available (what a thin write
    /// can still take), as `pool info` names them.
    Stats(cmd_stats::StatsArgs),
    /// Every metadata region: what, device, block range, size (like vdolistmetadata).
    ListMetadata(cmd_stats::ListMetadataArgs),
    /// Audit reference counts, free space and block maps; with --repair, rebuild them.
    ///
    /// Exits as fsck does: 0 no damage, 1 damage repaired, 4 damage left (found without
    /// --repair, or metadata that does not load), 8 not checked (no pool, pool held,
    /// --repair on a served pool, an I/O error).
    Check(cmd_check::CheckArgs),
    /// Read and verify every page and stored block of the pool, at a bounded rate,
    /// while it serves; rewrite damaged metadata from memory; name damaged data.
    Scrub(cmd_scrub::ScrubArgs),
    /// Serve every volume of the pool over NBD (unix socket and 127.0.0.1:10809).
    ///
    /// With no pool at the default path (no --pool, no FEWERBYTES_POOL), first creates
    /// one: a sparse 16 GiB file with one volume, disk0. While serving, the volume,
    /// stats, list-metadata and check commands work through <pool>.ctl (or
    /// --control-socket). Under a service manager ($NOTIFY_SOCKET set) it reports
    /// READY=1 once every socket accepts and STOPPING=1 when a stop begins.
    Serve(serve::ServeArgs),
    /// Print the shell completion script for SHELL (bash, zsh, fish, elvish, powershell).
    ///
    /// bash: `fewerbytes completions bash > /usr/share/bash-completion/completions/fewerbytes`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Write the man pages (fewerbytes.1 and one per subcommand) into DIR.
    Man {
        /// Where to write them (created if missing), e.g. /usr/local/share/man/man1.
        dir: PathBuf,
    },
}

/// Which pool a command works on, and whether the user named it.
#[derive(Clone)]
pub struct PoolPath {
    /// The path.
    pub path: PathBuf,
    /// Named by --pool or FEWERBYTES_POOL (not the built-in default).
    pub explicit: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let serving = matches!(cli.command, Command::Serve(_));
    let checking = matches!(cli.command, Command::Check(_));
    if !serving {
        // `fewerbytes stats | head` should end quietly when head does, like any Unix
        // tool. The server keeps Rust's default (SIGPIPE ignored): a client that goes
        // away must cost an EPIPE on its socket, not the process.
        // SAFETY: setting a signal disposition to SIG_DFL before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    logging::init(
        cli.log_level,
        cli.log_format,
        if serving { "info" } else { "warn" },
    );
    if let Some(path) = cli.allow_file {
        access::set_allow_file(path);
    }
    if cli.require_server {
        control::set_require_server();
    }
    let pool = which_pool(cli.pool, cli.control_socket, &cli.command);
    match pool.and_then(|pool| run(cli.command, &pool)) {
        Ok(code) => code,
        Err(error) => {
            if let Some(interrupted) = interrupt::find(&error) {
                eprintln!(
                    "{}fewerbytes: {}",
                    logging::warning_line_prefix(),
                    interrupted_sentence(&error, interrupted)
                );
                return ExitCode::from(interrupted.exit_code());
            }
            eprintln!(
                "{}fewerbytes: error: {}",
                logging::error_line_prefix(),
                one_sentence(&error)
            );
            if checking {
                cmd_check::error_code(&error)
            } else if serving && serve::is_not_owner(&error) {
                ExitCode::from(serve::EXIT_NOT_OWNER)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// The pool a command works on: `--pool` (or `FEWERBYTES_POOL`); else, for a command
/// that reaches an existing pool and was given a control socket, the pool the server
/// on that socket holds (such a command then goes to that server or fails, never
/// opening the pool itself); else `./fewerbytes.pool`.
fn which_pool(
    pool: Option<PathBuf>,
    control_socket: Option<PathBuf>,
    command: &Command,
) -> Result<PoolPath> {
    let reaches_served_pool = !matches!(
        command,
        Command::Serve(_)
            | Command::Completions { .. }
            | Command::Man { .. }
            | Command::Pool(cmd_pool::PoolCommand::Create(_))
    );
    let asks_server = pool.is_none() && reaches_served_pool;
    if let Some(socket) = control_socket {
        control::set_control_socket(socket.clone());
        if asks_server {
            let served = control::served_pool(&socket)?;
            control::set_require_server();
            return Ok(PoolPath {
                path: served.path,
                explicit: true,
            });
        }
    }
    Ok(match pool {
        Some(path) => PoolPath {
            path: homes::pool_name(path)?,
            explicit: true,
        },
        None => PoolPath {
            path: PathBuf::from(DEFAULT_POOL_PATH),
            explicit: false,
        },
    })
}

/// An error and its causes joined by ": ", leaving out a cause whose text the message
/// before it already ends with (errors that print their source, then also return it).
fn one_sentence(error: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// The one line of a command a signal stopped: the signal, what stopped and what it
/// left (the context the command gave), and how the pool's close went.
fn interrupted_sentence(error: &anyhow::Error, interrupted: &interrupt::Interrupted) -> String {
    let mut out = interrupted.to_string();
    for cause in error.chain() {
        if cause.is::<interrupt::Interrupted>() {
            break;
        }
        out.push_str(": ");
        out.push_str(&cause.to_string());
    }
    match interrupted.closed_sentence() {
        Some(closed) => format!("{out}; {closed}."),
        None => format!("{out}."),
    }
}

fn run(command: Command, pool: &PoolPath) -> Result<ExitCode> {
    match command {
        Command::Pool(command) => cmd_pool::run(command, &pool.path),
        Command::Volume(command) => cmd_volume::run(command, &pool.path),
        Command::Stats(args) => cmd_stats::stats(args, &pool.path),
        Command::ListMetadata(args) => cmd_stats::list_metadata(args, &pool.path),
        Command::Check(args) => cmd_check::run(args, &pool.path),
        Command::Scrub(args) => cmd_scrub::run(args, &pool.path),
        Command::Serve(args) => serve::run(args, pool),
        Command::Completions { shell } => cmd_generate::completions::<Cli>(shell),
        Command::Man { dir } => cmd_generate::man_pages::<Cli>(&dir),
    }
}
