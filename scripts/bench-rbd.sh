#!/usr/bin/env bash
# fewerbytes on an RBD image (served over NBD, unix socket) against fio's rbd engine
# writing straight to an image: the seed's mix, 4k randwrite QD32 x4 jobs and 128k write
# QD8, each for RUNTIME seconds; bytes Ceph received = the rbd pool's write_bytes delta;
# the ops the server's librbd kept in flight to the OSDs; a checkpoint's time with
# librbd's cache on and off; then the time a take-over after kill -9 takes until the
# new server answers, for a pool whose journal ring is as large as the format makes it
# (64 MiB) and filled to just under the point where a checkpoint starts.
#
#   RUNTIME=30 scripts/bench-rbd.sh
#   FB_BEFORE=/tmp/fewerbytes-old RUNTIME=30 scripts/bench-rbd.sh   # two binaries, one run
#
# FB (default target/release/fewerbytes) is measured; with FB_BEFORE, that binary too,
# each run of it right before FB's (same cluster, same minute), each on a pool of its
# own. The cluster's OSD is a sparse file of FEWERBYTES_CEPH_OSD_SIZE bytes (default here
# 32 GiB): at 4 GiB the plain 128 KiB run filled it, and a full Ceph pool holds fio's
# rbd writes (no error), so the run after it waited forever.
set -euo pipefail
cd "$(dirname "$0")/.."
FB=${FB:-target/release/fewerbytes}
FB_BEFORE=${FB_BEFORE:-}
D=${BENCH_DIR:-/tmp/rbd-bench}
RUNTIME=${RUNTIME:-30}
export FEWERBYTES_CEPH_OSD_SIZE=${FEWERBYTES_CEPH_OSD_SIZE:-34359738368}
scripts/ceph/cluster.sh start $D >/dev/null
eval "$(scripts/ceph/cluster.sh env $D)"
export CEPH_CONF
export FEWERBYTES_RUN_DIR=$D/run-fb FEWERBYTES_STATE_DIR=$D/state-fb
# Bytes Ceph received: the OSD's count of the bytes of client writes (its perf counters
# op_w_in_bytes + op_rw_in_bytes, read through its admin socket), exact at once; the
# pool's write_bytes in `rados df` says the same but lags by the mgr's stats period.
pool_written() {
    python3 -c '
import json, socket, struct, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
s.sendall(b"{\"prefix\": \"perf dump\"}\0")
n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
data = b""
while len(data) < n:
    data += s.recv(n - len(data))
osd = json.loads(data)["osd"]
print(osd["op_w_in_bytes"] + osd["op_rw_in_bytes"])
' $D/run/osd.0.asok
}
MIX="--dedupe_percentage=75 --buffer_compress_percentage=50 --buffer_compress_chunk=512 --randrepeat=0"
# Ops in flight from a librbd client to the OSDs: its objecter's op_active, sampled every
# 0.2 s through the client's admin socket while fio runs; prints the mean and the max.
inflight() {
    python3 scripts/ceph/inflight.py "$1" >$D/inflight.out &
    SAMPLER=$!
}
run() { # name, engine args, rw, bs, qd, jobs
    local name=$1 eng=$2 rw=$3 bs=$4 qd=$5 jobs=$6 before after out asok=$D/$1.asok
    # fio's rbd client takes the admin socket ceph.conf names for client.admin.
    [[ $name == plain ]] && asok=$D/run/client.admin.asok
    before=$(pool_written)
    inflight $asok
    out=$(fio --name=$name $eng --rw=$rw --bs=$bs --iodepth=$qd --numjobs=$jobs --group_reporting \
        --size=512M --offset_increment=512M --time_based --runtime=$RUNTIME $MIX --end_fsync=1 \
        --output-format=json --output=$D/fio.json >/dev/null 2>&1; python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]["write"]; print(j["io_bytes"], j["bw"])' $D/fio.json)
    after=$(pool_written)
    kill $SAMPLER; wait $SAMPLER || true
    set -- $out $(cat $D/inflight.out)
    echo "$name $rw $bs QD$qd x$jobs: fio wrote $(( $1 >> 20 )) MiB at $(( $2 / 1024 )) MiB/s; Ceph received $(( (after - before) >> 20 )) MiB; ops in flight to the OSDs mean $3, max $4"
}
# serve BINARY IMAGE SOCKET LOG [ARGS...]: start a server, wait until it answers; its pid in $SERVED.
serve() {
    local bin=$1 image=$2 sock=$3 log=$4
    shift 4
    CEPH_ARGS="--admin-socket $D/${image#fb-}.asok" $bin --pool rbd:rbd/$image serve --socket $sock --no-tcp "$@" >$log 2>&1 &
    SERVED=$!
    until nbdinfo --size "nbd+unix:///v?socket=$sock" >/dev/null 2>&1; do
        kill -0 $SERVED 2>/dev/null || { cat $log; exit 1; }
        sleep 0.05
    done
}
rbd create --size 4G rbd/plain
declare -A BIN=([fewerbytes]=$FB)
NAMES=(fewerbytes)
[[ -n $FB_BEFORE ]] && BIN[before]=$FB_BEFORE && NAMES=(before fewerbytes)
declare -A PID
for n in "${NAMES[@]}"; do
    rbd create --size 6G rbd/fb-$n
    ${BIN[$n]} pool create rbd:rbd/fb-$n >/dev/null
    ${BIN[$n]} --pool rbd:rbd/fb-$n volume create v --size 4G >/dev/null
    serve ${BIN[$n]} fb-$n $D/$n.sock $D/serve-$n.log
    PID[$n]=$SERVED
done
for round in 1 2; do
    for w in "randwrite 4k 32 4" "write 128k 8 1"; do
        run plain "--ioengine=rbd --clientname=admin --pool=rbd --rbdname=plain" $w
        for n in "${NAMES[@]}"; do
            run $n "--ioengine=nbd --uri=nbd+unix:///v?socket=$D/$n.sock" $w
        done
    done
done
rbd du 2>/dev/null
for n in "${NAMES[@]}"; do kill ${PID[$n]}; wait ${PID[$n]} || true; done

# A checkpoint's writes, with librbd's cache on (its default) and off: 256 MiB of 4 KiB
# random writes of unique data (the same offsets for every server) dirty the block map's
# pages; then `volume create` takes two checkpoints, the first writing those pages.
for round in 1 2; do
    for cache in false true; do
        for n in "${NAMES[@]}"; do
            bin=${BIN[$n]}
            img=ck-$n-$cache-$round
            rbd create --size 4G rbd/$img
            $bin pool create rbd:rbd/$img >/dev/null
            $bin --pool rbd:rbd/$img volume create v --size 2G >/dev/null
            CEPH_ARGS="--rbd_cache=$cache" $bin --pool rbd:rbd/$img serve --socket $D/ck.sock --no-tcp >$D/$img.log 2>&1 &
            SERVED=$!
            until nbdinfo --size "nbd+unix:///v?socket=$D/ck.sock" >/dev/null 2>&1; do sleep 0.05; done
            t0=$(date +%s.%N)
            fio --name=ck --ioengine=nbd --uri="nbd+unix:///v?socket=$D/ck.sock" --rw=randwrite --bs=4k \
                --iodepth=32 --size=2G --io_size=256M --randseed=7 >/dev/null 2>&1
            t1=$(date +%s.%N)
            $bin --pool rbd:rbd/$img volume create t --size 1M >/dev/null
            t2=$(date +%s.%N)
            echo "$n rbd_cache=$cache: 256 MiB of 4k random writes in $(awk -v a=$t0 -v b=$t1 'BEGIN{printf "%.1f", b-a}') s; volume create (two checkpoints) $(awk -v a=$t1 -v b=$t2 'BEGIN{printf "%.2f", b-a}') s"
            kill $SERVED; wait $SERVED || true
            rbd rm --no-progress rbd/$img
        done
    done
done

# Take-over after kill -9, with the journal as full as it gets: a 10 GiB image gives the
# largest ring (64 MiB, 131072 sectors); 4 KiB random writes of unique data fill it, and
# the server is killed once 35% of the ring is in use (a checkpoint starts at 40%).
for n in "${NAMES[@]}"; do
    bin=${BIN[$n]}
    rbd create --size 10G rbd/tk-$n
    $bin pool create rbd:rbd/tk-$n >/dev/null
    $bin --pool rbd:rbd/tk-$n volume create v --size 8G --thin >/dev/null
    serve $bin tk-$n $D/tk.sock $D/tk-$n.log
    fio --name=fill --ioengine=nbd --uri="nbd+unix:///v?socket=$D/tk.sock" --rw=randwrite --bs=4k \
        --iodepth=32 --size=8G --time_based --runtime=600 --randrepeat=0 >/dev/null 2>&1 &
    FIO=$!
    used=0
    ring=1
    for _ in $(seq 6000); do
        read -r used ring < <($bin --pool rbd:rbd/tk-$n stats --json 2>/dev/null | python3 -c '
import json,sys
l=dict(json.load(sys.stdin)["limits"]); print(l["journal sectors in use"], l["journal sectors"])')
        (( used * 100 >= ring * 35 )) && break
        sleep 0.1
    done
    kill -9 $SERVED; wait $SERVED 2>/dev/null || true
    kill $FIO; wait $FIO 2>/dev/null || true
    echo "$n: killed with $used of $ring journal sectors in use ($(( used * 512 >> 20 )) MiB)"
    start=$(date +%s.%N)
    serve $bin tk-$n $D/tk.sock $D/tk2-$n.log --take-over
    end=$(date +%s.%N)
    echo "$n: take-over after kill -9: serving after $(awk -v a=$start -v b=$end 'BEGIN{printf "%.2f", b-a}') s"
    head -20 $D/tk2-$n.log | cut -c1-220
    kill $SERVED; wait $SERVED || true
done
scripts/ceph/cluster.sh stop $D >/dev/null
