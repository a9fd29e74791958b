#!/usr/bin/env bash
# Metadata operations at size (the performance targets): delete of a 32 GiB volume and trim of
# 15 GiB, each under one second, clones that add no data, and snapshots of a full 32 GiB
# volume and of a 4 PiB thin one in at most 10 ms each.
#
#   scripts/bench-metadata.sh               # a 32 GiB volume
#   VOLUME_GIB=8 scripts/bench-metadata.sh  # smaller
#   BENCH_DIR=/mnt/disk scripts/bench-metadata.sh
#
# The volume is filled over NBD with fio's seed mix (75% duplicate, 50% compressible,
# so every block is mapped and ~13% of it stored), with a running server; then, through
# the server's control socket and over NBD, each operation is timed from the command's
# start to its exit. Delete and clone are checkpointed before they return (durable);
# trim is timed to the end of a following flush.
set -euo pipefail
cd "$(dirname "$0")/.."

VOLUME_GIB=${VOLUME_GIB:-32}
TRIM_GIB=${TRIM_GIB:-15}
BENCH_DIR=${BENCH_DIR:-/var/tmp}

cargo build --release -q
FB=$PWD/target/release/fewerbytes
dir=$(mktemp -d "$BENCH_DIR/fewerbytes-bench-md.XXXXXX")
server_pid=
cleanup() {
    [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT

pool=$dir/pool
sock=$dir/nbd.sock
"$FB" pool create "$pool" --size "$((VOLUME_GIB * 2 + 8))G" >/dev/null
"$FB" --pool "$pool" volume create big --size "${VOLUME_GIB}G" >/dev/null
${SERVE_WRAPPER:-} "$FB" --pool "$pool" serve --socket "$sock" --no-tcp >"$dir/serve.log" 2>&1 &
server_pid=$!
for _ in $(seq 50); do [[ -S $sock ]] && break; sleep 0.1; done

seconds() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$@"; }
now() { date +%s.%N; }

t0=$(now)
fio --name=fill --ioengine=nbd --uri="nbd+unix:///big?socket=$sock" --rw=write --bs=1M --iodepth=8 \
    --size="${VOLUME_GIB}G" --dedupe_percentage=75 --buffer_compress_percentage=50 \
    --buffer_compress_chunk=512 --refill_buffers --end_fsync=1 >/dev/null
t1=$(now)
echo "fill ${VOLUME_GIB} GiB (seed mix, 1M writes QD8): $(seconds "$t0" "$t1") s"

# The server logs each volume operation's own time ("done in X ms"): the engine's work
# and its checkpoint, without the command's start-up and its control-socket round trip.
logged_ms() { grep -F "control: $1: done in" "$dir/serve.log" | tail -1 | sed 's/.*done in \([0-9.]*\) ms.*/\1/'; }
# The command's own floor in this run: a query through the same socket.
t0=$(now); "$FB" --pool "$pool" volume list >/dev/null; t1=$(now)
echo "volume list (the command's start-up and round trip, for scale): $(seconds "$t0" "$t1") s"

t0=$(now); "$FB" --pool "$pool" volume snapshot big before >/dev/null; t1=$(now)
echo "snapshot of the full ${VOLUME_GIB} GiB volume, just filled (a checkpoint first writes the pages the fill left changed): $(seconds "$t0" "$t1") s (server: $(logged_ms "take snapshot 'before' of volume 'big'") ms)"
# Ten more of the same volume, now idle: what a snapshot costs by itself.
snapshots_ms() {
    local vol=$1 ms=()
    for i in $(seq 10); do
        "$FB" --pool "$pool" volume snapshot "$vol" "s$i" >/dev/null
        ms+=("$(logged_ms "take snapshot 's$i' of volume '$vol'")")
    done
    for i in $(seq 10); do "$FB" --pool "$pool" volume snapshot delete "$vol" "s$i" >/dev/null; done
    printf '%s\n' "${ms[@]}" | sort -n | python3 -c "import sys; v=[float(x) for x in sys.stdin]; print(f'min {v[0]:.1f} ms, median {(v[4]+v[5])/2:.1f} ms, max {v[-1]:.1f} ms')"
}
echo "ten snapshots of the idle ${VOLUME_GIB} GiB volume (server): $(snapshots_ms big)"

fio --name=change --ioengine=nbd --uri="nbd+unix:///big?socket=$sock" --rw=randwrite --bs=4k \
    --iodepth=8 --size="${VOLUME_GIB}G" --io_size=64M --refill_buffers --end_fsync=1 >/dev/null
t0=$(now); changed=$("$FB" --pool "$pool" volume diff big --from before 2>&1 | tail -1); t1=$(now)
echo "diff after 64 MiB of 4k random writes ($changed): $(seconds "$t0" "$t1") s"

t0=$(now); "$FB" --pool "$pool" volume rollback big before >/dev/null; t1=$(now)
echo "rollback of the ${VOLUME_GIB} GiB volume to the snapshot: $(seconds "$t0" "$t1") s (server: $(logged_ms "roll volume 'big' back to 'before'") ms)"

t0=$(now); "$FB" --pool "$pool" volume snapshot delete big before >/dev/null; t1=$(now)
echo "delete of the snapshot (the volume holds all its pages alone again): $(seconds "$t0" "$t1") s (server: $(logged_ms "delete volume 'big@before'") ms)"

# A 4 PiB thin volume with 64 MiB written at 64 scattered places.
"$FB" --pool "$pool" volume create huge --size 4P --thin >/dev/null 2>&1
"$(command -v -p python3)" - "nbd+unix:///huge?socket=$sock" <<'EOF'
import nbd, os, sys
h = nbd.NBD()
h.connect_uri(sys.argv[1])
size = h.get_size()
for i in range(64):
    h.pwrite(os.urandom(1 << 20), (size // 64) * i)
h.flush()
h.shutdown()
EOF
t0=$(now); "$FB" --pool "$pool" volume snapshot huge before >/dev/null; t1=$(now)
echo "snapshot of a 4 PiB thin volume (64 MiB written at 64 places), just written: $(seconds "$t0" "$t1") s (server: $(logged_ms "take snapshot 'before' of volume 'huge'") ms)"
echo "ten snapshots of the idle 4 PiB thin volume (server): $(snapshots_ms huge)"
"$FB" --pool "$pool" volume snapshot delete huge before >/dev/null
"$FB" --pool "$pool" volume delete huge >/dev/null

t0=$(now); "$FB" --pool "$pool" volume clone big big-clone >/dev/null; t1=$(now)
echo "clone of the ${VOLUME_GIB} GiB volume: $(seconds "$t0" "$t1") s (server: $(logged_ms "clone volume 'big' as 'big-clone' (thick)") ms)"

# The reference-count audit pauses the pool's I/O while it runs.
t0=$(now); "$FB" --pool "$pool" check >/dev/null; t1=$(now)
echo "check (audit of both volumes' maps against every count): $(seconds "$t0" "$t1") s"

t0=$(now)
# libnbd's Python module is installed for the system's python3.
"$(command -v -p python3)" - "nbd+unix:///big-clone?socket=$sock" "$TRIM_GIB" <<'EOF'
import nbd, sys
h = nbd.NBD()
h.connect_uri(sys.argv[1])
step = 2**31  # below the 32-bit length limit of compact request headers
for off in range(0, int(sys.argv[2]) * 2**30, step):
    h.trim(step, off)
h.flush()
h.shutdown()
EOF
t1=$(now)
echo "trim of $TRIM_GIB GiB of the clone, then flush (libnbd, 2 GiB requests): $(seconds "$t0" "$t1") s"

t0=$(now); "$FB" --pool "$pool" volume delete big >/dev/null; t1=$(now)
echo "delete of the ${VOLUME_GIB} GiB volume (its clone holds every block): $(seconds "$t0" "$t1") s"

t0=$(now); "$FB" --pool "$pool" volume delete big-clone >/dev/null; t1=$(now)
echo "delete of the clone (frees $(( VOLUME_GIB - TRIM_GIB )) GiB of mappings and the stored data): $(seconds "$t0" "$t1") s"

"$FB" --pool "$pool" stats
echo "($(nproc) CPUs, pool file in $BENCH_DIR)"
