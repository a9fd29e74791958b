//! Replies of one connection: each built whole into an owned [`Reply`], queued, and
//! written in batches. Whichever thread finds the socket free writes every reply
//! queued so far with one `writev`, and keeps writing until the queue is empty;
//! a thread that finds another one writing only queues its reply. Replies that
//! complete together then cost one system call (and one TCP push) instead of one
//! each, and no thread waits for the socket while another writes.
//!
//! A reply carries its request's [`Permit`], given back once the reply is written
//! (or dropped because the connection failed), so the queue holds at most
//! `max_inflight_per_connection` replies and the buffers they point into are in the
//! server's byte budget until they are on the wire.

use crate::inflight::Permit;
use crate::protocol::{simple_reply, ChunkHeader, ReplyMode};
use crate::stream::Stream;
use parking_lot::Mutex;
use std::io::{self, IoSlice, Write};
use std::net::Shutdown;
use std::ops::Range;
use std::sync::Arc;

/// Where a piece of a reply lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// In [`Reply::heads`].
    Heads,
    /// In [`Reply::data`].
    Data,
}

/// One reply, whole, ready for the wire.
pub(crate) struct Reply {
    /// Reply and chunk headers (and small payloads), back to back.
    heads: Vec<u8>,
    /// Read data the reply carries (empty otherwise).
    data: Vec<u8>,
    /// The reply in wire order, as pieces of `heads` and `data`.
    parts: Vec<(Source, Range<usize>)>,
    /// The request's share of the limits, released when the reply is written.
    permit: Option<Permit>,
}

impl Reply {
    /// An empty reply with room for `parts` pieces and `heads_bytes` of headers.
    pub(crate) fn with_capacity(parts: usize, heads_bytes: usize) -> Reply {
        Reply {
            heads: Vec::with_capacity(heads_bytes),
            data: Vec::new(),
            parts: Vec::with_capacity(parts),
            permit: None,
        }
    }

    /// A simple reply (magic, error, cookie).
    pub(crate) fn simple(cookie: u64, errno: u32) -> Reply {
        let mut reply = Reply::with_capacity(1, crate::protocol::SIMPLE_REPLY_BYTES);
        reply.push_head(&simple_reply(cookie, errno));
        reply
    }

    /// One chunk: its header, then `payload`, copied (small payloads only).
    pub(crate) fn chunk(
        mode: ReplyMode,
        flags: u16,
        kind: u16,
        cookie: u64,
        request_offset: u64,
        payload: &[u8],
    ) -> Reply {
        let head = ChunkHeader::new(
            mode,
            flags,
            kind,
            cookie,
            request_offset,
            payload.len() as u64,
        );
        let mut reply = Reply::with_capacity(1, head.as_bytes().len() + payload.len());
        reply.push_head(head.as_bytes());
        reply.push_head(payload);
        reply
    }

    /// Append header bytes (merged into the previous piece when that one is headers
    /// too, so a run of headers is one slice on the wire).
    pub(crate) fn push_head(&mut self, bytes: &[u8]) {
        let begin = self.heads.len();
        self.heads.extend_from_slice(bytes);
        let end = self.heads.len();
        match self.parts.last_mut() {
            Some((Source::Heads, range)) if range.end == begin => range.end = end,
            _ => self.parts.push((Source::Heads, begin..end)),
        }
    }

    /// The buffer later [`Reply::push_data`] ranges point into.
    pub(crate) fn set_data(&mut self, data: Vec<u8>) {
        self.data = data;
    }

    /// Append `range` of the data buffer as a new piece.
    pub(crate) fn push_data(&mut self, range: Range<usize>) {
        debug_assert!(range.end <= self.data.len());
        self.parts.push((Source::Data, range));
    }

    /// Attach the request's permit, released once the reply is written.
    pub(crate) fn hold(&mut self, permit: Permit) {
        self.permit = Some(permit);
    }

    /// The pieces as slices, appended to `out`.
    fn slices<'a>(&'a self, out: &mut Vec<IoSlice<'a>>) {
        for (source, range) in &self.parts {
            let bytes = match source {
                Source::Heads => self.heads.get(range.clone()),
                Source::Data => self.data.get(range.clone()),
            };
            if let Some(bytes) = bytes.filter(|b| !b.is_empty()) {
                out.push(IoSlice::new(bytes));
            }
        }
    }
}

/// The replies of one connection waiting for the socket, and who is writing them.
pub(crate) struct Replies {
    id: u64,
    stream: Arc<Stream>,
    state: Mutex<ReplyState>,
}

#[derive(Default)]
struct ReplyState {
    /// Replies not yet taken by a writer; at most one per request in flight.
    pending: Vec<Reply>,
    /// A thread is writing: it will also write whatever is pushed meanwhile.
    writing: bool,
    /// A write failed: the connection is being torn down, later replies are dropped.
    failed: bool,
}

impl Replies {
    pub(crate) fn new(id: u64, stream: Arc<Stream>) -> Replies {
        Replies {
            id,
            stream,
            state: Mutex::new(ReplyState::default()),
        }
    }

    /// Queue a reply without writing it: the caller (or a thread writing now) calls
    /// [`Replies::flush`] soon.
    pub(crate) fn push(&self, reply: Reply) {
        let mut state = self.state.lock();
        if state.failed {
            drop(state);
            drop(reply);
            return;
        }
        state.pending.push(reply);
    }

    /// Queue a reply and write the queue.
    pub(crate) fn send(&self, reply: Reply) {
        self.push(reply);
        self.flush();
    }

    /// Write every queued reply, unless another thread is writing (it will write
    /// them). Returns once the queue was empty at some point after the call began,
    /// or another thread took over.
    pub(crate) fn flush(&self) {
        let mut batch = {
            let mut state = self.state.lock();
            if state.writing || state.pending.is_empty() {
                return;
            }
            state.writing = true;
            std::mem::take(&mut state.pending)
        };
        loop {
            let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(batch.len() * 2);
            for reply in &batch {
                reply.slices(&mut slices);
            }
            let written = write_all_slices(&self.stream, &mut slices);
            drop(slices);
            // Written (or failed): the permits go back, then the next batch.
            batch.clear();
            let mut state = self.state.lock();
            if let Err(e) = written {
                tracing::debug!(id = self.id, error = %e, "NBD reply not written; closing");
                state.failed = true;
                self.stream.shutdown(Shutdown::Both);
            }
            if state.failed {
                let dropped = std::mem::take(&mut state.pending);
                state.writing = false;
                drop(state);
                drop(dropped);
                return;
            }
            if state.pending.is_empty() {
                state.writing = false;
                return;
            }
            std::mem::swap(&mut batch, &mut state.pending);
        }
    }
}

/// `write_all` over several buffers with as few system calls as the kernel allows
/// (the standard library passes at most `IOV_MAX` slices per call).
fn write_all_slices(stream: &Stream, slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    let mut bufs: &mut [IoSlice<'_>] = slices;
    let mut w = stream;
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
