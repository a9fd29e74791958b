#!/usr/bin/env bash
# Where the bytes a write load sends to the drive go, beyond the data: the metadata
# the pool wrote by region (journal, block-map pages, count pages, fingerprint pages,
# directory and catalog pages, super blocks), as a share of the guest's bytes; and what
# the server wrote to its files in all (/proc/PID/io write_bytes), with the write
# counters that explain it (dedup hits, blocks stored compressed or whole, compaction).
#
#   scripts/bench-metadata-bytes.sh                         # 4k randwrite QD32x4, random data
#   BS=128k RW=write QD=8 JOBS=1 scripts/bench-metadata-bytes.sh   # 128k sequential, random
#   MIX=1 scripts/bench-metadata-bytes.sh                   # the seed's mix instead
#   FB=/tmp/fb-old scripts/bench-metadata-bytes.sh          # another build
#
# A fresh pool file in BENCH_DIR (POOL_SIZE, default 8G) with one volume of JOBS x
# JOB_SIZE, served over TCP; fio (ioengine=nbd, RUNTIME seconds, end_fsync) writes
# it; then `stats --json` gives the guest bytes and `metadata_written_by_region`.
# Needs (Debian): fio, libnbd-bin (nbdinfo), python3.
set -euo pipefail
cd "$(dirname "$0")/.."

BS=${BS:-4k}
RW=${RW:-randwrite}
QD=${QD:-32}
JOBS=${JOBS:-4}
JOB_SIZE=${JOB_SIZE:-1G}
RUNTIME=${RUNTIME:-15}
POOL_SIZE=${POOL_SIZE:-8G}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
PORT=${PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
if [[ -z ${FB:-} ]]; then
    cargo build --release -q
    FB=$PWD/target/release/fewerbytes
fi
data=(--refill_buffers --randrepeat=0)
[[ ${MIX:-0} == 1 ]] && data=(--dedupe_percentage=75 --buffer_compress_percentage=50 --buffer_compress_chunk=512 --refill_buffers)

dir=$(mktemp -d "$BENCH_DIR/fewerbytes-metadata.XXXXXX")
server_pid=''
cleanup() {
    [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT

volume_bytes=$(($(numfmt --from=iec "$JOB_SIZE") * JOBS))
"$FB" pool create "$dir/pool" --size "$POOL_SIZE" >/dev/null
"$FB" --pool "$dir/pool" volume create vol --size "$volume_bytes" >/dev/null
"$FB" --pool "$dir/pool" --control-socket "$dir/ctl" serve --socket "$dir/sock" \
    --listen "127.0.0.1:$PORT" >"$dir/serve.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do nbdinfo "nbd://127.0.0.1:$PORT/vol" >/dev/null 2>&1 && break; sleep 0.1; done
fio --name=metadata --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/vol" --time_based --runtime="$RUNTIME" \
    --end_fsync=1 --group_reporting --rw="$RW" --bs="$BS" --iodepth="$QD" --numjobs="$JOBS" \
    --size="$JOB_SIZE" --offset_increment="$JOB_SIZE" "${data[@]}" >"$dir/fio.txt" 2>&1
"$FB" --pool "$dir/pool" --control-socket "$dir/ctl" stats --json >"$dir/stats.json"
# What the server wrote to its files (data and metadata; counted as pages are dirtied).
server_written=$(awk '/^write_bytes/ {print $2}' "/proc/$server_pid/io")
echo "## $BS $RW QD$QD x$JOBS, $([[ ${MIX:-0} == 1 ]] && echo "seed mix" || echo random), ${RUNTIME}s ($(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u +%H:%M) UTC)"
python3 - "$dir/stats.json" "$server_written" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
c = s["counters"]
guest = c["guest_bytes_written"]
written = int(sys.argv[2])
print(f"guest bytes written: {guest / 2**20:.0f} MiB; the server wrote {written / 2**20:.0f} MiB "
      f"({100 * written / guest:.2f}%)")
print(f"blocks: {c['blocks_written']} written, {c['dedup_hits']} dedup hits, "
      f"{c['compressed_writes']} stored compressed, {c['uncompressed_writes']} whole, "
      f"{c['zero_blocks_written']} zero; {s['compacted_blocks']} packed blocks compacted; "
      f"{s['checkpoints']} checkpoints")
total = 0
for name, b in s["metadata_written_by_region"]:
    total += b
    print(f"  {name:18s} {b / 2**20:9.1f} MiB  {100 * b / guest:5.2f}%")
print(f"  {'metadata, all':18s} {total / 2**20:9.1f} MiB  {100 * total / guest:5.2f}%")
PY
