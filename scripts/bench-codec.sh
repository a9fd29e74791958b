#!/usr/bin/env bash
# Bytes stored and CPU spent per codec (zstd per pool, and the early give-up on
# incompressible blocks). Imports each corpus into a fresh pool made with each
# `--compression`, and prints the data stored (`stats`: data blocks used, compressed
# bytes) and the CPU (user + sys seconds) of the import. `none` is the import without a
# codec, so a codec's own CPU is its row's CPU minus the `none` row's.
#
#   scripts/bench-codec.sh                                   # the seed mix and random data
#   ROOTFS=/path/to/root.img scripts/bench-codec.sh          # and a root file system image
#   CODECS="lz4 zstd:1 zstd" MIX_SIZE=1G ROUNDS=3 scripts/bench-codec.sh
#
# The mix is fio's (the seed's: dedupe_percentage=75, buffer_compress_percentage=50,
# buffer_compress_chunk=512) written sequentially into a file; random is fio's random
# buffers (nothing to compress). The CPU figure is the median of ROUNDS imports.
# Needs (Debian): fio, python3, time.
set -euo pipefail
cd "$(dirname "$0")/.."

MIX_SIZE=${MIX_SIZE:-1G}
RANDOM_SIZE=${RANDOM_SIZE:-512M}
POOL_SIZE=${POOL_SIZE:-4G}
ROOTFS=${ROOTFS:-}
CODECS=${CODECS:-none lz4 zstd:1 zstd zstd:9}
ROUNDS=${ROUNDS:-1}
BENCH_DIR=${BENCH_DIR:-/var/tmp}

cargo build --release -q
FB=${FB:-$PWD/target/release/fewerbytes}
dir=$(mktemp -d "$BENCH_DIR/fewerbytes-codec.XXXXXX")
trap 'rm -rf "$dir"' EXIT

fio --name=mix --filename="$dir/mix.img" --rw=write --bs=4k --size="$MIX_SIZE" --ioengine=psync \
    --dedupe_percentage=75 --buffer_compress_percentage=50 --buffer_compress_chunk=512 \
    --refill_buffers --randrepeat=0 >/dev/null
fio --name=random --filename="$dir/random.img" --rw=write --bs=4k --size="$RANDOM_SIZE" \
    --ioengine=psync --refill_buffers --randrepeat=0 >/dev/null
corpora=("mix|$dir/mix.img" "random|$dir/random.img")
[[ -n $ROOTFS ]] && corpora+=("rootfs|$ROOTFS")

echo "| corpus | compression | data stored | of which fragments | blocks stored whole | import CPU (user+sys s) |"
echo "|---|---|---|---|---|---|"
for c in "${corpora[@]}"; do
    IFS='|' read -r name file <<<"$c"
    for codec in $CODECS; do
        cpus=()
        for _ in $(seq "$ROUNDS"); do
            rm -f "$dir/pool"*
            "$FB" pool create "$dir/pool" --size "$POOL_SIZE" --overcommit --compression "$codec" >/dev/null
            cpus+=("$( { /usr/bin/time -f "%U %S" "$FB" --pool "$dir/pool" volume import v "$file" >/dev/null; } 2>&1 |
                tail -1 | awk '{print $1 + $2}')")
        done
        stats=$("$FB" --pool "$dir/pool" stats --json)
        python3 -c '
import json, statistics, sys
name, codec, size, stats = sys.argv[1:5]
cpu = statistics.median(float(c) for c in sys.argv[5:])
s = json.loads(stats)
used, fragments, whole = s["stored_bytes"], s["compressed_bytes"], s["whole_blocks"]
mib = lambda b: f"{b / 2**20:.1f} MiB"
print(f"| {name} ({int(size) / 2**20:.0f} MiB) | {codec} | {mib(used)} | {mib(fragments)} | {whole} | {cpu:.2f} |")' \
            "$name" "$codec" "$(stat -c %s "$file")" "$stats" "${cpus[@]}"
    done
done
echo
echo "($(date -u +'%Y-%m-%d %H:%M') UTC, commit $(git describe --always --dirty), $ROUNDS round(s), load $(cut -d' ' -f1-3 /proc/loadavg))"
