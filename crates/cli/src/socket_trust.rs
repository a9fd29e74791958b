//! Who may answer on a pool's sockets: root, and the pool file's owner (who can read
//! and write the pool anyway); for a pool that is not a file (an RBD image), this
//! process's own user (whose Ceph key reaches the image).
//!
//! A pool kept in a directory others may write (`/tmp`, a shared mount) leaves its
//! socket names free for another user to bind while no server runs: a command that
//! sent its request there would hand that user a receive's stream, or take a send's
//! bytes from them. So the command checks the peer's credentials (SO_PEERCRED) of
//! every control connection before it sends a byte, and `serve` neither starts beside
//! nor removes a socket file whose owner fails the same rule.

use anyhow::{bail, Context, Result};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::Path;

/// The uids trusted to serve the pool named `pool_path`: root and the pool file's
/// owner; for a pool that is not a file, root and this process's user.
pub fn trusted_uids(pool_path: &Path) -> Result<Vec<u32>> {
    let owner = if crate::homes::is_elsewhere(pool_path) {
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() }
    } else {
        std::fs::metadata(pool_path)
            .with_context(|| format!("could not read the owner of {}", pool_path.display()))?
            .uid()
    };
    let mut uids = vec![0, owner];
    uids.dedup();
    Ok(uids)
}

/// The words for who may serve the pool: "root or the owner of pool P (uid U)".
fn trusted_words(pool_path: &Path, trusted: &[u32]) -> String {
    match trusted {
        [_, owner] => format!(
            "neither root nor the owner of pool {} (uid {owner})",
            pool_path.display()
        ),
        _ => format!("not root, who owns pool {}", pool_path.display()),
    }
}

/// Refuse the connection `stream` to the socket `socket` unless the process that
/// listens there runs as a uid in `trusted` (checked before anything is sent on it).
pub fn check_peer(
    stream: &UnixStream,
    socket: &Path,
    pool_path: &Path,
    trusted: &[u32],
) -> Result<()> {
    let Some(cred) = fewerbytes_nbd::peer_credentials(stream) else {
        bail!(
            "could not learn who answers on {} (SO_PEERCRED failed: {}); nothing was \
             sent to it",
            socket.display(),
            std::io::Error::last_os_error()
        );
    };
    if trusted.contains(&cred.uid) {
        return Ok(());
    }
    bail!(
        "the server on {} runs as uid {} (pid {}), {}: another user may have made the \
         socket to catch this command's requests and streams, so nothing was sent to \
         it; check who runs that process, remove the socket (`rm {}`), and start the \
         pool's server as root or its owner",
        socket.display(),
        cred.uid,
        cred.pid,
        trusted_words(pool_path, trusted),
        socket.display()
    )
}

/// Refuse to remove (or start beside) the socket file at `socket` unless a uid in
/// `trusted` owns it: a stale socket another user made is theirs to explain.
pub fn check_owner(socket: &Path, pool_path: &Path, trusted: &[u32]) -> Result<()> {
    let meta = std::fs::symlink_metadata(socket)
        .with_context(|| format!("could not inspect {}", socket.display()))?;
    if trusted.contains(&meta.uid()) {
        return Ok(());
    }
    bail!(
        "{} belongs to uid {}, {}: another user may have made it, so it is left as it \
         is; check who made it, remove it (`rm {}`), and start again",
        socket.display(),
        meta.uid(),
        trusted_words(pool_path, trusted),
        socket.display()
    )
}
