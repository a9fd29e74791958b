#!/usr/bin/env bash
# A throwaway one-node Ceph cluster for tests and docs: one mon, one mgr, one OSD
# (bluestore on a sparse file), all on 127.0.0.1, no systemd, auth none, pool size 1,
# and an RBD pool named `rbd`. Everything lives in DIR (default /tmp/fewerbytes-ceph).
#
#   scripts/ceph/cluster.sh start [DIR]   # start (nothing to do if already running); prints the env
#   scripts/ceph/cluster.sh env [DIR]     # CEPH_CONF=... and the pool's name, for `eval`
#   scripts/ceph/cluster.sh stop [DIR]    # kill the daemons and remove DIR
#
# FEWERBYTES_CEPH_OSD_SIZE: the OSD's sparse file, in bytes (default 4294967296, 4 GiB).
#
# Needs Debian's ceph-mon ceph-mgr ceph-osd ceph-common (Ceph 16.2 on Debian 12).
# Starts in a few seconds, in about 250 MiB. The mon listens on a free port picked at
# start, so several clusters (one per test binary) can run side by side.
set -euo pipefail

cmd=${1:-}
dir=${2:-${FEWERBYTES_CEPH_DIR:-/tmp/fewerbytes-ceph}}
pool=rbd
export PATH="$PATH:/usr/sbin:/sbin"

die() {
    echo "cluster.sh: $*" >&2
    exit 1
}

print_env() {
    echo "CEPH_CONF=$dir/ceph.conf"
    echo "CEPH_KEYRING=$dir/keyring"
    echo "FEWERBYTES_CEPH_POOL=$pool"
}

running() {
    [[ -f $dir/ceph.conf ]] || return 1
    local name
    for name in mon.a mgr.x osd.0; do
        [[ -f $dir/run/$name.pid ]] && kill -0 "$(cat "$dir/run/$name.pid")" 2>/dev/null || return 1
    done
    timeout 10 ceph -c "$dir/ceph.conf" health >/dev/null 2>&1
}

stop() {
    # SIGKILL at once: the cluster is thrown away with its directory, so there is
    # nothing to shut down cleanly (a clean ceph-mgr exit takes seconds).
    local pidfile pid
    for pidfile in "$dir"/run/*.pid; do
        [[ -f $pidfile ]] || continue
        pid=$(cat "$pidfile")
        kill -9 "$pid" 2>/dev/null || true
    done
    for pidfile in "$dir"/run/*.pid; do
        [[ -f $pidfile ]] || continue
        pid=$(cat "$pidfile")
        # Gone, or a zombie its parent has yet to reap (state Z).
        for _ in $(seq 50); do
            [[ -r /proc/$pid/stat && $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]] || break
            sleep 0.1
        done
    done
    rm -rf "$dir"
}

free_port() {
    local port
    for _ in $(seq 100); do
        port=$((20000 + RANDOM % 20000))
        if ! ss -Hltn "sport = :$port" | grep -q .; then
            echo "$port"
            return
        fi
    done
    die "no free port found"
}

start() {
    for tool in ceph-mon ceph-mgr ceph-osd ceph monmaptool rbd; do
        command -v "$tool" >/dev/null ||
            die "$tool is missing: apt-get install ceph-mon ceph-mgr ceph-osd ceph-common"
    done
    if running; then
        print_env
        return
    fi
    # A half-started cluster (a crash, a killed test) is thrown away.
    stop
    mkdir -p "$dir"/{run,log,mon/ceph-a,mgr/ceph-x,osd/ceph-0}
    local fsid port conf
    fsid=$(cat /proc/sys/kernel/random/uuid)
    port=$(free_port)
    conf=$dir/ceph.conf
    cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$port
ms bind msgr1 = false
public network = 127.0.0.0/8
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = false
keyring = $dir/keyring
run dir = $dir/run
pid file = $dir/run/\$name.pid
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
mon data = $dir/mon/\$cluster-\$id
mgr data = $dir/mgr/\$cluster-\$id
osd data = $dir/osd/\$cluster-\$id
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
# Small: the cluster is for tests on a shared machine.
osd memory target = 268435456
bluestore cache autotune = false
bluestore cache size = 67108864
osd objectstore = bluestore
bluestore block path = $dir/osd/block-0
bluestore block create = true
bluestore block size = ${FEWERBYTES_CEPH_OSD_SIZE:-4294967296}
bluestore block db create = false
bluestore block wal create = false
mgr initial modules =
[mgr]
mgr disabled modules = dashboard prometheus restful
EOF
    : >"$dir/keyring"
    monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$port]" "$dir/monmap" >/dev/null
    ceph-mon -c "$conf" -i a --mkfs --monmap "$dir/monmap" >/dev/null
    ceph-mon -c "$conf" -i a 2>>"$dir/log/mon-start.log"
    timeout 30 ceph -c "$conf" mon stat >/dev/null || die "the mon did not come up (see $dir/log/mon.a.log)"
    ceph-mgr -c "$conf" -i x 2>>"$dir/log/mgr-start.log"
    local uuid
    uuid=$(cat /proc/sys/kernel/random/uuid)
    [[ $(ceph -c "$conf" osd new "$uuid") == 0 ]] || die "ceph osd new did not give osd.0"
    ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$uuid" >"$dir/log/osd-mkfs.log" 2>&1 ||
        die "ceph-osd --mkfs failed (see $dir/log/osd-mkfs.log)"
    ceph-osd -c "$conf" -i 0 2>>"$dir/log/osd-start.log"
    ceph -c "$conf" osd pool create "$pool" 8 8 >/dev/null 2>&1
    timeout 60 rbd -c "$conf" pool init "$pool" || die "rbd pool init failed (see $dir/log)"
    # Ready when an image can be created and removed.
    timeout 60 rbd -c "$conf" create --size 4M "$pool/cluster-sh-probe" ||
        die "the pool does not take an image (see $dir/log)"
    rbd -c "$conf" rm --no-progress "$pool/cluster-sh-probe"
    print_env
}

case $cmd in
start) start ;;
stop) stop ;;
env)
    running || die "no cluster running in $dir (run: $0 start $dir)"
    print_env
    ;;
*) die "usage: $0 start|stop|env [DIR]" ;;
esac
