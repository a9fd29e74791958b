#!/usr/bin/env bash
# Does the dedup window hold what it says? Imports the same random file twice into
# a fresh pool, at fractions of the dedup window the pool reports, and prints the share of
# the second copy that deduplicated, and the index's memory per TiB of window.
#
#   scripts/bench-dedup-window.sh
#   FRACTIONS="20 50 90" INDEX_MEMORY=4M POOL_SIZE=8G scripts/bench-dedup-window.sh
#
# Two pools: one whose window is set by --index-memory (INDEX_MEMORY, default 2M: a 2 GiB
# window in a POOL_SIZE pool large enough for both copies of the largest fraction even if
# the second deduplicated by half), every fraction; and a pool at its default (window = the
# whole data region, DEFAULT_POOL_SIZE), only the fractions at which two copies fit if
# nothing deduplicates (at most 45%).
# The share deduplicated is stats' dedup_saved_blocks over the file's blocks, checked
# against the data used (random data: each block stored whole, none compresses).
# Needs (Debian): python3, coreutils. No timing is taken.
set -euo pipefail
cd "$(dirname "$0")/.."

FRACTIONS=${FRACTIONS:-25 50 75 90 100 120}
INDEX_MEMORY=${INDEX_MEMORY:-2M}
POOL_SIZE=${POOL_SIZE:-8G}
DEFAULT_POOL_SIZE=${DEFAULT_POOL_SIZE:-4G}
BENCH_DIR=${BENCH_DIR:-/var/tmp}

cargo build --release -q
FB=$PWD/target/release/fewerbytes
dir=$(mktemp -d "$BENCH_DIR/fewerbytes-dedup-window.XXXXXX")
trap 'rm -rf "$dir"' EXIT

# window_entries POOL: the window `pool info` reports, in 4 KiB blocks, and the index's memory.
window_entries() {
    "$FB" --pool "$1" pool info --json |
        python3 -c 'import json, sys; i = json.load(sys.stdin); print(i["dedup_window_bytes"] // 4096, i["index_memory_bytes"])'
}

stat_field() { python3 -c 'import json, sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"; }

# dropped POOL: entries the index dropped for want of a place when rebuilt at an open
# (stats opens the pool: more distinct blocks stored than the window).
dropped() {
    "$FB" --pool "$1" stats --verbose | sed -n 's/^limits\.index entries dropped since open *: *\([0-9]*\).*/\1/p'
}

echo "| pool | reported window | fraction of the window | file | second copy deduplicated | by data used | index entries dropped (rebuilt at open) |"
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
        used_first=$("$FB" --pool "$pool" stats --json | stat_field stored_bytes)
        "$FB" --pool "$pool" volume import second "$dir/file" >/dev/null
        local json drops
        drops=$(dropped "$pool")
        json=$("$FB" --pool "$pool" stats --json)
        saved=$(stat_field dedup_saved_blocks <<<"$json")
        used_second=$(stat_field stored_bytes <<<"$json")
        python3 -c '
import sys
label, entries, f, blocks, saved, u1, u2, memory, drops = sys.argv[1:]
entries, blocks, saved, u1, u2 = map(int, (entries, blocks, saved, u1, u2))
drops = drops or "-"
window_gib = entries * 4096 / 2**30
print(f"| {label} | {window_gib:.2f} GiB ({entries} blocks, index {int(memory) / 2**20:.2f} MiB) | {f}% |"
      f" {blocks * 4096 / 2**20:.0f} MiB | **{100 * saved / blocks:.1f}%** | {100 * (1 - (u2 - u1) / u1):.1f}% | {drops} |")' \
            "$label" "$entries" "$f" "$blocks" "$saved" "$used_first" "$used_second" "$memory" "$drops"
        rm -f "$dir/file"
    done
    echo "$label: index memory per TiB of window: $(python3 -c "print(f'{$memory / ($entries * 4096) * 1024:.3f} GiB')")" >&2
}

measure "--size $POOL_SIZE --index-memory $INDEX_MEMORY" "$POOL_SIZE" "$FRACTIONS" --index-memory "$INDEX_MEMORY"
default_fractions=
for f in $FRACTIONS; do
    if ((f <= 45)); then default_fractions+=" $f"; fi
done
measure "--size $DEFAULT_POOL_SIZE (default index)" "$DEFAULT_POOL_SIZE" "$default_fractions"
echo
echo "($(date -u +'%Y-%m-%d %H:%M') UTC, commit $(git describe --always --dirty))"
