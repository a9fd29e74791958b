//! Readiness notification for service managers (systemd's `sd_notify` protocol):
//! `serve` tells the manager when every socket accepts (`READY=1`) and when a stop
//! begins (`STOPPING=1`), each with a `STATUS=` line a person reads in
//! `systemctl status`.
//!
//! The protocol is one datagram of `KEY=VALUE` lines sent to the unix socket named by
//! `$NOTIFY_SOCKET`: a path, or an abstract socket written with a leading `@`. Without
//! the variable (not run by a service manager) nothing is sent. Sending is best effort:
//! a failure is logged, never fatal, since the server works the same either way (the
//! manager then reports a start timeout, which names the problem).

use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// The environment variable a service manager sets for `Type=notify` services.
const NOTIFY_SOCKET_VAR: &str = "NOTIFY_SOCKET";

/// Where notifications go, if anywhere.
pub struct Notifier {
    /// The manager's socket address and the text of `$NOTIFY_SOCKET`, for messages.
    target: Option<(SocketAddr, String)>,
}

impl Notifier {
    /// Read `$NOTIFY_SOCKET` and remove it from the environment, so that no process
    /// this one might start takes the manager's socket for its own (what sd_notify's
    /// `unset_environment` does). Call before any thread starts: changing the
    /// environment races with threads that read it.
    pub fn from_env() -> Notifier {
        let Some(value) = std::env::var_os(NOTIFY_SOCKET_VAR) else {
            return Notifier { target: None };
        };
        std::env::remove_var(NOTIFY_SOCKET_VAR);
        let text = value.to_string_lossy().into_owned();
        match parse_address(&value) {
            Ok(addr) => {
                tracing::debug!(socket = %text, "will notify the service manager");
                Notifier {
                    target: Some((addr, text)),
                }
            }
            Err(e) => {
                tracing::warn!("NOTIFY_SOCKET={text} is not a socket this server can use: {e}");
                Notifier { target: None }
            }
        }
    }

    /// Whether a service manager is listening.
    pub fn is_active(&self) -> bool {
        self.target.is_some()
    }

    /// Every socket accepts: the manager may start the units that need this one.
    pub fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={}\n", one_line(status)));
    }

    /// A stop has begun (connections closing, final checkpoint to come).
    pub fn stopping(&self, status: &str) {
        self.send(&format!("STOPPING=1\nSTATUS={}\n", one_line(status)));
    }

    fn send(&self, message: &str) {
        let Some((addr, text)) = &self.target else {
            return;
        };
        let sent = UnixDatagram::unbound()
            .and_then(|socket| socket.send_to_addr(message.as_bytes(), addr));
        match sent {
            Ok(_) => {
                tracing::debug!(socket = %text, message = ?message.trim_end(), "notified the service manager")
            }
            Err(e) => tracing::warn!("could not notify the service manager on {text}: {e}"),
        }
    }
}

/// `$NOTIFY_SOCKET` as an address: `@name` is an abstract socket (Linux), anything
/// starting with `/` a path. Other forms (systemd's `vsock:`) are refused.
fn parse_address(value: &std::ffi::OsStr) -> io::Result<SocketAddr> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = value.as_bytes();
    match bytes.first() {
        Some(b'@') => abstract_address(bytes.get(1..).unwrap_or_default()),
        Some(b'/') => SocketAddr::from_pathname(value),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "expected an absolute path or @abstract-name",
        )),
    }
}

#[cfg(target_os = "linux")]
fn abstract_address(name: &[u8]) -> io::Result<SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    SocketAddr::from_abstract_name(name)
}

#[cfg(not(target_os = "linux"))]
fn abstract_address(_name: &[u8]) -> io::Result<SocketAddr> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "abstract unix sockets exist only on Linux",
    ))
}

/// A `STATUS=` value must not contain a newline: it would start another assignment.
fn one_line(text: &str) -> String {
    text.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn paths_and_abstract_names_are_addresses_and_nothing_else_is() {
        let path = parse_address(OsStr::new("/run/systemd/notify")).unwrap();
        assert_eq!(
            path.as_pathname(),
            Some(std::path::Path::new("/run/systemd/notify"))
        );
        let abstract_addr = parse_address(OsStr::new("@fb-notify")).unwrap();
        assert!(abstract_addr.as_pathname().is_none());
        assert!(parse_address(OsStr::new("vsock:2:1234")).is_err());
        assert!(parse_address(OsStr::new("")).is_err());
    }

    #[test]
    fn a_status_stays_one_assignment() {
        assert_eq!(one_line("a\nb"), "a b");
    }
}
