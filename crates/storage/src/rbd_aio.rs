//! Asynchronous writes to an RBD image (`rbd_aio_write2`), for a batch of writes
//! that need not wait for one another ([`crate::Storage::write_batch`]).
//!
//! One request is an [`InFlight`]: a completion (`rbd_aio_create_completion`) given to
//! one `rbd_aio_write2`, waited for (`rbd_aio_wait_for_complete`), its result read
//! (`rbd_aio_get_return_value`) and released (`rbd_aio_release`), once each, on every
//! path: its `Drop` waits and releases, so a batch that stops at an error (or a panic)
//! still waits for what it submitted, and leaks no completion. It borrows the bytes it
//! writes for as long as it lives: librbd may write from the caller's buffer rather
//! than a copy (its zero-copy aio, when its cache is off) until the request completes.

use crate::rbd_lib::{Completion, Image, Lib};
use std::ffi::{c_char, c_void};
use std::marker::PhantomData;

/// Most requests one batch keeps in flight. librbd's objecter lets a client have
/// 1024 operations (`objecter_inflight_ops`) and 100 MiB (`objecter_inflight_op_bytes`)
/// in flight, shared by every thread of the process; 64 keeps one batch (a
/// checkpoint's pages, 4 KiB each: 256 KiB) from taking most of that from the
/// threads serving clients, and is deeper than the 16 at which fio's rbd engine
/// writes 4 KiB blocks at five times its depth-1 rate on the test cluster
/// (docs/benchmarks.md, "RBD: raw write throughput").
pub(crate) const AIO_IN_FLIGHT_MAX: usize = 64;

/// Called by librbd, on one of its threads, when a request completes: nothing to
/// do, the batch waits on the completion itself.
unsafe extern "C" fn completed(_completion: Completion, _arg: *mut c_void) {}

/// One submitted write, borrowing its bytes until it has completed (see the
/// module's comment).
pub(crate) struct InFlight<'bytes> {
    lib: &'static Lib,
    completion: Completion,
    result: Option<isize>,
    _bytes: PhantomData<&'bytes [u8]>,
}

impl<'bytes> InFlight<'bytes> {
    /// Submit a write of `bytes` at `offset_bytes` of `image`; the negative errno when
    /// librbd refuses to queue it (nothing then remains to wait for or release).
    pub(crate) fn write(
        lib: &'static Lib,
        image: Image,
        bytes: &'bytes [u8],
        offset_bytes: u64,
    ) -> Result<InFlight<'bytes>, i64> {
        let mut completion: Completion = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the callback is a function that touches
        // nothing, so its argument (NULL) is never read.
        let r = unsafe {
            (lib.rbd_aio_create_completion)(std::ptr::null_mut(), completed, &mut completion)
        };
        if r < 0 {
            return Err(r.into());
        }
        // SAFETY: an open image (the caller's, open for the whole call and the
        // batch's); `bytes` stays valid for reads of its length until the request
        // completes, since the `InFlight` returned borrows it and waits for the
        // completion before it is dropped; `completion` is a fresh one, given to this
        // request only.
        let r = unsafe {
            (lib.rbd_aio_write2)(
                image,
                offset_bytes,
                bytes.len(),
                bytes.as_ptr().cast::<c_char>(),
                completion,
                0,
            )
        };
        if r < 0 {
            // SAFETY: a refused request was not queued (librbd 16 queues every one
            // and reports errors through the completion; older versions checked
            // their arguments first and returned before queueing): nothing uses the
            // completion, released once, here.
            unsafe { (lib.rbd_aio_release)(completion) };
            return Err(r.into());
        }
        Ok(InFlight {
            lib,
            completion,
            result: None,
            _bytes: PhantomData,
        })
    }

    /// Wait for the request to complete; its result, a negative errno on failure.
    pub(crate) fn wait(&mut self) -> isize {
        if let Some(r) = self.result {
            return r;
        }
        // SAFETY: the completion of a submitted request, not yet released; waited
        // for once (the result is kept).
        unsafe { (self.lib.rbd_aio_wait_for_complete)(self.completion) };
        // SAFETY: as above; the request has completed, so its result is set.
        let r = unsafe { (self.lib.rbd_aio_get_return_value)(self.completion) };
        self.result = Some(r);
        r
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.wait();
        // SAFETY: the request has completed (waited for above), so librbd uses
        // neither the completion nor the bytes any more; released once, here.
        unsafe { (self.lib.rbd_aio_release)(self.completion) };
    }
}
