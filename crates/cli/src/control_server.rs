//! The server side of the control socket: `serve` accepts management requests on
//! `<pool>.ctl` (or `--control-socket`) and runs them against the pool it holds (see
//! `control` for the protocol and the client side).
//!
//! Stopping never goes through the socket's path: the accept loop is woken by
//! shutdown(2) on the listening descriptor, so a socket file that a tmp cleaner or an
//! admin deleted (or replaced) cannot keep `serve` from stopping.

use anyhow::{bail, Context, Result};
use fewerbytes_engine::{Pool, VolumeInfo};
use fewerbytes_nbd::ExportUsers;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::control::{
    control_path, execute, Answer, ControlClient, Envelope, PoolIdentity, Reply, Request, Served,
    ServedPool, StatsReport,
};

/// Longest request line a server reads; requests are a name and a few numbers.
const REQUEST_BYTES_MAX: u64 = 64 * 1024;
/// Control connections served at once; more are refused. Management is interactive
/// and rare, so a handful is plenty, and a limit keeps a misbehaving script from
/// piling up threads.
const CONTROL_CONNECTIONS_MAX: usize = 16;
/// How long a server waits for a client's request line before giving up on it.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a failed accept (e.g. out of file descriptors) before trying again.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// The server side: accepts control connections until stopped.
pub struct ControlServer {
    path: PathBuf,
    /// Device and inode of the socket file this server bound: on stop the file at
    /// `path` is removed only if it is still this one (not another server's).
    file_id: Option<(u64, u64)>,
    listener: Arc<UnixListener>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Listen on the pool's control socket and serve requests against `pool`.
    pub fn start(pool_path: &Path, pool: Arc<Pool>, served: Arc<Served>) -> Result<ControlServer> {
        let path = control_path(pool_path)?;
        if ControlClient::probe(pool_path)?.is_some() {
            bail!(
                "another server already answers on {}; stop it first",
                path.display()
            );
        }
        // The pool this server holds: requests for any other file are refused.
        let identity = PoolIdentity::of(pool_path)
            .with_context(|| format!("could not identify {}", pool_path.display()))?;
        // Absolute, so a command run from another directory finds the same file (an
        // RBD pool's name is its canonical URI already).
        let path_held = if crate::homes::is_elsewhere(pool_path) {
            pool_path.to_path_buf()
        } else {
            std::fs::canonicalize(pool_path)
                .with_context(|| format!("could not resolve {}", pool_path.display()))?
        };
        let held = Arc::new(ServedPool {
            path: path_held,
            identity,
        });
        crate::homes::make_home(pool_path, &path)?;
        let listener = Arc::new(UnixListener::bind(&path).with_context(|| {
            if path.exists() {
                format!(
                    "could not listen on {}: a server of another pool answers there \
                     (a pool file renamed while served?)",
                    path.display()
                )
            } else {
                format!("could not listen on {}", path.display())
            }
        })?);
        // Root-only (or owner-only): the socket can delete volumes. The window between
        // bind and chmod is closed by the peer-uid check in `serve_connection`.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("could not restrict {} to its owner", path.display()))?;
        let file_id = file_id(&path);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            let listener = Arc::clone(&listener);
            std::thread::Builder::new()
                .name("control".into())
                .spawn(move || accept_loop(&listener, pool, served, held, stop))
                .context("could not start the control thread")?
        };
        Ok(ControlServer {
            path,
            file_id,
            listener,
            stop,
            thread: Some(thread),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stop accepting, wait for the accept loop, remove the socket.
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop, blocked in accept(2): on a listening unix socket,
        // shutdown(2) makes accept return EINVAL, now and on every later call. The
        // flag is set first, so the loop ends instead of retrying.
        // SAFETY: the descriptor belongs to `self.listener`, which is alive (and so
        // open) for the whole call; shutdown(2) takes no pointers.
        unsafe {
            libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR);
        }
        let _ = thread.join();
        if self.file_id.is_some() && file_id(&self.path) == self.file_id {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// Device and inode of the file at `path`, if there is one.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|metadata| (metadata.dev(), metadata.ino()))
}

fn accept_loop(
    listener: &UnixListener,
    pool: Arc<Pool>,
    served: Arc<Served>,
    held: Arc<ServedPool>,
    stop: Arc<AtomicBool>,
) {
    let active = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::SeqCst) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(_) if stop.load(Ordering::SeqCst) => break,
            Err(e) => {
                tracing::warn!("control socket accept failed: {e}");
                std::thread::sleep(ACCEPT_RETRY);
                continue;
            }
        };
        if stop.load(Ordering::SeqCst) {
            break;
        }
        if active.load(Ordering::SeqCst) >= CONTROL_CONNECTIONS_MAX {
            let _ = refuse(
                stream,
                &format!("the server is busy ({CONTROL_CONNECTIONS_MAX} control requests at once); try again"),
            );
            continue;
        }
        active.fetch_add(1, Ordering::SeqCst);
        let pool = Arc::clone(&pool);
        let served = Arc::clone(&served);
        let held = Arc::clone(&held);
        let active_for_thread = Arc::clone(&active);
        let spawned = std::thread::Builder::new()
            .name("control-request".into())
            .spawn(move || {
                if let Err(e) = serve_connection(stream, &pool, &served, &held) {
                    tracing::warn!("control request failed: {e:#}");
                }
                active_for_thread.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            active.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("could not start a control request thread: {e}");
        }
    }
}

fn refuse(mut stream: UnixStream, error: &str) -> Result<()> {
    let reply = Reply {
        ok: false,
        value: None,
        error: Some(error.to_string()),
        wrong_pool: false,
    };
    let mut line = serde_json::to_string(&reply)?;
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    Ok(())
}

fn serve_connection(
    stream: UnixStream,
    pool: &Arc<Pool>,
    served: &Served,
    held: &ServedPool,
) -> Result<()> {
    stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    if let Some(uid) = peer_uid(&stream) {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let own_uid = unsafe { libc::geteuid() };
        if uid != own_uid && uid != 0 {
            return refuse(
                stream,
                "permission denied: only the server's user may manage the pool",
            );
        }
    }
    let mut line = String::new();
    BufReader::new((&stream).take(REQUEST_BYTES_MAX)).read_line(&mut line)?;
    if line.trim().is_empty() {
        // A probe (connect and close) or a client that gave up: nothing to answer.
        return Ok(());
    }
    let reply = match serde_json::from_str::<Envelope>(&line) {
        Err(e) => Reply {
            ok: false,
            value: None,
            error: Some(format!("the server could not understand the request: {e}")),
            wrong_pool: false,
        },
        // Asked without a pool: the one request that names none.
        Ok(Envelope {
            request: Request::WhichPool,
            ..
        }) => Reply {
            ok: true,
            value: Some(Answer::ServedPool(held.clone())),
            error: None,
            wrong_pool: false,
        },
        Ok(envelope) if envelope.pool.as_ref() != Some(&held.identity) => Reply {
            ok: false,
            value: None,
            error: Some(
                "the server on this control socket holds another pool than the file the \
                 command named (a pool file renamed or replaced while served), so it \
                 refused the request"
                    .into(),
            ),
            wrong_pool: true,
        },
        Ok(Envelope {
            request: request @ (Request::SendVolume(_) | Request::ReceiveVolume(_)),
            ..
        }) => {
            // The connection carries the stream from here on, at the pace of the
            // other end: no timeout.
            stream.set_read_timeout(None)?;
            let mut line = serde_json::to_string(&Reply {
                ok: true,
                value: Some(Answer::Streaming),
                error: None,
                wrong_pool: false,
            })?;
            line.push('\n');
            (&stream).write_all(line.as_bytes())?;
            tracing::info!("control: {}: begins", request.in_words());
            crate::stream_serve::serve(&stream, pool, &held.path, &request);
            return Ok(());
        }
        Ok(Envelope { request, .. }) => {
            let what = request.in_words();
            let changes_pool = request.changes_pool();
            let started = std::time::Instant::now();
            let answer = match request {
                Request::Endpoints => Ok(Answer::Endpoints(served.endpoints.clone())),
                Request::Stats => {
                    let stats = pool.stats();
                    served.low_water.observe(&stats);
                    Ok(Answer::Stats(Box::new(StatsReport {
                        warn_at: Some(served.low_water.status()),
                        pool: stats,
                        nbd_server: Some(served.server.stats().into()),
                    })))
                }
                other => execute(pool, &other).map(|mut answer| {
                    count_clients(&mut answer, &served.server.users());
                    answer
                }),
            };
            // Changes at INFO, with their outcome; queries (list, stats, ...) at DEBUG.
            match (&answer, changes_pool) {
                (Ok(_), true) => tracing::info!(
                    "control: {what}: done in {:.1} ms",
                    started.elapsed().as_secs_f64() * 1000.0
                ),
                (Err(e), true) => tracing::info!("control: {what}: refused: {e}"),
                (Ok(_), false) => tracing::debug!("control: {what}: answered"),
                (Err(e), false) => tracing::debug!("control: {what}: refused: {e}"),
            }
            match answer {
                Ok(answer) => Reply {
                    ok: true,
                    value: Some(answer),
                    error: None,
                    wrong_pool: false,
                },
                Err(e) => Reply {
                    ok: false,
                    value: None,
                    error: Some(format!("{e}")),
                    wrong_pool: false,
                },
            }
        }
    };
    let mut out = serde_json::to_string(&reply)?;
    out.push('\n');
    (&stream).write_all(out.as_bytes())?;
    Ok(())
}

/// Make a volume's `users` count clients rather than connections. The engine counts
/// open volume handles, one per NBD connection, so a client with several connections
/// (QEMU's multi-conn, `nbdcopy --connections 4`) would count several times: its
/// connections are taken out and its distinct clients put in (handles opened other
/// than over NBD still count one each).
fn count_clients(answer: &mut Answer, users: &BTreeMap<String, ExportUsers>) {
    let count = |volume: &mut VolumeInfo| {
        if let Some(export) = users.get(&volume.name) {
            let connections = u32::try_from(export.connections).unwrap_or(u32::MAX);
            let clients = u32::try_from(export.clients).unwrap_or(u32::MAX);
            volume.users = volume
                .users
                .saturating_sub(connections)
                .saturating_add(clients);
        }
    };
    match answer {
        Answer::Volumes(volumes) => volumes.iter_mut().for_each(count),
        Answer::Volume(volume) => count(volume),
        _ => {}
    }
}

/// The user id of the process at the other end, from SO_PEERCRED.
fn peer_uid(stream: &UnixStream) -> Option<u32> {
    fewerbytes_nbd::peer_credentials(stream).map(|cred| cred.uid)
}
