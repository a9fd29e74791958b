#!/usr/bin/env bash
# The saving lost when the dedup index gets less memory (`--index-memory`).
# Imports a corpus into fresh pools whose index has the default memory, then 1/2, 1/4, 1/8
# and 1/16 of it (thin: --overcommit, so two copies of a large image fit), and prints the data
# stored and the space saving `stats` reports, and the data a second import of it adds.
#
#   scripts/bench-index-budget.sh                     # the seed mix, 3 GiB, and a rootfs if given
#   ROOTFS=/path/to/root.img MIX_SIZE=2G POOL_SIZE=4G scripts/bench-index-budget.sh
#
# The mix is fio's (the seed's: dedupe_percentage=75, buffer_compress_percentage=50,
# buffer_compress_chunk=512) written sequentially into a file; ROOTFS is any raw image
# (the test guest's scripts/guest/build-image.sh makes one). No timing is taken.
# Needs (Debian): fio, python3.
set -euo pipefail
cd "$(dirname "$0")/.."

MIX_SIZE=${MIX_SIZE:-3G}
POOL_SIZE=${POOL_SIZE:-4G}
ROOTFS=${ROOTFS:-}
DIVISORS=${DIVISORS:-1 2 4 8 16}
BENCH_DIR=${BENCH_DIR:-/var/tmp}

cargo build --release -q
FB=$PWD/target/release/fewerbytes
dir=$(mktemp -d "$BENCH_DIR/fewerbytes-index-budget.XXXXXX")
trap 'rm -rf "$dir"' EXIT

fio --name=mix --filename="$dir/mix.img" --rw=write --bs=4k --size="$MIX_SIZE" --ioengine=psync \
    --dedupe_percentage=75 --buffer_compress_percentage=50 --buffer_compress_chunk=512 \
    --refill_buffers --randrepeat=0 >/dev/null
corpora=("mix|$dir/mix.img")
[[ -n $ROOTFS ]] && corpora+=("rootfs|$ROOTFS")

"$FB" pool create "$dir/probe" --size "$POOL_SIZE" >/dev/null
default_memory=$("$FB" --pool "$dir/probe" pool info --json |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["index_memory_bytes"])')
rm -f "$dir/probe"*

echo "| corpus | index memory | window | data stored | space saving (stats) | second copy: data added |"
echo "|---|---|---|---|---|---|"
for c in "${corpora[@]}"; do
    IFS='|' read -r name file <<<"$c"
    for d in $DIVISORS; do
        rm -f "$dir/pool"*
        "$FB" pool create "$dir/pool" --size "$POOL_SIZE" --overcommit --index-memory $((default_memory / d)) >/dev/null
        window=$("$FB" --pool "$dir/pool" pool info | sed -n 's/^Dedup window: *\([^(]*\) (.*/\1/p')
        "$FB" --pool "$dir/pool" volume import first "$file" >/dev/null
        first=$("$FB" --pool "$dir/pool" stats --json)
        "$FB" --pool "$dir/pool" volume import second "$file" >/dev/null
        second=$("$FB" --pool "$dir/pool" stats --json)
        python3 -c '
import json, sys
name, d, window, first, second, size = sys.argv[1:]
a, b = json.loads(first), json.loads(second)
used, saving, added = a["stored_bytes"], a["saving_percent"], b["stored_bytes"] - a["stored_bytes"]
label = "default" if d == "1" else f"1/{d} of the default"
print(f"| {name} ({int(size) / 2**20:.0f} MiB) | {label} | {window.strip()} | {used / 2**20:.1f} MiB |"
      f" {saving:.1f}% | {added / 2**20:.1f} MiB |")' \
            "$name" "$d" "$window" "$first" "$second" "$(stat -c %s "$file")"
    done
done
echo
echo "($(date -u +'%Y-%m-%d %H:%M') UTC, commit $(git describe --always --dirty), pools of $POOL_SIZE)"
