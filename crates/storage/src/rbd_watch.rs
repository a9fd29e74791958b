//! `OwnerWatch`: how an owned RBD image learns that it was taken over while nothing
//! is written through it.
//!
//! A take-over blocklists the owner's client, and the OSDs then drop that client's
//! watch on the image's header. When the owner runs again (a paused process resumed,
//! a partition healed) librbd finds its watch gone, fails to re-register it, and
//! tells the image's update watchers (`rbd_update_watch`) that the header may have
//! changed. The header also changes for ordinary reasons (a resize, a snapshot), so
//! a change is only a prompt: a thread of this watch then asks librbd whether this
//! client still owns the lock (`rbd_is_exclusive_lock_owner`, which asks the OSD
//! that holds the header). The callback itself only sets a flag: librbd calls it on
//! its own thread, where a blocking librbd call could deadlock.

use crate::rbd_lib::{Image, Lib};
use crate::{FencedListener, IoOp, StorageError};
use parking_lot::{Condvar, Mutex};
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::thread::JoinHandle;

/// What the callback, the watch's thread and the storage share.
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// The header changed since the thread last looked.
    pending: bool,
    /// The storage is closing: the thread ends.
    stop: bool,
    /// Told once when the image is found taken over.
    listener: Option<FencedListener>,
    /// Found taken over (the listener, once set, is told at once): librbd's
    /// error, or `None` when the lock is simply another client's now.
    lost: Option<Option<i32>>,
}

/// The image handle, for the watch's thread.
struct Handle {
    lib: &'static Lib,
    image: Image,
}

// SAFETY: an `rbd_image_t` may be used from any thread (librbd serves concurrent
// calls on one handle); the storage closes it only after joining this thread.
unsafe impl Send for Handle {}

/// The watch on one owned image's header, and its thread.
pub(crate) struct OwnerWatch {
    lib: &'static Lib,
    image: Image,
    watch_handle: u64,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// librbd's callback: note the change and wake the thread.
unsafe extern "C" fn header_changed(arg: *mut c_void) {
    // SAFETY: `arg` is the `Shared` that `OwnerWatch::start` registered, which it
    // keeps alive (an `Arc` it holds) until `rbd_update_unwatch` has returned, after
    // which librbd makes no more calls.
    let shared = unsafe { &*arg.cast::<Shared>() };
    shared.state.lock().pending = true;
    shared.changed.notify_one();
}

impl OwnerWatch {
    /// Watch `image` (open, its lock held), named `device` in errors. `None` when
    /// librbd refuses the watch: the image is then only found taken over at its
    /// next write or flush.
    pub(crate) fn start(lib: &'static Lib, image: Image, device: &str) -> Option<OwnerWatch> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let mut watch_handle = 0u64;
        // SAFETY: an open image; the callback and its argument stay valid until the
        // unwatch in `Drop` (the `Arc` is held by the returned value).
        let r = unsafe {
            (lib.rbd_update_watch)(
                image,
                &mut watch_handle,
                header_changed,
                Arc::as_ptr(&shared).cast_mut().cast::<c_void>(),
            )
        };
        if r < 0 {
            tracing::warn!("{device}: cannot watch the image's header (error {r}): a take-over is found at the next write");
            return None;
        }
        let handle = Handle { lib, image };
        let thread_shared = Arc::clone(&shared);
        let thread_device = device.to_string();
        let thread = std::thread::Builder::new()
            .name("rbd-owner-watch".into())
            .spawn(move || run(&handle, &thread_shared, &thread_device));
        let thread = match thread {
            Ok(thread) => Some(thread),
            Err(e) => {
                tracing::warn!("{device}: cannot start the owner watch ({e}): a take-over is found at the next write");
                None
            }
        };
        Some(OwnerWatch {
            lib,
            image,
            watch_handle,
            shared,
            thread,
        })
    }

    /// Tell `listener` when the image is found taken over (at once if it was).
    pub(crate) fn on_fenced(&self, listener: FencedListener, device: &str) {
        let mut state = self.shared.state.lock();
        if let Some(lost) = state.lost {
            drop(state);
            listener(fenced_error(device, lost));
            return;
        }
        state.listener = Some(listener);
    }
}

/// The error a fenced owner is told.
fn fenced_error(device: &str, errno: Option<i32>) -> StorageError {
    let source = match errno {
        Some(errno) => std::io::Error::from_raw_os_error(errno),
        None => std::io::Error::other("another client holds the image's exclusive lock now"),
    };
    StorageError::Fenced {
        device: device.to_string(),
        op: IoOp::Own,
        source,
    }
}

/// The watch's thread: at each change of the header, whether the lock is still ours.
fn run(handle: &Handle, shared: &Shared, device: &str) {
    loop {
        {
            let mut state = shared.state.lock();
            while !state.pending && !state.stop {
                shared.changed.wait(&mut state);
            }
            if state.stop {
                return;
            }
            state.pending = false;
        }
        let mut is_owner: c_int = 0;
        // SAFETY: an open image (closed only after this thread is joined) and a valid
        // out-pointer.
        let r = unsafe { (handle.lib.rbd_is_exclusive_lock_owner)(handle.image, &mut is_owner) };
        let lost = match r {
            0 if is_owner != 0 => None,
            0 => Some(None),
            // Blocklisted (Ceph's EBLOCKLISTED is ESHUTDOWN).
            r if r == -libc::ESHUTDOWN => Some(Some(libc::ESHUTDOWN)),
            // Anything else (the cluster unreachable for now) proves nothing: the next
            // change, write or flush tells.
            _ => None,
        };
        let Some(lost) = lost else { continue };
        let mut state = shared.state.lock();
        state.lost = Some(lost);
        let listener = state.listener.take();
        drop(state);
        tracing::error!(
            "{device}: this client no longer owns the image: another client took it over"
        );
        if let Some(listener) = listener {
            listener(fenced_error(device, lost));
        }
        return;
    }
}

impl Drop for OwnerWatch {
    fn drop(&mut self) {
        // SAFETY: the watch registered in `start`, on the still-open image; librbd
        // waits for a callback in flight before it returns, so `shared` outlives
        // every use of the pointer it was given.
        unsafe { (self.lib.rbd_update_unwatch)(self.image, self.watch_handle) };
        self.shared.state.lock().stop = true;
        self.shared.changed.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
