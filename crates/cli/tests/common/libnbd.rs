//! Clients written with libnbd's Python bindings (Debian's python3-libnbd), for what the
//! command-line tools cannot send: out-of-range requests and requests at any byte
//! offset and length (strict mode off), writes to a read-only export, and
//! connections held open across a crash.

use super::{require_tool, run_with_limit, Ran, CLIENT_LIMIT};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// Debian's own python3, which has libnbd's `nbd` module (a pyenv python may not).
pub fn system_python() -> PathBuf {
    let python = require_tool("/usr/bin/python3");
    let out = Command::new(&python)
        .args(["-c", "import nbd"])
        .output()
        .expect("run /usr/bin/python3");
    assert!(
        out.status.success(),
        "/usr/bin/python3 cannot import libnbd's `nbd` module (Debian package python3-libnbd); \
         run scripts/test.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    python
}

/// A Python script run with Debian's python3 and libnbd's bindings.
pub fn python_nbd(script: &str, args: &[&str]) -> Ran {
    let python = system_python();
    let mut cmd = Command::new(python);
    cmd.arg("-c").arg(script).args(args);
    let ran = run_with_limit(&mut cmd, CLIENT_LIMIT);
    assert!(
        ran.status.success(),
        "libnbd script failed:\n{}",
        ran.report()
    );
    ran
}

/// Sends each request the server must refuse, checks the errno, and checks the
/// connection still works after each one.
pub const BAD_REQUESTS_PY: &str = r#"
import errno, sys, nbd
uri = sys.argv[1]
def connect():
    h = nbd.NBD()
    h.set_strict_mode(0)   # send what the server must refuse
    h.connect_uri(uri)
    return h
h = connect()
size = h.get_size()
h.pwrite(b"\xa5" * 4096, 0)
failures = []
def check(name, fn, allowed, may_disconnect=False):
    global h
    try:
        fn()
        failures.append(f"{name}: succeeded, expected {allowed}")
    except nbd.Error as e:
        code = errno.errorcode.get(e.errno, str(e.errno))
        if code not in allowed:
            if may_disconnect and not h.aio_is_ready():
                print(f"{name}: server disconnected (allowed): {e.string}")
                h = connect()
                return
            failures.append(f"{name}: got {code} ({e.string}), expected {allowed}")
        else:
            print(f"{name}: {code}")
    # The connection must still work.
    try:
        if h.pread(4096, 0) != b"\xa5" * 4096:
            failures.append(f"after {name}: read back wrong data")
    except nbd.Error as e:
        failures.append(f"after {name}: connection unusable: {e.string}")
        h = connect()
MiB = 1024 * 1024
check("read past end", lambda: h.pread(4096, size), ["EINVAL"])
check("read straddling end", lambda: h.pread(8192, size - 4096), ["EINVAL"])
check("write past end", lambda: h.pwrite(b"x" * 4096, size), ["EINVAL", "ENOSPC"])
check("write straddling end", lambda: h.pwrite(b"x" * 8192, size - 4096), ["EINVAL", "ENOSPC"])
check("trim past end", lambda: h.trim(4096, size), ["EINVAL", "ENOSPC"])
check("write-zeroes past end", lambda: h.zero(4096, size), ["EINVAL", "ENOSPC"])
check("block-status past end", lambda: h.block_status(4096, size, lambda *a: 0), ["EINVAL"])
check("read offset near 2^64", lambda: h.pread(4096, (1 << 64) - 4096), ["EINVAL"])
check("read one byte past end", lambda: h.pread(2, size - 1), ["EINVAL"])
check("write one byte past end", lambda: h.pwrite(b"y" * 3, size - 2), ["EINVAL", "ENOSPC"])
check("trim one byte past end", lambda: h.trim(2, size - 1), ["EINVAL", "ENOSPC"])
check("read longer than maximum", lambda: h.pread(33 * MiB, 0), ["EINVAL", "EOVERFLOW"])
check("write longer than maximum", lambda: h.pwrite(b"z" * (33 * MiB), 0), ["EINVAL", "ENOSPC", "EOVERFLOW"], may_disconnect=True)
# A good request at the very end still works, and the data written first is intact.
h.pwrite(b"\x5a" * 4096, size - 4096)
assert h.pread(4096, size - 4096) == b"\x5a" * 4096
h.flush()
h.shutdown()
if failures:
    print("FAILURES:\n" + "\n".join(failures))
    sys.exit(1)
print("all refused as expected")
"#;

/// Writes, zeroes and trims at odd byte offsets and lengths through libnbd
/// (structured replies, strict mode off), checking every byte read back against a
/// model; or, with `verify`, only reads the volume back and compares.
///
/// Arguments: URI, `write` or `verify`, and a comma-separated list of seeds. The
/// model is what every seed's operations leave, in order; `write` sends only the
/// last seed's (the earlier ones are on the server already).
pub const BYTES_PY: &str = r#"
import random, sys, nbd
uri, mode, seeds = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
MiB, B = 1 << 20, 4096
h = nbd.NBD()
h.set_strict_mode(0)
h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
h.connect_uri(uri)
assert h.get_structured_replies_negotiated(), "structured replies not negotiated"
assert h.get_block_size(nbd.SIZE_MINIMUM) == 1, "minimum block size is not 1"
size = h.get_size()
REGION = 8 * MiB
model = bytearray(REGION)
last = bytearray(1)  # the export's last byte

def ops(seed):
    rng = random.Random(seed)
    # One byte, 511 bytes, 4095 across a block boundary, 1 MiB + 14 at offset 1,
    # a FUA write of a partial block, more starting and ending mid-block.
    for off, n, fua in [(0, 1, 0), (4097, 1, 0), (3, 511, 0), (4095, 4095, 0),
                        (1, MiB + 14, 0), (5 * B + 17, 33, nbd.CMD_FLAG_FUA),
                        (2 * MiB + 4093, 3 * B + 7, 0), (3 * MiB - 100, 200, 0),
                        (rng.randrange(REGION - 9000), rng.randrange(1, 9000), 0)]:
        yield ("write", off, rng.randbytes(n), fua)
    yield ("zero", 100003, 10, 0)
    yield ("trim", 5000, 100, 0)
    yield ("trim", 8191, 3 * B + 2, 0)
    yield ("zero", 2 * MiB + 1, 2 * B, 0)
    yield ("last", size - 1, bytes([seed % 251 + 1]), 0)

def apply(op):
    kind, off, arg, _ = op
    if kind == "write":
        model[off:off + len(arg)] = arg
    elif kind in ("zero", "trim"):
        model[off:off + arg] = bytes(arg)
    else:
        last[0] = arg[0]

def send(op):
    kind, off, arg, fua = op
    if kind == "write":
        h.pwrite(arg, off, fua)
    elif kind == "zero":
        h.zero(arg, off)
    elif kind == "trim":
        h.trim(arg, off)
    else:
        h.pwrite(arg, off)

def check(off, n):
    got = h.pread(n, off)
    want = bytes(model[off:off + n])
    if got != want:
        i = next(i for i in range(n) if got[i] != want[i])
        sys.exit(f"read of {n} bytes at {off}: byte at {off + i} is {got[i]:#x}, model has {want[i]:#x}")

for seed in seeds[:-1]:
    for op in ops(seed):
        apply(op)
for op in ops(seeds[-1]):
    apply(op)
    if mode == "write":
        send(op)
        kind, off, arg, _ = op
        if kind != "last":
            n = len(arg) if kind == "write" else arg
            lo, hi = max(0, off - B), min(REGION, off + n + B)
            check(lo, hi - lo)
if mode == "write":
    check(1, MiB + 14)
    # Block status at an odd offset and length answers for exactly that range.
    seen = []
    h.block_status(3, 4097, lambda ctx, off, entries, err: seen.append((off, entries)))
    assert seen and seen[0][0] == 4097, f"block status: {seen}"
    h.flush()
check(0, REGION)
got = h.pread(1, size - 1)
assert got == bytes(last), f"last byte is {got!r}, model has {bytes(last)!r}"
h.shutdown()
print("bytes ok")
"#;

/// Checks every kind of write gets EPERM from a read-only export and reads still work.
pub const READ_ONLY_PY: &str = r#"
import errno, sys, nbd
h = nbd.NBD()
h.set_strict_mode(0)
h.connect_uri(sys.argv[1])
assert h.is_read_only(), "read-only flag not advertised"
failures = []
for name, fn in [("write", lambda: h.pwrite(b"x" * 4096, 0)),
                 ("trim", lambda: h.trim(4096, 0)),
                 ("write-zeroes", lambda: h.zero(4096, 0))]:
    try:
        fn()
        failures.append(f"{name} succeeded on a read-only export")
    except nbd.Error as e:
        code = errno.errorcode.get(e.errno, str(e.errno))
        if code != "EPERM":
            failures.append(f"{name}: got {code} ({e.string}), expected EPERM")
    if h.pread(4096, 0) != b"\x3c" * 4096:
        failures.append(f"after {name}: data changed or connection lost")
h.shutdown()
if failures:
    print("FAILURES:\n" + "\n".join(failures))
    sys.exit(1)
print("read-only ok")
"#;

/// A libnbd Python script that connects, does its work, prints one line starting
/// with `ready`, then holds its connections open until its stdin closes.
pub struct HeldConnection {
    child: Child,
}

impl HeldConnection {
    /// A plain connection, held open.
    pub fn open(uri: &str) -> HeldConnection {
        HeldConnection::run(
            "import nbd, sys\nh = nbd.NBD()\nh.connect_uri(sys.argv[1])\nprint('ready', h.get_size(), flush=True)\nsys.stdin.read()\n",
            uri,
        )
    }

    /// Runs `script` with `uri` as its argument until it prints `ready`.
    pub fn run(script: &str, uri: &str) -> HeldConnection {
        let python = system_python();
        let mut child = Command::new(python)
            .arg("-c")
            .arg(script)
            .arg(uri)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start held connection");
        let mut line = String::new();
        use std::io::BufRead;
        let stdout = child.stdout.take().expect("stdout");
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read from held connection");
        assert!(
            line.starts_with("ready"),
            "libnbd client on {uri} failed before it was ready: {line:?}"
        );
        HeldConnection { child }
    }
}

/// Writes on connection a, flushes on b, and holds both open (no close-time flush).
pub const MULTI_CONN_PY: &str = r#"
import nbd, sys
a = nbd.NBD(); a.connect_uri(sys.argv[1])
b = nbd.NBD(); b.connect_uri(sys.argv[1])
assert a.can_multi_conn(), "CAN_MULTI_CONN not advertised"
a.pwrite(b"\x71" * 65536, 0)          # acknowledged on connection a, never flushed there
a.pwrite(b"\x73" * 4096, 3 << 20, nbd.CMD_FLAG_FUA)  # FUA: durable on its own
b.pwrite(b"\x72" * 4096, 1 << 20)
b.flush()                               # must cover a's acknowledged write too
print("ready", flush=True)
sys.stdin.read()                        # keep both connections open: no DISC, no close-time flush
"#;

impl Drop for HeldConnection {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
