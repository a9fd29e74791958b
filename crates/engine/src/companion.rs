//! Files written beside a pool (its companions: the allow list, the saved dedup
//! index, a receive's progress, an export's staging file) in a directory another user
//! may also write, such as `/tmp`.
//!
//! A name another user can know beforehand is never opened for writing: each new
//! contents goes to a new file of a random name made with `O_CREAT | O_EXCL |
//! O_NOFOLLOW`, mode 0600 (a file or symbolic link someone placed there is never
//! opened, so never written through), is synced, and is renamed over the companion's
//! name, which replaces whatever is there (a link included) without following it.
//! The directory is synced after, so the change is durable on return.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Random names tried before giving up: one taken by chance is 1 in 2^64, so a
/// second one taken means someone is making them, and a few more will not help.
const STAGING_ATTEMPTS_MAX: u32 = 8;

/// A new file beside `path` to stage its next contents: `<path>.<random>.new`, made
/// with `O_EXCL | O_NOFOLLOW` and mode 0600. The caller renames it over `path` (or
/// removes it).
pub fn create_staging(path: &Path) -> io::Result<(PathBuf, File)> {
    let mut last = None;
    for _ in 0..STAGING_ATTEMPTS_MAX {
        // The thread RNG is seeded from the OS's random source: the name cannot be
        // guessed before it is made.
        let suffix = format!(".{:016x}.new", rand::random::<u64>());
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        let staging = PathBuf::from(name);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&staging)
        {
            Ok(file) => return Ok((staging, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(with_path(e, "could not create", &staging)),
        }
    }
    let e = last.unwrap_or_else(|| io::Error::other("no name tried"));
    Err(with_path(e, "could not create a new file beside", path))
}

/// Replace the file at `path` with what `fill` writes: staged in a new file
/// ([`create_staging`]), synced, renamed over `path`, the directory synced. A failure
/// leaves `path` as it was and removes the staging file.
pub fn replace_with(path: &Path, fill: impl FnOnce(&mut File) -> io::Result<()>) -> io::Result<()> {
    let (staging, mut file) = create_staging(path)?;
    let replaced = fill(&mut file)
        .and_then(|()| file.sync_all())
        .map_err(|e| with_path(e, "could not write", &staging))
        .and_then(|()| {
            std::fs::rename(&staging, path).map_err(|e| with_path(e, "could not replace", path))
        });
    if let Err(e) = replaced {
        let _ = std::fs::remove_file(&staging);
        return Err(e);
    }
    let dir = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|dir| dir.sync_all())
        .map_err(|e| with_path(e, "could not sync", dir))
}

/// Replace the file at `path` with `contents` ([`replace_with`]): the one way a
/// companion file of a pool is written.
pub fn replace_file(path: &Path, contents: &[u8]) -> io::Result<()> {
    replace_with(path, |file| file.write_all(contents))
}

/// `e`, its message naming what was done to which path.
fn with_path(e: io::Error, what: &str, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_link_at_the_name_is_replaced_not_followed() {
        let dir = std::env::temp_dir().join(format!("fb-companion-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, b"kept").unwrap();
        let path = dir.join("pool.state");
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        replace_file(&path, b"new").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"kept");
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert!(std::fs::symlink_metadata(&path).unwrap().is_file());
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 2, "a staging file was left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
