#!/usr/bin/env bash
# One-command benchmark: fio over NBD against fewerbytes and, in the same run,
# against qemu-nbd serving a raw file and nbdkit's file plugin on the same disk.
#
#   scripts/bench.sh                 # 30 s per job
#   RUNTIME=10 scripts/bench.sh      # shorter
#   BENCH_DIR=/mnt/disk scripts/bench.sh   # put the files on another drive
#
# Throughput counts the time to the end of the final flush (fio's end_fsync=1,
# timed around fio), so a server that only defers writes cannot look faster.
# Bytes reaching the drive for fewerbytes are the pool's own per-device counters
# (stats --json, data + metadata); a raw file receives every guest byte.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNTIME=${RUNTIME:-30}
JOBS=${JOBS:-4}
JOB_SIZE=${JOB_SIZE:-1G}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
PORT=${PORT:-10899}

cargo build --release -q
FB=$PWD/target/release/fewerbytes
dir=$(mktemp -d "$BENCH_DIR/fewerbytes-bench.XXXXXX")
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

# run_fio URI NAME RW BS DEPTH JOBS [extra...]: prints "MiB/s io_bytes"
run_fio() {
    local uri=$1 name=$2 rw=$3 bs=$4 depth=$5 jobs=$6
    shift 6
    local start end
    start=$(date +%s.%N)
    fio --name="$name" --ioengine=nbd --uri="$uri" --rw="$rw" --bs="$bs" --iodepth="$depth" \
        --numjobs="$jobs" --size="$JOB_SIZE" --offset_increment="$JOB_SIZE" --time_based --runtime="$RUNTIME" \
        --end_fsync=1 --group_reporting --output-format=json "$@" >"$dir/fio.json"
    end=$(date +%s.%N)
    python3 -c '
import json, sys
start, end = float(sys.argv[1]), float(sys.argv[2])
text = open(sys.argv[3]).read()  # fio prints "connected" lines before the JSON
j = json.loads(text[text.index("{"):])["jobs"][0]
io = j["write"]["io_bytes"] + j["read"]["io_bytes"]
lat = j["read"]["clat_ns"]["mean"] / 1000 if j["read"]["io_bytes"] else 0
print(f"{io / (end - start) / 2**20:.1f} {io} {lat:.1f}")' "$start" "$end" "$dir/fio.json"
}

fb_device_bytes() {
    # One device here: it receives data and metadata, counted once.
    "$FB" --pool "$dir/pool" stats --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["data_device"]["write_bytes"])'
}

start_fewerbytes() {
    rm -f "$dir/pool"*
    "$FB" pool create "$dir/pool" --size $((volume_bytes * 2)) >/dev/null
    "$FB" --pool "$dir/pool" volume create vol --size "$volume_bytes" >/dev/null
    "$FB" --pool "$dir/pool" serve --listen "127.0.0.1:$PORT" >"$dir/serve.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 50); do nbdinfo "nbd://127.0.0.1:$PORT/vol" >/dev/null 2>&1 && return; sleep 0.1; done
    echo "fewerbytes did not start" >&2; cat "$dir/serve.log" >&2; exit 1
}

start_qemu_nbd() {
    rm -f "$dir/raw"
    truncate -s "$volume_bytes" "$dir/raw"
    qemu-nbd -f raw --cache=none --aio=native -t -e 0 -p "$PORT" -b 127.0.0.1 "$dir/raw" >"$dir/qemu.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 50); do nbdinfo "nbd://127.0.0.1:$PORT" >/dev/null 2>&1 && return; sleep 0.1; done
    echo "qemu-nbd did not start" >&2; cat "$dir/qemu.log" >&2; exit 1
}

start_nbdkit() {
    rm -f "$dir/raw"
    truncate -s "$volume_bytes" "$dir/raw"
    nbdkit -f -p "$PORT" -i 127.0.0.1 file "$dir/raw" >"$dir/nbdkit.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 50); do nbdinfo "nbd://127.0.0.1:$PORT" >/dev/null 2>&1 && return; sleep 0.1; done
    echo "nbdkit did not start" >&2; exit 1
}

stop_server() {
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=
}

declare -A result
workloads=("4k randwrite QD32x$JOBS, 75% dup / 50% compressible|randwrite|4k|32|$JOBS|mix"
           "4k randwrite QD32x$JOBS, random data|randwrite|4k|32|$JOBS|random"
           "128k write QD8, 75% dup / 50% compressible|write|128k|8|1|mix"
           "4k randread QD1|randread|4k|1|1|random")

for server in ${SERVERS:-qemu-nbd nbdkit fewerbytes}; do
    for w in "${workloads[@]}"; do
        IFS='|' read -r label rw bs depth jobs data <<<"$w"
        case $server in
            qemu-nbd) start_qemu_nbd; uri="nbd://127.0.0.1:$PORT" ;;
            nbdkit) start_nbdkit; uri="nbd://127.0.0.1:$PORT" ;;
            fewerbytes) start_fewerbytes; uri="nbd://127.0.0.1:$PORT/vol" ;;
        esac
        if [[ $rw == randread ]]; then
            # Reads need data: fill the volume with random data first.
            fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=8 --size="$volume_bytes" \
                --refill_buffers --end_fsync=1 >/dev/null
        fi
        before=0
        [[ $server == fewerbytes ]] && before=$(fb_device_bytes)
        if [[ $data == mix ]]; then extra=("${mix[@]}"); else extra=("${random[@]}"); fi
        read -r mibs io lat < <(run_fio "$uri" bench "$rw" "$bs" "$depth" "$jobs" "${extra[@]}")
        drive="100%"
        if [[ $server == fewerbytes && $rw != randread ]]; then
            after=$(fb_device_bytes)
            drive=$(python3 -c "print(f'{100 * ($after - $before) / $io:.1f}%')")
        fi
        [[ $rw == randread ]] && drive="-"
        result["$server|$label"]="$mibs|$drive|$lat"
        stop_server
    done
done

echo
echo "| workload | qemu-nbd raw (MiB/s) | nbdkit file (MiB/s) | fewerbytes (MiB/s) | ratio to faster baseline | bytes reaching the drive (fewerbytes) |"
echo "|---|---|---|---|---|---|"
for w in "${workloads[@]}"; do
    IFS='|' read -r label rw _ <<<"$w"
    IFS='|' read -r q _ ql <<<"${result["qemu-nbd|$label"]}"
    IFS='|' read -r k _ kl <<<"${result["nbdkit|$label"]}"
    IFS='|' read -r f d fl <<<"${result["fewerbytes|$label"]}"
    if [[ $rw == randread ]]; then
        ratio=$(python3 -c "print(f'{$fl / min($ql, $kl):.2f}x latency ({$fl:.0f} us vs {min($ql, $kl):.0f} us)')")
    else
        ratio=$(python3 -c "print(f'{$f / max($q, $k):.2f}x')")
    fi
    echo "| $label | $q | $k | $f | $ratio | $d |"
done
echo
echo "(runtime ${RUNTIME}s per job, $JOBS jobs of $JOB_SIZE, files in $BENCH_DIR, $(nproc) CPUs)"
