#!/usr/bin/env bash
# The one test command: installs the NBD clients the tests drive (when missing and
# when run as root on Debian), then runs every test of the workspace in release mode
# and prints a summary.
#
#   scripts/test.sh                 # the default run; CI's whole .ci/run (this, with its
#                                   # build, fmt and clippy) last took about 21 minutes on
#                                   # an idle 2-core machine, about 35 under load
#   FEWERBYTES_SOAK=1 scripts/test.sh   # larger fio workloads and file trees, 2,048 model cases
#   FEWERBYTES_CRASH_SOAK=1 scripts/test.sh   # 2,000 crash-simulation workloads (docs/testing.md)
#   scripts/test.sh -- nbdinfo      # extra arguments go to `cargo test` (here: a filter)
#   FEWERBYTES_FUZZ_SECONDS=0 scripts/test.sh   # without the fuzz step
# With no arguments, every fuzz target in fuzz/ then runs for FEWERBYTES_FUZZ_SECONDS
# (default 20) each (scripts/fuzz.sh, docs/testing.md); each counts as one test.
set -euo pipefail

cd "$(dirname "$0")/.."

# Debian packages providing each client the tests run. A test whose client is
# missing fails with a message naming the package; it is never skipped.
PACKAGES=(libnbd-bin nbd-client fio nbdkit python3-libnbd e2fsprogs qemu-utils util-linux mount systemd debootstrap perl libtest-mockmodule-perl libjson-perl openssl libssl-dev pkg-config ceph-mon ceph-mgr ceph-osd ceph-common)
TOOLS=(nbdinfo nbdsh nbdfuse nbdcopy nbd-client fio qemu-img qemu-io mkfs.ext4 fsck.ext4 losetup fstrim mount umount systemd-analyze debootstrap prove openssl ceph-mon ceph-mgr ceph-osd ceph rbd)

have_tool() {
    PATH="$PATH:/usr/sbin:/sbin" command -v "$1" >/dev/null 2>&1
}

missing=()
for t in "${TOOLS[@]}"; do
    have_tool "$t" || missing+=("$t")
done
if ! /usr/bin/python3 -c 'import nbd' >/dev/null 2>&1; then
    missing+=("python3-libnbd")
fi
# The build's: the openssl crate links the system's libssl (NBD over TLS).
if ! pkg-config --exists openssl 2>/dev/null; then
    missing+=("libssl-dev pkg-config")
fi
# The Proxmox plugin's tests (packaging/proxmox/t).
if ! perl -MTest::MockModule -MJSON -e 1 >/dev/null 2>&1; then
    missing+=("libtest-mockmodule-perl libjson-perl")
fi

if ((${#missing[@]})); then
    echo "test.sh: missing clients: ${missing[*]}"
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "test.sh: installing ${PACKAGES[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q
        apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
    else
        echo "test.sh: not root or not Debian: install ${PACKAGES[*]} yourself; the NBD client tests will fail without them" >&2
    fi
fi

# The guest tests (crates/cli/tests/guest.rs) boot VMs with Debian's
# qemu-system-x86_64, unpacked into a private folder rather than installed (that would
# replace qemu-utils 10): scripts/guest/qemu.sh does it once per machine (as root).
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    scripts/guest/qemu.sh >/dev/null || echo "test.sh: scripts/guest/qemu.sh failed: the guest tests will fail" >&2
fi

# Show which clients the tests will use.
echo "test.sh: clients: $(nbdinfo --version 2>/dev/null | head -1), $(qemu-img --version | head -1), $(fio --version), $(nbd-client --version 2>&1 | head -1 || true), guests: $("${FEWERBYTES_GUEST_CACHE:-/var/cache/fewerbytes-test}"/qemu-system-x86/bin/qemu-system-x86_64 --version 2>/dev/null | head -1 || echo 'no qemu-system-x86_64')"

log=$(mktemp -t fewerbytes-test.XXXXXX)
trap 'rm -f "$log"' EXIT

status=0
start=$(date +%s)
# --no-fail-fast: one failing test binary must not hide the results of the others.
cargo test --workspace --release --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?

# Fuzzing: each target for a bounded time; one summary line per target.
fuzz_log=$(mktemp -t fewerbytes-fuzz.XXXXXX)
trap 'rm -f "$log" "$fuzz_log"' EXIT
if [[ $# -eq 0 && ${FEWERBYTES_FUZZ_SECONDS:-20} != 0 ]]; then
    FEWERBYTES_FUZZ_SUMMARY=$fuzz_log scripts/fuzz.sh || status=$?
fi
elapsed=$(( $(date +%s) - start ))

# Summary over every test binary cargo ran.
passed=0 failed=0 ignored=0
while read -r p f i; do
    passed=$((passed + p)); failed=$((failed + f)); ignored=$((ignored + i))
done < <(sed -n 's/^test result: [A-Za-z]*\. \([0-9]*\) passed; \([0-9]*\) failed; \([0-9]*\) ignored.*/\1 \2 \3/p' "$log")

echo
echo "================ fewerbytes test summary (${elapsed}s) ================"
# One line per test binary: which one, and what it reported.
awk '/^ *Running /{
         bin=$0; sub(/^.*deps\//, "", bin); sub(/-[0-9a-f]+\)$/, "", bin)
         what=$0; sub(/^ *Running /, "", what); sub(/ \(.*$/, "", what)
         name=bin ": " what}
     /^ *Doc-tests /{name=$0; sub(/^ *Doc-tests /, "doc-tests ", name)}
     /^test result:/{r=$0; sub(/^test result: /, "", r); sub(/; [0-9]+ measured.*finished in/, ", in", r)
         printf "  %-52s %s\n", name, r}' "$log"
# The crash simulation's totals (crates/engine/tests/crash/ writes them past the
# test harness's capture).
if grep -q '^crash points: ' "$log"; then
    echo "crash simulation (crates/engine/tests/crash/):"
    grep -E '^crash (points|workloads): ' "$log" | sed 's/^/  /'
fi
if [[ -s $fuzz_log ]]; then
    echo "fuzz targets (executions this run):"
    sed 's/^fuzz /  /' "$fuzz_log"
    passed=$((passed + $(grep -c 'no crash$' "$fuzz_log" || true)))
    failed=$((failed + $(grep -c ' FAILED ' "$fuzz_log" || true)))
fi
if grep -q '^failures:' "$log"; then
    echo "failed tests:"
    grep -E '^    [a-zA-Z0-9_:]+$' "$log" | sort -u | sed 's/^    /  - /' || true
fi
if [[ $status -ne 0 && $failed -eq 0 ]]; then
    echo "cargo test exited with $status before all tests ran (build failure?)"
    failed=$((failed + 1))
fi
echo "summary: $passed passed, $failed failed, $ignored skipped"
exit "$status"
