//! `DeviceUri` and `open_device`: a device named by a URI, and the one place every
//! device of a pool is opened from its name.
//!
//! A name is one of:
//! - a path, absolute or relative (`/var/lib/vm.pool`, `vm.pool`, `/dev/vg/pool`): a
//!   regular file or a block device, [`FileStorage`];
//! - `file:///abs/path` or `file:/abs/path`: the same, spelled as a URI (only
//!   absolute paths: `file:` with no host names no directory to be relative to);
//! - `rbd:POOL/IMAGE` or `rbd:POOL/IMAGE@CLUSTER`: an image of a Ceph RBD pool,
//!   [`RbdStorage`]. The cluster's name picks its config (`/etc/ceph/CLUSTER.conf`,
//!   default `ceph`), as `rbd --cluster` does; `$CEPH_CONF` names a config file to
//!   read instead, and `$CEPH_ID` the client id (`client.ID`, default `admin`), as
//!   `rbd --id` does; `$CEPH_ARGS` is honoured by librados itself.
//!
//! A name with a colon before its first slash is a URI, so a file whose name has one
//! is written with a directory in front (`./a:b`). Any other scheme (`nbd:`, `http:`)
//! is refused, naming the schemes there are, rather than taken for a file.
//!
//! [`DeviceUri`]'s `Display` is the canonical name (`file:` URIs shown as their path,
//! `rbd:` without a default cluster), which is what a data device's label records
//! for its metadata device and what messages and statistics call the device.

use crate::{FileStorage, RbdStorage, Storage, StorageError};

use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The cluster name librados assumes when none is given.
const DEFAULT_CLUSTER: &str = "ceph";

/// Where a device is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceUri {
    /// A regular file or a block device, by its path as given.
    File(PathBuf),
    /// An image of a Ceph RBD pool.
    Rbd {
        /// The RADOS pool.
        pool: String,
        /// The image in it.
        image: String,
        /// The cluster's name (`None`: the default, `ceph`).
        cluster: Option<String>,
    },
}

/// How a device is opened ([`open_device`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceOptions {
    /// Take the device over from a holder that is dead or cut off (an RBD image):
    /// blocklist the holder's client address on the cluster, so that nothing it still
    /// sends is accepted, then break its lock and take it. Without it a device another
    /// client holds is refused ([`StorageError::Owned`]). A file's lock is the
    /// kernel's and dies with its process: there is nothing to take over.
    pub take_over: Option<TakeOver>,
    /// Only read, taking no lock, while another program may hold the device (to read
    /// a pool's identity from its first blocks): a file is opened `O_RDONLY` and not
    /// locked, an RBD image with `rbd_open_read_only`. Writes to such a device fail.
    /// The default (false) opens it read-write and exclusive, which is how a pool is
    /// opened, also read-only: the engine's read-only mode relies on nobody writing.
    /// Exclusive is a file's `flock`, and an RBD image's exclusive lock taken at open
    /// and kept until close (see `rbd.rs`: another client that holds it is named in
    /// the refusal).
    pub read_only: bool,
    /// An RBD image with librbd's write-back cache off (`rbd_cache = false` over
    /// ceph.conf): each write returns once the OSDs have it, or with its own error,
    /// so a full Ceph pool refuses the one write with no space and the pool stays
    /// writable, where with the cache on (the default) the refusal comes at the next
    /// flush and latches the pool. Much slower writes (`rbd.rs`). No effect on a file.
    pub write_through: bool,
}

/// How a take-over fences the old holder ([`DeviceOptions::take_over`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TakeOver {
    /// How long the old holder stays blocklisted (librbd's
    /// `rbd_blocklist_expire_seconds`); `None`: the cluster's default
    /// (`mon_osd_blocklist_default_expire`, one hour unless configured).
    pub blocklist_expire_seconds: Option<u64>,
}

fn invalid(uri: &str, reason: impl Into<String>) -> StorageError {
    StorageError::InvalidUri {
        uri: uri.to_string(),
        reason: reason.into(),
    }
}

/// A Ceph pool or image name part: not empty, no `/` or `@` (which the URI uses as
/// separators), no control characters or NUL (librados takes C strings).
fn check_ceph_name(uri: &str, what: &str, name: &str) -> Result<(), StorageError> {
    if name.is_empty() {
        return Err(invalid(uri, format!("the {what} name is empty")));
    }
    if let Some(c) = name
        .chars()
        .find(|c| matches!(c, '/' | '@') || c.is_control())
    {
        return Err(invalid(
            uri,
            format!("the {what} name {name:?} contains {c:?}, which is not allowed there"),
        ));
    }
    Ok(())
}

impl DeviceUri {
    /// Parse a device's name (see the module's comment for the forms).
    pub fn parse(name: &str) -> Result<DeviceUri, StorageError> {
        if name.is_empty() {
            return Err(invalid(name, "the name is empty"));
        }
        if name.contains('\0') {
            return Err(invalid(name, "the name contains a NUL byte"));
        }
        let Some((scheme, rest)) = split_scheme(name) else {
            return Ok(DeviceUri::File(PathBuf::from(name)));
        };
        match scheme {
            "file" => parse_file(name, rest),
            "rbd" => parse_rbd(name, rest),
            other => Err(invalid(
                name,
                format!(
                    "the scheme {other}: is not one fewerbytes opens (a device is a path, \
                     file:///PATH or rbd:POOL/IMAGE[@CLUSTER]; a file whose name has a \
                     colon is written ./{name})"
                ),
            )),
        }
    }

    /// Parse a device's name given as a path (`Pool::open` takes a `&Path`): a name
    /// that is not UTF-8 can only be a file.
    pub fn from_path(path: &Path) -> Result<DeviceUri, StorageError> {
        match path.to_str() {
            Some(name) => DeviceUri::parse(name),
            None => Ok(DeviceUri::File(path.to_path_buf())),
        }
    }

    /// The file's path, for a file or block device.
    pub fn file_path(&self) -> Option<&Path> {
        match self {
            DeviceUri::File(path) => Some(path),
            DeviceUri::Rbd { .. } => None,
        }
    }

    /// Whether this names a file or block device (so that files can be kept beside
    /// it), rather than a device elsewhere.
    pub fn is_file(&self) -> bool {
        self.file_path().is_some()
    }
}

/// `(scheme, rest)` when `name` starts with `SCHEME:` (letters, digits, `+-.`,
/// starting with a letter: RFC 3986) and no `/` comes before the colon.
fn split_scheme(name: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = name.split_once(':')?;
    let mut chars = scheme.chars();
    let first = chars.next()?;
    let is_scheme = first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    is_scheme.then_some((scheme, rest))
}

fn parse_file(name: &str, rest: &str) -> Result<DeviceUri, StorageError> {
    // file:///p (empty authority), file://localhost/p, or file:/p.
    let path = match rest.strip_prefix("//") {
        Some(after) => {
            let slash = after.find('/').ok_or_else(|| {
                invalid(name, "a file: URI needs an absolute path (file:///PATH)")
            })?;
            let (host, path) = after.split_at(slash);
            if !(host.is_empty() || host == "localhost") {
                return Err(invalid(
                    name,
                    format!("a file: URI names a file on this host, not on {host}"),
                ));
            }
            path
        }
        None => rest,
    };
    if !path.starts_with('/') {
        return Err(invalid(
            name,
            "a file: URI needs an absolute path (file:///PATH); a relative path is given \
             without file:",
        ));
    }
    if path.contains(['?', '#']) || path.contains('%') {
        return Err(invalid(
            name,
            "a file: URI here takes a plain path: no query (?), fragment (#) or %-escapes; \
             give the path itself instead",
        ));
    }
    Ok(DeviceUri::File(PathBuf::from(path)))
}

fn parse_rbd(name: &str, rest: &str) -> Result<DeviceUri, StorageError> {
    let (pool_image, cluster) = match rest.rsplit_once('@') {
        Some((pool_image, cluster)) => {
            check_ceph_name(name, "cluster", cluster)?;
            (pool_image, Some(cluster.to_string()))
        }
        None => (rest, None),
    };
    let Some((pool, image)) = pool_image.split_once('/') else {
        return Err(invalid(
            name,
            "an RBD device is rbd:POOL/IMAGE[@CLUSTER]: the pool or the image is missing",
        ));
    };
    check_ceph_name(name, "pool", pool)?;
    check_ceph_name(name, "image", image)?;
    Ok(DeviceUri::Rbd {
        pool: pool.to_string(),
        image: image.to_string(),
        cluster: cluster.filter(|c| c != DEFAULT_CLUSTER),
    })
}

impl std::fmt::Display for DeviceUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceUri::File(path) => write!(f, "{}", path.display()),
            DeviceUri::Rbd {
                pool,
                image,
                cluster: None,
            } => write!(f, "rbd:{pool}/{image}"),
            DeviceUri::Rbd {
                pool,
                image,
                cluster: Some(cluster),
            } => write!(f, "rbd:{pool}/{image}@{cluster}"),
        }
    }
}

impl std::str::FromStr for DeviceUri {
    type Err = StorageError;
    fn from_str(name: &str) -> Result<DeviceUri, StorageError> {
        DeviceUri::parse(name)
    }
}

/// Open the device `uri` names: the one way a pool's device is opened from a name
/// (the engine's open of a pool by name, the metadata device a data device's label
/// names, and pool creation). A file or block device must exist
/// ([`FileStorage::create`] makes a file); an RBD image must exist (`rbd create`).
///
/// For an RBD image the config is `$CEPH_CONF` when set (an error names it when it
/// cannot be read), else librados's search for the cluster's config; the client id
/// is `$CEPH_ID` when set, else `admin`.
pub fn open_device(
    uri: &DeviceUri,
    options: &DeviceOptions,
) -> Result<Arc<dyn Storage>, StorageError> {
    match uri {
        DeviceUri::File(path) if options.read_only => {
            Ok(Arc::new(FileStorage::open_read_only(path)?))
        }
        DeviceUri::File(path) => Ok(Arc::new(FileStorage::open(path)?)),
        DeviceUri::Rbd {
            pool,
            image,
            cluster,
        } => {
            let conf = std::env::var_os("CEPH_CONF")
                .filter(|c| !c.is_empty())
                .map(PathBuf::from);
            let id = std::env::var("CEPH_ID").ok().filter(|id| !id.is_empty());
            let opened = RbdStorage::open_with(
                pool,
                image,
                cluster.as_deref(),
                id.as_deref(),
                conf.as_deref(),
                options,
            )?;
            Ok(Arc::new(opened))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn rbd(pool: &str, image: &str, cluster: Option<&str>) -> DeviceUri {
        DeviceUri::Rbd {
            pool: pool.into(),
            image: image.into(),
            cluster: cluster.map(Into::into),
        }
    }

    fn reason(name: &str) -> String {
        match DeviceUri::parse(name) {
            Err(StorageError::InvalidUri { uri, reason }) => {
                assert_eq!(uri, name, "the error names the URI");
                reason
            }
            other => panic!("{name} parsed as {other:?}"),
        }
    }

    #[test]
    fn paths_are_files() {
        for name in [
            "/var/lib/vm.pool",
            "vm.pool",
            "./a:b",
            "dir/x:y",
            "/dev/vg/pool",
        ] {
            assert_eq!(
                DeviceUri::parse(name).unwrap(),
                DeviceUri::File(PathBuf::from(name))
            );
        }
    }

    #[test]
    fn file_uris_are_their_paths() {
        for name in [
            "file:///var/lib/vm.pool",
            "file:/var/lib/vm.pool",
            "file://localhost/var/lib/vm.pool",
        ] {
            let uri = DeviceUri::parse(name).unwrap();
            assert_eq!(uri, DeviceUri::File(PathBuf::from("/var/lib/vm.pool")));
            assert_eq!(uri.to_string(), "/var/lib/vm.pool");
        }
    }

    #[test]
    fn rbd_uris_round_trip() {
        assert_eq!(
            DeviceUri::parse("rbd:vms/pool0").unwrap(),
            rbd("vms", "pool0", None)
        );
        assert_eq!(
            DeviceUri::parse("rbd:vms/pool0@backup").unwrap(),
            rbd("vms", "pool0", Some("backup"))
        );
        for name in ["rbd:vms/pool0", "rbd:vms/pool0@backup", "rbd:a.b-c/d_e.f"] {
            assert_eq!(DeviceUri::parse(name).unwrap().to_string(), name);
        }
        // The default cluster is not spelled out.
        assert_eq!(
            DeviceUri::parse("rbd:vms/pool0@ceph").unwrap().to_string(),
            "rbd:vms/pool0"
        );
        assert!(!DeviceUri::parse("rbd:vms/pool0").unwrap().is_file());
    }

    #[test]
    fn malformed_names_say_what_is_wrong() {
        assert!(reason("").contains("empty"));
        assert!(reason("rbd:vms/").contains("image name is empty"));
        assert!(reason("rbd:/img").contains("pool name is empty"));
        assert!(reason("rbd:vms").contains("POOL/IMAGE"));
        assert!(reason("rbd:vms/a/b").contains("'/'"));
        assert!(reason("rbd:vms/img@").contains("cluster name is empty"));
        assert!(reason("rbd:vms/img@a@b").contains("'@'"));
        let nbd = reason("nbd://host/export");
        assert!(nbd.contains("nbd:"), "{nbd}");
        assert!(nbd.contains("rbd:POOL/IMAGE"), "{nbd}");
        assert!(reason("file:relative/path").contains("absolute"));
        assert!(reason("file://otherhost/p").contains("otherhost"));
        assert!(reason("file:///a%20b").contains("%"));
        assert!(reason("a\0b").contains("NUL"));
    }

    #[test]
    fn a_file_with_a_colon_after_a_slash_is_a_path() {
        assert!(DeviceUri::parse("/tmp/a:b").unwrap().is_file());
        assert!(reason("a:b").contains("./a:b"));
    }
}
