#!/usr/bin/env bash
# How many requests a fewerbytes server on RBD keeps in flight to the OSDs, with
# librbd's cache on (its default) and off: fio over NBD, 4k randwrite QD32 x4 jobs,
# 128k write QD8, then 4k randread QD32 x4 of what was written, RUNTIME seconds each, the
# seed's mix; the server's objecter op_active sampled every 0.2 s through its admin
# socket (mean and max). A pool of its own for each mode, on the throwaway cluster.
#
#   RUNTIME=20 scripts/bench-rbd-cache.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FB=${FB:-target/release/fewerbytes}
D=${BENCH_DIR:-/tmp/rbd-bench-cache}
RUNTIME=${RUNTIME:-20}
scripts/ceph/cluster.sh start $D >/dev/null
eval "$(scripts/ceph/cluster.sh env $D)"
export CEPH_CONF FEWERBYTES_RUN_DIR=$D/run-fb FEWERBYTES_STATE_DIR=$D/state-fb
inflight() {
    python3 scripts/ceph/inflight.py "$1" >$D/inflight.out &
    SAMPLER=$!
}
for round in 1 2; do
    for cache in true false; do
        img=cache-$cache-$round
        rbd create --size 4G rbd/$img
        $FB pool create rbd:rbd/$img >/dev/null
        $FB --pool rbd:rbd/$img volume create v --size 2G >/dev/null
        CEPH_ARGS="--rbd_cache=$cache --admin-socket $D/$img.asok" \
            $FB --pool rbd:rbd/$img serve --socket $D/$img.sock --no-tcp >$D/$img.log 2>&1 &
        SERVED=$!
        until nbdinfo --size "nbd+unix:///v?socket=$D/$img.sock" >/dev/null 2>&1; do sleep 0.1; done
        for job in "randwrite 4k 32 4" "write 128k 8 1" "randread 4k 32 4"; do
            set -- $job
            inflight $D/$img.asok
            fio --name=c --ioengine=nbd --uri="nbd+unix:///v?socket=$D/$img.sock" --rw=$1 --bs=$2 \
                --iodepth=$3 --numjobs=$4 --group_reporting --size=256M --offset_increment=256M \
                --time_based --runtime=$RUNTIME --dedupe_percentage=75 --buffer_compress_percentage=50 \
                --buffer_compress_chunk=512 --randrepeat=0 --end_fsync=1 \
                --output-format=json --output=$D/fio.json >/dev/null 2>&1
            kill $SAMPLER
            wait $SAMPLER || true
            read -r mean max <$D/inflight.out
            echo "rbd_cache=$cache $job: $(python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
k = "read" if j["read"]["io_bytes"] else "write"
print("%s %d MiB/s, %d IOPS" % (k, j[k]["bw"] // 1024, j[k]["iops"]))' $D/fio.json); in flight mean $mean, max $max"
        done
        kill $SERVED
        wait $SERVED || true
    done
done
scripts/ceph/cluster.sh stop $D >/dev/null
