#!/usr/bin/env bash
# What an open after a crash costs when the journal's tail stores many new blocks: a
# block stored new is journalled without its fingerprint (a NewStored record), so
# replay reads each such block back, checks its crc and hashes it. Writes SIZE of new,
# incompressible data (fio, 128k sequential writes, QD8, then a flush), kills the
# server (SIGKILL: nothing closes the pool), then times a read-only open
# (`pool info`, which replays the journal) and a read-write one (`serve` until it
# answers NBD). Prints the seconds of each and the data rate of the replay's reads.
#
#   scripts/bench-replay.sh                 # SIZE=2G
#   SIZE=4G FB=/tmp/fb-other scripts/bench-replay.sh
#
# Needs (Debian): fio, libnbd-bin (nbdinfo).
set -euo pipefail
cd "$(dirname "$0")/.."

SIZE=${SIZE:-2G}
POOL_SIZE=${POOL_SIZE:-16G}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
PORT=${PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
if [[ -z ${FB:-} ]]; then
    cargo build --release -q
    FB=$PWD/target/release/fewerbytes
fi

dir=$(mktemp -d "$BENCH_DIR/fewerbytes-replay.XXXXXX")
server_pid=''
cleanup() {
    if [[ -n $server_pid ]]; then
        kill -9 "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$dir"
}
trap cleanup EXIT

serve() {
    "$FB" --pool "$dir/pool" serve --socket "$dir/sock" --listen "127.0.0.1:$PORT" \
        >>"$dir/serve.log" 2>&1 &
    server_pid=$!
    until nbdinfo "nbd://127.0.0.1:$PORT/vol" >/dev/null 2>&1; do
        kill -0 "$server_pid" || { cat "$dir/serve.log"; exit 1; }
        sleep 0.05
    done
}

"$FB" pool create "$dir/pool" --size "$POOL_SIZE" >/dev/null
"$FB" --pool "$dir/pool" volume create vol --size "$SIZE" >/dev/null
serve
fio --name=replay --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/vol" --rw=write --bs=128k \
    --iodepth=8 --size="$SIZE" --end_fsync=1 --refill_buffers --randrepeat=0 >"$dir/fio.txt"
kill -9 "$server_pid"
wait "$server_pid" 2>/dev/null || true
server_pid=''
sync
echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
start=$(date +%s.%N)
"$FB" --pool "$dir/pool" pool info >"$dir/info.txt"
read_only=$(echo "$(date +%s.%N) - $start" | bc)
echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
start=$(date +%s.%N)
serve
read_write=$(echo "$(date +%s.%N) - $start" | bc)
bytes=$(numfmt --from=iec "$SIZE")
echo "## replay of $SIZE of new blocks after a kill ($(date -u +%H:%M) UTC, $FB)"
printf 'read-only open (pool info): %.2f s (%.0f MiB/s of blocks read back)\n' \
    "$read_only" "$(echo "$bytes / 1048576 / $read_only" | bc -l)"
printf 'read-write open (serve until NBD answers): %.2f s\n' "$read_write"
grep -i "replay" "$dir/serve.log" | tail -3 || true
