#!/usr/bin/env bash
# Dense against sparse dedup index (`pool create --index`), with the same small index
# memory, so that a few GiB of data stand for terabytes: the window scales with the
# memory (a dense index covers about 1 TiB per GiB, a sparse one 16).
#
#   scripts/bench-sparse.sh
#   INDEX_MEMORY=1M FRACTIONS="100 1000" MIX_FRACTIONS= scripts/bench-sparse.sh
#   TEMPLATE=debian.raw scripts/bench-sparse.sh
#   BENCH_DIR=/dev/shm INDEX_MEMORY=256K TEMPLATE_MB=128 scripts/bench-sparse.sh   # in RAM
#
# Table 1, a template cloned after other data: into a fresh pool per mode and fraction,
# import the template (TEMPLATE, a raw image; by default the first TEMPLATE_MB MiB of a
# tar of /usr/share, real files of every kind), then random data worth FRACTIONS
# percent of the pool's dense window, then the template again into a new volume. The
# saving is the share of the second copy's non-zero blocks deduplicated (stats'
# dedup_saved_blocks before and after it). 1000% of the dense window is 10 TiB of other
# data for 1 GiB of index memory (1.04 TiB of dense window per GiB).
#
# Table 2, the seed's mix (scripts/bench.sh's fio options: dedupe_percentage=75
# buffer_compress_percentage=50, at bs 4k and 128k): fio writes a file of MIX_FRACTIONS
# percent of the dense window, imported into a fresh pool per mode; the share of its
# blocks deduplicated and the data the pool stores for it.
#
# Each import is its own open of the pool (the index is rebuilt from the object
# records each time, as after a restart). With WRITER=nbdcopy, table 1's pools are
# served instead (`serve`, its worker threads) and each image is written by nbdcopy
# over NBD (several requests in flight, spread over the server's threads and zones).
# No timing is taken.
# Every pool is as large as the largest fraction needs (sparse files), so every row of a
# mode has the same window (a sparse index is capped to what the pool's objects need).
# Needs (Debian): fio, tar, python3, coreutils; libnbd-bin (nbdcopy) for WRITER=nbdcopy. Disk: BENCH_DIR needs about twice the
# largest fraction of other data plus the template twice.
set -euo pipefail
cd "$(dirname "$0")/.."

INDEX_MEMORY=${INDEX_MEMORY:-512K}
FRACTIONS=${FRACTIONS:-0 25 50 100 200 400 1000}
MIX_FRACTIONS=${MIX_FRACTIONS-25 50 100}
MODES=${MODES:-dense sparse}
TEMPLATE=${TEMPLATE:-}
TEMPLATE_MB=${TEMPLATE_MB:-256}
BENCH_DIR=${BENCH_DIR:-/var/tmp}

if [ -z "${FB:-}" ]; then
    cargo build --release -q -p fewerbytes
    FB=$PWD/target/release/fewerbytes
fi
dir=$(mktemp -d "$BENCH_DIR/fewerbytes-sparse.XXXXXX")

WRITER=${WRITER:-import}
server_pid=
stop_server() {
    if [ -n "$server_pid" ]; then
        kill "$server_pid"
        wait "$server_pid" || true
        server_pid=
    fi
}
trap 'stop_server; rm -rf "$dir"' EXIT

# write_volume NAME FILE: a new volume holding FILE, by `volume import` or nbdcopy.
write_volume() {
    if [ "$WRITER" = import ]; then
        "$FB" --pool "$dir/pool" volume import "$1" "$2" >/dev/null
        return
    fi
    if [ -z "$server_pid" ]; then
        "$FB" --pool "$dir/pool" serve --socket "$dir/nbd.sock" --no-tcp >>"$dir/serve.log" 2>&1 &
        server_pid=$!
        for _ in $(seq 100); do
            if [ -S "$dir/nbd.sock" ]; then break; fi
            sleep 0.1
        done
    fi
    "$FB" --pool "$dir/pool" volume create "$1" --size "$(stat -c %s "$2")" --thin >/dev/null
    nbdcopy "$2" "nbd+unix:///$1?socket=$dir/nbd.sock"
}

if [ -z "$TEMPLATE" ]; then
    TEMPLATE=$dir/template.img
    tar cf - /usr/share 2>/dev/null | head -c $((TEMPLATE_MB << 20)) >"$TEMPLATE" || true
fi
template_bytes=$(stat -c %s "$TEMPLATE")
template_nonzero=$(python3 -c '
import sys
n = 0
with open(sys.argv[1], "rb") as f:
    while True:
        b = f.read(4096)
        if not b:
            break
        n += b.count(0) != len(b)
print(n)' "$TEMPLATE")

stat_field() { "$FB" --pool "$1" stats --json | python3 -c 'import json, sys; print(json.load(sys.stdin)[sys.argv[1]])' "$2"; }

# new_pool MODE SIZE: a fresh pool of that index mode; prints its dense window in blocks.
new_pool() {
    rm -f "$dir/pool"
    "$FB" pool create "$dir/pool" --size "$2" --index-memory "$INDEX_MEMORY" --index "$1" >/dev/null
    "$FB" --pool "$dir/pool" pool info --json | python3 -c '
import json, sys
i = json.load(sys.stdin)
print(i["index_entries"], i["dedup_window_bytes"] // 4096, i["index_memory_bytes"])'
}

# The dense window of INDEX_MEMORY (blocks), from a pool made to ask.
read -r dense_window _ _ < <(new_pool dense 1G)
max_fraction=$(printf '%s\n' $FRACTIONS $MIX_FRACTIONS 100 | sort -n | tail -1)
POOL_SIZE=$(python3 -c "print(f'{int(($dense_window * 4096 * $max_fraction / 100 + 3 * $template_bytes) * 1.3 / 2**20) + 512}M')")

echo "Template: $TEMPLATE ($((template_bytes >> 20)) MiB, $template_nonzero non-zero blocks); index memory $INDEX_MEMORY; pools of $POOL_SIZE; written by $WRITER"
echo
echo "| other data (of the dense window) | other data | mode | window | clone deduplicated (of its non-zero blocks) | stored for the clone |"
echo "|---|---|---|---|---|---|"
for f in $FRACTIONS; do
    other_bytes=$((dense_window * 4096 * f / 100))
    rm -f "$dir/other"
    if ((other_bytes > 0)); then head -c "$other_bytes" /dev/urandom >"$dir/other"; fi
    for mode in $MODES; do
        read -r _ window _ < <(new_pool "$mode" "$POOL_SIZE")
        write_volume template "$TEMPLATE"
        if ((other_bytes > 0)); then write_volume other "$dir/other"; fi
        saved0=$(stat_field "$dir/pool" dedup_saved_blocks)
        used0=$(stat_field "$dir/pool" stored_bytes)
        write_volume clone "$TEMPLATE"
        saved1=$(stat_field "$dir/pool" dedup_saved_blocks)
        used1=$(stat_field "$dir/pool" stored_bytes)
        stop_server
        python3 -c '
import sys
f, other, mode, window, nonzero, s0, s1, u0, u1 = sys.argv[1:]
other, window, nonzero, s0, s1, u0, u1 = map(int, (other, window, nonzero, s0, s1, u0, u1))
print(f"| {f}% | {other / 2**30:.2f} GiB | {mode} | {window * 4096 / 2**30:.2f} GiB | **{100 * (s1 - s0) / nonzero:.1f}%** |"
      f" {(u1 - u0) / 2**20:.1f} MiB |")' \
            "$f" "$other_bytes" "$mode" "$window" "$template_nonzero" "$saved0" "$saved1" "$used0" "$used1"
    done
    rm -f "$dir/other"
done

if [ -n "$MIX_FRACTIONS" ]; then
    echo
    echo "| mix file (of the dense window) | fio bs | mode | blocks deduplicated | stored (of the file) |"
    echo "|---|---|---|---|---|"
    for f in $MIX_FRACTIONS; do
        mix_bytes=$((dense_window * 4096 * f / 100 / 1048576 * 1048576))
        for bs in 4k 128k; do
            rm -f "$dir/mix"
            fio --name=mix --filename="$dir/mix" --rw=write --bs="$bs" --size="$mix_bytes" \
                --ioengine=psync --dedupe_percentage=75 --buffer_compress_percentage=50 \
                --buffer_compress_chunk=512 --refill_buffers --randseed=1 >/dev/null
            for mode in $MODES; do
                new_pool "$mode" "$POOL_SIZE" >/dev/null
                "$FB" --pool "$dir/pool" volume import mix "$dir/mix" >/dev/null
                saved=$(stat_field "$dir/pool" dedup_saved_blocks)
                used=$(stat_field "$dir/pool" stored_bytes)
                python3 -c '
import sys
f, bs, mode, size, saved, used = sys.argv[1:]
size, saved, used = int(size), int(saved), int(used)
print(f"| {f}% ({size / 2**20:.0f} MiB) | {bs} | {mode} | **{100 * saved / (size // 4096):.1f}%** | {100 * used / size:.1f}% |")' \
                    "$f" "$bs" "$mode" "$mix_bytes" "$saved" "$used"
            done
        done
        rm -f "$dir/mix"
    done
fi
echo
echo "($(date -u +'%Y-%m-%d %H:%M') UTC, commit $(git describe --always --dirty))"
