//! Requests in flight and the limits on them: each connection's own limit, the
//! server-wide request slots and buffer bytes (each connection's reserve, then the
//! shared pools), and the [`Permit`] a request holds from the moment its header is
//! read until its reply has been written.

use crate::config::{
    CONNECTION_RESERVED_BUFFER_BYTES, CONNECTION_SHARED_BUFFER_BYTES_MAX,
    PAYLOAD_COMPLETION_RESERVE_BYTES,
};
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Requests and buffer bytes in flight across the server, with their limits.
///
/// Buffer bytes come from two places, so that no connection can starve the others
/// by stalling (a client that pipelines large reads and never reads the replies, or
/// sends a large write's header and never its payload, holds its buffers for up to
/// [`crate::REPLY_WRITE_TIMEOUT`] or [`crate::PAYLOAD_TIMEOUT`]):
/// - each connection's own reserve of [`CONNECTION_RESERVED_BUFFER_BYTES`], which no
///   other connection can take, so ordinary requests always find room;
/// - the shared pool of [`crate::INFLIGHT_BUFFER_BYTES_MAX`], of which one connection holds
///   at most [`CONNECTION_SHARED_BUFFER_BYTES_MAX`], so several connections always
///   find room for large requests too.
#[derive(Debug)]
pub(crate) struct InflightLimits {
    state: Mutex<InflightState>,
    released: Condvar,
    requests_max: usize,
    bytes_max: u64,
    /// Requests in flight across the server, readable without the lock (a reader
    /// polls its socket only while no connection has any: see `stream.rs`).
    requests_now: Arc<AtomicUsize>,
}

#[derive(Debug, Default)]
struct InflightState {
    /// Request slots taken from the shared pool.
    shared_requests: usize,
    /// Request slots taken from connections' own reserves.
    reserved_requests: usize,
    /// Bytes taken from the shared pool.
    shared_bytes: u64,
    /// Bytes taken from connections' own reserves.
    reserved_bytes: u64,
}

/// One connection's requests in flight: at most its own limit of them, and its view
/// of the server-wide limits: its request slots and buffer bytes come from its own
/// reserve first, then from the shared pools (bytes up to its cap; request slots up
/// to its per-connection limit).
#[derive(Debug)]
pub(crate) struct Inflight {
    limits: Arc<InflightLimits>,
    /// Requests in flight on this connection at most
    /// ([`crate::ServerConfig::max_inflight_per_connection`]).
    requests_max: usize,
    /// Requests holding a [`Permit`] on this connection (queued, running or replying).
    requests: Mutex<usize>,
    /// The reader waits here for a per-connection slot.
    slot_free: Condvar,
    /// `requests`, readable without the lock (the reader polls only while it is
    /// zero: with requests in flight, the CPUs are better left to workers).
    requests_now: Arc<AtomicUsize>,
    /// Size of this connection's reserve of request slots.
    requests_reserve: usize,
    /// This connection's request slots in its own reserve, and in the shared pool
    /// (changed only under `limits.state`'s lock, like the bytes below).
    reserved_requests: AtomicUsize,
    shared_requests: AtomicUsize,
    /// This connection's bytes in its own reserve, and in the shared pool. Changed
    /// only under `limits.state`'s lock (atomics only to be `Sync` without a second
    /// lock). Which bucket a request's bytes came from is not remembered: a release
    /// gives back shared bytes first, which leaves the same total held either way.
    reserved_bytes: AtomicU64,
    shared_bytes: AtomicU64,
}

impl InflightLimits {
    /// Limits with `requests_max` shared request slots and `bytes_max` shared bytes.
    pub(crate) fn new(requests_max: usize, bytes_max: u64) -> InflightLimits {
        InflightLimits {
            state: Mutex::new(InflightState::default()),
            released: Condvar::new(),
            requests_max,
            bytes_max,
            requests_now: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Requests in flight across the server now, readable without a lock.
    pub(crate) fn requests_now(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.requests_now)
    }

    /// Keep `requests_now` equal to the slots taken (called under `state`'s lock).
    fn publish(&self, state: &InflightState) {
        self.requests_now.store(
            state.shared_requests + state.reserved_requests,
            Ordering::Relaxed,
        );
    }

    /// A new connection's view: at most `requests_max` requests in flight, with an
    /// empty reserve of `requests_reserve` slots.
    pub(crate) fn for_connection(
        self: &Arc<Self>,
        requests_max: usize,
        requests_reserve: usize,
    ) -> Arc<Inflight> {
        Arc::new(Inflight {
            limits: Arc::clone(self),
            requests_max,
            requests: Mutex::new(0),
            slot_free: Condvar::new(),
            requests_now: Arc::new(AtomicUsize::new(0)),
            requests_reserve,
            reserved_requests: AtomicUsize::new(0),
            shared_requests: AtomicUsize::new(0),
            reserved_bytes: AtomicU64::new(0),
            shared_bytes: AtomicU64::new(0),
        })
    }

    /// Requests in flight now (reserved and shared).
    pub(crate) fn requests(&self) -> usize {
        let state = self.state.lock();
        state.shared_requests + state.reserved_requests
    }

    /// Requests and buffer bytes (reserved and shared) in flight now.
    pub(crate) fn snapshot(&self) -> (usize, u64) {
        let state = self.state.lock();
        (
            state.shared_requests + state.reserved_requests,
            state.shared_bytes + state.reserved_bytes,
        )
    }
}

impl Inflight {
    /// This connection's requests in flight now, readable without a lock.
    pub(crate) fn requests_now(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.requests_now)
    }

    /// This connection's requests in flight now (queued, running or replying).
    pub(crate) fn requests_in_flight(&self) -> usize {
        self.requests_now.load(Ordering::Relaxed)
    }

    /// Take a server-wide request slot if one is free now.
    fn try_acquire_request(&self) -> bool {
        let mut state = self.limits.state.lock();
        self.take_request(&mut state)
    }

    /// Take a slot from this connection's reserve, else from the shared pool, if
    /// either has one free now.
    fn take_request(&self, state: &mut InflightState) -> bool {
        let reserved = self.reserved_requests.load(Ordering::Relaxed);
        if reserved < self.requests_reserve {
            self.reserved_requests
                .store(reserved + 1, Ordering::Relaxed);
            state.reserved_requests += 1;
            self.limits.publish(state);
            return true;
        }
        if state.shared_requests < self.limits.requests_max {
            self.shared_requests.fetch_add(1, Ordering::Relaxed);
            state.shared_requests += 1;
            self.limits.publish(state);
            return true;
        }
        false
    }

    /// Take `bytes` more buffer bytes if they fit now.
    fn try_acquire_bytes(&self, bytes: u64) -> bool {
        let mut state = self.limits.state.lock();
        self.take_bytes(&mut state, bytes)
    }

    /// Take `bytes` from this connection's reserve, else from the shared pool, if
    /// either has room now.
    fn take_bytes(&self, state: &mut InflightState, bytes: u64) -> bool {
        let reserved = self.reserved_bytes.load(Ordering::Relaxed);
        if reserved + bytes <= CONNECTION_RESERVED_BUFFER_BYTES {
            self.reserved_bytes
                .store(reserved + bytes, Ordering::Relaxed);
            state.reserved_bytes += bytes;
            return true;
        }
        let shared = self.shared_bytes.load(Ordering::Relaxed);
        if shared + bytes <= CONNECTION_SHARED_BUFFER_BYTES_MAX
            && state.shared_bytes + bytes <= self.limits.bytes_max
        {
            self.shared_bytes.store(shared + bytes, Ordering::Relaxed);
            state.shared_bytes += bytes;
            return true;
        }
        false
    }

    /// Take the next piece of a write payload as it arrives: `piece` bytes, of which
    /// `remaining` (the piece included) are not charged yet. From this connection's
    /// reserve if they fit; else from the shared pool while it keeps
    /// [`PAYLOAD_COMPLETION_RESERVE_BYTES`] free; else, when the whole remainder fits
    /// what is free, all of it (the payload then finishes without another wait).
    /// Returns the bytes taken, 0 when nothing fits now.
    ///
    /// Why this cannot leave two honest payloads waiting on each other: pieces never
    /// take the last [`PAYLOAD_COMPLETION_RESERVE_BYTES`] of the pool, so once the
    /// requests charged whole (reads, and payloads that took their remainder) are
    /// answered, at least that much is free, and any waiting payload's remainder
    /// (≤ one maximum payload) fits.
    fn take_piece(&self, state: &mut InflightState, piece: u64, remaining: u64) -> u64 {
        let reserved = self.reserved_bytes.load(Ordering::Relaxed);
        if reserved + piece <= CONNECTION_RESERVED_BUFFER_BYTES {
            self.reserved_bytes
                .store(reserved + piece, Ordering::Relaxed);
            state.reserved_bytes += piece;
            return piece;
        }
        let shared = self.shared_bytes.load(Ordering::Relaxed);
        let free = self.limits.bytes_max.saturating_sub(state.shared_bytes);
        let take = if free >= piece + PAYLOAD_COMPLETION_RESERVE_BYTES {
            piece
        } else if free >= remaining {
            remaining
        } else {
            return 0;
        };
        if shared + take > CONNECTION_SHARED_BUFFER_BYTES_MAX {
            return 0;
        }
        self.shared_bytes.store(shared + take, Ordering::Relaxed);
        state.shared_bytes += take;
        take
    }

    /// Wait for a server-wide request slot.
    fn acquire_request(&self) {
        let mut state = self.limits.state.lock();
        while !self.take_request(&mut state) {
            self.limits.released.wait(&mut state);
        }
    }

    /// Wait until `bytes` more buffer bytes fit (`bytes` ≤ a connection's share of
    /// the pool, checked at compile time, so they fit once this connection's
    /// earlier requests are answered).
    fn acquire_bytes(&self, bytes: u64) {
        let mut state = self.limits.state.lock();
        while !self.take_bytes(&mut state, bytes) {
            self.limits.released.wait(&mut state);
        }
    }

    /// Give back one server-wide request slot and its bytes.
    fn release(&self, bytes: u64) {
        let mut state = self.limits.state.lock();
        let shared = self.shared_bytes.load(Ordering::Relaxed);
        let reserved = self.reserved_bytes.load(Ordering::Relaxed);
        let shared_requests = self.shared_requests.load(Ordering::Relaxed);
        let reserved_requests = self.reserved_requests.load(Ordering::Relaxed);
        // A release without its acquire would corrupt the accounting every other
        // connection waits on: fail loudly rather than clamp.
        assert!(
            shared_requests + reserved_requests > 0,
            "a request slot released but this connection holds none"
        );
        assert!(
            shared + reserved >= bytes,
            "{bytes} buffer bytes released, more than this connection holds"
        );
        let from_shared = bytes.min(shared);
        let from_reserved = bytes - from_shared;
        self.shared_bytes
            .store(shared - from_shared, Ordering::Relaxed);
        self.reserved_bytes
            .store(reserved - from_reserved, Ordering::Relaxed);
        // Shared slots first, as for bytes: the reserve is what stays at hand.
        if shared_requests > 0 {
            self.shared_requests
                .store(shared_requests - 1, Ordering::Relaxed);
            state.shared_requests -= 1;
        } else {
            self.reserved_requests
                .store(reserved_requests - 1, Ordering::Relaxed);
            state.reserved_requests -= 1;
        }
        state.shared_bytes -= from_shared;
        state.reserved_bytes -= from_reserved;
        self.limits.publish(&state);
        self.limits.released.notify_all();
    }
}

/// A request's share of the limits, given back when its reply has been written.
pub(crate) struct Permit {
    inflight: Arc<Inflight>,
    bytes: u64,
}

impl Permit {
    /// Wait for a per-connection slot, then a server-wide one.
    pub(crate) fn acquire(inflight: &Arc<Inflight>) -> Permit {
        {
            let mut requests = inflight.requests.lock();
            while *requests >= inflight.requests_max {
                inflight.slot_free.wait(&mut requests);
            }
            *requests += 1;
            inflight.requests_now.store(*requests, Ordering::Relaxed);
        }
        inflight.acquire_request();
        Permit {
            inflight: Arc::clone(inflight),
            bytes: 0,
        }
    }

    /// A per-connection and a server-wide slot if both are free now.
    pub(crate) fn try_acquire(inflight: &Arc<Inflight>) -> Option<Permit> {
        {
            let mut requests = inflight.requests.lock();
            if *requests >= inflight.requests_max {
                return None;
            }
            *requests += 1;
            inflight.requests_now.store(*requests, Ordering::Relaxed);
        }
        if !inflight.try_acquire_request() {
            let mut requests = inflight.requests.lock();
            *requests -= 1;
            inflight.requests_now.store(*requests, Ordering::Relaxed);
            inflight.slot_free.notify_one();
            return None;
        }
        Some(Permit {
            inflight: Arc::clone(inflight),
            bytes: 0,
        })
    }

    /// Wait until `bytes` of buffer fit the server-wide budget.
    pub(crate) fn add_bytes(&mut self, bytes: u64) {
        self.inflight.acquire_bytes(bytes);
        self.bytes += bytes;
    }

    /// Charge the next piece of a write payload if it fits now (see
    /// `Inflight::take_piece`): the bytes charged (`piece`, or all of `remaining`),
    /// 0 if none.
    pub(crate) fn try_add_piece(&mut self, piece: u64, remaining: u64) -> u64 {
        let taken = {
            let mut state = self.inflight.limits.state.lock();
            self.inflight.take_piece(&mut state, piece, remaining)
        };
        self.bytes += taken;
        taken
    }

    /// Wait until the next piece of a write payload fits, and charge it: the bytes
    /// charged (`piece`, or all of `remaining`).
    pub(crate) fn add_piece(&mut self, piece: u64, remaining: u64) -> u64 {
        let taken = {
            let inflight = &self.inflight;
            let mut state = inflight.limits.state.lock();
            loop {
                let taken = inflight.take_piece(&mut state, piece, remaining);
                if taken > 0 {
                    break taken;
                }
                inflight.limits.released.wait(&mut state);
            }
        };
        self.bytes += taken;
        taken
    }

    /// Take `bytes` of the budget if they fit now.
    pub(crate) fn try_add_bytes(&mut self, bytes: u64) -> bool {
        let fit = self.inflight.try_acquire_bytes(bytes);
        if fit {
            self.bytes += bytes;
        }
        fit
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.inflight.release(self.bytes);
        let mut requests = self.inflight.requests.lock();
        *requests = requests.saturating_sub(1);
        self.inflight
            .requests_now
            .store(*requests, Ordering::Relaxed);
        self.inflight.slot_free.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{INFLIGHT_BUFFER_BYTES_MAX, PAYLOAD_PIECE_BYTES};
    use crate::protocol::PAYLOAD_MAX_BYTES;

    #[test]
    fn payloads_arriving_together_all_finish_and_a_stalled_one_holds_what_came() {
        // 16 connections receive maximum payloads at once, a piece each in turn, and
        // a payload's bytes go back when it is complete (its write done and answered).
        // Pieces alone could fill the pool with half payloads that each wait for the
        // others; the completion reserve must let every one finish.
        let limits = Arc::new(InflightLimits::new(1024, INFLIGHT_BUFFER_BYTES_MAX));
        let payload = u64::from(PAYLOAD_MAX_BYTES);
        let conns: Vec<Arc<Inflight>> = (0..16).map(|_| limits.for_connection(64, 8)).collect();
        let mut permits: Vec<Option<Permit>> = conns.iter().map(Permit::try_acquire).collect();
        let mut remaining = vec![payload; conns.len()];
        let mut rounds = 0;
        while remaining.iter().any(|&r| r > 0) {
            rounds += 1;
            assert!(
                rounds < 10_000,
                "payloads wait on each other: {remaining:?}"
            );
            for (permit, left) in permits.iter_mut().zip(remaining.iter_mut()) {
                let Some(p) = permit.as_mut() else { continue };
                let piece = PAYLOAD_PIECE_BYTES.min(*left);
                *left -= p.try_add_piece(piece, *left);
                if *left == 0 {
                    *permit = None;
                }
            }
        }
        assert_eq!(limits.snapshot(), (0, 0));

        // A stalled payload holds the pieces that came: its first, from its own reserve.
        let staller = limits.for_connection(64, 8);
        let mut p = Permit::try_acquire(&staller).expect("a slot");
        assert_eq!(
            p.try_add_piece(PAYLOAD_PIECE_BYTES, payload),
            PAYLOAD_PIECE_BYTES
        );
        assert_eq!(limits.snapshot(), (1, PAYLOAD_PIECE_BYTES));
    }
}
