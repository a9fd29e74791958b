#!/usr/bin/env bash
# Where the server's time goes: perf over `fewerbytes serve` while fio writes.
#
#   scripts/bench-profile.sh                    # 4k randwrite QD32x4 and 128k write QD8, seed mix
#   WORKLOADS="128k-mix" RUNTIME=30 scripts/bench-profile.sh
#   WORKLOADS="4k-random 128k-random" scripts/bench-profile.sh   # incompressible, unique data
#
# For each workload: a fresh pool (a file in BENCH_DIR, twice the volume) served over TCP,
# fio as in bench.sh, and while it runs (after WARMUP seconds) two perf passes over the
# server, one after the other: `perf stat` (CPU time, context switches and the write and
# wake-up system calls, counted) and `perf record -g` (where the CPU time goes, sampled by
# cpu-clock: this VM has no hardware counters). Each pass is divided by the guest bytes the
# server took in during it (its stats counter). Samples are grouped by symbol into the
# categories below; the 25 heaviest symbols are printed too.
# Needs (Debian): linux-perf, fio, libnbd-bin (nbdinfo), python3.
set -euo pipefail
cd "$(dirname "$0")/.."

WORKLOADS=${WORKLOADS:-4k-mix 128k-mix}
RUNTIME=${RUNTIME:-40}
WARMUP=${WARMUP:-5}
SAMPLE=${SAMPLE:-12}
JOBS=${JOBS:-4}
JOB_SIZE=${JOB_SIZE:-1G}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
PORT=${PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

cargo build --release -q
FB=$PWD/target/release/fewerbytes
dir=$(mktemp -d "$BENCH_DIR/fewerbytes-profile.XXXXXX")
server_pid='' fio_pid=''
cleanup() {
    [[ -n $fio_pid ]] && kill "$fio_pid" 2>/dev/null
    [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT

volume_bytes=$(($(numfmt --from=iec "$JOB_SIZE") * JOBS))
mix=(--dedupe_percentage=75 --buffer_compress_percentage=50 --buffer_compress_chunk=512 --refill_buffers)
pool=$dir/pool

guest_bytes() {
    "$FB" --pool "$pool" --control-socket "$dir/ctl" stats --json |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["counters"]["guest_bytes_written"])'
}

for w in $WORKLOADS; do
    case $w in
        4k-mix | 4k-random) args=(--rw=randwrite --bs=4k --iodepth=32 --numjobs="$JOBS" --size="$JOB_SIZE" --offset_increment="$JOB_SIZE") ;;
        128k-mix | 128k-random) args=(--rw=write --bs=128k --iodepth=8 --numjobs=1 --size="$volume_bytes") ;;
        *) echo "unknown workload $w" >&2; exit 1 ;;
    esac
    # The seed's mix, or fio's default random buffers (incompressible, unique).
    data=("${mix[@]}")
    [[ $w == *-random ]] && data=(--refill_buffers --randrepeat=0)
    rm -f "$pool"*
    "$FB" pool create "$pool" --size $((volume_bytes * 2)) >/dev/null
    "$FB" --pool "$pool" volume create vol --size "$volume_bytes" >/dev/null
    "$FB" --pool "$pool" --control-socket "$dir/ctl" serve --socket "$dir/sock" --listen "127.0.0.1:$PORT" \
        >"$dir/serve.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 100); do nbdinfo "nbd://127.0.0.1:$PORT/vol" >/dev/null 2>&1 && break; sleep 0.1; done
    fio --name=profile --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/vol" --time_based --runtime="$RUNTIME" \
        --end_fsync=1 --group_reporting "${args[@]}" "${data[@]}" >"$dir/fio.txt" 2>&1 &
    fio_pid=$!
    sleep "$WARMUP"

    before=$(guest_bytes)
    perf stat -x, -o "$dir/stat.csv" -e task-clock,context-switches \
        -e syscalls:sys_enter_pwrite64,syscalls:sys_enter_pwritev,syscalls:sys_enter_pwritev2 \
        -e syscalls:sys_enter_fdatasync,syscalls:sys_enter_futex,syscalls:sys_enter_recvfrom \
        -e syscalls:sys_enter_read,syscalls:sys_enter_writev,syscalls:sys_enter_sendmsg \
        -p "$server_pid" -- sleep "$SAMPLE" 2>/dev/null
    after=$(guest_bytes)
    stat_bytes=$((after - before))

    before=$(guest_bytes)
    perf record -q -F 1999 -e cpu-clock -g -o "$dir/perf.data" -p "$server_pid" -- sleep "$SAMPLE" 2>/dev/null
    after=$(guest_bytes)
    record_bytes=$((after - before))
    wait "$fio_pid" || true
    fio_pid=''
    kill "$server_pid"; wait "$server_pid" 2>/dev/null || true
    server_pid=''

    perf report -i "$dir/perf.data" --stdio --no-children --sort sym --percent-limit 0 -g none 2>/dev/null \
        >"$dir/report.txt"
    perf report -i "$dir/perf.data" --stdio --no-children --sort comm --percent-limit 0 -g none 2>/dev/null \
        >"$dir/threads.txt"
    echo "## $w ($(date -u +'%Y-%m-%d %H:%M') UTC, commit $(git describe --always --dirty), fio ${RUNTIME}s, samples ${SAMPLE}s after ${WARMUP}s)"
    python3 - "$dir/stat.csv" "$stat_bytes" "$dir/report.txt" "$record_bytes" "$w" "$dir/threads.txt" <<'EOF'
import re, sys
stat_path, stat_bytes, report_path, record_bytes, workload, threads_path = sys.argv[1:]
stat_bytes, record_bytes = int(stat_bytes), int(record_bytes)
blocks = stat_bytes / 4096
requests = stat_bytes / (4096 if workload.startswith("4k") else 131072)
counts = {}
for line in open(stat_path):
    parts = line.strip().split(",")
    if len(parts) > 2 and parts[0] and parts[0][0].isdigit():
        counts[parts[2]] = float(parts[0])
cpu_ms = counts.get("task-clock", 0)
print(f"perf stat: {stat_bytes / 2**20:.0f} MiB taken in, server CPU {cpu_ms / 1000:.2f} s "
      f"= {cpu_ms * 1000 / blocks:.2f} µs per 4 KiB block, {cpu_ms * 1000 / requests:.1f} µs per request")
for event, value in counts.items():
    if event != "task-clock":
        print(f"  {event.replace('syscalls:sys_enter_', '')}: {value:.0f} = {value / requests:.2f} per request")
print()

categories = [
    ("BLAKE3 (fingerprints)", r"blake3"),
    ("LZ4 (compression)", r"lz4"),
    ("copies and zeroing (memcpy/memset, user copies, page clearing)",
     r"memcpy|memmove|memset|copy_user|copy_to_user|copy_from_user|clear_page|rep_movs|rep_stos|_copy_from_iter|_copy_to_iter|copyin|copyout"),
    ("allocator", r"malloc|free|realloc|_int_|alloc_|dealloc|cfree|arena|tcache"),
    ("scheduler, futex, wake-ups, idle",
     r"futex|schedule|switch_to|__switch|ttwu|try_to_wake|wake_up|enqueue|dequeue|pick_next|finish_task|idle|update_curr|update_load|select_task|mutex_spin|raw_spin|_raw_spin|parking_lot|sched|native_queued"),
    ("network (TCP on loopback)", r"tcp|skb|sock|inet|ip_|net_|__dev_queue|loopback|napi|recvmsg|sendmsg|nf_|sk_"),
    ("page cache and file write (kernel)",
     r"ext4|filemap|iomap|generic_perform_write|folio|page_cache|pagecache|xas_|blk_|bio|jbd2|writeback|vfs_write|rw_verify|file_|mark_buffer|balance_dirty|lru"),
    ("syscall entry and exit", r"entry_SYSCALL|syscall_|do_syscall|exit_to_user|__x64_sys"),
]
total = 0.0
share = {name: 0.0 for name, _ in categories}
share["other fewerbytes code"] = 0.0
share["other"] = 0.0
top = []
for line in open(report_path):
    m = re.match(r"\s+([\d.]+)%\s+\[(.)\]\s+(.*)", line)
    if not m:
        continue
    pct, where, sym = float(m.group(1)), m.group(2), m.group(3).strip()
    total += pct
    top.append((pct, where, sym))
    for name, pattern in categories:
        if re.search(pattern, sym, re.I):
            share[name] += pct
            break
    else:
        if where == "." and re.search(r"fewerbytes|engine|nbd|format|storage", sym):
            share["other fewerbytes code"] += pct
        else:
            share["other"] += pct
print(f"perf record: {record_bytes / 2**20:.0f} MiB taken in while sampling; server CPU by category (self time):")
for name, pct in sorted(share.items(), key=lambda kv: -kv[1]):
    print(f"  {pct:5.1f}%  {name}")
print()
print("heaviest symbols:")
for pct, where, sym in top[:25]:
    print(f"  {pct:5.1f}%  [{where}] {sym[:110]}")
print()
print("threads:")
for line in open(threads_path):
    m = re.match(r"\s+([\d.]+)%\s+(.*)", line)
    if m:
        print(f"  {float(m.group(1)):5.1f}%  {m.group(2).strip()}")
EOF
    echo
done
