//! The pool's devices and its read-only latch.
//!
//! A pool has a data device and a metadata device, which are one device unless the
//! pool keeps its metadata apart. The first failed write or flush, corruption found,
//! or broken invariant latches the pool read-only: writes are refused from then on
//! (EngineError::ReadOnly), reads go on, and the journal is failed so that every
//! flush waiting on it returns. A pool opened read-only is latched from its open and
//! writes nothing.
//!
//! A latch because another client took a device over and fenced this one off
//! (`StorageError::Fenced`, an RBD image's lock lost) is told apart: the pool is no
//! longer this process's, and a server should stop rather than go on serving reads
//! from it (`Pool::on_latch`).

use crate::journal::Journal;
use crate::{EngineError, Result};
use fewerbytes_storage::{Storage, StorageError};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What a latch listener is told (`Pool::on_latch`).
#[derive(Debug, Clone)]
pub struct Latched {
    /// Why the pool latched (the first failure).
    pub reason: String,
    /// Another client took a device over and fenced this process off: the pool is
    /// no longer this process's to serve.
    pub fenced: bool,
}

/// Called once when the pool latches.
pub type LatchListener = Box<dyn Fn(&Latched) + Send + Sync>;

/// The devices, the latch, and whether the pool is closed.
pub(crate) struct Devices {
    data: Arc<dyn Storage>,
    meta: Arc<dyn Storage>,
    separate_metadata: bool,
    meta_path: Option<String>,
    /// Opened read-only: no checkpoint, no upgrade, no write of any kind.
    opened_read_only: bool,
    /// Shared with the devices' take-over watches (`Storage::on_fenced`), which hold
    /// it and not the devices.
    latch: Arc<Latch>,
    closed: AtomicBool,
}

/// The read-only latch.
struct Latch {
    latched: AtomicBool,
    /// Why the latch was set (the first reason wins).
    reason: Mutex<String>,
    /// The latch was set because a device was taken over by another client.
    fenced: AtomicBool,
    /// Told once when the latch is set (`Pool::on_latch`).
    listener: Mutex<Option<LatchListener>>,
    /// Failed by the latch, so that flushes waiting for a commit return.
    journal: Arc<Journal>,
}

impl Latch {
    /// A device was taken over (`Storage::on_fenced`). A pool opened read-only is
    /// latched from its open; it is only told, once, so that its server stops too.
    fn fence(&self, why: String, opened_read_only: bool) {
        if !opened_read_only {
            return self.set(why, true);
        }
        if !self.fenced.swap(true, Ordering::SeqCst) {
            tracing::error!("{why}");
            *self.reason.lock() = why.clone();
            if let Some(listener) = self.listener.lock().as_ref() {
                listener(&Latched {
                    reason: why,
                    fenced: true,
                });
            }
        }
    }

    fn set(&self, why: String, fenced: bool) {
        if !self.latched.swap(true, Ordering::SeqCst) {
            tracing::error!("{why}");
            *self.reason.lock() = why.clone();
            self.fenced.store(fenced, Ordering::SeqCst);
            self.journal.fail(why.clone());
            if let Some(listener) = self.listener.lock().as_ref() {
                listener(&Latched {
                    reason: why,
                    fenced,
                });
            }
        }
    }

    fn reason(&self) -> Option<String> {
        self.latched
            .load(Ordering::Acquire)
            .then(|| self.reason.lock().clone())
    }
}

impl Devices {
    /// The devices of an opening pool: `meta` with its path when metadata lives apart.
    pub(crate) fn new(
        data: Arc<dyn Storage>,
        meta: Option<(Arc<dyn Storage>, String)>,
        opened_read_only: bool,
        journal: Arc<Journal>,
    ) -> Self {
        let separate_metadata = meta.is_some();
        let (meta, meta_path) = match meta {
            Some((m, p)) => (m, Some(p)),
            None => (data.clone(), None),
        };
        let latch = Arc::new(Latch {
            latched: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
            fenced: AtomicBool::new(false),
            listener: Mutex::new(None),
            journal,
        });
        let watched = if separate_metadata {
            vec![&data, &meta]
        } else {
            vec![&data]
        };
        for device in watched {
            let latch = Arc::clone(&latch);
            device.on_fenced(Box::new(move |e| {
                latch.fence(format!("latched read-only: {e}"), opened_read_only);
            }));
        }
        Devices {
            data,
            meta,
            separate_metadata,
            meta_path,
            opened_read_only,
            latch,
            closed: AtomicBool::new(false),
        }
    }

    /// The data device.
    pub(crate) fn data(&self) -> &dyn Storage {
        self.data.as_ref()
    }
    /// The metadata device (the data device when metadata is not apart).
    pub(crate) fn meta(&self) -> &dyn Storage {
        self.meta.as_ref()
    }
    /// Metadata lives on its own device.
    pub(crate) fn separate_metadata(&self) -> bool {
        self.separate_metadata
    }
    /// The data device's name (its path).
    pub(crate) fn data_path(&self) -> String {
        self.data.name().to_string()
    }
    /// The metadata device's path, when metadata lives apart.
    pub(crate) fn meta_path(&self) -> Option<String> {
        self.meta_path.clone()
    }

    /// Opened read-only: nothing is ever written.
    pub(crate) fn opened_read_only(&self) -> bool {
        self.opened_read_only
    }
    /// Set the latch of a pool opened read-only, once loaded (no failure: no log,
    /// and the journal stays as it is).
    pub(crate) fn latch_opened_read_only(&self) {
        self.latch.latched.store(true, Ordering::SeqCst);
        *self.latch.reason.lock() = "opened read-only".into();
    }

    /// A device result, latching the pool read-only on an I/O failure.
    pub(crate) fn check_io<T>(&self, r: std::result::Result<T, StorageError>) -> Result<T> {
        r.map_err(|e| {
            let err = EngineError::Io(e);
            self.latch(&err);
            err
        })
    }

    /// A write's result, latching the pool read-only on an I/O failure but not when
    /// the device only had no space ([`StorageError::is_no_space`]): for writes whose
    /// caller keeps what it wrote and tries again later (the packers' data).
    pub(crate) fn check_write_or_no_space<T>(
        &self,
        r: std::result::Result<T, StorageError>,
    ) -> Result<T> {
        match r {
            Err(e) if e.is_no_space() => Err(EngineError::Io(e)),
            other => self.check_io(other),
        }
    }

    /// Latch the pool read-only if `err` is a device failure, corruption, or a
    /// broken invariant.
    pub(crate) fn latch(&self, err: &EngineError) {
        if matches!(
            err,
            EngineError::Io(_) | EngineError::Corrupt { .. } | EngineError::Invariant(_)
        ) {
            let fenced = matches!(err, EngineError::Io(e) if e.is_fenced());
            self.latch
                .set(format!("latched read-only after: {err}"), fenced);
        }
    }

    /// Latch the pool read-only for `why` (the first reason wins).
    pub(crate) fn latch_with(&self, why: String) {
        self.latch.set(why, false);
    }

    /// Call `listener` once when the pool latches (at once if it already has). A
    /// pool opened read-only calls it only when a device is taken over.
    pub(crate) fn on_latch(&self, listener: LatchListener) {
        let mut slot = self.latch.listener.lock();
        let fenced = self.latch.fenced.load(Ordering::SeqCst);
        let already = match self.latched() {
            Some(reason) if !self.opened_read_only || fenced => Some(reason),
            _ => None,
        };
        if let Some(reason) = already {
            listener(&Latched { reason, fenced });
            return;
        }
        *slot = Some(listener);
    }

    /// Latch the pool read-only if `r` reports a broken invariant (a count below zero).
    pub(crate) fn check_invariant<T>(&self, r: Result<T>) -> Result<T> {
        r.inspect_err(|e| self.latch(e))
    }

    /// Why the pool is latched, if it is.
    pub(crate) fn latched(&self) -> Option<String> {
        self.latch.reason()
    }

    /// Refuse a change to a latched or closed pool.
    pub(crate) fn ensure_writable(&self) -> Result<()> {
        if let Some(why) = self.latched() {
            return Err(EngineError::ReadOnly(why));
        }
        if self.is_closed() {
            return Err(EngineError::ReadOnly("the pool is closed".into()));
        }
        Ok(())
    }

    /// Mark the pool closed; returns whether it already was.
    pub(crate) fn close(&self) -> bool {
        self.closed.swap(true, Ordering::SeqCst)
    }
    /// The pool is closing or closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}
