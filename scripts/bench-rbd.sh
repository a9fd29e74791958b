#!/usr/bin/env bash
# fewerbytes on an RBD image (served over NBD, unix socket) against fio's rbd engine
# writing straight to an image: the seed's mix, 4k randwrite QD32 x4 jobs and 128k write
# QD8, each for RUNTIME seconds; bytes Ceph received = the rbd pool's write_bytes delta;
# then the time a take-over after kill -9 takes until the new server answers.
#
#   RUNTIME=30 scripts/bench-rbd.sh
#
# The cluster's one OSD holds 4 GiB (scripts/ceph/cluster.sh; FEWERBYTES_CEPH_OSD_SIZE=16G
# for more): the plain 128 KiB run fills it in about 30 s here. fio's rbd engine then
# waits (librbd holds writes to a full pool); the fewerbytes server refuses them with
# ENOSPC (docs/ceph.md, "A full Ceph pool"), which fails its fio run.
set -euo pipefail
cd "$(dirname "$0")/.."
FB=target/release/fewerbytes
D=/tmp/rbd-bench
RUNTIME=${RUNTIME:-30}
scripts/ceph/cluster.sh start $D >/dev/null
eval "$(scripts/ceph/cluster.sh env $D)"
export CEPH_CONF
pool_written() { rados df --format json 2>/dev/null | python3 -c 'import json,sys; print([p for p in json.load(sys.stdin)["pools"] if p["name"]=="rbd"][0]["write_bytes"])'; }
MIX="--dedupe_percentage=75 --buffer_compress_percentage=50 --buffer_compress_chunk=512 --randrepeat=0"
run() { # name, engine args, rw, bs, qd, jobs
    local name=$1 eng=$2 rw=$3 bs=$4 qd=$5 jobs=$6 before after out
    before=$(pool_written)
    out=$(fio --name=$name $eng --rw=$rw --bs=$bs --iodepth=$qd --numjobs=$jobs --group_reporting \
        --size=512M --offset_increment=512M --time_based --runtime=$RUNTIME $MIX --end_fsync=1 \
        --output-format=json --output=$D/fio.json >/dev/null 2>&1; python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]["write"]; print(j["io_bytes"], j["bw"])' $D/fio.json)
    after=$(pool_written)
    set -- $out
    echo "$name $rw $bs QD$qd x$jobs: fio wrote $(( $1 >> 20 )) MiB at $(( $2 / 1024 )) MiB/s; Ceph received $(( (after - before) >> 20 )) MiB"
}
rbd create --size 4G rbd/plain
rbd create --size 6G rbd/fbdata
$FB pool create rbd:rbd/fbdata >/dev/null
$FB --pool rbd:rbd/fbdata volume create v --size 4G >/dev/null
$FB --pool rbd:rbd/fbdata serve --socket $D/fb.sock --no-tcp > $D/serve.log 2>&1 &
SERVE=$!
until nbdinfo --size "nbd+unix:///v?socket=$D/fb.sock" >/dev/null 2>&1; do sleep 0.1; done
for round in 1 2; do
  run plain "--ioengine=rbd --clientname=admin --pool=rbd --rbdname=plain" randwrite 4k 32 4
  run fewerbytes "--ioengine=nbd --uri=nbd+unix:///v?socket=$D/fb.sock" randwrite 4k 32 4
  run plain "--ioengine=rbd --clientname=admin --pool=rbd --rbdname=plain" write 128k 8 1
  run fewerbytes "--ioengine=nbd --uri=nbd+unix:///v?socket=$D/fb.sock" write 128k 8 1
done
rbd du rbd/plain rbd/fbdata 2>/dev/null || rbd du
# Take-over after kill -9: until the new server answers.
kill -9 $SERVE; wait $SERVE 2>/dev/null || true
start=$(date +%s.%N)
$FB --pool rbd:rbd/fbdata serve --socket $D/fb.sock --no-tcp --take-over > $D/serve2.log 2>&1 &
SERVE=$!
until nbdinfo --size "nbd+unix:///v?socket=$D/fb.sock" >/dev/null 2>&1; do sleep 0.05; done
end=$(date +%s.%N)
echo "take-over after kill -9: serving after $(awk -v a=$start -v b=$end 'BEGIN{printf "%.2f", b-a}') s"
grep -i "replay\|take\|blocklist" $D/serve2.log | head -5
kill $SERVE; wait $SERVE || true
scripts/ceph/cluster.sh stop $D >/dev/null
