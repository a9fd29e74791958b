//! librados and librbd, loaded at run time (`dlopen`), so that a machine without
//! Ceph builds and runs everything else, and opening an RBD image there fails with
//! an error naming the package to install.
//!
//! Only the functions [`crate::rbd`] calls are bound, by hand, with the signatures
//! of Ceph 16's `rados/librados.h` and `rbd/librbd.h` (stable C APIs: the symbols
//! have kept these signatures since Ceph 10). The libraries are loaded once per
//! process and never unloaded, so the function pointers stay valid for its life.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// `rados_t`: a cluster handle.
pub(crate) type Rados = *mut c_void;
/// `rados_ioctx_t`: an I/O context on one pool.
pub(crate) type Ioctx = *mut c_void;
/// `rbd_image_t`: an open image.
pub(crate) type Image = *mut c_void;

/// `rbd_completion_t`: the completion of one asynchronous request (`rbd_aio_*`).
pub(crate) type Completion = *mut c_void;
/// `rbd_callback_t`: called by librbd, on one of its threads, when a request whose
/// completion it was given at creation has completed.
pub(crate) type CompletionCallback = unsafe extern "C" fn(Completion, *mut c_void);

/// `rbd_update_callback_t`: called by librbd, on one of its threads, when the
/// image's header may have changed.
pub(crate) type UpdateCallback = unsafe extern "C" fn(*mut c_void);

/// `RBD_LOCK_MODE_EXCLUSIVE` of the `rbd_lock_mode_t` enum (a C `int`).
pub(crate) const LOCK_MODE_EXCLUSIVE: c_int = 0;

/// The package that installs `librbd.so.1` and `librados.so.2` on Debian.
pub(crate) const PACKAGE: &str = "librbd1";

/// Declares [`Lib`], one field per C function with its signature, and `bind`,
/// which looks each up in the library named with it.
macro_rules! library {
    ($($library:ident $name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The bound functions.
        pub(crate) struct Lib {
            $(pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
        }

        fn bind(rados: *mut c_void, rbd: *mut c_void) -> Result<Lib, String> {
            let handles = [("librados.so.2", rados), ("librbd.so.1", rbd)];
            Ok(Lib {
                $($name: {
                    let (library, handle) = library!(@handle handles, $library);
                    let name = concat!(stringify!($name), "\0");
                    let name = CStr::from_bytes_with_nul(name.as_bytes())
                        .map_err(|e| format!("symbol name {name}: {e}"))?;
                    let sym = symbol(handle, library, name)?;
                    // SAFETY: `sym` is the address of the C function of this name,
                    // whose signature in the Ceph headers is the field's type
                    // (checked by hand against librados.h and librbd.h); a function
                    // pointer has the size and representation of a data pointer on
                    // every platform Ceph runs on.
                    unsafe {
                        std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) $(-> $ret)?>(sym)
                    }
                },)*
            })
        }
    };
    (@handle $handles:ident, rados) => { $handles[0] };
    (@handle $handles:ident, rbd) => { $handles[1] };
}

library! {
    rados rados_create2: fn(*mut Rados, *const c_char, *const c_char, u64) -> c_int;
    rados rados_conf_read_file: fn(Rados, *const c_char) -> c_int;
    rados rados_conf_parse_env: fn(Rados, *const c_char) -> c_int;
    rados rados_conf_set: fn(Rados, *const c_char, *const c_char) -> c_int;
    rados rados_connect: fn(Rados) -> c_int;
    rados rados_shutdown: fn(Rados);
    rados rados_cluster_fsid: fn(Rados, *mut c_char, usize) -> c_int;
    rados rados_blocklist_add: fn(Rados, *mut c_char, u32) -> c_int;
    rados rados_ioctx_create: fn(Rados, *const c_char, *mut Ioctx) -> c_int;
    rados rados_ioctx_destroy: fn(Ioctx);
    rados rados_set_pool_full_try: fn(Ioctx);
    rbd rbd_open: fn(Ioctx, *const c_char, *mut Image, *const c_char) -> c_int;
    rbd rbd_open_read_only: fn(Ioctx, *const c_char, *mut Image, *const c_char) -> c_int;
    rbd rbd_close: fn(Image) -> c_int;
    rbd rbd_read2: fn(Image, u64, usize, *mut c_char, c_int) -> isize;
    rbd rbd_write2: fn(Image, u64, usize, *const c_char, c_int) -> isize;
    rbd rbd_flush: fn(Image) -> c_int;
    rbd rbd_aio_create_completion: fn(*mut c_void, CompletionCallback, *mut Completion) -> c_int;
    rbd rbd_aio_write2: fn(Image, u64, usize, *const c_char, Completion, c_int) -> c_int;
    rbd rbd_aio_wait_for_complete: fn(Completion) -> c_int;
    rbd rbd_aio_get_return_value: fn(Completion) -> isize;
    rbd rbd_aio_release: fn(Completion);
    rbd rbd_discard: fn(Image, u64, u64) -> c_int;
    rbd rbd_get_size: fn(Image, *mut u64) -> c_int;
    rbd rbd_get_features: fn(Image, *mut u64) -> c_int;
    rbd rbd_resize: fn(Image, u64) -> c_int;
    rbd rbd_update_watch: fn(Image, *mut u64, UpdateCallback, *mut c_void) -> c_int;
    rbd rbd_update_unwatch: fn(Image, u64) -> c_int;
    rbd rbd_is_exclusive_lock_owner: fn(Image, *mut c_int) -> c_int;
    rbd rbd_lock_acquire: fn(Image, c_int) -> c_int;
    rbd rbd_lock_get_owners: fn(Image, *mut c_int, *mut *mut c_char, *mut usize) -> c_int;
    rbd rbd_lock_get_owners_cleanup: fn(*mut *mut c_char, usize);
    rbd rbd_lock_break: fn(Image, c_int, *const c_char) -> c_int;
}

static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();

/// The libraries, loaded on first use; the error says what is missing and which
/// package installs it.
pub(crate) fn lib() -> Result<&'static Lib, String> {
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by libc, valid
    // until the next dl* call on this thread; it is copied at once.
    let err = unsafe { libc::dlerror() };
    if err.is_null() {
        "unknown error".to_string()
    } else {
        // SAFETY: non-NULL, NUL-terminated (dlerror's contract).
        unsafe { CStr::from_ptr(err) }
            .to_string_lossy()
            .into_owned()
    }
}

fn open(name: &CStr) -> Result<*mut c_void, String> {
    // SAFETY: `name` is NUL-terminated; dlopen runs the library's initialisers,
    // which for librados/librbd only set up static state.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(format!(
            "{} cannot be loaded ({}): install {PACKAGE} (apt-get install {PACKAGE}) to use RBD images",
            name.to_string_lossy(),
            dlerror()
        ));
    }
    Ok(handle)
}

fn symbol(handle: *mut c_void, library: &str, name: &CStr) -> Result<*mut c_void, String> {
    // SAFETY: `handle` came from a successful dlopen and is never closed; `name`
    // is NUL-terminated.
    let sym = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if sym.is_null() {
        return Err(format!(
            "{library} has no {} ({}): it is too old, install {PACKAGE} from Ceph 16 or later",
            name.to_string_lossy(),
            dlerror()
        ));
    }
    Ok(sym)
}

fn load() -> Result<Lib, String> {
    let rados = open(c"librados.so.2")?;
    let rbd = open(c"librbd.so.1")?;
    bind(rados, rbd)
}

/// The error a librbd or librados call's negative return `r` (`-errno`) stands for.
pub(crate) fn errno_error(r: i64) -> std::io::Error {
    std::io::Error::from_raw_os_error(i32::try_from(-r).unwrap_or(libc::EIO))
}
