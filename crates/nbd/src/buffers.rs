//! Write payload buffers kept for reuse by one connection ([`PayloadBuffers`]): a
//! write's payload is read into a buffer that earlier requests already allocated and
//! initialised, instead of a fresh zeroed one per request. At 128 KiB per request a
//! fresh buffer cost a 128 KiB `memset` (or a fresh mapping and its page faults),
//! about 3% of the server's CPU on sequential writes.
//!
//! Memory: a connection keeps at most [`KEPT_BYTES_MAX`] in buffers between
//! requests, on top of the buffer bytes its requests hold in flight (which
//! `inflight.rs` limits), and drops them all when one of its workers retires idle.

use parking_lot::Mutex;

/// Bytes of idle buffers one connection keeps: four 128 KiB requests' worth (a
/// queue-depth-8 writer of 128 KiB returns a buffer about as often as it takes one),
/// or 128 buffers of 4 KiB. Bounds the memory an idle-but-connected client holds
/// beyond the in-flight budget (256 MiB at 512 connections, until their workers
/// retire and the buffers go).
pub(crate) const KEPT_BYTES_MAX: usize = 512 << 10;

/// Buffers kept at most, whatever their size.
const KEPT_BUFFERS_MAX: usize = 128;

/// A write's payload: the first `len` bytes of `buf`. `buf` may be longer (it was
/// initialised by an earlier, larger request), so no byte is zeroed twice.
pub(crate) struct Payload {
    buf: Vec<u8>,
    len: usize,
}

impl Payload {
    /// No payload.
    pub(crate) fn none() -> Payload {
        Payload {
            buf: Vec::new(),
            len: 0,
        }
    }

    /// The payload's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        self.buf.get(..self.len).unwrap_or(&[])
    }

    /// Bytes `from..to` of the payload, to be filled as they arrive: the buffer
    /// grows (zeroed) only to `to`, so a payload that stalls part-way holds memory
    /// for what arrived, not for its whole length.
    pub(crate) fn piece_mut(&mut self, from: usize, to: usize) -> &mut [u8] {
        let to = to.min(self.len);
        if self.buf.len() < to {
            self.buf.resize(to, 0);
        }
        self.buf.get_mut(from..to).unwrap_or(&mut [])
    }
}

/// One connection's idle payload buffers.
#[derive(Default)]
pub(crate) struct PayloadBuffers {
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    buffers: Vec<Vec<u8>>,
    bytes: usize,
}

impl PayloadBuffers {
    /// A payload of `len` bytes to fill with [`Payload::piece_mut`] (their content is
    /// whatever an earlier request left; a fresh buffer's room is reserved, not
    /// touched, until pieces arrive).
    pub(crate) fn take(&self, len: usize) -> Payload {
        let found = {
            let mut kept = self.kept.lock();
            // The most recently returned buffer that is large enough (warm in cache);
            // else any, grown below.
            let at = kept
                .buffers
                .iter()
                .rposition(|b| b.len() >= len)
                .or_else(|| kept.buffers.len().checked_sub(1));
            let buf = at.map(|i| kept.buffers.swap_remove(i));
            if let Some(b) = &buf {
                kept.bytes -= b.len();
            }
            buf
        };
        let mut buf = found.unwrap_or_default();
        buf.reserve(len.saturating_sub(buf.len()));
        Payload { buf, len }
    }

    /// Keep a payload's buffer for a later request, if it fits the limits.
    pub(crate) fn give_back(&self, payload: Payload) {
        let buf = payload.buf;
        if buf.is_empty() || buf.len() > KEPT_BYTES_MAX {
            return;
        }
        let mut kept = self.kept.lock();
        if kept.buffers.len() < KEPT_BUFFERS_MAX && kept.bytes + buf.len() <= KEPT_BYTES_MAX {
            kept.bytes += buf.len();
            kept.buffers.push(buf);
        }
    }

    /// Drop every kept buffer (the connection went idle).
    pub(crate) fn clear(&self) {
        let mut kept = self.kept.lock();
        kept.buffers.clear();
        kept.bytes = 0;
    }

    /// Bytes kept now.
    #[cfg(test)]
    fn kept_bytes(&self) -> usize {
        self.kept.lock().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_within_the_limits() {
        let pool = PayloadBuffers::default();
        let mut p = pool.take(4096);
        p.piece_mut(0, 4096).fill(7);
        assert_eq!(p.bytes().len(), 4096);
        pool.give_back(p);
        assert_eq!(pool.kept_bytes(), 4096);
        // A smaller payload reuses it; its bytes are the old ones (never read before
        // they are filled), and it stays 4096 long for the next large one.
        let p = pool.take(512);
        assert_eq!(p.bytes(), &[7u8; 512][..]);
        assert_eq!(pool.kept_bytes(), 0);
        pool.give_back(p);
        let p = pool.take(4096);
        assert_eq!(p.bytes().len(), 4096);
        pool.give_back(p);
        // Larger than what is kept: grown as pieces arrive.
        let mut p = pool.take(8192);
        assert_eq!(p.piece_mut(4096, 8192).len(), 4096);
        assert_eq!(p.bytes().len(), 8192);
        pool.give_back(p);
        assert_eq!(pool.kept_bytes(), 8192);
        // Past the byte limit: not kept.
        let big: Vec<Payload> = (0..5)
            .map(|_| {
                let mut p = pool.take(128 << 10);
                p.piece_mut(0, 128 << 10);
                p
            })
            .collect();
        for p in big {
            pool.give_back(p);
        }
        assert!(pool.kept_bytes() <= KEPT_BYTES_MAX);
        let mut p = pool.take(KEPT_BYTES_MAX + 1);
        p.piece_mut(0, KEPT_BYTES_MAX + 1);
        pool.give_back(p);
        assert!(pool.kept_bytes() <= KEPT_BYTES_MAX);
        pool.clear();
        assert_eq!(pool.kept_bytes(), 0);
        assert!(Payload::none().bytes().is_empty());
    }
}
