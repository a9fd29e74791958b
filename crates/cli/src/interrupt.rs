//! SIGINT and SIGTERM: one handler for every command that holds a pool for long.
//!
//! The first signal is only recorded: `serve` wakes on a byte written to a pipe its
//! main thread reads ([`Stop::wait`]), and the long loops of import, export, send,
//! receive and scrub poll [`check`] between chunks or records and return
//! [`Interrupted`], so the command stops where its state is known, the pool is
//! closed as at any end (the final checkpoint, the holder cleared), and `main` prints
//! one line saying what stopped and what it left, exiting 130 (SIGINT) or 143
//! (SIGTERM). A second signal exits at once: the user wants out now, and nothing
//! flushed is lost (the next open replays the journal).
//!
//! Commands that do not poll keep the default disposition: they are short, or run
//! through a server (whose own stop handles the pool), and Ctrl-C ends them at once.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};

use crate::exit_codes;

/// The pipe's write end, for the handler (which may touch nothing but atomics
/// and async-signal-safe calls).
static WAKE_FD: AtomicI32 = AtomicI32::new(-1);
/// Signals received; the second one exits at once.
static RECEIVED: AtomicU32 = AtomicU32::new(0);
/// The first signal received (0: none yet).
static FIRST_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// Whether the handlers are installed (once per process).
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The byte `wake_fenced` writes: no signal has number 0.
const FENCED_BYTE: u8 = 0;

/// The read end of the self-pipe.
pub struct Stop {
    read_fd: i32,
}

/// What woke the main thread.
pub enum Woken {
    /// SIGINT or SIGTERM, by name.
    Signal(&'static str),
    /// The pool was taken over by another server.
    Fenced,
}

/// Wake the main thread: the pool was taken over (called from the pool's latch).
pub fn wake_fenced() {
    let fd = WAKE_FD.load(Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: one valid byte written to our own pipe; a full pipe means the
        // main thread is already being woken.
        unsafe { libc::write(fd, (&FENCED_BYTE as *const u8).cast(), 1) };
    }
}

extern "C" fn on_signal(signal: libc::c_int) {
    if RECEIVED.fetch_add(1, Ordering::SeqCst) >= 1 {
        // A second signal while the clean stop is under way: the user wants out now.
        // Nothing acknowledged is lost: flushed writes are in the journal.
        // SAFETY: _exit(2) is async-signal-safe and takes no pointers.
        unsafe { libc::_exit(i32::from(exit_codes::interrupted(signal))) };
    }
    FIRST_SIGNAL.store(signal, Ordering::SeqCst);
    let fd = WAKE_FD.load(Ordering::SeqCst);
    if fd >= 0 {
        // The signal number fits a byte (SIGINT 2, SIGTERM 15).
        let byte = signal as u8;
        // SAFETY: write(2) is async-signal-safe; the buffer is one valid byte. A
        // full pipe (signals faster than the reader) loses nothing that matters.
        unsafe { libc::write(fd, (&byte as *const u8).cast(), 1) };
    }
}

/// Install the handlers (before the pool is opened, so a signal during the open
/// is seen at the first poll). Called once per process.
pub fn install() -> io::Result<Stop> {
    assert!(
        !INSTALLED.swap(true, Ordering::SeqCst),
        "the SIGINT/SIGTERM handlers are installed once per process"
    );
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // The read end blocks (`Stop::wait`); the write end must not, in the handler.
    // SAFETY: fcntl on a descriptor this process just made.
    if unsafe { libc::fcntl(fds[0], libc::F_SETFL, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    WAKE_FD.store(fds[1], Ordering::SeqCst);
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction is a valid starting point; the handler is an
        // `extern "C" fn(c_int)` as sa_sigaction expects without SA_SIGINFO.
        // SA_RESTART: a system call the signal lands in (a device read, a fsync)
        // resumes; the loops see the signal at their next poll.
        let rc = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(Stop { read_fd: fds[0] })
}

/// Install the handlers for a command that polls [`check`] (the pipe is unused), once
/// however many of its steps ask.
pub fn install_for_command() -> anyhow::Result<()> {
    use anyhow::Context;
    if INSTALLED.load(Ordering::SeqCst) {
        return Ok(());
    }
    install().context("could not install the SIGINT/SIGTERM handlers")?;
    Ok(())
}

/// `Err(Interrupted)` once SIGINT or SIGTERM was received: what every long loop
/// calls between steps.
pub fn check() -> Result<(), Interrupted> {
    match FIRST_SIGNAL.load(Ordering::SeqCst) {
        0 => Ok(()),
        signal => Err(Interrupted {
            signal,
            closed: None,
        }),
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// A command stopped by SIGINT or SIGTERM. Its context (added by the command) says
/// what stopped and what state that left; [`crate::control::run_and_close`] records
/// how the pool's close went.
#[derive(Debug)]
pub struct Interrupted {
    signal: i32,
    /// The pool this process held, and whether its close succeeded (its error).
    pub closed: Option<(String, Result<(), String>)>,
}

impl Interrupted {
    /// The exit code: 128 + the signal's number, as a shell reports a death by it.
    pub fn exit_code(&self) -> u8 {
        exit_codes::interrupted(self.signal)
    }

    /// How the pool's close went, for the end of the line (none: this process did
    /// not hold the pool).
    pub fn closed_sentence(&self) -> Option<String> {
        match &self.closed {
            None => None,
            Some((pool, Ok(()))) => Some(format!("pool {pool} closed cleanly")),
            Some((pool, Err(e))) => Some(format!(
                "pool {pool} could not be closed ({e}): its next open replays its journal"
            )),
        }
    }
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "interrupted by {}", signal_name(self.signal))
    }
}

impl std::error::Error for Interrupted {}

/// Say what an interrupted `result` left (`state`, a sentence); other results pass.
pub fn explain<T>(result: anyhow::Result<T>, state: impl FnOnce() -> String) -> anyhow::Result<T> {
    match result {
        Err(e) if find(&e).is_some() => Err(e.context(state())),
        other => other,
    }
}

/// The [`Interrupted`] in `error`'s chain, if it is one.
pub fn find(error: &anyhow::Error) -> Option<&Interrupted> {
    error
        .chain()
        .find_map(|cause| cause.downcast_ref::<Interrupted>())
}

impl Stop {
    /// Block until SIGINT or SIGTERM arrives, or the pool is taken over.
    pub fn wait(&self) -> Woken {
        let mut byte = 0u8;
        loop {
            // SAFETY: reading one byte into a valid one-byte buffer from our own fd.
            let n = unsafe { libc::read(self.read_fd, (&mut byte as *mut u8).cast(), 1) };
            if n == 1 {
                return match byte {
                    FENCED_BYTE => Woken::Fenced,
                    signal => Woken::Signal(signal_name(i32::from(signal))),
                };
            }
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // EOF or an error on our own pipe cannot happen while WAKE_FD is open;
            // treat it as a stop rather than spin.
            return Woken::Signal("a stop");
        }
    }
}
