#!/usr/bin/env bash
# A/B benchmark of two fewerbytes binaries in one run, alternating A B, B A, A B, ...
# so a machine whose load changes (shared CPUs) weighs on both alike; prints each run
# and the ratio B/A per workload. With QEMU_NBD=1, qemu-nbd on a raw file (O_DIRECT, as in
# bench.sh) takes a turn in each round too. SERVE_ARGS are passed to both servers' `serve`
# (e.g. "--threads 8").
#
#   A=/path/to/old/fewerbytes B=target/release/fewerbytes scripts/bench-ab.sh
#   ROUNDS=3 RUNTIME=20 WORKLOADS="4k-mix 128k-mix 512-random" QEMU_NBD=1 scripts/bench-ab.sh
#
# Workloads (fio over NBD, TCP on loopback, end_fsync=1, throughput to the end of
# the final flush, as in bench.sh):
#   4k-mix      4k randwrite QD32 x JOBS, 75% dup / 50% compressible
#   4k-random   4k randwrite QD32 x JOBS, random data (incompressible, unique)
#   128k-mix    128k write QD8, same mix
#   512-random  512-byte randwrite QD32, random data (partial blocks: read-modify-write)
#   128k-random 128k write QD8, random data (incompressible, unique)
set -euo pipefail
cd "$(dirname "$0")/.."

A=${A:?set A to the baseline fewerbytes binary}
B=${B:-$PWD/target/release/fewerbytes}
ROUNDS=${ROUNDS:-2}
RUNTIME=${RUNTIME:-20}
JOBS=${JOBS:-4}
JOB_SIZE=${JOB_SIZE:-1G}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
PORT=${PORT:-10898}
WORKLOADS=${WORKLOADS:-4k-mix 128k-mix 512-random}
QEMU_NBD=${QEMU_NBD:-0}
read -r -a serve_args <<<"${SERVE_ARGS:-}"

dir=$(mktemp -d "$BENCH_DIR/fewerbytes-ab.XXXXXX")
server_pid=
cleanup() {
    [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT

job_bytes=$(numfmt --from=iec "$JOB_SIZE")
volume_bytes=$((job_bytes * JOBS))
mix=(--dedupe_percentage=75 --buffer_compress_percentage=50 --buffer_compress_chunk=512 --refill_buffers)
random=(--refill_buffers --randrepeat=0)

wait_ready() {
    for _ in $(seq 100); do nbdinfo "$1" >/dev/null 2>&1 && return; sleep 0.1; done
    echo "server did not start" >&2; cat "$dir/serve.log" >&2; exit 1
}

start_fewerbytes() {
    local bin=$1
    rm -f "$dir/pool"*
    "$bin" pool create "$dir/pool" --size $((volume_bytes * 2)) >/dev/null
    "$bin" --pool "$dir/pool" volume create vol --size "$volume_bytes" >/dev/null
    "$bin" --pool "$dir/pool" serve --listen "127.0.0.1:$PORT" "${serve_args[@]}" >"$dir/serve.log" 2>&1 &
    server_pid=$!
    uri="nbd://127.0.0.1:$PORT/vol"
    wait_ready "$uri"
}

start_qemu_nbd() {
    rm -f "$dir/raw"
    truncate -s "$volume_bytes" "$dir/raw"
    qemu-nbd -f raw --cache=none --aio=native -t -e 0 -p "$PORT" -b 127.0.0.1 "$dir/raw" >"$dir/serve.log" 2>&1 &
    server_pid=$!
    uri="nbd://127.0.0.1:$PORT"
    wait_ready "$uri"
}

stop_server() {
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=
}

# run_fio WORKLOAD: prints MiB/s to the end of the final flush.
run_fio() {
    local args
    case $1 in
        4k-mix) args=(--rw=randwrite --bs=4k --iodepth=32 --numjobs="$JOBS" "${mix[@]}") ;;
        4k-random) args=(--rw=randwrite --bs=4k --iodepth=32 --numjobs="$JOBS" "${random[@]}") ;;
        128k-mix) args=(--rw=write --bs=128k --iodepth=8 --numjobs=1 "${mix[@]}") ;;
        512-random) args=(--rw=randwrite --bs=512 --iodepth=32 --numjobs=1 "${random[@]}") ;;
        128k-random) args=(--rw=write --bs=128k --iodepth=8 --numjobs=1 "${random[@]}") ;;
        *) echo "unknown workload $1" >&2; exit 1 ;;
    esac
    local start end
    start=$(date +%s.%N)
    fio --name=ab --ioengine=nbd --uri="$uri" --size="$JOB_SIZE" --offset_increment="$JOB_SIZE" \
        --time_based --runtime="$RUNTIME" --end_fsync=1 --group_reporting --output-format=json \
        "${args[@]}" >"$dir/fio.json"
    end=$(date +%s.%N)
    python3 -c '
import json, sys
start, end = float(sys.argv[1]), float(sys.argv[2])
text = open(sys.argv[3]).read()
j = json.loads(text[text.index("{"):])["jobs"][0]
written = j["write"]["io_bytes"]
print(f"{written / (end - start) / 2**20:.1f}")' "$start" "$end" "$dir/fio.json"
}

declare -A sum
servers=(A B)
[[ $QEMU_NBD == 1 ]] && servers+=(qemu-nbd)
echo "A = $A"
echo "B = $B"
for w in $WORKLOADS; do
    for round in $(seq "$ROUNDS"); do
        order=("${servers[@]}")
        if ((round % 2 == 0)); then
            order=(B A "${servers[@]:2}")
        fi
        for s in "${order[@]}"; do
            case $s in
                A) start_fewerbytes "$A" ;;
                B) start_fewerbytes "$B" ;;
                qemu-nbd) start_qemu_nbd ;;
            esac
            mibs=$(run_fio "$w")
            stop_server
            echo "$w round $round $s: $mibs MiB/s ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1 /proc/loadavg))"
            sum["$w|$s"]=$(python3 -c "print(${sum["$w|$s"]:-0} + $mibs)")
        done
    done
done
echo
echo "| workload | A (MiB/s, mean) | B (MiB/s, mean) | B / A |$([[ $QEMU_NBD == 1 ]] && echo " qemu-nbd raw (MiB/s, mean) | B / qemu-nbd |")"
echo "|---|---|---|---|$([[ $QEMU_NBD == 1 ]] && echo "---|---|")"
for w in $WORKLOADS; do
    a=$(python3 -c "print(f'{${sum["$w|A"]} / $ROUNDS:.1f}')")
    b=$(python3 -c "print(f'{${sum["$w|B"]} / $ROUNDS:.1f}')")
    line="| $w | $a | $b | $(python3 -c "print(f'{$b / $a:.2f}')") |"
    if [[ $QEMU_NBD == 1 ]]; then
        q=$(python3 -c "print(f'{${sum["$w|qemu-nbd"]} / $ROUNDS:.1f}')")
        line+=" $q | $(python3 -c "print(f'{$b / $q:.2f}')") |"
    fi
    echo "$line"
done
echo
echo "(runtime ${RUNTIME}s per run, $ROUNDS rounds alternating, $JOBS jobs of $JOB_SIZE for 4k, files in $BENCH_DIR, $(nproc) CPUs)"
