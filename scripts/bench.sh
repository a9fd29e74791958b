#!/usr/bin/env bash
# One-command benchmark: fio over NBD against fewerbytes and, in the same run,
# against its peers on identical drives, counting the bytes that reach each drive.
#
#   scripts/bench.sh                         # the full run: both drives, ~19 min on 2 shared CPUs
#                                            # before the fewerbytes-zstd peer was added
#   RUNTIME=20 scripts/bench.sh              # seconds per job (default 12)
#   BENCH_QUICK=1 scripts/bench.sh           # a few seconds per job, a subset (development)
#   BENCH_THROTTLED=0 scripts/bench.sh       # the plain drive only (1: both, only: throttled)
#   SERVERS="fewerbytes qemu-nbd" WORKLOADS="4k-mix 128k-mix" scripts/bench.sh
#   POOL_ARGS="--compression zstd" scripts/bench.sh   # passed to `fewerbytes pool create`
#   FB=/tmp/fb-new scripts/bench.sh         # that binary instead of building this tree's
#   FB_BEFORE=/tmp/fb-old SERVERS="qemu-nbd fewerbytes-before fewerbytes" scripts/bench.sh
#                                            # an earlier build as one more server, same run
#   SERVERS="fewerbytes fewerbytes-zstd" scripts/bench.sh   # LZ4 (the default) against zstd
#
# Needs (Debian): fio, qemu-utils (qemu-nbd, qemu-img), nbdkit, nbdfuse, libnbd-bin
# (nbdinfo), e2fsprogs, util-linux (losetup), python3; root, for loop devices and mounts.
#
# Servers, each on its own fresh loop device over a sparse file in DRIVE_DIR:
#   qemu-nbd     qemu-nbd -f raw --cache=none --aio=native on the loop device
#   nbdkit       nbdkit file on the loop device (page cache)
#   qcow2-64k    ext4 on the loop device, a qcow2 file (64k clusters, preallocation=metadata
#                as a Proxmox "dir" storage creates it) served by qemu-nbd as above
#   qcow2-128k   the same with cluster_size=128k,extended_l2=on
#   fewerbytes   a pool on the loop device, one volume
#   fewerbytes-before   the same with the binary FB_BEFORE (an earlier build: before/after
#                in one run, alternating with the others; never counted as a peer)
#   fewerbytes-zstd  the same, made with --compression zstd
# Bytes reaching the drive are the loop device's own counter (/sys/block/loopN/stat,
# sectors written) before and after each job; the final flush (fio end_fsync=1) is counted,
# and throughput is the bytes written divided by the wall time of the whole fio run, so a
# server that only defers writes to the flush cannot look faster.
#
# The throttled drive stands for a hard disk: nbdkit's rate filter (rate=1200M bits/s, about
# 150 MiB/s) and delay filter (delay-write=3ms) over a file, exposed as a file by nbdfuse,
# with the loop device on that file (a loop device writes one request at a time, so each
# write pays the delay as a seek would; sequential writes pay it too, so 128k writes of a
# raw peer run at ~30 MiB/s where a disk would stream). Every server gets the same kind of
# drive (nbdkit file is left off it: THROTTLED_SERVERS, below); the run measures the drive
# itself first (fio on the bare loop device) and prints it.
#
# The drives' backing files live in DRIVE_DIR (default /dev/shm: the plain drive is RAM, so
# its figures are the servers' CPU and the loop device's, not the VM disk's).
#
# Output: docs/bench/results.csv, docs/bench/table.md, docs/bench/drive-bytes.svg, and the
# section of docs/benchmarks.md between the "bench.sh results" markers (a quick run writes
# into its own directory instead and leaves docs/ alone; OUT_DIR and UPDATE_DOC override).
set -euo pipefail
cd "$(dirname "$0")/.."

BENCH_QUICK=${BENCH_QUICK:-0}
if [[ $BENCH_QUICK == 1 ]]; then
    RUNTIME=${RUNTIME:-3}
    JOB_SIZE=${JOB_SIZE:-128M}
    WORKLOADS=${WORKLOADS:-4k-mix 128k-random zeros randread-qd1}
    THROTTLED_WORKLOADS=${THROTTLED_WORKLOADS:-4k-mix}
    OUT_DIR=${OUT_DIR:-/var/tmp/fewerbytes-bench-quick}
    UPDATE_DOC=${UPDATE_DOC:-0}
fi
RUNTIME=${RUNTIME:-12}
JOBS=${JOBS:-4}
JOB_SIZE=${JOB_SIZE:-1G}
# A smaller volume on the throttled drive bounds what a page-cache server leaves dirty
# for the final flush (at ~150 MiB/s every GiB takes 7 s).
THROTTLED_JOB_SIZE=${THROTTLED_JOB_SIZE:-256M}
WORKLOADS=${WORKLOADS:-4k-mix 4k-random 128k-mix 128k-random 1m-mix zeros randread-qd32 randread-qd1}
THROTTLED_WORKLOADS=${THROTTLED_WORKLOADS:-4k-mix 4k-random 128k-mix 128k-random 1m-mix zeros}
BENCH_THROTTLED=${BENCH_THROTTLED:-1}
SERVERS=${SERVERS:-qemu-nbd nbdkit qcow2-64k qcow2-128k fewerbytes fewerbytes-zstd}
# nbdkit file is left off the throttled drive by default: it leaves 4k random writes in the
# page cache, and its final flush then writes them one by one at the drive's ~300 writes/s
# (a quick run: 512 MiB dirty, a 193 s flush, 2.6 MiB/s), which alone would outlast the run.
THROTTLED_SERVERS=${THROTTLED_SERVERS:-qemu-nbd qcow2-64k qcow2-128k fewerbytes fewerbytes-zstd}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
# The drives' backing files: in RAM (tmpfs) by default. On the VM's ext4, deleting a file
# that took a few GiB of random 4k writes (hundreds of thousands of extents) took up to two
# minutes each, longer than the job; the loop device's counters are the same either way.
DRIVE_DIR=${DRIVE_DIR:-/dev/shm}
# A free port by default: other people's servers on this machine take the usual ones.
PORT=${PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
POOL_ARGS=${POOL_ARGS:-}
OUT_DIR=${OUT_DIR:-docs/bench}
UPDATE_DOC=${UPDATE_DOC:-1}
THROTTLE_RATE=${THROTTLE_RATE:-1200M}
THROTTLE_DELAY=${THROTTLE_DELAY:-3ms}

# FB: the fewerbytes binary (default: this tree's, built now).
if [[ -z ${FB:-} ]]; then
    cargo build --release -q
    FB=$PWD/target/release/fewerbytes
fi
FB_BEFORE=${FB_BEFORE:-}
dir=$(mktemp -d "$BENCH_DIR/fewerbytes-bench.XXXXXX")
drive_dir=$(mktemp -d "$DRIVE_DIR/fewerbytes-bench-drive.XXXXXX")
mkdir -p "$OUT_DIR"
csv=$dir/results.csv
echo "set,workload,server,mib_s,read_lat_us,guest_bytes,drive_bytes,server_cpu_s,runtime_s" >"$csv"

server_pid='' loop='' fs_mount='' fuse_mount='' fuse_pid=''
stop_server() {
    if [[ -n $server_pid ]]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    server_pid=
}
# release_drive: the server must be stopped first.
release_drive() {
    if [[ -n $fs_mount ]]; then umount "$fs_mount"; fs_mount=; fi
    if [[ -n $loop ]]; then losetup -d "$loop"; loop=; fi
    if [[ -n $fuse_mount ]]; then
        # The loop device lets go of its file asynchronously.
        for _ in $(seq 50); do umount "$fuse_mount" 2>/dev/null && break; sleep 0.1; done
        wait "$fuse_pid" 2>/dev/null || true
        fuse_mount='' fuse_pid=''
    fi
    rm -f "$drive_dir/drive.img"
}
cleanup() {
    stop_server
    release_drive || true
    rm -rf "$dir" "$drive_dir"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# new_drive BYTES THROTTLED: a fresh loop device over a sparse file, in $loop.
new_drive() {
    local bytes=$1 throttled=$2 file=$drive_dir/drive.img
    rm -f "$file"
    truncate -s "$bytes" "$file"
    if [[ $throttled == 1 ]]; then
        mkdir -p "$dir/fuse"
        nbdfuse "$dir/fuse/disk" [ nbdkit --filter=rate --filter=delay file "$file" \
            rate="$THROTTLE_RATE" delay-write="$THROTTLE_DELAY" ] >"$dir/nbdfuse.log" 2>&1 &
        fuse_pid=$! fuse_mount=$dir/fuse
        for _ in $(seq 100); do [[ -e $dir/fuse/disk ]] && break; sleep 0.1; done
        [[ -e $dir/fuse/disk ]] || { echo "nbdfuse did not start" >&2; cat "$dir/nbdfuse.log" >&2; exit 1; }
        file=$dir/fuse/disk
    fi
    loop=$(losetup -f --show "$file")
}

sectors_written() { awk '{print $7}' "/sys/block/${loop#/dev/}/stat"; }

wait_ready() {
    for _ in $(seq 100); do nbdinfo "$1" >/dev/null 2>&1 && return; sleep 0.1; done
    echo "server did not start" >&2; cat "$dir/serve.log" >&2; exit 1
}

# start_server SERVER VOLUME_BYTES THROTTLED: a fresh drive and the server on it; sets uri.
start_server() {
    local server=$1 volume_bytes=$2 throttled=$3
    case $server in
        fewerbytes | fewerbytes-before | fewerbytes-zstd)
            local fb=$FB
            if [[ $server == fewerbytes-before ]]; then
                [[ -x $FB_BEFORE ]] || { echo "fewerbytes-before needs FB_BEFORE, a fewerbytes binary" >&2; exit 1; }
                fb=$FB_BEFORE
            fi
            new_drive $((volume_bytes * 2)) "$throttled"
            local codec=()
            [[ $server == fewerbytes-zstd ]] && codec=(--compression zstd)
            # shellcheck disable=SC2086 # POOL_ARGS is a list of words
            "$fb" pool create "$loop" "${codec[@]}" $POOL_ARGS >"$dir/pool-create.txt"
            "$fb" --pool "$loop" volume create vol --size "$volume_bytes" >/dev/null
            "$fb" --pool "$loop" --control-socket "$dir/ctl" serve --socket "$dir/sock" \
                --listen "127.0.0.1:$PORT" >"$dir/serve.log" 2>&1 &
            server_pid=$! uri="nbd://127.0.0.1:$PORT/vol"
            ;;
        qemu-nbd | nbdkit)
            new_drive "$volume_bytes" "$throttled"
            if [[ $server == qemu-nbd ]]; then
                qemu-nbd -f raw --cache=none --aio=native -t -e 0 -p "$PORT" -b 127.0.0.1 "$loop" >"$dir/serve.log" 2>&1 &
            else
                nbdkit -f -p "$PORT" -i 127.0.0.1 file "$loop" >"$dir/serve.log" 2>&1 &
            fi
            server_pid=$! uri="nbd://127.0.0.1:$PORT"
            ;;
        qcow2-64k | qcow2-128k)
            # Room for the qcow2 metadata and ext4's own.
            new_drive $((volume_bytes + volume_bytes / 8 + (256 << 20))) "$throttled"
            # Initialised now, not lazily by ext4 in the background during a job.
            mkfs.ext4 -q -E lazy_itable_init=0,lazy_journal_init=0 "$loop"
            mkdir -p "$dir/fs"
            mount "$loop" "$dir/fs"
            fs_mount=$dir/fs
            local opts=cluster_size=64k,preallocation=metadata
            [[ $server == qcow2-128k ]] && opts=cluster_size=128k,extended_l2=on,preallocation=metadata
            qemu-img create -q -f qcow2 -o "$opts" "$dir/fs/vm.qcow2" "$volume_bytes"
            sync -f "$dir/fs"
            qemu-nbd -f qcow2 --cache=none --aio=native -t -e 0 -p "$PORT" -b 127.0.0.1 "$dir/fs/vm.qcow2" >"$dir/serve.log" 2>&1 &
            server_pid=$! uri="nbd://127.0.0.1:$PORT"
            ;;
        *) echo "unknown server $server" >&2; exit 1 ;;
    esac
    wait_ready "$uri"
}

cpu_seconds() { awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$server_pid/stat"; }

mix=(--dedupe_percentage=75 --buffer_compress_percentage=50 --buffer_compress_chunk=512 --refill_buffers)
random=(--refill_buffers --randrepeat=0)
zero=(--zero_buffers)

# workload KEY: sets label, rw, bs, depth, jobs, data.
workload() {
    case $1 in
        4k-mix) label="4k randwrite QD32x$JOBS, seed mix" rw=randwrite bs=4k depth=32 jobs=$JOBS data=mix ;;
        4k-random) label="4k randwrite QD32x$JOBS, random" rw=randwrite bs=4k depth=32 jobs=$JOBS data=random ;;
        128k-mix) label="128k write QD8, seed mix" rw=write bs=128k depth=8 jobs=1 data=mix ;;
        128k-random) label="128k write QD8, random" rw=write bs=128k depth=8 jobs=1 data=random ;;
        1m-mix) label="1M write QD8, seed mix" rw=write bs=1M depth=8 jobs=1 data=mix ;;
        zeros) label="128k write QD8, zero blocks" rw=write bs=128k depth=8 jobs=1 data=zero ;;
        randread-qd32) label="4k randread QD32x$JOBS" rw=randread bs=4k depth=32 jobs=$JOBS data=random ;;
        randread-qd1) label="4k randread QD1" rw=randread bs=4k depth=1 jobs=1 data=random ;;
        *) echo "unknown workload $1" >&2; exit 1 ;;
    esac
}

# run_job SET KEY SERVER JOB_SIZE: one fio job on the running server, one CSV row.
run_job() {
    local set=$1 key=$2 server=$3 job_size=$4 extra start end sectors_before cpu_before
    workload "$key"
    # One job covers the whole volume, as the jobs of a 4k workload do together.
    ((jobs == 1)) && job_size=$(($(numfmt --from=iec "$job_size") * JOBS))
    case $data in mix) extra=("${mix[@]}") ;; random) extra=("${random[@]}") ;; zero) extra=("${zero[@]}") ;; esac
    sectors_before=$(sectors_written)
    cpu_before=$(cpu_seconds)
    start=$(date +%s.%N)
    fio --name=bench --ioengine=nbd --uri="$uri" --rw="$rw" --bs="$bs" --iodepth="$depth" \
        --numjobs="$jobs" --size="$job_size" --offset_increment="$job_size" --time_based \
        --runtime="$RUNTIME" --end_fsync=1 --group_reporting --output-format=json "${extra[@]}" \
        >"$dir/fio.json"
    end=$(date +%s.%N)
    local drive_bytes=$((($(sectors_written) - sectors_before) * 512))
    local cpu
    cpu=$(awk -v a="$(cpu_seconds)" -v b="$cpu_before" 'BEGIN {printf "%.2f", a - b}')
    python3 -c '
import csv, json, sys
start, end, path, set_, label, server, drive, cpu = sys.argv[1:]
text = open(path).read()  # fio prints "connected" lines before the JSON
j = json.loads(text[text.index("{"):])["jobs"][0]
io = j["write"]["io_bytes"] + j["read"]["io_bytes"]
lat = j["read"]["clat_ns"]["mean"] / 1000 if j["read"]["io_bytes"] else 0
seconds = float(end) - float(start)
csv.writer(sys.stdout, lineterminator="\n").writerow(
    [set_, label, server, f"{io / seconds / 2**20:.1f}", f"{lat:.1f}", io, drive, cpu, f"{seconds:.1f}"])' \
        "$start" "$end" "$dir/fio.json" "$set" "$label" "$server" "$drive_bytes" "$cpu" | tee -a "$csv"
}

fio_write_field() {
    python3 -c 'import json, sys; print(round(json.load(sys.stdin)["jobs"][0]["write"][sys.argv[1]]))' "$1"
}

# measure_throttled_drive: what the bare throttled drive does, for the record.
measure_throttled_drive() {
    new_drive $((1 << 30)) 1
    local seq rnd
    seq=$(fio --name=seq --filename="$loop" --rw=write --bs=1M --iodepth=8 --ioengine=libaio --direct=1 \
        --size=1G --runtime=5 --time_based --output-format=json | fio_write_field bw_bytes)
    rnd=$(fio --name=rnd --filename="$loop" --rw=randwrite --bs=4k --iodepth=32 --ioengine=libaio --direct=1 \
        --size=1G --runtime=5 --time_based --output-format=json | fio_write_field iops)
    release_drive
    echo "throttled drive (fio on the bare loop device, 5 s each): 1M sequential writes QD8 $((seq >> 20)) MiB/s, 4k random writes QD32 $rnd IOPS" | tee "$dir/throttled-drive.txt"
}

# run_set SET JOB_SIZE WORKLOAD...: every write workload on every server (servers
# alternate within a workload, so a change in the machine's load weighs on all alike),
# then the reads, on one filled drive per server.
run_set() {
    local set=$1 job_size=$2 throttled=0 key server
    shift 2
    [[ $set == throttled ]] && throttled=1
    local volume_bytes=$(($(numfmt --from=iec "$job_size") * JOBS))
    local reads=() servers=$SERVERS
    [[ $set == throttled ]] && servers=$THROTTLED_SERVERS
    for key in "$@"; do
        [[ $key == randread-* ]] && { reads+=("$key"); continue; }
        for server in $servers; do
            start_server "$server" "$volume_bytes" "$throttled"
            run_job "$set" "$key" "$server" "$job_size"
            stop_server
            release_drive
        done
    done
    ((${#reads[@]})) || return 0
    for server in $servers; do
        start_server "$server" "$volume_bytes" "$throttled"
        # Reads need data: the whole volume, random.
        fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=8 --size="$volume_bytes" \
            --refill_buffers --end_fsync=1 >/dev/null
        for key in "${reads[@]}"; do run_job "$set" "$key" "$server" "$job_size"; done
        stop_server
        release_drive
    done
}

started=$(date -u +"%Y-%m-%d %H:%M")
# shellcheck disable=SC2086 # workload lists are words
{
    if [[ $BENCH_THROTTLED != only ]]; then run_set plain "$JOB_SIZE" $WORKLOADS; fi
    if [[ $BENCH_THROTTLED != 0 ]]; then
        measure_throttled_drive
        run_set throttled "$THROTTLED_JOB_SIZE" $THROTTLED_WORKLOADS
    fi
}
finished=$(date -u +"%H:%M")

command="scripts/bench.sh"
[[ $BENCH_QUICK == 1 ]] && command="BENCH_QUICK=1 $command"
cp "$csv" "$OUT_DIR/results.csv"
python3 scripts/bench-report.py --csv "$OUT_DIR/results.csv" --out-dir "$OUT_DIR" \
    --doc "$([[ $UPDATE_DOC == 1 ]] && echo docs/benchmarks.md)" \
    --command "RUNTIME=$RUNTIME BENCH_THROTTLED=$BENCH_THROTTLED $command" \
    --commit "$(git describe --always --dirty)" --when "$started–$finished UTC" \
    --note "$RUNTIME s per job; a volume of $JOBS×$JOB_SIZE (a 4k job of $JOBS covers $JOB_SIZE each, a one-job workload all of it), $JOBS×$THROTTLED_JOB_SIZE on the throttled drive; $(nproc) CPUs shared with other engineers' builds; load average at the end $(cut -d' ' -f1-3 /proc/loadavg)" \
    --drive-note "$(cat "$dir/throttled-drive.txt" 2>/dev/null || true)" \
    --pool-info "$(grep -i 'window\|index' "$dir/pool-create.txt" 2>/dev/null | head -3 | tr '\n' ' ' || true)"
cat "$OUT_DIR/table.md"
