#!/usr/bin/env bash
# A guest that works hard: the test guest (scripts/guest/build-image.sh) boots from a
# fewerbytes volume and runs its "churn" job: ROUNDS rounds of copying /usr, writing
# MIB MiB of random data and MIB/4 MiB of pseudo-random data, checking every copied
# file after dropping the page cache, deleting the previous round and running fstrim.
# Then it powers off, the pool is checked (`fewerbytes check`), the volume is exported
# and `fsck.ext4 -n` and the last round's checksums are verified on the export.
#
#   scripts/bench-guest-churn.sh               # ROUNDS=3 MIB=128, files under /var/tmp
#   ROUNDS=2 MIB=64 scripts/bench-guest-churn.sh
#
# Prints a markdown table: guest run time, bytes the guest wrote and trimmed (server
# counters), data stored before and after, and bytes reaching the drive (the pool's
# device counters and the server's /proc/PID/io write_bytes). Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/guest/common.sh

ROUNDS=${ROUNDS:-3}
MIB=${MIB:-128}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
fb_need python3 python3
fb_need fsck.ext4 e2fsprogs

cargo build --release -q -p fewerbytes
FB=$PWD/target/release/fewerbytes
eval "$(scripts/guest/build-image.sh)"
dir=$(mktemp -d "$BENCH_DIR/fewerbytes-churn.XXXXXX")
server=
loop=
cleanup() {
    if mountpoint -q "$dir/mnt" 2>/dev/null; then umount "$dir/mnt" || umount -l "$dir/mnt"; fi
    [[ -n $loop ]] && losetup -d "$loop" 2>/dev/null
    [[ -n $server ]] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT
mib() { python3 -c "print(f'{$1 / 2**20:.1f}')"; }

pool=$dir/vm.pool
"$FB" pool create "$pool" --size 16G >/dev/null
"$FB" --pool "$pool" volume create vm --size "$SIZE" >/dev/null
"$FB" --pool "$pool" volume import vm "$IMAGE" >/dev/null 2>&1
"$FB" --pool "$pool" serve --socket "$dir/fb.sock" --no-tcp >"$dir/serve.log" 2>&1 &
server=$!
for _ in $(seq 1 600); do [[ -S $dir/fb.sock && -S $pool.ctl ]] && break; sleep 0.1; done
"$FB" --pool "$pool" stats --json >"$dir/before.json"
io0=$(fb_proc_write_bytes "$server")
cpu0=$(fb_proc_cpu_ticks "$server")
start=$(date +%s.%N)
GUEST_MEM=1024 GUEST_TIMEOUT=${GUEST_TIMEOUT:-5400} scripts/guest/boot.sh "nbd+unix:///vm?socket=$dir/fb.sock" "$dir/console" \
    fb.job=churn fb.rounds="$ROUNDS" fb.mib="$MIB" fb.seed=100 >"$dir/qemu.out" 2>&1 ||
    { cat "$dir/qemu.out"; tail -40 "$dir/console"; exit 1; }
end=$(date +%s.%N)
fb_console_ok "$dir/console" || { tail -40 "$dir/console"; echo "the churn job did not finish" >&2; exit 1; }
"$FB" --pool "$pool" stats --json >"$dir/after.json"
io=$(($(fb_proc_write_bytes "$server") - io0))
cpu=$((($(fb_proc_cpu_ticks "$server") - cpu0) / $(getconf CLK_TCK)))
hwm=$(fb_proc_hwm_kib "$server")
kill "$server"
wait "$server"
server=
"$FB" --pool "$pool" check >"$dir/check.txt" || { cat "$dir/check.txt" >&2; exit 1; }

# Read back: export, fsck, mount read-only, the last round's checksums.
"$FB" --pool "$pool" volume export vm "$dir/vm.raw" >/dev/null 2>&1
fsck.ext4 -n -f "$dir/vm.raw" >"$dir/fsck.txt" 2>&1 || { cat "$dir/fsck.txt" >&2; exit 1; }
mkdir -p "$dir/mnt"
loop=$(losetup -f -r --show "$dir/vm.raw")
mount -o ro,noload "$loop" "$dir/mnt"
checked=0
while read -r _ sum path; do
    path=${path%$'\r'}
    got=$(sha256sum "$dir/mnt$path" | cut -d' ' -f1)
    [[ $got == "$sum" ]] || { echo "$path read back differs: $got, the guest printed $sum" >&2; exit 1; }
    if [[ $path == *.sums ]]; then
        (cd "$dir/mnt${path%.sums}" && sha256sum -c --quiet "$dir/mnt$path")
    fi
    checked=$((checked + 1))
done < <(grep -ao 'FEWERBYTES-SHA256 .*' "$dir/console")
[[ $checked -ge 3 ]] || { echo "the guest printed $checked checksums, expected 3" >&2; exit 1; }

j() { fb_json "$1" "$2"; }
written=$(($(j "$dir/after.json" 'j["counters"]["guest_bytes_written"]') - $(j "$dir/before.json" 'j["counters"]["guest_bytes_written"]')))
trimmed=$(($(j "$dir/after.json" 'j["counters"]["trimmed_bytes"]') - $(j "$dir/before.json" 'j["counters"]["trimmed_bytes"]')))
dev=$(($(j "$dir/after.json" 'j["data_device"]["write_bytes"]') - $(j "$dir/before.json" 'j["data_device"]["write_bytes"]')))
used0=$(j "$dir/before.json" 'j["stored_bytes"]')
used1=$(j "$dir/after.json" 'j["stored_bytes"]')
echo
echo "Guest churn: $ROUNDS rounds of MIB=$MIB ($(fb_guest_accel "$KERNEL"), 1 vCPU, 1 GiB), $(nproc) host CPUs, $(date -u +'%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD)"
echo
echo "| measure | value |"
echo "|---|---|"
echo "| guest power-on to power-off | $(python3 -c "print(f'{$end - $start:.0f}')") s |"
echo "| bytes the guest wrote (server counter) | $(mib "$written") MiB |"
echo "| bytes the guest trimmed (server counter) | $(mib "$trimmed") MiB |"
echo "| data stored before / after | $(mib "$used0") / $(mib "$used1") MiB |"
echo "| bytes reaching the drive (pool device counter) | $(mib "$dev") MiB ($(python3 -c "print(f'{100 * $dev / max($written, 1):.1f}')")% of written) |"
echo "| bytes reaching the drive (/proc/PID/io write_bytes) | $(mib "$io") MiB |"
echo "| server CPU time / peak RSS | ${cpu} s / $((hwm / 1024)) MiB |"
echo "| fewerbytes check, fsck.ext4 -n of the export, $checked checksums read back | clean |"
