//! The control socket: how commands reach a pool that `serve` holds.
//!
//! A pool is opened by one process at a time. While `fewerbytes serve` holds it, the
//! server also listens on its control socket: `<pool>.ctl` unless `--control-socket`
//! (or `FEWERBYTES_CONTROL_SOCKET`) names another path, as the systemd unit does with
//! `/run/fewerbytes/NAME.ctl` (a unix socket, mode 0600, peers must share its user id).
//! Every management command first tries that socket: if a server answers *for the same
//! pool*, the request goes there as one JSON line and the reply comes back as one JSON
//! line (`{"ok":true,"value":…}` or `{"ok":false,"error":"…"}`); if not, the command
//! opens the pool itself. Both paths run the same [`execute`], so the output is the
//! same. The server's side is `control_server`.
//!
//! The socket is found by the pool's path, but a path can change hands: after the
//! served pool file is renamed and a new pool made at its old path, `<pool>.ctl`
//! still leads to the server of the renamed one. So every request carries the
//! identity of the file the command was pointed at ([`PoolIdentity`]: device and
//! inode), and a server refuses a request for any other file with `wrong_pool` set;
//! a command that meets such a server opens the pool at its path itself.
//!
//! A command given a control socket and no pool first asks the server which pool it
//! holds ([`served_pool`]: the one request sent without an identity), then goes on
//! as if that path had been named, through that server only.

use anyhow::{anyhow, bail, Context, Result};
use fewerbytes_engine::{
    AuditReport, Compression, EngineError, IndexMode, OpenOptions, Pool, PoolInfo, PoolStats,
    Provisioning, Region, SavedIndex, VolumeInfo,
};
use fewerbytes_nbd::{Server, ServerStats};
use serde::{Deserialize, Serialize};
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use crate::socket_trust::{check_owner, check_peer, trusted_uids};

/// Which pool a name leads to: device and inode of a regular file, or `u64::MAX` and
/// the device number of a block device (whatever node names it); for a pool that is
/// not a file (an RBD image), its id from its super block, with `dev` and `ino` 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolIdentity {
    /// `st_dev`, or `u64::MAX` for a block device.
    pub dev: u64,
    /// `st_ino`, or `st_rdev` for a block device.
    pub ino: u64,
    /// The pool's id (`pool info`), for a pool that is not a file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_id: Option<String>,
}

impl PoolIdentity {
    /// The identity of the pool named `path` now (a file's, following symbolic links;
    /// an RBD pool's id, read from its device).
    pub fn of(path: &Path) -> Result<PoolIdentity> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        if crate::homes::is_elsewhere(path) {
            return Ok(PoolIdentity {
                dev: 0,
                ino: 0,
                pool_id: Some(crate::homes::pool_id(path)?),
            });
        }
        let meta = std::fs::metadata(path)?;
        Ok(if meta.file_type().is_block_device() {
            PoolIdentity {
                dev: u64::MAX,
                ino: meta.rdev(),
                pool_id: None,
            }
        } else {
            PoolIdentity {
                dev: meta.dev(),
                ino: meta.ino(),
                pool_id: None,
            }
        })
    }
}

/// What goes over the socket: a request and the pool it is meant for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope {
    /// The file the client was pointed at; a server holding another refuses.
    #[serde(default)]
    pub pool: Option<PoolIdentity>,
    /// The request.
    #[serde(flatten)]
    pub request: Request,
}

/// One management request.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    /// Whether a server answers for this pool (answered `Done`).
    Ping,
    /// Which pool the server holds (answered `ServedPool`, by a server only). Sent
    /// with no pool identity: a command given only `--control-socket` learns here
    /// which pool it works on.
    WhichPool,
    /// `pool info`.
    PoolInfo,
    /// `volume list`.
    ListVolumes,
    /// `volume create`.
    CreateVolume {
        name: String,
        size_bytes: u64,
        /// What it reserves (absent: thick).
        #[serde(default, skip_serializing_if = "is_thick")]
        provisioning: Provisioning,
    },
    /// `volume resize`.
    ResizeVolume {
        name: String,
        size_bytes: u64,
        allow_shrink: bool,
    },
    /// `volume clone`.
    CloneVolume {
        src: String,
        dst: String,
        /// What the clone reserves (absent: thick).
        #[serde(default, skip_serializing_if = "is_thick")]
        provisioning: Provisioning,
    },
    /// `volume set`: change what a volume reserves.
    SetVolume {
        name: String,
        provisioning: Provisioning,
    },
    /// `volume delete`.
    DeleteVolume { name: String, force: bool },
    /// `volume rename`.
    RenameVolume { name: String, new_name: String },
    /// `volume rollback`: `name` takes what `from` holds.
    RollbackVolume { name: String, from: String },
    /// `volume snapshot`: take snapshot `snapshot` of volume `name`.
    SnapshotVolume { name: String, snapshot: String },
    /// `volume snapshot list`: the snapshots of volume `name`.
    ListSnapshots { name: String },
    /// `volume diff`: the byte ranges of `name` that differ from `from`.
    DiffVolume { name: String, from: String },
    /// `volume allow`: limit a volume to the allow list's identities (the pool's
    /// flag), or lift the limit.
    LimitVolume { name: String, limited: bool },
    /// `pool set --compression`.
    SetCompression { compression: Compression },
    /// `pool set --index`, `--index-memory`: recorded, used from the next open.
    SetIndex {
        mode: Option<IndexMode>,
        memory_bytes: Option<u64>,
    },
    /// `stats`.
    Stats,
    /// `list-metadata`.
    Regions,
    /// `check`.
    Audit,
    /// `pool grow`.
    GrowPool,
    /// Where the server serves NBD (answered by a server only, never locally).
    Endpoints,
    /// `scrub start`.
    ScrubStart { rate_bytes_per_s: u64 },
    /// `scrub pause`.
    ScrubPause,
    /// `scrub resume`.
    ScrubResume,
    /// `scrub status`.
    ScrubStatus,
    /// `volume send`: the server writes the stream on this connection, after the
    /// `Streaming` answer, in frames (`stream_socket`).
    SendVolume(crate::stream_request::SendRequest),
    /// `volume receive`: the connection carries the stream to the server, after the
    /// `Streaming` answer (`stream_socket`).
    ReceiveVolume(crate::stream_request::ReceiveRequest),
}

fn is_thick(p: &Provisioning) -> bool {
    *p == Provisioning::Thick
}

/// A provisioning as a person would say it: "thick", "thin", "reserving 2.00 GiB".
pub fn provisioning_in_words(p: Provisioning) -> String {
    match p {
        Provisioning::Thick => "thick".into(),
        Provisioning::Reserve(0) => "thin".into(),
        Provisioning::Reserve(bytes) => {
            format!("reserving {}", crate::size::format_size(bytes))
        }
    }
}

impl Request {
    /// The request as a person would say it, for the server's log.
    pub fn in_words(&self) -> String {
        match self {
            Request::Ping => "ping".into(),
            Request::WhichPool => "which pool".into(),
            Request::PoolInfo => "pool info".into(),
            Request::ListVolumes => "volume list".into(),
            Request::CreateVolume {
                name,
                size_bytes,
                provisioning,
            } => format!(
                "create volume '{name}' of {} ({})",
                crate::size::format_size(*size_bytes),
                provisioning_in_words(*provisioning)
            ),
            Request::ResizeVolume {
                name,
                size_bytes,
                allow_shrink,
            } => format!(
                "resize volume '{name}' to {}{}",
                crate::size::format_size(*size_bytes),
                if *allow_shrink {
                    " (shrink allowed)"
                } else {
                    ""
                }
            ),
            Request::CloneVolume {
                src,
                dst,
                provisioning,
            } => format!(
                "clone volume '{src}' as '{dst}' ({})",
                provisioning_in_words(*provisioning)
            ),
            Request::SetVolume { name, provisioning } => format!(
                "make volume '{name}' {}",
                provisioning_in_words(*provisioning)
            ),
            Request::DeleteVolume { name, force } => format!(
                "delete volume '{name}'{}",
                if *force { " (forced)" } else { "" }
            ),
            Request::RenameVolume { name, new_name } => {
                format!("rename volume '{name}' to '{new_name}'")
            }
            Request::RollbackVolume { name, from } => {
                format!("roll volume '{name}' back to '{from}'")
            }
            Request::DiffVolume { name, from } => {
                format!("changes of volume '{name}' since '{from}'")
            }
            Request::SnapshotVolume { name, snapshot } => {
                format!("take snapshot '{snapshot}' of volume '{name}'")
            }
            Request::ListSnapshots { name } => format!("snapshots of volume '{name}'"),
            Request::LimitVolume {
                name,
                limited: true,
            } => {
                format!("limit volume '{name}' to the allow list's identities")
            }
            Request::LimitVolume {
                name,
                limited: false,
            } => format!("open volume '{name}' to any client"),
            Request::SetCompression { compression } => {
                format!("set the pool's compression to {compression}")
            }
            Request::SetIndex { .. } => "set the pool's dedup index".into(),
            Request::Stats => "stats".into(),
            Request::Regions => "list-metadata".into(),
            Request::Audit => "check".into(),
            Request::GrowPool => "pool grow".into(),
            Request::Endpoints => "endpoints".into(),
            Request::ScrubStart { rate_bytes_per_s } => match rate_bytes_per_s {
                0 => "start a scrub (unthrottled)".into(),
                r => format!(
                    "start a scrub at {}/s at most",
                    crate::size::format_size(*r)
                ),
            },
            Request::ScrubPause => "pause the scrub".into(),
            Request::ScrubResume => "resume the scrub".into(),
            Request::ScrubStatus => "scrub status".into(),
            Request::SendVolume(send) => match &send.from {
                Some(base) => format!("send volume '{}' (changes since '{base}')", send.name),
                None => format!("send volume '{}'", send.name),
            },
            Request::ReceiveVolume(receive) if receive.abandon => {
                format!("discard the interrupted receive of '{}'", receive.name)
            }
            Request::ReceiveVolume(receive) => format!("receive volume '{}'", receive.name),
        }
    }

    /// Whether the request changes the pool (logged at INFO; queries at DEBUG).
    pub fn changes_pool(&self) -> bool {
        matches!(
            self,
            Request::CreateVolume { .. }
                | Request::ResizeVolume { .. }
                | Request::CloneVolume { .. }
                | Request::SetVolume { .. }
                | Request::DeleteVolume { .. }
                | Request::RenameVolume { .. }
                | Request::RollbackVolume { .. }
                | Request::SnapshotVolume { .. }
                | Request::GrowPool
                | Request::SetCompression { .. }
                | Request::ScrubStart { .. }
                | Request::ScrubPause
                | Request::ScrubResume
                | Request::ReceiveVolume(_)
        )
    }
}

/// What a request returns.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", content = "data", rename_all = "kebab-case")]
pub enum Answer {
    /// Pool geometry and settings (boxed: by far the largest answer).
    PoolInfo(Box<PoolInfo>),
    /// Every volume.
    Volumes(Vec<VolumeInfo>),
    /// The volume just created, resized or cloned.
    Volume(VolumeInfo),
    /// Done, nothing to report (delete).
    Done,
    /// Statistics.
    Stats(Box<StatsReport>),
    /// Metadata regions.
    Regions(Vec<Region>),
    /// Audit result.
    Audit(AuditReport),
    /// Where the server serves NBD.
    Endpoints(Endpoints),
    /// What `pool grow` did.
    Grown(fewerbytes_engine::GrowReport),
    /// The scrub's progress and report.
    Scrub(fewerbytes_engine::ScrubStatus),
    /// The pool a server holds.
    ServedPool(ServedPool),
    /// Byte ranges (offset, length) that changed (`volume diff`), in order.
    Changes(Vec<(u64, u64)>),
    /// A send or receive begins: the stream's frames follow on this connection.
    Streaming,
    /// A send or receive ended well: its summary line for the person who asked.
    Streamed(String),
}

/// The pool a server holds, as it tells a command that named only its control socket.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServedPool {
    /// The pool's path, absolute (the server resolved it when it started).
    pub path: PathBuf,
    /// The file at that path when the server started.
    pub identity: PoolIdentity,
}

/// What `stats` reports: the pool's statistics and, when served, the NBD server's.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatsReport {
    /// The engine's statistics (its fields at the top level of `stats --json`).
    #[serde(flatten)]
    pub pool: PoolStats,
    /// Connections, requests in flight and limits of the NBD server holding the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_server: Option<NbdServerStats>,
    /// The server's `--warn-at` mark and whether the pool is past it (served only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warn_at: Option<crate::low_water::WarnAt>,
}

/// The NBD server's gauges and limits (`fewerbytes_nbd::ServerStats`, serializable).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NbdServerStats {
    /// Connections open.
    pub connections: u64,
    /// Requests read and not yet answered.
    pub inflight_requests: u64,
    /// Bytes of buffers those requests hold.
    pub inflight_buffer_bytes: u64,
    /// Every named limit and its value.
    pub limits: Vec<(String, u64)>,
}

impl From<ServerStats> for NbdServerStats {
    fn from(stats: ServerStats) -> NbdServerStats {
        NbdServerStats {
            connections: stats.connections as u64,
            inflight_requests: stats.inflight_requests as u64,
            inflight_buffer_bytes: stats.inflight_buffer_bytes,
            limits: stats.limits,
        }
    }
}

/// What a serving process adds to the control socket's answers.
pub struct Served {
    /// Where clients connect.
    pub endpoints: Endpoints,
    /// The NBD server, for its statistics.
    pub server: Arc<Server>,
    /// The `--warn-at` mark.
    pub low_water: Arc<crate::low_water::LowWater>,
}

/// Where a server listens for NBD clients.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Endpoints {
    /// The unix socket, if any.
    pub unix_socket: Option<PathBuf>,
    /// The TCP address, if any.
    pub tcp: Option<String>,
}

impl Endpoints {
    /// The best URI for one export: the unix socket if there is one, else TCP.
    pub fn uri(&self, export: &str) -> Option<String> {
        match (&self.unix_socket, &self.tcp) {
            (Some(socket), _) => Some(format!("nbd+unix:///{export}?socket={}", socket.display())),
            (None, Some(addr)) => Some(format!("nbd://{addr}/{export}")),
            (None, None) => None,
        }
    }
}

/// The reply line.
#[derive(Debug, Serialize, Deserialize)]
pub struct Reply {
    /// Whether the request succeeded.
    pub ok: bool,
    /// The answer, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<Answer>,
    /// One sentence, when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Set when the server holds another pool than the one the request names.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wrong_pool: bool,
}

/// A server answered for another pool than the file the command was pointed at.
#[derive(Debug)]
pub struct WrongPool(String);

impl std::fmt::Display for WrongPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WrongPool {}

/// Run a request on an open pool: the one place both paths go through.
pub fn execute(pool: &Pool, request: &Request) -> std::result::Result<Answer, EngineError> {
    Ok(match request {
        Request::Ping => Answer::Done,
        Request::WhichPool => {
            return Err(EngineError::Refused(
                "the pool is not being served, so no server names it".into(),
            ))
        }
        Request::PoolInfo => Answer::PoolInfo(Box::new(pool.info())),
        Request::ListVolumes => Answer::Volumes(pool.list_volumes()),
        Request::CreateVolume {
            name,
            size_bytes,
            provisioning,
        } => Answer::Volume(pool.create_volume_with(name, *size_bytes, *provisioning)?),
        Request::ResizeVolume {
            name,
            size_bytes,
            allow_shrink,
        } => Answer::Volume(pool.resize_volume(name, *size_bytes, *allow_shrink)?),
        Request::CloneVolume {
            src,
            dst,
            provisioning,
        } => Answer::Volume(pool.clone_volume_with(src, dst, *provisioning)?),
        Request::SetVolume { name, provisioning } => {
            Answer::Volume(pool.set_provisioning(name, *provisioning)?)
        }
        Request::DeleteVolume { name, force } => {
            pool.delete_volume(name, *force)?;
            Answer::Done
        }
        Request::RenameVolume { name, new_name } => {
            Answer::Volume(pool.rename_volume(name, new_name)?)
        }
        Request::RollbackVolume { name, from } => Answer::Volume(pool.rollback_volume(name, from)?),
        Request::SnapshotVolume { name, snapshot } => {
            Answer::Volume(pool.snapshot_volume(name, snapshot)?)
        }
        Request::ListSnapshots { name } => Answer::Volumes(pool.snapshots(name)?),
        Request::DiffVolume { name, from } => {
            let mut changes: Vec<(u64, u64)> = Vec::new();
            let mut at = 0;
            for run in pool.changed_extents(name, from)? {
                if run.changed {
                    changes.push((at, run.len_bytes));
                }
                at += run.len_bytes;
            }
            Answer::Changes(changes)
        }
        Request::LimitVolume { name, limited } => {
            Answer::Volume(pool.set_volume_limited(name, *limited)?)
        }
        Request::SetCompression { compression } => {
            pool.set_compression(*compression)?;
            Answer::PoolInfo(Box::new(pool.info()))
        }
        Request::SetIndex { mode, memory_bytes } => {
            pool.set_index(*mode, *memory_bytes)?;
            Answer::PoolInfo(Box::new(pool.info()))
        }
        Request::Stats => Answer::Stats(Box::new(StatsReport {
            pool: pool.stats(),
            nbd_server: None,
            warn_at: None,
        })),
        Request::Regions => Answer::Regions(pool.regions()),
        // A latched pool's memory may hold changes its devices never took (a
        // reference taken for a write that failed): auditing it would report them
        // as damage. Say what happened instead.
        Request::Audit => match pool.latched_reason() {
            Some(why) => {
                return Err(EngineError::Refused(format!(
                    "not audited: the pool is {why}; stop the server (its close reports \
                     the failure), then run `fewerbytes check` on the reopened pool"
                )))
            }
            None => Answer::Audit(pool.audit()),
        },
        Request::GrowPool => Answer::Grown(pool.grow()?),
        Request::ScrubStart { rate_bytes_per_s } => {
            Answer::Scrub(pool.scrub_start(*rate_bytes_per_s)?)
        }
        Request::ScrubPause => Answer::Scrub(pool.scrub_pause()?),
        Request::ScrubResume => Answer::Scrub(pool.scrub_resume()?),
        Request::ScrubStatus => Answer::Scrub(pool.scrub_status()),
        Request::Endpoints => {
            return Err(EngineError::Refused(
                "the pool is not being served, so it has no NBD endpoints".into(),
            ))
        }
        Request::SendVolume(_) | Request::ReceiveVolume(_) => {
            return Err(EngineError::Refused(
                "a send or receive streams: only a server's control connection carries it".into(),
            ))
        }
    })
}

/// The control socket named by `--control-socket` or `FEWERBYTES_CONTROL_SOCKET`, set
/// once by `main` before any command runs. Process-wide rather than an argument because
/// every command and the server reach it through [`control_path`], and both sides must
/// agree on it.
static CONTROL_SOCKET: OnceLock<PathBuf> = OnceLock::new();

/// Make `path` the control socket of this process's pool (server and client side).
pub fn set_control_socket(path: PathBuf) {
    // Set once, from the command line, before anything reads it.
    let _ = CONTROL_SOCKET.set(path);
}

/// Set by `--require-server`: commands go to a server or fail, never opening the pool
/// themselves. The Proxmox plugin passes it: a pool opened by a command would keep a
/// starting service from taking it, and a storage whose server is down must say so.
static REQUIRE_SERVER: OnceLock<()> = OnceLock::new();

/// Make every command of this process refuse to open the pool itself.
pub fn set_require_server() {
    let _ = REQUIRE_SERVER.set(());
}

/// The control socket: the one named by `--control-socket`, else `<pool>.ctl` beside
/// the pool, or `<run dir>/<pool-id>.ctl` for a pool that is not a file (`homes`).
pub fn control_path(pool_path: &Path) -> Result<PathBuf> {
    match CONTROL_SOCKET.get() {
        Some(path) => Ok(path.clone()),
        None => crate::homes::run_file(pool_path, ".ctl"),
    }
}

/// A server found on the control socket, holding the pool at the path it was
/// found by.
pub struct ControlClient {
    path: PathBuf,
    pool: PoolIdentity,
    /// The pool's name, for the words of a refusal.
    pool_path: PathBuf,
    /// Who may answer on the socket (`socket_trust`): checked on every connection.
    trusted: Vec<u32>,
}

impl ControlClient {
    /// Connect to the control socket if a server is there and holds the pool at
    /// `pool_path`. A socket file that nobody answers on is stale (a server that was
    /// killed): it is removed. A server of another pool (the one that was at this
    /// path before it was renamed) is left alone, and `None` returned: the command
    /// then opens the pool at the path itself. A server that runs as neither root
    /// nor the pool's owner, or a stale socket file of another user, is refused
    /// (`socket_trust`) before anything is sent or removed.
    pub fn probe(pool_path: &Path) -> Result<Option<ControlClient>> {
        let path = control_path(pool_path)?;
        let stream = match UnixStream::connect(&path) {
            Ok(stream) => stream,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                remove_stale_socket(&path, pool_path)?;
                return Ok(None);
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("could not reach the control socket {}", path.display())
                })
            }
        };
        // No file at the path: no pool there, whoever answers on the socket.
        let Ok(pool) = PoolIdentity::of(pool_path) else {
            return Ok(None);
        };
        let trusted = trusted_uids(pool_path)?;
        check_peer(&stream, &path, pool_path, &trusted)?;
        drop(stream);
        let client = ControlClient {
            path,
            pool,
            pool_path: pool_path.to_path_buf(),
            trusted,
        };
        match client.call(&Request::Ping) {
            Ok(_) => Ok(Some(client)),
            Err(e) if e.downcast_ref::<WrongPool>().is_some() => {
                tracing::warn!("{e}; opening {} directly", pool_path.display());
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Send a streaming request (`SendVolume`, `ReceiveVolume`) and wait for the
    /// server's `Streaming` answer; then the connection carries the stream
    /// (`stream_socket`). Returns the connection's reading side (which may hold
    /// the first frames already) and its writing side.
    pub fn open_stream(&self, request: &Request) -> Result<(BufReader<UnixStream>, UnixStream)> {
        let stream = send_envelope(
            self.connect()?,
            &Envelope {
                pool: Some(self.pool.clone()),
                request: request.clone(),
            },
        )?;
        let writer = stream
            .try_clone()
            .context("could not duplicate the control connection")?;
        let mut reader = BufReader::new(stream);
        match read_reply(&mut reader, &self.path)? {
            Answer::Streaming => Ok((reader, writer)),
            other => bail!(
                "the server answered a {} with {other:?}",
                request.in_words()
            ),
        }
    }

    /// Send one request and wait for its reply.
    pub fn call(&self, request: &Request) -> Result<Answer> {
        exchange(
            self.connect()?,
            &self.path,
            &Envelope {
                pool: Some(self.pool.clone()),
                request: request.clone(),
            },
        )
    }
}

impl ControlClient {
    /// A new connection to the server, whose user is checked before anything is
    /// sent: the socket may have been replaced since the probe.
    fn connect(&self) -> Result<UnixStream> {
        let stream = UnixStream::connect(&self.path)
            .with_context(|| format!("the server on {} stopped answering", self.path.display()))?;
        check_peer(&stream, &self.path, &self.pool_path, &self.trusted)?;
        Ok(stream)
    }
}

/// Send one request on a connected control socket and read its reply.
fn exchange(stream: UnixStream, path: &Path, envelope: &Envelope) -> Result<Answer> {
    let mut reader = BufReader::new(send_envelope(stream, envelope)?);
    read_reply(&mut reader, path)
}

/// Write the request line.
fn send_envelope(mut stream: UnixStream, envelope: &Envelope) -> Result<UnixStream> {
    let mut line = serde_json::to_string(envelope)?;
    line.push('\n');
    stream
        .write_all(line.as_bytes())
        .context("could not send the request to the server")?;
    Ok(stream)
}

/// Read one reply line.
fn read_reply(reader: &mut impl BufRead, path: &Path) -> Result<Answer> {
    let mut reply_line = String::new();
    reader
        .read_line(&mut reply_line)
        .context("could not read the server's reply")?;
    if reply_line.is_empty() {
        bail!(
            "the server on {} closed the connection without answering",
            path.display()
        );
    }
    answer_of(&reply_line)
}

/// The answer a reply line carries, or its error.
pub fn answer_of(reply_line: &str) -> Result<Answer> {
    let reply: Reply = serde_json::from_str(reply_line)
        .context("the server's reply is not what this version of fewerbytes expects")?;
    match (reply.ok, reply.value, reply.error) {
        (true, Some(answer), _) => Ok(answer),
        (false, _, Some(error)) if reply.wrong_pool => Err(WrongPool(error).into()),
        (false, _, Some(error)) => Err(anyhow!(error)),
        _ => bail!("the server's reply has neither a value nor an error"),
    }
}

/// Ask the server on `socket` which pool it holds, for a command given a control
/// socket but no pool. The pool's path must name the same file here as in the server
/// (another mount namespace may see another file there, or none): else the command
/// would work on a pool the server does not hold.
pub fn served_pool(socket: &Path) -> Result<ServedPool> {
    let hint = "start the server (`systemctl start fewerbytes@NAME` for the service), or \
                name the pool with --pool";
    let stream = UnixStream::connect(socket).with_context(|| {
        format!(
            "no fewerbytes server answers on the control socket {} ({hint})",
            socket.display()
        )
    })?;
    let peer = stream
        .try_clone()
        .context("could not duplicate the control connection")?;
    let envelope = Envelope {
        pool: None,
        request: Request::WhichPool,
    };
    let answer = exchange(stream, socket, &envelope).with_context(|| {
        format!(
            "the server on the control socket {} did not say which pool it holds",
            socket.display()
        )
    })?;
    let Answer::ServedPool(served) = answer else {
        bail!(
            "the server on the control socket {} answered 'which pool' with {answer:?}",
            socket.display()
        );
    };
    // Asking which pool carries nothing; what follows goes only to a server run by
    // root or the owner of the pool it names.
    check_peer(&peer, socket, &served.path, &trusted_uids(&served.path)?)?;
    match PoolIdentity::of(&served.path) {
        Ok(identity) if identity == served.identity => Ok(served),
        found => bail!(
            "the server on the control socket {} holds the pool {}, but {} here ({}); name \
             the pool as this process sees it with --pool",
            socket.display(),
            served.path.display(),
            served.path.display(),
            match found {
                Ok(_) => "is another file".to_string(),
                Err(e) => format!("cannot be read: {e}"),
            }
        ),
    }
}

/// Remove a control socket nobody answers on (a server that was killed), if root or
/// the pool's owner made it (without a pool to ask, this user).
fn remove_stale_socket(path: &Path, pool_path: &Path) -> Result<()> {
    let trusted = trusted_uids(pool_path).unwrap_or_else(|_| {
        // SAFETY: geteuid has no preconditions and cannot fail.
        vec![0, unsafe { libc::geteuid() }]
    });
    if std::fs::symlink_metadata(path).is_err_and(|e| e.kind() == io::ErrorKind::NotFound) {
        return Ok(());
    }
    check_owner(path, pool_path, &trusted)?;
    tracing::info!("removing stale control socket {}", path.display());
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => {
            Err(e).with_context(|| format!("could not remove stale socket {}", path.display()))
        }
    }
}

/// Either a server's control socket or a pool this process opened: what management
/// commands talk to.
pub enum PoolHandle {
    /// A server holds the pool.
    Served(ControlClient),
    /// This process opened it; closed by [`with_pool`].
    Local(Arc<Pool>),
}

impl PoolHandle {
    /// Run one request.
    pub fn call(&self, request: &Request) -> Result<Answer> {
        match self {
            PoolHandle::Served(client) => client.call(request),
            PoolHandle::Local(pool) => Ok(execute(pool, request)?),
        }
    }
}

/// The server holding the pool at `pool_path`, if one answers; `None` when this
/// process may open the pool itself (refused under `--require-server`), and then
/// stops at SIGINT or SIGTERM where its stream loop polls (`interrupt`), closing the
/// pool. For the stream commands (send, receive).
pub fn served_or_local(pool_path: &Path) -> Result<Option<ControlClient>> {
    if let Some(client) = ControlClient::probe(pool_path)? {
        tracing::debug!("using the server on {}", client.path().display());
        return Ok(Some(client));
    }
    if REQUIRE_SERVER.get().is_some() {
        bail!(
            "no fewerbytes server answers for pool {} on {} (--require-server); start it \
             (`systemctl start fewerbytes@NAME` for the service)",
            pool_path.display(),
            control_path(pool_path)?.display()
        );
    }
    crate::interrupt::install_for_command()?;
    Ok(None)
}

/// How a command that is not served opens the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read-write: the open takes a checkpoint (and upgrades a version-1 pool).
    ReadWrite,
    /// Read-only: nothing is written, so inspecting a pool leaves its bytes (and a
    /// version-1 pool's version) as they were.
    ReadOnly,
}

/// Reach the pool at `pool_path` (through its server if one runs, else by opening it
/// read-write), run `body`, and close the pool if this process opened it.
pub fn with_pool<T>(pool_path: &Path, body: impl FnOnce(&PoolHandle) -> Result<T>) -> Result<T> {
    with_pool_access(pool_path, Access::ReadWrite, body)
}

/// [`with_pool`] for commands that only read: a pool not served is opened read-only.
pub fn inspect_pool<T>(pool_path: &Path, body: impl FnOnce(&PoolHandle) -> Result<T>) -> Result<T> {
    with_pool_access(pool_path, Access::ReadOnly, body)
}

fn with_pool_access<T>(
    pool_path: &Path,
    access: Access,
    body: impl FnOnce(&PoolHandle) -> Result<T>,
) -> Result<T> {
    if let Some(client) = ControlClient::probe(pool_path)? {
        tracing::debug!("using the server on {}", client.path().display());
        return body(&PoolHandle::Served(client));
    }
    if REQUIRE_SERVER.get().is_some() {
        let control = control_path(pool_path)?;
        bail!(
            "no fewerbytes server answers for pool {} on {} (--require-server); start it \
             (`systemctl start fewerbytes@NAME` for the service)",
            pool_path.display(),
            control.display()
        );
    }
    let opened = match access {
        Access::ReadWrite => open_pool(pool_path, &OpenOptions::default()),
        Access::ReadOnly => open_pool_read_only(pool_path, &OpenOptions::default()),
    };
    let pool = match opened {
        Ok(pool) => pool,
        Err(e) if is_locked(&e) => {
            // A server that is starting holds the pool before its control socket
            // listens: wait for the socket rather than fail.
            for _ in 0..CONTROL_WAIT_STEPS {
                std::thread::sleep(std::time::Duration::from_millis(100));
                if let Some(client) = ControlClient::probe(pool_path)? {
                    return body(&PoolHandle::Served(client));
                }
            }
            return Err(e.context(format!(
                "no server answers on {} (a server started with --control-socket, as the \
                 fewerbytes@ service is with /run/fewerbytes/NAME.ctl, answers only there: \
                 pass the same --control-socket or FEWERBYTES_CONTROL_SOCKET)",
                control_path(pool_path)?.display()
            )));
        }
        Err(e) => return Err(e),
    };
    run_and_close(pool_path, pool, |pool| {
        body(&PoolHandle::Local(Arc::clone(pool)))
    })
}

/// How long (in 100 ms steps) a command waits for a starting server's control socket.
const CONTROL_WAIT_STEPS: u32 = 50;

/// Whether `e` says another process (or this one) holds the pool's lock.
fn is_locked(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<EngineError>(),
            Some(EngineError::Io(
                fewerbytes_engine::storage::StorageError::Locked { .. }
            ))
        ) || matches!(
            cause.downcast_ref::<fewerbytes_engine::storage::StorageError>(),
            Some(fewerbytes_engine::storage::StorageError::Locked { .. })
        )
    })
}

/// Open the pool in this process, run `body`, close the pool (final checkpoint) even
/// when `body` failed; the first error wins.
pub fn with_local_pool<T>(
    pool_path: &Path,
    options: &OpenOptions,
    body: impl FnOnce(&Arc<Pool>) -> Result<T>,
) -> Result<T> {
    let pool = open_pool(pool_path, options)?;
    run_and_close(pool_path, pool, body)
}

/// [`with_local_pool`] for commands that only read (`volume export`): the pool is
/// opened read-only, so nothing is written to it, and a pool on a full file system,
/// or one that did not close cleanly there, can still be read out.
pub fn with_local_pool_read_only<T>(
    pool_path: &Path,
    options: &OpenOptions,
    body: impl FnOnce(&Arc<Pool>) -> Result<T>,
) -> Result<T> {
    let pool = open_pool_read_only(pool_path, options)?;
    run_and_close(pool_path, pool, body)
}

/// Run `body` on an open pool, then close it; the first error wins.
pub fn run_and_close<T>(
    pool_path: &Path,
    pool: Arc<Pool>,
    body: impl FnOnce(&Arc<Pool>) -> Result<T>,
) -> Result<T> {
    let mut result = body(&pool);
    let closed = pool
        .close()
        .with_context(|| format!("could not close pool {}", pool_path.display()));
    if let Err(e) = &mut result {
        // The line a stopped command ends with says how the close went.
        if let Some(interrupted) = e.downcast_mut::<crate::interrupt::Interrupted>() {
            let how = closed.as_ref().map(|_| ()).map_err(|c| format!("{c:#}"));
            interrupted.closed = Some((pool_path.display().to_string(), how));
        }
    }
    match (result, closed) {
        (Ok(value), Ok(())) => Ok(value),
        (Err(e), _) => Err(e),
        (Ok(_), Err(e)) => Err(e),
    }
}

/// Open a pool in this process, with a sentence that says which pool when it fails.
/// The dedup index a clean close saved beside the pool is loaded, and saved again
/// at this open's close (`SavedIndex::Beside`).
pub fn open_pool(pool_path: &Path, options: &OpenOptions) -> Result<Arc<Pool>> {
    require_pool(pool_path)?;
    crate::homes::make_state_home(pool_path);
    let options = OpenOptions {
        saved_index: SavedIndex::Beside,
        ..options.clone()
    };
    Pool::open(pool_path, &options)
        .with_context(|| format!("could not open pool {}", pool_path.display()))
}

/// Open a pool read-only ([`Pool::open_read_only`]: no checkpoint, no upgrade),
/// saying which pool when it fails.
pub fn open_pool_read_only(pool_path: &Path, options: &OpenOptions) -> Result<Arc<Pool>> {
    require_pool(pool_path)?;
    Pool::open_read_only(pool_path, options)
        .with_context(|| format!("could not open pool {}", pool_path.display()))
}

/// Open a pool to repair it ([`Pool::open_for_repair`]), saying which pool when it fails.
pub fn open_pool_for_repair(pool_path: &Path, options: &OpenOptions) -> Result<Arc<Pool>> {
    require_pool(pool_path)?;
    // The damaged-block hint beside the pool (a repair open keeps no saved index).
    let options = OpenOptions {
        saved_index: SavedIndex::Beside,
        ..options.clone()
    };
    Pool::open_for_repair(pool_path, &options)
        .with_context(|| format!("could not open pool {}", pool_path.display()))
}

/// An error unless something is at `pool_path`. A pool that is not a file (an RBD
/// image) is not looked for here: opening it says what is missing.
fn require_pool(pool_path: &Path) -> Result<()> {
    if !crate::homes::is_elsewhere(pool_path) && !pool_path.exists() {
        bail!(
            "there is no pool at {} (create one with `fewerbytes pool create {} --size 16G`, \
             or name another with --pool or FEWERBYTES_POOL)",
            pool_path.display(),
            pool_path.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_one_json_object_each() {
        let line = serde_json::to_string(&Request::CreateVolume {
            name: "vm1".into(),
            size_bytes: 4096,
            provisioning: Provisioning::Thick,
        })
        .unwrap();
        assert_eq!(
            line,
            r#"{"op":"create-volume","name":"vm1","size_bytes":4096}"#
        );
        let back: Request = serde_json::from_str(&line).unwrap();
        assert!(matches!(
            back,
            Request::CreateVolume {
                size_bytes: 4096,
                ..
            }
        ));
    }

    #[test]
    fn error_replies_carry_one_sentence() {
        let reply = Reply {
            ok: false,
            value: None,
            error: Some("no volume named 'x' in this pool".into()),
            wrong_pool: false,
        };
        let line = serde_json::to_string(&reply).unwrap();
        assert_eq!(
            line,
            r#"{"ok":false,"error":"no volume named 'x' in this pool"}"#
        );
    }

    #[test]
    fn a_request_carries_the_pool_it_is_for() {
        let envelope = Envelope {
            pool: Some(PoolIdentity {
                dev: 2049,
                ino: 12,
                pool_id: None,
            }),
            request: Request::DeleteVolume {
                name: "vm1".into(),
                force: false,
            },
        };
        let line = serde_json::to_string(&envelope).unwrap();
        assert_eq!(
            line,
            r#"{"pool":{"dev":2049,"ino":12},"op":"delete-volume","name":"vm1","force":false}"#
        );
        let back: Envelope = serde_json::from_str(&line).unwrap();
        assert_eq!(back.pool, envelope.pool);
        assert!(matches!(
            back.request,
            Request::DeleteVolume { force: false, .. }
        ));
        // A request without a pool names none, and a server refuses it.
        let bare: Envelope = serde_json::from_str(r#"{"op":"ping"}"#).unwrap();
        assert_eq!(bare.pool, None);
    }

    #[test]
    fn control_path_is_beside_the_pool() {
        assert_eq!(
            control_path(Path::new("/var/lib/vm.pool")).unwrap(),
            PathBuf::from("/var/lib/vm.pool.ctl")
        );
    }
}
