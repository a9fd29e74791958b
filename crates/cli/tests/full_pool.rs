//! A pool with no free data block left (all its blocks hold data): writes of new
//! data fail with ENOSPC over NBD, the pool is not latched (stats say normal),
//! reads and trims go on, and after a trim new data fits again, without a restart.

mod common;

use common::libnbd::python_nbd;
use common::*;

/// Fill the export with random bytes until a write fails; it must fail with ENOSPC.
/// Then what was written reads back, a trim of everything is taken, and new
/// random bytes are written, flushed and read back.
const FILL_PY: &str = r#"
import errno, os, sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
size = h.get_size()
chunk = 1 << 20
written = []
for off in range(0, size, chunk):
    data = os.urandom(chunk)
    try:
        h.pwrite(data, off)
    except nbd.Error as e:
        if e.errno not in (errno.ENOSPC, "ENOSPC"):
            sys.exit(f"the write at {off} failed with errno {e.errno}, not ENOSPC: {e}")
        break
    written.append(data)
else:
    sys.exit(f"{size} bytes of random data fit in a pool that should be full")
h.flush()
for i, data in enumerate(written):
    if h.pread(chunk, i * chunk) != data:
        sys.exit(f"MiB {i}, written before the pool was full, reads back other bytes")
print(f"full after {len(written)} MiB")
h.trim(size, 0)
h.flush()
data = os.urandom(chunk)
h.pwrite(data, 0)
h.flush()
if h.pread(chunk, 0) != data:
    sys.exit("the write after the trim reads back other bytes")
print("written again after the trim")
"#;

#[test]
fn a_full_pool_fails_writes_with_enospc_and_takes_them_again_after_a_trim() {
    let dir = TempDir::new("fullpool");
    let pool = dir.join("test.pool");
    let pool_str = pool.to_str().expect("utf-8 temp path");
    fewerbytes_ok(&pool, &["pool", "create", pool_str, "--size", "64M"]);
    fewerbytes_ok(
        &pool,
        &["volume", "create", "vm", "--size", "128M", "--thin"],
    );
    let mut server = Server::start(dir.path(), &pool, &[]);
    let ran = python_nbd(FILL_PY, &[&server.unix_uri("vm")]);
    assert!(
        ran.stdout.contains("written again after the trim"),
        "{}",
        ran.report()
    );
    assert_eq!(
        server.stats()["mode"],
        "normal",
        "a full pool is not latched:\n{}",
        server.log_text()
    );
    let status = server.stop();
    assert!(status.success(), "{}", server.log_text());
    drop(server);
    assert_check_clean(&pool);
}
