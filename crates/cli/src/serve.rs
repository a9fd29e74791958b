//! `serve`: every volume of a pool over NBD, plus the control socket that lets the
//! other commands manage the pool while this process holds it.
//!
//! With no pool at the default path, a default one is made first (a sparse 16 GiB
//! file with one volume, `disk0`), so one command gives a newcomer a served disk.
//! With `--read-only` the pool is opened read-only: nothing is written to it, not
//! even a checkpoint, so a pool on a full file system can be served and read out.
//! SIGINT or SIGTERM stops accepting, closes connections, takes the final checkpoint
//! (none when read-only) and removes the sockets; a second signal exits at once. The stop never goes through
//! a socket's path (a signal writes to a pipe the main thread reads, and the accept
//! loops are woken by shutdown(2) on their listening descriptors; `interrupt` holds the
//! handler), so it works even
//! when the socket files were deleted. Under a service manager, `READY=1` is sent once
//! every socket accepts and `STOPPING=1` when the stop begins (see `notify`).

use anyhow::{bail, Context, Result};
use fewerbytes_engine::storage::{StorageError, TakeOver};
use fewerbytes_engine::{CreateOptions, EngineError, OpenOptions, Pool, SavedIndex};
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;

use crate::socket_trust::trusted_uids;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use crate::access::{allow_path, AllowFile};
use crate::control::{open_pool, open_pool_read_only, Endpoints, Served};
use crate::control_server::ControlServer;
use crate::low_water::LowWater;
use crate::notify::Notifier;
use crate::size::{format_size, round_down};
use crate::PoolPath;
use fewerbytes_nbd::{pool_exports, Server, ServerConfig, TlsCredentials, TlsMode, TlsSettings};

/// Size of the pool file made when `serve` finds none at the default path: sparse, so
/// it costs only what is written, and large enough for a real VM disk.
const DEFAULT_POOL_BYTES: u64 = 16 << 30;
/// The volume made in a default pool.
const DEFAULT_VOLUME: &str = "disk0";
/// Volume sizes of a default pool are whole MiB, which every client accepts.
const DEFAULT_VOLUME_ALIGN_BYTES: u64 = 1 << 20;
/// Where NBD clients connect unless told otherwise: loopback only; the standard port.
const DEFAULT_TCP_ADDR: &str = "127.0.0.1:10809";

/// `serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// Unix socket to serve on [default: <pool>.sock beside the pool].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// TCP address to serve on; anything but loopback must be asked for here.
    #[arg(long, value_name = "ADDR:PORT", env = "FEWERBYTES_LISTEN", default_value = DEFAULT_TCP_ADDR, conflicts_with = "no_tcp")]
    listen: String,
    /// Serve on the unix socket only.
    #[arg(long)]
    no_tcp: bool,
    /// The volume the empty export name ("") opens [default: the only volume].
    #[arg(long, value_name = "NAME")]
    default_volume: Option<String>,
    /// Refuse writes (clients get EPERM), and write nothing to the pool: it is opened
    /// read-only, so volume changes through the control socket are refused too.
    #[arg(long)]
    read_only: bool,
    /// Do not give blocks freed by trims, overwrites, deletes and compaction back to
    /// the device (by default each checkpoint discards what it freed: a hole punched
    /// in a pool file, BLKDISCARD on a block device). Nothing is stored in the pool.
    #[arg(long)]
    no_discard: bool,
    /// Log a warning when the pool's Use% (as `stats` shows it) reaches PERCENT, and
    /// again after it fell below and reaches it again; `stats` shows the mark.
    #[arg(long, value_name = "PERCENT", default_value_t = crate::low_water::DEFAULT_WARN_AT_PERCENT, value_parser = crate::low_water::parse_percent)]
    warn_at: u8,
    /// Take the pool over from a server that died or is cut off (a pool on RBD): its
    /// client is blocklisted on the Ceph cluster, so that nothing it still sends is
    /// accepted, and its lock broken; then the pool opens as usual (the journal
    /// replayed). Only when that server is known to be down or fenced: the old server,
    /// if it wakes, loses every write it had not flushed and stops.
    #[arg(long)]
    take_over: bool,
    /// With --take-over: seconds the old server's client stays blocklisted
    /// [default: the cluster's, `mon_osd_blocklist_default_expire`, one hour].
    #[arg(long, value_name = "SECONDS", requires = "take_over", value_parser = clap::value_parser!(u64).range(1..=u64::from(u32::MAX)))]
    blocklist_expire: Option<u64>,
    /// Worker threads for hashing and compression [default: one per CPU].
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Memory for the dedup index while serving, instead of the window the pool
    /// records: a smaller budget keeps a sample of the stored blocks (`pool info`
    /// shows the window it gives). The index is rebuilt at every open.
    #[arg(long, value_parser = crate::size::parse_size_arg, value_name = "S")]
    index_memory: Option<u64>,
    /// Microseconds a connection polls for a client's next request before sleeping,
    /// while the client sends back to back with nothing in flight (queue depth 1:
    /// halves read latency on a VM); 0 never polls, for hosts that want the CPU.
    #[arg(long, value_name = "US", default_value_t = fewerbytes_nbd::DEFAULT_READ_SPIN.as_micros() as u64)]
    poll_us: u64,
    /// Close a connection after this many seconds with no request and nothing in
    /// flight; 0 never closes one (the default: an idle guest disk fails its next I/O
    /// when closed, unless its client reconnects).
    #[arg(long, value_name = "SECONDS", default_value_t = fewerbytes_nbd::DEFAULT_IDLE_TIMEOUT.map_or(0, |t| t.as_secs()))]
    idle_timeout: u64,
    /// Connections at once from one local user (by uid) or one remote host (by IP);
    /// root and the pool's owner are not limited.
    #[arg(long, value_name = "N", default_value_t = fewerbytes_nbd::DEFAULT_MAX_CONNECTIONS_PER_SOURCE)]
    max_connections_per_source: usize,
    /// TLS (NBD STARTTLS) on every endpoint: off, on (offered; clients may stay in
    /// clear) or require [default: require on a --listen address beyond loopback, or
    /// on TCP whenever credentials are given; off on the unix socket and loopback].
    #[arg(long, value_name = "MODE")]
    tls: Option<TlsModeArg>,
    /// x509 credentials: a directory with server-cert.pem, server-key.pem and (for
    /// --tls-verify-peer) ca-cert.pem, as qemu's tls-creds-x509 and nbdkit read it.
    #[arg(long, value_name = "DIR", conflicts_with = "tls_psk")]
    tls_certificates: Option<PathBuf>,
    /// Require a client certificate signed by DIR/ca-cert.pem; its subject CN is the
    /// client's identity for `volume allow`.
    #[arg(long, requires = "tls_certificates")]
    tls_verify_peer: bool,
    /// PSK credentials: psktool's file of `identity:hexkey` lines; the identity a
    /// client uses is its identity for `volume allow`.
    #[arg(long, value_name = "FILE")]
    tls_psk: Option<PathBuf>,
}

/// `--tls`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum TlsModeArg {
    Off,
    On,
    Require,
}

impl From<TlsModeArg> for TlsMode {
    fn from(mode: TlsModeArg) -> TlsMode {
        match mode {
            TlsModeArg::Off => TlsMode::Off,
            TlsModeArg::On => TlsMode::On,
            TlsModeArg::Require => TlsMode::Require,
        }
    }
}

/// The server's TLS from the command line: credentials loaded, the mode of each
/// endpoint chosen. `None`: no TLS anywhere.
fn tls_settings(args: &ServeArgs) -> Result<Option<TlsSettings>> {
    let credentials = match (&args.tls_certificates, &args.tls_psk) {
        (Some(dir), _) => Some(
            TlsCredentials::x509(dir, args.tls_verify_peer).with_context(|| {
                format!("could not load the x509 credentials in {}", dir.display())
            })?,
        ),
        (None, Some(file)) => Some(
            TlsCredentials::psk(file)
                .with_context(|| format!("could not load the PSK file {}", file.display()))?,
        ),
        (None, None) => None,
    };
    let beyond_loopback = !args.no_tcp && !is_loopback(&args.listen);
    let (tcp, unix) = match (args.tls, &credentials) {
        (Some(mode), _) => (TlsMode::from(mode), TlsMode::from(mode)),
        (None, Some(_)) => (TlsMode::Require, TlsMode::Off),
        (None, None) if beyond_loopback => bail!(
            "--listen {} reaches beyond this host, where TLS is required by default: give \
             --tls-certificates DIR or --tls-psk FILE (README: \"Serving over TLS\"), or \
             --tls off to serve every volume in clear to anyone who reaches the port",
            args.listen
        ),
        (None, None) => (TlsMode::Off, TlsMode::Off),
    };
    let Some(credentials) = credentials else {
        if tcp != TlsMode::Off {
            bail!("--tls on|require needs credentials: --tls-certificates DIR or --tls-psk FILE");
        }
        return Ok(None);
    };
    Ok(Some(TlsSettings {
        credentials: Arc::new(credentials),
        tcp,
        unix,
    }))
}

/// Whether every address `listen` resolves to is loopback.
fn is_loopback(listen: &str) -> bool {
    use std::net::ToSocketAddrs;
    listen
        .to_socket_addrs()
        .map(|mut addrs| addrs.all(|a| a.ip().is_loopback()))
        .unwrap_or(false)
}

/// Run the server until SIGINT or SIGTERM.
pub fn run(args: ServeArgs, pool_path: &PoolPath) -> Result<ExitCode> {
    // First: it changes the environment, which must happen before any thread starts.
    let notifier = Notifier::from_env();
    let path = &pool_path.path;
    if !path.exists() && !pool_path.explicit {
        create_default_pool(path)?;
    }
    let stop =
        crate::interrupt::install().context("could not install the SIGINT/SIGTERM handlers")?;
    let options = OpenOptions {
        threads: args.threads,
        index_memory_bytes: args.index_memory,
        no_discard: args.no_discard,
        hold_index_build: false,
        take_over: args.take_over.then_some(TakeOver {
            blocklist_expire_seconds: args.blocklist_expire,
        }),
        saved_index: SavedIndex::Beside,
    };
    // A read-only server writes nothing to the pool (no checkpoint at open or close),
    // so it can serve a pool whose file system is full.
    if args.take_over && !crate::homes::is_elsewhere(path) {
        bail!(
            "--take-over is for a pool on RBD images; a pool file is locked by the \
             kernel, and its lock goes with the process that held it"
        );
    }
    if args.take_over && args.read_only {
        bail!("--take-over opens the pool to write it; leave out --read-only");
    }
    let pool = if args.read_only {
        open_pool_read_only(path, &options)?
    } else {
        open_pool(path, &options).map_err(|e| owned_hint(e, path))?
    };
    // A pool taken over by another server stops this one (below), rather than have
    // it serve reads of a pool it no longer owns.
    let fenced_why = Arc::new(std::sync::Mutex::new(String::new()));
    let told = Arc::clone(&fenced_why);
    pool.on_latch(Box::new(move |latched| {
        if latched.fenced {
            if let Ok(mut why) = told.lock() {
                why.clone_from(&latched.reason);
            }
            crate::interrupt::wake_fenced();
        }
    }));
    crate::homes::remember_id(path, pool.id());
    let served = start(&args, path, &pool);
    let Started {
        server,
        control,
        socket,
        tcp,
        low_water,
    } = match served {
        Ok(parts) => parts,
        Err(e) => {
            if let Err(close_error) = pool.close() {
                tracing::warn!("closing the pool after a failed start: {close_error:#}");
            }
            return Err(e);
        }
    };
    let watcher = match low_water.watch(Arc::clone(&pool)) {
        Ok(watcher) => Some(watcher),
        Err(e) => {
            tracing::warn!("cannot watch --warn-at {}%: {e:#}", args.warn_at);
            None
        }
    };
    if notifier.is_active() {
        notifier.ready(&ready_status(path, &pool, &socket, tcp.as_deref()));
    }
    let signal = match stop.wait() {
        crate::interrupt::Woken::Signal(signal) => signal,
        crate::interrupt::Woken::Fenced => {
            let why = fenced_why.lock().map(|why| why.clone()).unwrap_or_default();
            return stop_fenced(&pool, &why, server, control, watcher);
        }
    };
    tracing::info!("{signal} received: stopping");
    let stopping = if args.read_only {
        "Stopping: closing connections (the pool was opened read-only: nothing to write)"
    } else {
        "Stopping: closing connections and taking the final checkpoint"
    };
    println!("{stopping}.");
    notifier.stopping(stopping);
    control.stop();
    drop(watcher);
    server.shutdown();
    drop(server);
    let closed = pool
        .close()
        .with_context(|| format!("could not close pool {}", path.display()));
    // The NBD server removed its socket file (if it was still its own).
    closed?;
    if args.read_only {
        println!(
            "Pool {} closed (opened read-only: nothing written).",
            path.display()
        );
    } else {
        println!("Pool {} closed cleanly.", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// Stop a server whose pool another server took over: connections are closed (they
/// reconnect to the new owner), nothing is written (the pool is latched, and the
/// cluster refuses this client anyway), and the exit is an error.
fn stop_fenced(
    pool: &Arc<Pool>,
    why: &str,
    server: Arc<Server>,
    control: ControlServer,
    watcher: Option<crate::low_water::Watcher>,
) -> Result<ExitCode> {
    tracing::error!("the pool was taken over by another server: stopping ({why})");
    control.stop();
    drop(watcher);
    server.shutdown();
    drop(server);
    // The close fails (latched), or writes nothing (opened read-only): nothing is
    // checkpointed, nothing more is written.
    let _ = Arc::clone(pool).close();
    Err(TakenOver(why.to_string()).into())
}

/// The exit code of a `serve` that does not own its pool: refused because another
/// server holds it, or stopped because another server took it over. Apart from 1
/// so that a service manager does not start it again and again
/// (`RestartPreventExitStatus=` in the unit).
pub const EXIT_NOT_OWNER: u8 = 3;

/// `serve` stopped: another server took the pool over.
#[derive(Debug)]
struct TakenOver(String);

impl std::fmt::Display for TakenOver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stopped serving: the pool is no longer this server's (another server took it \
             over; what this one had not flushed is lost): {}",
            self.0
        )
    }
}

impl std::error::Error for TakenOver {}

/// Whether `error` says the pool is another server's: held by it at open, or taken
/// over by it while served ([`EXIT_NOT_OWNER`]).
pub fn is_not_owner(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause.is::<TakenOver>()
            || matches!(
                cause.downcast_ref::<EngineError>(),
                Some(EngineError::Io(StorageError::Owned { .. }))
            )
    })
}

/// Add to the refusal of a pool another server holds how to take it over.
fn owned_hint(error: anyhow::Error, path: &Path) -> anyhow::Error {
    if !is_not_owner(&error) {
        return error;
    }
    error.context(format!(
        "another server holds pool {}: stop it, or, if its host is down or cut off and \
         will not be back, take the pool over with `fewerbytes --pool {} serve --take-over` \
         (which blocklists the other server's client on the cluster first)",
        path.display(),
        path.display()
    ))
}

/// What `systemctl status` shows while serving: the pool, its volumes, the endpoints.
fn ready_status(pool_path: &Path, pool: &Pool, socket: &Path, tcp: Option<&str>) -> String {
    let volumes = pool.list_volumes().len();
    let pool_path = if crate::homes::is_elsewhere(pool_path) {
        pool_path.to_path_buf()
    } else {
        std::path::absolute(pool_path).unwrap_or_else(|_| pool_path.to_path_buf())
    };
    let mut status = format!(
        "Serving {volumes} volume{} of {} on {}",
        if volumes == 1 { "" } else { "s" },
        pool_path.display(),
        socket.display()
    );
    if let Some(addr) = tcp {
        status.push_str(&format!(" and tcp {addr}"));
    }
    status
}

/// What `start` leaves running.
struct Started {
    server: Arc<Server>,
    control: ControlServer,
    /// The unix socket, absolute.
    socket: PathBuf,
    /// The TCP address bound, unless `--no-tcp`.
    tcp: Option<String>,
    /// The `--warn-at` mark.
    low_water: Arc<LowWater>,
}

/// Who may open which volume: the pool's flags and its allow file, checked now (the
/// log names each limited volume that stays closed, and why). The policy holds the
/// pool weakly: the server must not keep it open past its close; a pool gone is closed.
fn allow_policy(pool_path: &Path, pool: &Arc<Pool>, read_only: bool) -> Result<AllowFile> {
    let path = allow_path(pool_path)?;
    crate::access::check_at_start(pool, &path, read_only);
    let weak = Arc::downgrade(pool);
    Ok(AllowFile::new(
        path,
        format!("{:016x}", pool.id()),
        Box::new(move |name| {
            weak.upgrade()
                .is_none_or(|pool| pool.volume_limited(name).unwrap_or(false))
        }),
    ))
}

/// Listen on every endpoint and print how to connect.
fn start(args: &ServeArgs, pool_path: &Path, pool: &Arc<Pool>) -> Result<Started> {
    if let Some(name) = &args.default_volume {
        if !pool.list_volumes().iter().any(|v| &v.name == name) {
            bail!("--default-volume names '{name}', which is not a volume of this pool");
        }
    }
    for volume in pool.list_volumes().iter().filter(|v| v.incomplete) {
        tracing::warn!("{}", fewerbytes_nbd::incomplete_refusal(&volume.name));
    }
    let tls = tls_settings(args)?;
    let tls_tcp = tls.as_ref().map_or(TlsMode::Off, |t| t.tcp);
    let config = ServerConfig {
        read_only: args.read_only,
        default_export: args.default_volume.clone(),
        read_spin: std::time::Duration::from_micros(args.poll_us),
        tls,
        access: Some(Arc::new(allow_policy(pool_path, pool, args.read_only)?)),
        idle_timeout: (args.idle_timeout > 0)
            .then(|| std::time::Duration::from_secs(args.idle_timeout)),
        max_connections_per_source: args.max_connections_per_source,
        trusted_uids: trusted_uids(pool_path)?,
        ..ServerConfig::default()
    };
    let exports = pool_exports(Arc::clone(pool), args.default_volume.clone());
    let server = Server::new(config, exports);

    let socket = std::path::absolute(
        args.socket
            .clone()
            .map_or_else(|| crate::homes::run_file(pool_path, ".sock"), Ok)?,
    )
    .context("could not resolve the socket path")?;
    crate::homes::make_home(pool_path, &socket)?;
    clear_stale_socket(&socket, pool_path)?;
    server
        .listen_unix(&socket)
        .with_context(|| format!("could not listen on {}", socket.display()))?;
    let tcp = if args.no_tcp {
        None
    } else {
        let addr = match server.listen_tcp(&args.listen) {
            Ok(addr) => addr,
            Err(e) => {
                // Leave no socket file behind that no server answers on.
                let _ = std::fs::remove_file(&socket);
                return Err(e).with_context(|| format!("could not listen on {}", args.listen));
            }
        };
        if !addr.ip().is_loopback() && tls_tcp != TlsMode::Require {
            tracing::warn!(
                "listening on {addr}, beyond this host, without TLS required (--tls {}): \
                 anyone who reaches the port can read and write every volume that has no \
                 `volume allow` limit; keep it on a trusted network or firewalled, require \
                 TLS, or serve on the unix socket only (--no-tcp)",
                if tls_tcp == TlsMode::On { "on" } else { "off" }
            );
        }
        Some(addr.to_string())
    };
    let endpoints = Endpoints {
        unix_socket: Some(socket.clone()),
        tcp: tcp.clone(),
    };
    let low_water = Arc::new(LowWater::new(args.warn_at));
    let served = Arc::new(Served {
        endpoints,
        server: Arc::clone(&server),
        low_water: Arc::clone(&low_water),
    });
    let control = match ControlServer::start(pool_path, Arc::clone(pool), served) {
        Ok(control) => control,
        Err(e) => {
            let _ = std::fs::remove_file(&socket);
            return Err(e);
        }
    };
    crate::banner::print(&crate::banner::Banner {
        pool_path,
        pool,
        read_only: args.read_only,
        warn_at: args.warn_at,
        default_volume: args.default_volume.as_deref(),
        tls_asked: args.tls.is_some(),
        socket: &socket,
        tcp: tcp.as_deref().map(|addr| (addr, tls_tcp)),
        control: control.path(),
    });
    Ok(Started {
        server,
        control,
        socket,
        tcp,
        low_water,
    })
}

/// Create the default pool and its one volume, sized to what the pool can address.
fn create_default_pool(path: &Path) -> Result<()> {
    let info = Pool::create(&CreateOptions {
        path: path.to_path_buf(),
        size_bytes: Some(DEFAULT_POOL_BYTES),
        ..CreateOptions::default()
    })
    .with_context(|| format!("could not create the default pool {}", path.display()))?;
    println!("No pool at {}: created one.", path.display());
    println!("{}", crate::cmd_pool::created_sentence(&info));
    let volume_bytes = round_down(info.addressable_bytes, DEFAULT_VOLUME_ALIGN_BYTES);
    let pool = open_pool(path, &OpenOptions::default())?;
    let created = pool.create_volume(DEFAULT_VOLUME, volume_bytes);
    let closed = pool.close();
    let volume = created.with_context(|| format!("could not create volume '{DEFAULT_VOLUME}'"))?;
    closed.with_context(|| format!("could not close pool {}", path.display()))?;
    println!(
        "Volume '{}' created: {}.",
        volume.name,
        format_size(volume.size_bytes)
    );
    Ok(())
}

/// Remove a socket file nobody listens on, made by root or the pool's owner; refuse
/// one a live server answers on, and one another user made (`socket_trust`).
fn clear_stale_socket(path: &Path, pool_path: &Path) -> Result<()> {
    let metadata = match std::fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("could not inspect {}", path.display())),
    };
    if !metadata.file_type().is_socket() {
        bail!(
            "{} exists and is not a socket; choose another --socket",
            path.display()
        );
    }
    let trusted = trusted_uids(pool_path)?;
    if let Ok(live) = UnixStream::connect(path) {
        crate::socket_trust::check_peer(&live, path, pool_path, &trusted)?;
        bail!(
            "another server already listens on {}; stop it or choose another --socket",
            path.display()
        );
    }
    crate::socket_trust::check_owner(path, pool_path, &trusted)?;
    std::fs::remove_file(path)
        .with_context(|| format!("could not remove stale socket {}", path.display()))
}
