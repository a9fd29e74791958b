#!/usr/bin/env bash
# The boot storm, measured: the test guest (scripts/guest/build-image.sh) as a
# template, GUESTS clones (default 7) booted at once against one `fewerbytes serve`,
# each running its test unit (writes its files, fstrim, poweroff); then the same
# guests on GUESTS raw copies of the image, each served by its own qemu-nbd.
#
#   scripts/bench-boot-storm.sh                 # 7 guests, files under /var/tmp
#   GUESTS=3 BENCH_DIR=/mnt/disk scripts/bench-boot-storm.sh
#
# Prints a markdown table: wall time until every guest powered off, the servers'
# peak RSS (VmHWM; summed over the qemu-nbd processes) and CPU time (utime+stime
# during the storm), data stored before and after, and the bytes reaching the drive
# (/proc/PID/io write_bytes of the servers during the storm; for fewerbytes also its
# own device counters; for the raw copies, their allocated bytes before and after).
# Needs root (debootstrap on the first run), qemu-utils (qemu-nbd) and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/guest/common.sh

GUESTS=${GUESTS:-7}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
GUEST_MIB=${GUEST_MIB:-8}
fb_need qemu-nbd qemu-utils
fb_need python3 python3

cargo build --release -q -p fewerbytes
FB=$PWD/target/release/fewerbytes
eval "$(scripts/guest/build-image.sh)"
dir=$(mktemp -d "$BENCH_DIR/fewerbytes-storm.XXXXXX")
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$dir"
}
trap cleanup EXIT

# boot_all URI_PREFIX URI_SUFFIX LOG_PREFIX: boots guests 1..GUESTS at once (URI of
# guest i: PREFIX i SUFFIX) and waits for all; prints the wall time in seconds.
boot_all() {
    local start end i failed=0 boots=()
    start=$(date +%s.%N)
    for i in $(seq 1 "$GUESTS"); do
        scripts/guest/boot.sh "$1$i$2" "$3$i.console" fb.job=basic fb.seed="$i" fb.mib="$GUEST_MIB" \
            >"$3$i.qemu" 2>&1 &
        boots+=($!)
    done
    for i in "${!boots[@]}"; do
        wait "${boots[$i]}" || { echo "guest $((i + 1)) failed: $(cat "$3$((i + 1)).qemu")" >&2; failed=1; }
    done
    end=$(date +%s.%N)
    for i in $(seq 1 "$GUESTS"); do
        fb_console_ok "$3$i.console" || { echo "guest $i's unit did not finish: $3$i.console" >&2; failed=1; }
    done
    [[ $failed -eq 0 ]] || exit 1
    python3 -c "print(f'{$end - $start:.1f}')"
}

mib() { python3 -c "print(f'{$1 / 2**20:.1f}')"; }

# --- fewerbytes: one server, a template and its clones -----------------------------
pool=$dir/vm.pool
"$FB" pool create "$pool" --size 16G --overcommit >/dev/null
"$FB" --pool "$pool" volume create template --size "$SIZE" >/dev/null
"$FB" --pool "$pool" volume import template "$IMAGE" >/dev/null 2>&1
"$FB" --pool "$pool" serve --socket "$dir/fb.sock" --no-tcp >"$dir/serve.log" 2>&1 &
server=$!
pids+=("$server")
for _ in $(seq 1 600); do [[ -S $dir/fb.sock && -S $pool.ctl ]] && break; sleep 0.1; done
"$FB" --pool "$pool" stats --json >"$dir/template.json"
for i in $(seq 1 "$GUESTS"); do "$FB" --pool "$pool" volume clone template "vm$i" >/dev/null; done
"$FB" --pool "$pool" stats --json >"$dir/before.json"
cpu0=$(fb_proc_cpu_ticks "$server")
io0=$(fb_proc_write_bytes "$server")
alloc0=$(fb_allocated_bytes "$pool")
fb_wall=$(boot_all "nbd+unix:///vm" "?socket=$dir/fb.sock" "$dir/fb-vm")
"$FB" --pool "$pool" stats --json >"$dir/after.json"
fb_cpu=$((($(fb_proc_cpu_ticks "$server") - cpu0) / $(getconf CLK_TCK)))
fb_io=$(($(fb_proc_write_bytes "$server") - io0))
fb_hwm=$(fb_proc_hwm_kib "$server")
kill "$server"
wait "$server"
pids=()
alloc1=$(fb_allocated_bytes "$pool")
"$FB" --pool "$pool" check >"$dir/check.txt" || { cat "$dir/check.txt" >&2; exit 1; }
# One device (no metadata device): it receives data and metadata, counted once.
dev_bytes() { fb_json "$1" 'j["data_device"]["write_bytes"]'; }
fb_template=$(fb_json "$dir/template.json" 'j["stored_bytes"]')
fb_before=$(fb_json "$dir/before.json" 'j["stored_bytes"]')
fb_after=$(fb_json "$dir/after.json" 'j["stored_bytes"]')
fb_written=$(fb_json "$dir/after.json" 'j["counters"]["guest_bytes_written"] - '"$(fb_json "$dir/before.json" 'j["counters"]["guest_bytes_written"]')")
fb_trimmed=$(fb_json "$dir/after.json" 'j["counters"]["trimmed_bytes"] - '"$(fb_json "$dir/before.json" 'j["counters"]["trimmed_bytes"]')")
fb_dev=$(($(dev_bytes "$dir/after.json") - $(dev_bytes "$dir/before.json")))

# --- qemu-nbd: GUESTS raw copies, one server each ---------------------------------
copies=()
for i in $(seq 1 "$GUESTS"); do
    cp --sparse=always "$IMAGE" "$dir/vm$i.raw"
    copies+=("$dir/vm$i.raw")
done
sync
raw_before=$(fb_allocated_bytes "${copies[@]}")
for i in $(seq 1 "$GUESTS"); do
    qemu-nbd -f raw --cache=none --aio=native --discard=unmap -t -k "$dir/q$i.sock" "$dir/vm$i.raw" \
        >"$dir/qemu-nbd$i.log" 2>&1 &
    pids+=($!)
done
for i in $(seq 1 "$GUESTS"); do
    for _ in $(seq 1 600); do [[ -S $dir/q$i.sock ]] && break; sleep 0.1; done
done
q_cpu0=0 q_io0=0
for p in "${pids[@]}"; do
    q_cpu0=$((q_cpu0 + $(fb_proc_cpu_ticks "$p")))
    q_io0=$((q_io0 + $(fb_proc_write_bytes "$p")))
done
q_wall=$(boot_all "nbd+unix:///?socket=$dir/q" ".sock" "$dir/q-vm")
q_cpu=0 q_io=0 q_hwm=0
for p in "${pids[@]}"; do
    q_cpu=$((q_cpu + $(fb_proc_cpu_ticks "$p")))
    q_io=$((q_io + $(fb_proc_write_bytes "$p")))
    q_hwm=$((q_hwm + $(fb_proc_hwm_kib "$p")))
done
q_cpu=$(((q_cpu - q_cpu0) / $(getconf CLK_TCK)))
q_io=$((q_io - q_io0))
for p in "${pids[@]}"; do kill "$p"; wait "$p" 2>/dev/null || true; done
pids=()
sync
raw_after=$(fb_allocated_bytes "${copies[@]}")

accel=$(fb_guest_accel "$KERNEL")
echo
echo "Boot storm: $GUESTS guests ($accel), each writing ${GUEST_MIB} MiB pseudo-random + ${GUEST_MIB} MiB text + a copy of /usr/bin, then fstrim; $(nproc) CPUs; $(date -u +'%Y-%m-%d %H:%M UTC'); commit $(git rev-parse --short HEAD)"
echo
echo "| | fewerbytes (1 server, template + $GUESTS clones) | qemu-nbd ($GUESTS servers, $GUESTS raw copies) |"
echo "|---|---|---|"
echo "| wall time until all $GUESTS powered off | ${fb_wall} s | ${q_wall} s |"
echo "| server peak RSS (VmHWM) | $((fb_hwm / 1024)) MiB | $((q_hwm / 1024)) MiB (sum of $GUESTS) |"
echo "| server CPU time during the storm | ${fb_cpu} s | ${q_cpu} s (sum) |"
echo "| data stored: template alone | $(mib "$fb_template") MiB | $(mib "$(fb_allocated_bytes "$IMAGE")") MiB (the image) |"
echo "| data stored before the boots | $(mib "$fb_before") MiB | $(mib "$raw_before") MiB allocated |"
echo "| data stored after the boots | $(mib "$fb_after") MiB | $(mib "$raw_after") MiB allocated |"
echo "| bytes the guests wrote / trimmed | $(mib "$fb_written") / $(mib "$fb_trimmed") MiB (server counters) | - |"
echo "| bytes reaching the drive during the storm (/proc/PID/io) | $(mib "$fb_io") MiB | $(mib "$q_io") MiB |"
echo "| same, by the pool's device counters | $(mib "$fb_dev") MiB | - |"
echo "| pool file allocated before / after | $(mib "$alloc0") / $(mib "$alloc1") MiB | - |"
