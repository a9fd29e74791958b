//! The transmission phase of one connection: a reader that parses requests and
//! hands them to worker threads in batches, workers that run them against the
//! export, and replies queued as each request completes (out of order) and written
//! in batches (see `reply.rs`).
//!
//! Back-pressure: a request holds a [`Permit`] from the moment its header is read
//! until its reply is written. The reader takes one per-connection slot, one
//! server-wide slot and, for reads and writes, its buffer's bytes from the
//! byte budget (the connection's own reserve, then its share of the server-wide
//! pool: see `inflight.rs`); at any limit it hands over the requests it holds and
//! waits, and does not read the socket, until an earlier request completes. Nothing
//! a client sends can grow the server's memory past those limits.
//!
//! Handoffs: every request read from the socket buffer in one go is queued with one
//! lock and one wakeup per worker needed; a lone small write with nothing queued is
//! run by the reader itself (no wakeup at all); workers wake only while fewer than
//! one per CPU are running, and a worker that has more queued work leaves its
//! replies for one batched write. Requests that may wait for the disk (reads, block
//! status, and flushes and FUA writes, which wait for a group commit) never run on
//! the reader and each get a worker of their own, so a connection's other requests
//! never queue behind them.

use crate::buffers::{Payload, PayloadBuffers};
use crate::config::{
    PAYLOAD_PIECE_BYTES, PAYLOAD_TIMEOUT, THREAD_STACK_BYTES, WORKERS_PER_CONNECTION_MAX,
};
use crate::export::{Export, EIO, ENOMEM, ENOSPC, ENOTSUP, EOVERFLOW, EPERM, ESHUTDOWN};
use crate::inflight::{Inflight, Permit};
use crate::negotiate::{Contexts, Session};
use crate::protocol::*;
use crate::reply::{Replies, Reply};
use crate::shared::Shared;
use crate::stream::{Stream, StreamReader};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::VecDeque;
use std::io::{self, BufReader, Read};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A worker idle this long exits; the next burst of requests starts workers again
/// (a thread start costs tens of microseconds). Idle connections, the usual case for
/// VM disks, then hold one thread each instead of a full set of workers.
pub const WORKER_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Granularity at which reads look for zero ranges to send as holes: the engine's
/// block, so a hole chunk stands for whole unmapped or zero blocks.
const HOLE_SCAN_BYTES: u64 = 4096;

/// Size of the buffer a refused write's payload is read into and thrown away.
const DISCARD_CHUNK_BYTES: usize = 64 << 10;

/// Requests the reader parses before handing them to workers even if more are in
/// its buffer: workers start on a deep queue while the reader still parses.
const READ_BATCH_MAX: usize = 16;

/// A write up to this size (without FUA) is quick: a few microseconds of copying
/// and hashing (see `Job::quick`).
const QUICK_REQUEST_BYTES_MAX: u32 = 64 << 10;

/// Replies a worker leaves queued while it runs further quick requests, before it
/// writes them: bounds the delay one reply can see to that many quick requests.
const REPLIES_DEFERRED_MAX: usize = 8;

/// One connection in transmission.
struct Conn {
    id: u64,
    export: Arc<dyn Export>,
    /// Metadata contexts selected in negotiation (block status answers each).
    contexts: Contexts,
    mode: ReplyMode,
    replies: Replies,
    queue: Mutex<Queue>,
    /// Workers wait here for jobs.
    job_ready: Condvar,
    /// This connection's requests in flight and its share of the server's limits.
    inflight: Arc<Inflight>,
    /// Workers the reader keeps running quick jobs at once (one per CPU): more
    /// only take turns on the CPUs and cost wakeups.
    workers_running_max: usize,
    /// Threads at most (running, waiting on the disk, or idle).
    workers_max: usize,
    /// Write payload buffers kept between requests.
    buffers: PayloadBuffers,
    /// Closed after this long with no request and nothing in flight.
    idle_timeout: Option<Duration>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Workers waiting for a job.
    idle: usize,
    /// Jobs in `jobs` that may wait for the disk.
    queued_may_wait: usize,
    /// Jobs in `jobs` that are large writes (see [`Job::heavy`]).
    queued_heavy: usize,
    /// Workers running a job that may wait for the disk.
    running_may_wait: usize,
    /// Workers alive (started and not retired).
    workers: usize,
    /// The reader is done: workers exit once the queue is empty.
    closed: bool,
}

struct Job {
    header: RequestHeader,
    command: Command,
    payload: Payload,
    permit: Permit,
}

impl Job {
    /// May wait for the disk: a flush or FUA request waits for a group commit
    /// (milliseconds), a read or block status may read from the disk. Such a job
    /// never runs on the reader, and its worker does not count as running: each gets
    /// a worker of its own (up to [`crate::WORKERS_PER_CONNECTION_MAX`]), so one
    /// connection's other requests never wait behind it.
    fn may_wait(&self) -> bool {
        match self.command {
            Command::Flush | Command::Read { .. } | Command::BlockStatus { .. } => true,
            Command::Write { fua, .. }
            | Command::Trim { fua, .. }
            | Command::WriteZeroes { fua, .. } => fua,
            Command::Cache | Command::Disconnect => false,
        }
    }

    /// Tens of microseconds of CPU or more: a write larger than a quick one (hashing
    /// and compressing 4 KiB takes a few microseconds), without FUA.
    fn heavy(&self) -> bool {
        matches!(self.command, Command::Write { len, fua: false, .. } if len > QUICK_REQUEST_BYTES_MAX)
    }

    /// A few microseconds of CPU: a small write without FUA (it lands in the page
    /// cache), or a cache hint. The reader runs a lone quick job itself, and a
    /// worker may leave replies queued while it runs one.
    fn quick(&self) -> bool {
        match self.command {
            Command::Write { len, fua, .. } => !fua && len <= QUICK_REQUEST_BYTES_MAX,
            Command::Cache => true,
            _ => false,
        }
    }
}

/// Why the reader stopped.
#[derive(Debug)]
enum End {
    /// `NBD_CMD_DISC`.
    Disconnect,
    /// The client closed the socket between requests (or the server shut it).
    Closed,
    /// The socket failed or closed mid-request.
    Io(io::Error),
    /// A request that cannot be answered (bad magic, huge payload).
    Protocol(RequestError),
    /// No worker could be started.
    NoWorker(io::Error),
    /// No request and nothing in flight for the idle timeout.
    Idle,
}

/// Serve requests until the client disconnects, then wait for every request in
/// flight to be answered.
pub(crate) fn serve(
    shared: &Shared,
    id: u64,
    session: Session,
    mut reader: BufReader<StreamReader>,
    stream: Arc<Stream>,
) {
    let config = shared.config();
    let conn = Arc::new(Conn {
        id,
        export: session.export,
        contexts: session.contexts.clone(),
        mode: session.mode,
        replies: Replies::new(id, stream),
        queue: Mutex::new(Queue::default()),
        job_ready: Condvar::new(),
        inflight: shared.inflight_for_connection(),
        workers_running_max: shared.workers_running_max(),
        workers_max: WORKERS_PER_CONNECTION_MAX.min(config.max_inflight_per_connection),
        buffers: PayloadBuffers::default(),
        idle_timeout: config.idle_timeout,
    });
    let mut workers = Workers {
        handles: Vec::new(),
    };
    let ctx = RequestContext {
        mode: session.mode,
        size_bytes: 0,
        read_only: session.read_only,
        meta_context: session.contexts.any(),
    };
    reader.get_mut().set_spin(
        config.read_spin,
        conn.inflight.requests_now(),
        shared.polling(),
    );
    let mut batch = Vec::with_capacity(READ_BATCH_MAX);
    let mut end = read_requests(&conn, &mut reader, ctx, &mut workers, &mut batch);
    // Requests read before the end are still answered (DISC asks for that).
    if let Err(e) = workers.dispatch(&conn, &mut batch) {
        end = End::NoWorker(e);
    }
    match &end {
        End::Disconnect => tracing::debug!(id, "NBD client disconnected"),
        End::Closed => tracing::debug!(id, "NBD client closed the socket"),
        End::Io(e) => tracing::info!(id, error = %e, "NBD connection dropped: socket"),
        End::Protocol(e) => tracing::info!(id, error = %e, "NBD connection dropped: protocol"),
        End::NoWorker(e) => tracing::warn!(id, error = %e, "NBD connection dropped: no worker"),
        End::Idle => tracing::info!(
            id,
            idle_timeout_s = conn.idle_timeout.map_or(0, |t| t.as_secs()),
            "NBD connection closed: idle"
        ),
    }
    {
        let mut queue = conn.queue.lock();
        queue.closed = true;
        conn.job_ready.notify_all();
    }
    for worker in workers.handles {
        let _ = worker.join();
    }
    // Jobs left only if no worker ever started; their permits go back here.
    let orphans: Vec<Job> = conn.queue.lock().jobs.drain(..).collect();
    drop(batch);
    drop(orphans);
    // Every worker wrote its replies before it exited; this writes (or, on a failed
    // socket, drops) anything left, so no permit outlives the connection.
    conn.replies.flush();
}

/// Read requests into `batch`, handing it to workers before any read that may wait
/// on the socket and before waiting for a limit (the batch's permits count towards it).
fn read_requests(
    conn: &Arc<Conn>,
    reader: &mut BufReader<StreamReader>,
    mut ctx: RequestContext,
    workers: &mut Workers,
    batch: &mut Vec<Job>,
) -> End {
    let header_bytes = RequestHeader::wire_bytes(conn.mode);
    let mut header_buf = [0u8; EXTENDED_REQUEST_BYTES];
    let mut scratch = Vec::new();
    loop {
        if batch.len() >= READ_BATCH_MAX || reader.buffer().len() < header_bytes {
            if let Err(e) = workers.dispatch(conn, batch) {
                return End::NoWorker(e);
            }
        }
        let Some(wire) = header_buf.get_mut(..header_bytes) else {
            return End::Protocol(RequestError::Truncated);
        };
        match read_header(reader, wire, conn.idle_timeout, &conn.inflight) {
            Ok(Header::Read) => {}
            Ok(Header::Eof) => return End::Closed,
            Ok(Header::Idle) => return End::Idle,
            Err(e) => return End::Io(e),
        }
        let header = match RequestHeader::decode(wire, conn.mode) {
            Ok(h) => h,
            Err(e) => return End::Protocol(e),
        };
        let payload_bytes = header.payload_bytes(conn.mode);
        if payload_bytes > DISCARD_PAYLOAD_MAX_BYTES {
            return End::Protocol(RequestError::PayloadTooLarge {
                len: payload_bytes,
                max: DISCARD_PAYLOAD_MAX_BYTES,
            });
        }
        let mut permit = match Permit::try_acquire(&conn.inflight) {
            Some(permit) => permit,
            None => {
                if let Err(e) = workers.dispatch(conn, batch) {
                    return End::NoWorker(e);
                }
                Permit::acquire(&conn.inflight)
            }
        };
        ctx.size_bytes = conn.export.size_bytes();
        let command = match validate(&header, &ctx) {
            Ok(command) => command,
            Err(e) => {
                if let Err(e) = workers.dispatch(conn, batch) {
                    return End::NoWorker(e);
                }
                reader.get_mut().set_deadline(Some(PAYLOAD_TIMEOUT));
                let discarded = discard(reader, payload_bytes, &mut scratch);
                reader.get_mut().set_deadline(None);
                if let Err(io) = discarded {
                    return End::Io(io);
                }
                tracing::debug!(id = conn.id, error = %e, "NBD request refused");
                let mut reply = conn.error_reply(&header, e.errno(), &e.to_string());
                reply.hold(permit);
                conn.replies.send(reply);
                continue;
            }
        };
        // What a request's reply holds until written: a read's data, or a block
        // status answer at its largest. A write's payload is charged as it
        // arrives, below.
        let buffer_bytes = match command {
            Command::Disconnect => return End::Disconnect,
            Command::Read { len, .. } => u64::from(len),
            Command::BlockStatus { .. } => BLOCK_STATUS_MEMORY_MAX_BYTES,
            _ => 0,
        };
        if buffer_bytes > 0 && !permit.try_add_bytes(buffer_bytes) {
            if let Err(e) = workers.dispatch(conn, batch) {
                return End::NoWorker(e);
            }
            permit.add_bytes(buffer_bytes);
        }
        let payload = match command {
            Command::Write { len, .. } => {
                match read_payload(conn, reader, &mut permit, len, workers, batch) {
                    Ok(payload) => payload,
                    Err(end) => return end,
                }
            }
            _ => Payload::none(),
        };
        batch.push(Job {
            header,
            command,
            payload,
            permit,
        });
    }
}

/// Read a write's payload of `len` bytes, charging it to `permit` piece by piece as
/// it arrives (see [`PAYLOAD_PIECE_BYTES`]), all within [`PAYLOAD_TIMEOUT`] of its
/// header: a client that stalls part-way holds the pieces it sent, then loses them
/// and its connection at the timeout.
fn read_payload(
    conn: &Arc<Conn>,
    reader: &mut BufReader<StreamReader>,
    permit: &mut Permit,
    len: u32,
    workers: &mut Workers,
    batch: &mut Vec<Job>,
) -> Result<Payload, End> {
    // `len` ≤ PAYLOAD_MAX_BYTES (validated), and equals the payload on the wire.
    let len = u64::from(len);
    if (reader.buffer().len() as u64) < len {
        workers.dispatch(conn, batch).map_err(End::NoWorker)?;
    }
    let mut data = conn.buffers.take(len as usize);
    reader.get_mut().set_deadline(Some(PAYLOAD_TIMEOUT));
    let mut charged = 0u64;
    let mut filled = 0u64;
    let mut result = Ok(());
    while filled < len && result.is_ok() {
        if charged == filled {
            let piece = PAYLOAD_PIECE_BYTES.min(len - charged);
            let mut taken = permit.try_add_piece(piece, len - charged);
            if taken == 0 {
                workers.dispatch(conn, batch).map_err(End::NoWorker)?;
                // The wait for room is the server's, not the client's: the payload's
                // deadline moves by as much.
                let waiting = Instant::now();
                taken = permit.add_piece(piece, len - charged);
                if let Some(deadline) = reader.get_ref().deadline() {
                    let left = deadline.saturating_duration_since(waiting);
                    reader.get_mut().set_deadline(Some(left));
                }
            }
            charged += taken;
        }
        // Bytes within one piece; `charged` ≤ `len` ≤ PAYLOAD_MAX_BYTES fits usize.
        let to = charged.min(filled + PAYLOAD_PIECE_BYTES);
        result = reader.read_exact(data.piece_mut(filled as usize, to as usize));
        filled = to;
    }
    reader.get_mut().set_deadline(None);
    result.map_err(End::Io)?;
    Ok(data)
}

/// The worker threads of one connection, as the reader sees them.
struct Workers {
    handles: Vec<JoinHandle<()>>,
}

impl Workers {
    /// Hand `batch` over (leaving it empty): a lone small write with nothing queued
    /// runs here, on the reader; otherwise the jobs are queued with one lock and
    /// workers are woken, or started, until one per CPU is running. Fails only if no
    /// worker can run at all.
    fn dispatch(&mut self, conn: &Arc<Conn>, batch: &mut Vec<Job>) -> io::Result<()> {
        if batch.is_empty() {
            return Ok(());
        }
        let mut queue = conn.queue.lock();
        if batch.len() == 1 && queue.jobs.is_empty() {
            if batch.iter().all(Job::quick) {
                drop(queue);
                for job in batch.drain(..) {
                    conn.execute(job);
                }
                conn.replies.flush();
                return Ok(());
            }
            if let Some(job) = batch.pop_if(|job| matches!(job.command, Command::Read { .. })) {
                // A lone read whose bytes are at hand is answered here (queue depth 1
                // reads: no hand-over to a worker and back). Others go to a worker.
                drop(queue);
                match conn.try_read_here(job) {
                    Ok(()) => return Ok(()),
                    Err(job) => batch.push(job),
                }
                queue = conn.queue.lock();
            }
        }
        for job in batch.drain(..) {
            queue.queued_may_wait += usize::from(job.may_wait());
            queue.queued_heavy += usize::from(job.heavy());
            queue.jobs.push_back(job);
        }
        // A job that may wait gets a worker of its own; the others share one running
        // worker per CPU. Small jobs wake another worker only when more are queued
        // than are running (a running worker takes the next one, and its replies go
        // out together); a queued large write gets an idle CPU at once.
        let running = queue
            .workers
            .saturating_sub(queue.idle + queue.running_may_wait);
        let queued_cpu = queue.jobs.len() - queue.queued_may_wait;
        let wake_cpu = if queue.queued_heavy > 0 {
            queued_cpu.min(conn.workers_running_max.saturating_sub(running))
        } else {
            queued_cpu
                .min(conn.workers_running_max)
                .saturating_sub(running)
        };
        let wake = queue.queued_may_wait + wake_cpu;
        let woken = wake.min(queue.idle);
        for _ in 0..woken {
            conn.job_ready.notify_one();
        }
        let start = (wake - woken).min(conn.workers_max.saturating_sub(queue.workers));
        queue.workers += start;
        drop(queue);
        for _ in 0..start {
            self.start(conn)?;
        }
        Ok(())
    }

    /// Start one worker (already counted in `Queue::workers`).
    fn start(&mut self, conn: &Arc<Conn>) -> io::Result<()> {
        // Join workers that retired, so their threads are released.
        let (retired, alive): (Vec<_>, Vec<_>) =
            self.handles.drain(..).partition(|w| w.is_finished());
        self.handles = alive;
        for worker in retired {
            let _ = worker.join();
        }
        let worker_conn = Arc::clone(conn);
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-work-{}", conn.id))
            .stack_size(THREAD_STACK_BYTES)
            .spawn(move || work(&worker_conn));
        match spawned {
            Ok(handle) => self.handles.push(handle),
            Err(e) => {
                let mut queue = conn.queue.lock();
                queue.workers -= 1;
                if queue.workers == 0 {
                    return Err(e);
                }
                tracing::warn!(error = %e, "NBD worker not started; using fewer");
            }
        }
        Ok(())
    }
}

/// How waiting for a request header ended.
enum Header {
    /// The header is in the buffer.
    Read,
    /// The stream ended before its first byte.
    Eof,
    /// Nothing came and nothing was in flight for the idle timeout.
    Idle,
}

/// Fill `buf` with a request header. The socket's read timeout only wakes the reader
/// (it is at most `idle_timeout`): a client may stay idle between (or within)
/// headers as long as it likes, unless `idle_timeout` is set and it sends nothing
/// while none of its requests is in flight for that long.
fn read_header(
    reader: &mut BufReader<StreamReader>,
    buf: &mut [u8],
    idle_timeout: Option<Duration>,
    inflight: &Inflight,
) -> io::Result<Header> {
    let mut filled = 0;
    let mut idle_since = Instant::now();
    let mut busy = inflight.requests_in_flight() > 0;
    while filled < buf.len() {
        let Some(rest) = buf.get_mut(filled..) else {
            break;
        };
        match reader.read(rest) {
            Ok(0) if filled == 0 => return Ok(Header::Eof),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) && !reader.get_ref().has_deadline() =>
            {
                let Some(limit) = idle_timeout else { continue };
                // Idle from the first wake-up that finds nothing in flight.
                if busy || filled > 0 {
                    idle_since = Instant::now();
                }
                busy = inflight.requests_in_flight() > 0;
                if !busy && filled == 0 && idle_since.elapsed() >= limit {
                    return Ok(Header::Idle);
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(Header::Read)
}

/// Read and throw away `len` bytes of a refused request's payload.
fn discard(reader: &mut impl Read, len: u64, scratch: &mut Vec<u8>) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    scratch.resize(DISCARD_CHUNK_BYTES, 0);
    let mut left = len;
    while left > 0 {
        let n = usize::try_from(left)
            .unwrap_or(usize::MAX)
            .min(scratch.len());
        let Some(chunk) = scratch.get_mut(..n) else {
            break;
        };
        reader.read_exact(chunk)?;
        left -= n as u64;
    }
    Ok(())
}

/// A worker: run jobs until the reader closes the queue and it is empty. Replies of
/// quick jobs stay queued while more quick jobs are waiting (up to
/// [`REPLIES_DEFERRED_MAX`]), and are written before the worker waits or blocks.
fn work(conn: &Arc<Conn>) {
    let mut deferred = 0usize;
    let mut queue = conn.queue.lock();
    loop {
        let Some(job) = queue.jobs.pop_front() else {
            if deferred > 0 {
                deferred = 0;
                MutexGuard::unlocked(&mut queue, || conn.replies.flush());
                continue;
            }
            if queue.closed {
                queue.workers -= 1;
                return;
            }
            queue.idle += 1;
            let idle_too_long = conn
                .job_ready
                .wait_for(&mut queue, WORKER_IDLE_TIMEOUT)
                .timed_out();
            queue.idle -= 1;
            if idle_too_long && queue.jobs.is_empty() && !queue.closed {
                // Retire: an idle connection keeps only its reader thread, and no
                // payload buffers.
                queue.workers -= 1;
                conn.buffers.clear();
                return;
            }
            continue;
        };
        let may_wait = job.may_wait();
        if may_wait {
            queue.queued_may_wait -= 1;
            queue.running_may_wait += 1;
        }
        if job.heavy() {
            queue.queued_heavy -= 1;
        }
        let flush_first = deferred >= REPLIES_DEFERRED_MAX || !job.quick();
        MutexGuard::unlocked(&mut queue, || {
            if flush_first && deferred > 0 {
                conn.replies.flush();
                deferred = 0;
            }
            conn.execute(job);
            deferred += 1;
            if may_wait {
                conn.replies.flush();
                deferred = 0;
            }
        });
        if may_wait {
            queue.running_may_wait -= 1;
        }
    }
}

/// A short name for an NBD error value, for messages.
fn errno_name(errno: u32) -> &'static str {
    match errno {
        EPERM => "operation not permitted",
        EIO => "input/output error",
        ENOMEM => "out of memory",
        crate::export::EINVAL => "invalid argument",
        ENOSPC => "no space left",
        EOVERFLOW => "value too large",
        ENOTSUP => "operation not supported",
        ESHUTDOWN => "the export is shutting down",
        _ => "error",
    }
}

/// Clip and merge an export's runs to exactly `[offset, offset+len)`: a list of
/// `(start, len, is_data)`. A short answer is padded with data (the safe claim).
fn plan_runs(offset: u64, len: u64, runs: &[(u64, bool)]) -> Vec<(u64, u64, bool)> {
    let mut out: Vec<(u64, u64, bool)> = Vec::with_capacity(runs.len().min(1024));
    let end = offset.saturating_add(len);
    let mut pos = offset;
    let push =
        |out: &mut Vec<(u64, u64, bool)>, start: u64, n: u64, data: bool| match out.last_mut() {
            Some(last) if last.2 == data => last.1 += n,
            _ => out.push((start, n, data)),
        };
    for &(run_len, data) in runs {
        if pos >= end {
            break;
        }
        let n = run_len.min(end - pos);
        if n == 0 {
            continue;
        }
        push(&mut out, pos, n, data);
        pos += n;
    }
    if pos < end {
        push(&mut out, pos, end - pos, true);
    }
    out
}

/// Split a read buffer into runs of data and of zeros, `(start, len, is_data)`, on
/// [`HOLE_SCAN_BYTES`] boundaries of the export (edge pieces follow the request).
fn zero_runs(offset: u64, buf: &[u8]) -> Vec<(u64, u64, bool)> {
    let mut out: Vec<(u64, u64, bool)> = Vec::new();
    let mut pos = 0usize;
    while pos < buf.len() {
        let absolute = offset + pos as u64;
        let to_boundary = HOLE_SCAN_BYTES - (absolute % HOLE_SCAN_BYTES);
        let n = usize::try_from(to_boundary)
            .unwrap_or(usize::MAX)
            .min(buf.len() - pos);
        let data = buf
            .get(pos..pos + n)
            .is_some_and(|piece| piece.iter().any(|&b| b != 0));
        match out.last_mut() {
            Some(last) if last.2 == data => last.1 += n as u64,
            _ => out.push((absolute, n as u64, data)),
        }
        pos += n;
    }
    out
}

impl Conn {
    /// Run a job and queue its reply, which holds the job's permit until written.
    fn execute(&self, job: Job) {
        let Job {
            header,
            command,
            payload,
            permit,
        } = job;
        let ran = catch_unwind(AssertUnwindSafe(|| {
            self.run(&header, command, payload.bytes())
        }));
        // The write data is in the export now; its bytes stay counted until the reply is out.
        self.buffers.give_back(payload);
        let mut reply = ran.unwrap_or_else(|_| {
            tracing::error!(id = self.id, ?command, "NBD export panicked; answering EIO");
            self.error_reply(&header, EIO, "internal error in the server's export")
        });
        reply.hold(permit);
        self.replies.push(reply);
    }

    /// Run one command; its reply.
    fn run(&self, h: &RequestHeader, command: Command, payload: &[u8]) -> Reply {
        match command {
            Command::Read { offset, len, df } => self.read(h, offset, len, df),
            Command::Write { offset, fua, .. } => {
                let r = self.export.write(offset, payload, fua);
                self.finish(h, "write", r)
            }
            Command::Flush => {
                let r = self.export.flush();
                self.finish(h, "flush", r)
            }
            Command::Trim { offset, len, fua } => {
                let r = self.export.trim(offset, len, fua);
                self.finish(h, "trim", r)
            }
            Command::WriteZeroes { offset, len, fua } => {
                // NO_HOLE and FAST_ZERO need nothing: zeroing is a block-map update, always
                // fast; whether a later write there finds space is the volume's
                // reservation's to promise (a thick volume's covers its whole size, a
                // thin one promises nothing, for zeroed blocks or any others).
                let r = self.export.write_zeroes(offset, len, fua);
                self.finish(h, "write zeroes", r)
            }
            Command::BlockStatus {
                offset,
                len,
                req_one,
            } => self.block_status(h, offset, len, req_one),
            // A hint: the store has no cache to warm; success is what the spec allows.
            Command::Cache => self.ok_reply(h),
            // The reader handles DISC itself; it never reaches a worker. Nothing to send.
            Command::Disconnect => Reply::with_capacity(0, 0),
        }
    }

    fn finish(&self, h: &RequestHeader, op: &str, result: Result<(), u32>) -> Reply {
        match result {
            Ok(()) => self.ok_reply(h),
            Err(errno) => self.export_failed(h, op, errno),
        }
    }

    fn export_failed(&self, h: &RequestHeader, op: &str, errno: u32) -> Reply {
        let message = format!(
            "{op} of {} bytes at offset {} failed: {}",
            h.length,
            h.offset,
            errno_name(errno)
        );
        if errno == EIO {
            tracing::warn!(id = self.id, %message, "NBD request failed");
        } else {
            tracing::debug!(id = self.id, %message, "NBD request failed");
        }
        self.error_reply(h, errno, &message)
    }

    fn read(&self, h: &RequestHeader, offset: u64, len: u32, df: bool) -> Reply {
        // `len` ≤ PAYLOAD_MAX_BYTES, and its bytes are already counted in the budget.
        let mut buf = vec![0u8; len as usize];
        if let Err(errno) = self.export.read(offset, &mut buf) {
            return self.export_failed(h, "read", errno);
        }
        self.read_reply(h, offset, buf, df)
    }

    /// Run a lone small read here, on the reader, if the export has its bytes at hand
    /// (see [`Export::read_cached`]); otherwise give the job back for a worker.
    fn try_read_here(&self, job: Job) -> std::result::Result<(), Job> {
        let Command::Read { offset, len, df } = job.command else {
            return Err(job);
        };
        if len > QUICK_REQUEST_BYTES_MAX {
            return Err(job);
        }
        let mut buf = vec![0u8; len as usize];
        let done = catch_unwind(AssertUnwindSafe(|| {
            self.export.read_cached(offset, &mut buf)
        }))
        .unwrap_or(false);
        if !done {
            return Err(job);
        }
        let mut reply = self.read_reply(&job.header, offset, buf, df);
        reply.hold(job.permit);
        self.replies.push(reply);
        self.replies.flush();
        Ok(())
    }

    /// The reply to a read whose bytes are in `buf`.
    fn read_reply(&self, h: &RequestHeader, offset: u64, buf: Vec<u8>, df: bool) -> Reply {
        let len = buf.len() as u32;
        if !self.mode.chunked() {
            let mut reply = Reply::simple(h.cookie, 0);
            reply.set_data(buf);
            reply.push_data(0..len as usize);
            return reply;
        }
        let len64 = u64::from(len);
        // Ranges that read as zeros go out as OFFSET_HOLE chunks, unless the client
        // asked for one chunk (DF). Every non-data extent (unmapped or zero block)
        // reads as zeros, so scanning the buffer finds them all without a second call
        // into the export per read, and always agrees with the data just read.
        let runs = if df {
            vec![(offset, len64, true)]
        } else {
            zero_runs(offset, &buf)
        };
        let mut reply =
            Reply::with_capacity(runs.len() * 2, runs.len() * (EXTENDED_REPLY_BYTES + 12));
        reply.set_data(buf);
        let last = runs.len().saturating_sub(1);
        for (i, &(start, n, data)) in runs.iter().enumerate() {
            let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
            if data {
                let head = ChunkHeader::new(
                    self.mode,
                    flags,
                    REPLY_TYPE_OFFSET_DATA,
                    h.cookie,
                    h.offset,
                    8 + n,
                );
                reply.push_head(head.as_bytes());
                reply.push_head(&start.to_be_bytes());
                let from = (start - offset) as usize;
                reply.push_data(from..from + n as usize);
            } else {
                let head = ChunkHeader::new(
                    self.mode,
                    flags,
                    REPLY_TYPE_OFFSET_HOLE,
                    h.cookie,
                    h.offset,
                    12,
                );
                reply.push_head(head.as_bytes());
                reply.push_head(&start.to_be_bytes());
                // A run is within a read of ≤ 32 MiB.
                reply.push_head(&(n as u32).to_be_bytes());
            }
        }
        reply
    }

    /// The runs of `[offset, offset+len)` (at most [`BLOCK_STATUS_QUERY_MAX_BYTES`]),
    /// asked of `query` (the export's extents, or a dirty bitmap's runs) in steps of
    /// [`BLOCK_STATUS_QUERY_STEP_BYTES`] until `descriptors` runs are known: the runs
    /// in memory stay near that count, however fragmented the range. A run's flag is
    /// true for data (allocation) or dirty (a bitmap); what `query` leaves out is
    /// reported so, the answer a client can act on safely.
    fn runs(
        offset: u64,
        len: u64,
        descriptors: usize,
        query: impl Fn(u64, u64) -> Result<Vec<(u64, bool)>, u32>,
    ) -> Result<Vec<(u64, u64, bool)>, u32> {
        let end = offset.saturating_add(len.min(BLOCK_STATUS_QUERY_MAX_BYTES));
        let mut out: Vec<(u64, u64, bool)> = Vec::new();
        let mut pos = offset;
        while pos < end && out.len() < descriptors {
            let step = BLOCK_STATUS_QUERY_STEP_BYTES.min(end - pos);
            for run in plan_runs(pos, step, &query(pos, step)?) {
                match out.last_mut() {
                    Some(last) if last.2 == run.2 => last.1 += run.1,
                    _ => out.push(run),
                }
            }
            pos += step;
        }
        out.truncate(descriptors);
        Ok(out)
    }

    /// One block status chunk's payload: the context's id and its descriptors.
    fn status_payload(
        &self,
        id: u32,
        runs: &[(u64, u64, bool)],
        flags: impl Fn(bool) -> u32,
    ) -> Vec<u8> {
        let mut payload;
        if self.mode.extended {
            payload = Vec::with_capacity(8 + 16 * runs.len());
            payload.extend_from_slice(&id.to_be_bytes());
            payload.extend_from_slice(&(runs.len() as u32).to_be_bytes());
            for &(_, n, flag) in runs {
                payload.extend_from_slice(&n.to_be_bytes());
                payload.extend_from_slice(&u64::from(flags(flag)).to_be_bytes());
            }
        } else {
            payload = Vec::with_capacity(4 + 8 * runs.len());
            payload.extend_from_slice(&id.to_be_bytes());
            for &(_, n, flag) in runs {
                // Compact requests carry a 32-bit length, so every run fits.
                let n32 = u32::try_from(n).unwrap_or(COMPACT_DESCRIPTOR_MAX_BYTES as u32);
                payload.extend_from_slice(&n32.to_be_bytes());
                payload.extend_from_slice(&flags(flag).to_be_bytes());
            }
        }
        payload
    }

    /// Block status: a chunk for each metadata context selected (`base:allocation`
    /// first, then the dirty bitmaps in the order chosen), the last one flagged done.
    fn block_status(&self, h: &RequestHeader, offset: u64, len: u64, req_one: bool) -> Reply {
        let descriptors = if req_one {
            1
        } else {
            BLOCK_STATUS_DESCRIPTORS_MAX
        };
        let mut payloads: Vec<Vec<u8>> = Vec::with_capacity(1 + self.contexts.bitmaps.len());
        if self.contexts.base_allocation {
            match Self::runs(offset, len, descriptors, |at, n| self.export.extents(at, n)) {
                Ok(runs) => payloads.push(self.status_payload(
                    META_CONTEXT_BASE_ALLOCATION_ID,
                    &runs,
                    |data| if data { 0 } else { STATE_HOLE | STATE_ZERO },
                )),
                Err(errno) => return self.export_failed(h, "block status", errno),
            }
        }
        for (k, (_, bitmap)) in self.contexts.bitmaps.iter().enumerate() {
            match Self::runs(offset, len, descriptors, |at, n| bitmap.runs(at, n)) {
                Ok(runs) => payloads.push(self.status_payload(
                    META_CONTEXT_DIRTY_BITMAP_FIRST_ID + k as u32,
                    &runs,
                    |dirty| if dirty { STATE_DIRTY } else { 0 },
                )),
                Err(errno) => return self.export_failed(h, "block status (dirty bitmap)", errno),
            }
        }
        let kind = if self.mode.extended {
            REPLY_TYPE_BLOCK_STATUS_EXT
        } else {
            REPLY_TYPE_BLOCK_STATUS
        };
        let last = payloads.len().saturating_sub(1);
        let mut reply = Reply::with_capacity(2 * payloads.len(), 32 * payloads.len());
        let mut data = Vec::with_capacity(payloads.iter().map(Vec::len).sum());
        let mut ranges = Vec::with_capacity(payloads.len());
        for payload in &payloads {
            ranges.push(data.len()..data.len() + payload.len());
            data.extend_from_slice(payload);
        }
        reply.set_data(data);
        for (k, range) in ranges.into_iter().enumerate() {
            let flags = if k == last { REPLY_FLAG_DONE } else { 0 };
            let head = ChunkHeader::new(
                self.mode,
                flags,
                kind,
                h.cookie,
                h.offset,
                range.len() as u64,
            );
            reply.push_head(head.as_bytes());
            reply.push_data(range);
        }
        reply
    }

    /// Success without payload: a simple reply, or a NONE chunk under extended headers
    /// (which forbid simple replies).
    fn ok_reply(&self, h: &RequestHeader) -> Reply {
        if self.mode.extended {
            Reply::chunk(
                self.mode,
                REPLY_FLAG_DONE,
                REPLY_TYPE_NONE,
                h.cookie,
                h.offset,
                &[],
            )
        } else {
            Reply::simple(h.cookie, 0)
        }
    }

    /// An error: an ERROR chunk carrying the message when replies are chunked,
    /// else a simple reply with the error value (and never a payload).
    fn error_reply(&self, h: &RequestHeader, errno: u32, message: &str) -> Reply {
        if self.mode.chunked() {
            let payload = error_chunk_payload(errno, message);
            Reply::chunk(
                self.mode,
                REPLY_FLAG_DONE,
                REPLY_TYPE_ERROR,
                h.cookie,
                h.offset,
                &payload,
            )
        } else {
            Reply::simple(h.cookie, errno)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{plan_runs, zero_runs};

    #[test]
    fn zero_runs_follow_4k_boundaries_of_the_export() {
        let mut buf = vec![0u8; 3 * 4096];
        buf[4096] = 1;
        // The read starts 512 bytes into a block: edges are partial blocks.
        assert_eq!(
            zero_runs(512, &buf),
            vec![(512, 3584, false), (4096, 4096, true), (8192, 4608, false)]
        );
        assert_eq!(zero_runs(0, &[0; 512]), vec![(0, 512, false)]);
        assert_eq!(zero_runs(0, &[7; 8192]), vec![(0, 8192, true)]);
        assert!(zero_runs(0, &[]).is_empty());
    }

    #[test]
    fn runs_are_clipped_merged_and_padded() {
        // Export reports more than asked, with adjacent runs of one kind.
        let runs = [(4096, true), (4096, true), (8192, false), (1 << 20, true)];
        assert_eq!(
            plan_runs(0, 12288 + 4096, &runs),
            vec![(0, 8192, true), (8192, 8192, false)]
        );
        // Short answer: the rest is claimed as data.
        assert_eq!(
            plan_runs(512, 8192, &[(1024, false)]),
            vec![(512, 1024, false), (1536, 7168, true)]
        );
        // Zero-length runs are skipped; empty answers become one data run.
        assert_eq!(plan_runs(0, 512, &[(0, false)]), vec![(0, 512, true)]);
        assert_eq!(plan_runs(0, 512, &[]), vec![(0, 512, true)]);
    }
}
