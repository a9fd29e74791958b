#!/usr/bin/env bash
# What a pool costs against the size of its device: for each size, a sparse pool file
# is created, inspected, served, written, restarted cleanly and after kill -9, and
# each step's wall time and the peak memory (RSS) of the process that ran it are
# printed as one markdown table row. A restart is timed twice: until the server's
# first NBD answer (serving), and until `stats` says the dedup index is ready (loaded
# from the copy the clean stop saved, or rebuilt after kill -9).
#
#   scripts/bench-scale.sh                 # 1T 4T 15T on ext4, 64T 256T on XFS
#   SIZES="1T 15T" DATA=4G scripts/bench-scale.sh
#
# Sizes up to 15T go to a sparse file in $DIR (default /var/tmp/fb-scale, ext4 holds
# sparse files up to 16 TiB); larger ones to a sparse file on an XFS file system made
# in a sparse 15 TiB image and loop-mounted (needs root and xfsprogs, which this
# script installs with apt-get when missing). DATA (default 1G) of the seed's mix is
# written with fio over NBD before the restarts; 0 writes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

SIZES=${SIZES:-"1T 4T 15T 64T 256T"}
DATA=${DATA:-1G}
DIR=${DIR:-/var/tmp/fb-scale}
FB=${FB:-target/release/fewerbytes}
PORT=${PORT:-10870}

[[ -x $FB ]] || cargo build --release --quiet -p fewerbytes
mkdir -p "$DIR"

bytes_of() { numfmt --from=iec "$1"; }

xfs_mount=""
cleanup() {
    pkill -f "fewerbytes --pool $DIR" 2>/dev/null || true
    if [[ -n $xfs_mount ]]; then
        umount "$xfs_mount" 2>/dev/null || true
    fi
}
trap cleanup EXIT

# Where a pool of size $1 goes.
pool_dir_for() {
    if (($(bytes_of "$1") < $(bytes_of 16T))); then
        echo "$DIR"
        return
    fi
    if [[ -z $xfs_mount ]]; then
        command -v mkfs.xfs >/dev/null ||
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q xfsprogs >/dev/null
        xfs_mount=$DIR/xfs
        mkdir -p "$xfs_mount"
        rm -f "$DIR/xfs.img"
        truncate -s 15T "$DIR/xfs.img"
        mkfs.xfs -q "$DIR/xfs.img"
        mount -o loop "$DIR/xfs.img" "$xfs_mount"
    fi
    echo "$xfs_mount"
}

# Runs a command; prints "<seconds> <peak RSS MiB>".
measure() {
    /usr/bin/time -f "%e %M" -o "$DIR/time.out" "$@" >/dev/null 2>&1
    awk '{ printf "%.2f %d\n", $1, $2 / 1024 }' "$DIR/time.out"
}

# Starts `serve` on $1 and waits for its first NBD answer; prints the seconds it took.
serve_ready() {
    local pool=$1 start end
    start=$(date +%s.%N)
    echo "$start" >"$pool.start"
    "$FB" --pool "$pool" serve --listen "127.0.0.1:$PORT" --socket "$pool.sock" \
        >"$pool.serve.log" 2>&1 &
    echo $! >"$pool.pid"
    until nbdinfo --size "nbd://127.0.0.1:$PORT/v" >/dev/null 2>&1; do
        kill -0 "$(cat "$pool.pid")" 2>/dev/null || {
            cat "$pool.serve.log" >&2
            exit 1
        }
        sleep 0.05
    done
    end=$(date +%s.%N)
    awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }'
}

# Waits until the server of $1 says its dedup index is ready; prints the seconds since
# its serve started.
index_ready() {
    local pool=$1 end
    until "$FB" --pool "$pool" stats --json 2>/dev/null |
        python3 -c 'import json, sys; sys.exit(json.load(sys.stdin)["index"]["state"] != "ready")'; do
        sleep 0.05
    done
    end=$(date +%s.%N)
    awk -v a="$(cat "$pool.start")" -v b="$end" 'BEGIN { printf "%.2f", b - a }'
}

rss_mib() { awk '/VmRSS/ { printf "%d", $2 / 1024 }' "/proc/$(cat "$1.pid")/status"; }

stop_server() {
    local pid
    pid=$(cat "$1.pid")
    kill "-$2" "$pid"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
}

for t in nbdinfo fio; do command -v $t >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q libnbd-bin fio >/dev/null; done
command -v /usr/bin/time >/dev/null ||
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q time >/dev/null

echo "| device | create s / MiB | pool info s / MiB | ready s | RSS idle MiB | written | RSS after MiB | clean restart: serving / index ready s | kill -9 restart: serving / index ready s | check s / MiB |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for size in $SIZES; do
    dir=$(pool_dir_for "$size")
    pool=$dir/scale-$size.pool
    rm -f "$pool" "$pool".*
    read -r create_s create_mib < <(measure "$FB" pool create "$pool" --size "$size")
    "$FB" --pool "$pool" volume create v --size "$(($(bytes_of "$size") * 9 / 10 / 4096 * 4096))" --thin >/dev/null
    read -r info_s info_mib < <(measure "$FB" --pool "$pool" pool info)
    ready_s=$(serve_ready "$pool")
    idle_mib=$(rss_mib "$pool")
    if [[ $DATA != 0 ]]; then
        fio --name=scale --ioengine=nbd --uri="nbd://127.0.0.1:$PORT/v" --rw=write --bs=128k \
            --iodepth=8 --size="$DATA" --dedupe_percentage=75 --buffer_compress_percentage=50 \
            --buffer_compress_chunk=512 --end_fsync=1 >/dev/null
    fi
    after_mib=$(rss_mib "$pool")
    # Stopped once the index is built, so the stop saves it.
    index_ready "$pool" >/dev/null
    stop_server "$pool" TERM
    clean_s="$(serve_ready "$pool") / $(index_ready "$pool")"
    stop_server "$pool" KILL
    crash_s="$(serve_ready "$pool") / $(index_ready "$pool")"
    stop_server "$pool" TERM
    read -r check_s check_mib < <(measure "$FB" --pool "$pool" check)
    echo "| $size | $create_s / $create_mib | $info_s / $info_mib | $ready_s | $idle_mib | $DATA | $after_mib | $clean_s | $crash_s | $check_s / $check_mib |"
    rm -f "$pool" "$pool".*
done
