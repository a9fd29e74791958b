#!/usr/bin/env bash
# Does the dedup window hold what it says (issue 14)? Imports the same random file twice into
# a fresh pool, at fractions of the dedup window the pool reports, and prints the share of
# the second copy that deduplicated, and the index's memory per TiB of window.
#
#   scripts/bench-dedup-window.sh
#   FRACTIONS="20 50 90" INDEX_MEMORY=4M POOL_SIZE=8G scripts/bench-dedup-window.sh
#
# Two pools: one whose window is set by --index-memory (INDEX_MEMORY, default 8M: a 4 GiB
# window in a POOL_SIZE pool large enough for both copies even if nothing deduplicated),
# every fraction; and a pool at its default (window = the whole data region, DEFAULT_POOL_SIZE),
# only the fractions at which two copies fit if nothing deduplicates (at most 45%).
# The share deduplicated is stats' dedup_saved_blocks over the file's blocks, checked
# against the data used (random data: each block stored whole, none compresses).
# Needs (Debian): python3, coreutils. No timing is taken.
set -euo pipefail
cd "$(dirname "$0")/.."

FRACTIONS=${FRACTIONS:-20 40 60 80 90}
INDEX_MEMORY=${INDEX_MEMORY:-8M}
POOL_SIZE=${POOL_SIZE:-12G}
DEFAULT_POOL_SIZE=${DEFAULT_POOL_SIZE:-4G}
BENCH_DIR=${BENCH_DIR:-/var/tmp}

cargo build --release -q
FB=$PWD/target/release/fewerbytes
dir=$(mktemp -d "$BENCH_DIR/fewerbytes-dedup-window.XXXXXX")
trap 'rm -rf "$dir"' EXIT

# window_entries POOL: the index entries `pool info` reports (one 4 KiB block each).
window_entries() {
    "$FB" --pool "$1" pool info | sed -n 's/^Dedup window: .*(\([0-9]*\) index entries, \(.*\) of memory).*/\1 \2/p'
}

stat_field() { python3 -c 'import json, sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"; }

# Expected share kept by a 4-way set-associative table with random placement at load
# FRACTION (buckets of 4, Poisson arrivals): E[min(X, 4)] / E[X], X ~ Poisson(4 * load).
expected_kept() {
    python3 -c '
import math, sys
lam = 4 * float(sys.argv[1]) / 100
p = [math.exp(-lam) * lam**k / math.factorial(k) for k in range(4)]
kept = sum(k * p[k] for k in range(4)) + 4 * (1 - sum(p))
print(f"{100 * kept / lam:.1f}%")' "$1"
}

echo "| pool | reported window | fraction of the window | file | second copy deduplicated | by data used | a 4-way table with random placement would keep |"
echo "|---|---|---|---|---|---|---|"
measure() {
    local label=$1 size=$2 fractions=$3
    shift 3
    local pool=$dir/pool entries memory
    for f in $fractions; do
        rm -f "$pool"*
        "$FB" pool create "$pool" --size "$size" "$@" >/dev/null
        read -r entries memory < <(window_entries "$pool")
        local blocks=$((entries * f / 100))
        head -c $((blocks * 4096)) /dev/urandom >"$dir/file"
        "$FB" --pool "$pool" volume import first "$dir/file" >/dev/null
        local used_first saved used_second
        used_first=$("$FB" --pool "$pool" stats --json | stat_field data_used_bytes)
        "$FB" --pool "$pool" volume import second "$dir/file" >/dev/null
        local json
        json=$("$FB" --pool "$pool" stats --json)
        saved=$(stat_field dedup_saved_blocks <<<"$json")
        used_second=$(stat_field data_used_bytes <<<"$json")
        python3 -c '
import sys
label, entries, f, blocks, saved, u1, u2, memory, expected = sys.argv[1:]
entries, blocks, saved, u1, u2 = map(int, (entries, blocks, saved, u1, u2))
window_gib = entries * 4096 / 2**30
print(f"| {label} | {window_gib:.2f} GiB ({entries} entries, {memory}) | {f}% | {blocks * 4096 / 2**20:.0f} MiB |"
      f" **{100 * saved / blocks:.1f}%** | {100 * (1 - (u2 - u1) / u1):.1f}% | {expected} |")' \
            "$label" "$entries" "$f" "$blocks" "$saved" "$used_first" "$used_second" "$memory" "$(expected_kept "$f")"
        rm -f "$dir/file"
    done
    echo "$label: index memory per TiB of window: $(python3 -c "
import sys
units = {'B': 1, 'KiB': 2**10, 'MiB': 2**20, 'GiB': 2**30}
n, unit = '$memory'.split()
print(f'{float(n) * units[unit] / ($entries * 4096) * 1024:.2f} GiB')")" >&2
}

measure "--size $POOL_SIZE --index-memory $INDEX_MEMORY" "$POOL_SIZE" "$FRACTIONS" --index-memory "$INDEX_MEMORY"
default_fractions=
for f in $FRACTIONS; do
    if ((f <= 45)); then default_fractions+=" $f"; fi
done
measure "--size $DEFAULT_POOL_SIZE (default index)" "$DEFAULT_POOL_SIZE" "$default_fractions"
echo
echo "($(date -u +'%Y-%m-%d %H:%M') UTC, commit $(git describe --always --dirty))"
