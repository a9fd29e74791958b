#!/usr/bin/env bash
# What TLS costs: fio over NBD in clear and over TLS (x509, server certificate only),
# for fewerbytes and for `nbdkit file` with the same credentials, in one run, the four
# servers alternating round by round so a machine whose load changes weighs on all.
# Prints MiB/s and the server's CPU seconds per GiB written, and TLS / clear ratios.
#
#   ROUNDS=2 RUNTIME=10 scripts/bench-tls.sh
#   SERVERS="fb-clear fb-tls" FB=/path/to/fewerbytes scripts/bench-tls.sh   # a subset
#
# fio's nbd engine passes libnbd only a URI, and libnbd takes no credential file from
# a URI for it, so fio finds the client credentials in libnbd's default directory:
# $HOME/.pki/libnbd, which needs a user other than root (root's is /etc/pki/libnbd,
# which this script leaves alone). Run as root, fio runs as nobody (setpriv).
#
# Workloads (TCP on loopback, end_fsync=1, throughput to the end of the final flush,
# as in bench.sh; fewerbytes' data is the 75% dup / 50% compressible mix):
#   4k-mix      4k randwrite QD32 x JOBS
#   128k-mix    128k write QD8
set -euo pipefail
cd "$(dirname "$0")/.."

FB=${FB:-$PWD/target/release/fewerbytes}
ROUNDS=${ROUNDS:-2}
RUNTIME=${RUNTIME:-10}
JOBS=${JOBS:-4}
JOB_SIZE=${JOB_SIZE:-1G}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
PORT=${PORT:-10897}
WORKLOADS=${WORKLOADS:-4k-mix 128k-mix}

dir=$(mktemp -d "$BENCH_DIR/fewerbytes-tls.XXXXXX")
chmod 755 "$dir"
server_pid=
cleanup() {
    [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT

# Credentials: a CA, a server certificate for 127.0.0.1, a client certificate.
make_cert() { # NAME CN EXTENSIONS
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$2" \
        -keyout "$dir/$1-key.pem" -out "$dir/$1-req.pem" 2>/dev/null
    printf '%s\n' "$3" >"$dir/$1-ext.cnf"
    openssl x509 -req -days 2 -CAcreateserial -in "$dir/$1-req.pem" -CA "$dir/ca-cert.pem" \
        -CAkey "$dir/ca-key.pem" -out "$dir/$1-cert.pem" -extfile "$dir/$1-ext.cnf" 2>/dev/null
}
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj "/CN=bench CA" \
    -keyout "$dir/ca-key.pem" -out "$dir/ca-cert.pem" 2>/dev/null
make_cert server localhost "subjectAltName=DNS:localhost,IP:127.0.0.1"
make_cert client bench "extendedKeyUsage=clientAuth"
mkdir -p "$dir/certs" "$dir/home/.pki/libnbd" "$dir/work"
cp "$dir/ca-cert.pem" "$dir/server-cert.pem" "$dir/server-key.pem" "$dir/certs/"
cp "$dir/ca-cert.pem" "$dir/home/.pki/libnbd/"
cp "$dir/client-cert.pem" "$dir/home/.pki/libnbd/client-cert.pem"
cp "$dir/client-key.pem" "$dir/home/.pki/libnbd/client-key.pem"
chmod -R a+rX "$dir/home" && chmod 777 "$dir/work"

as_client=()
[[ $(id -u) == 0 ]] && as_client=(setpriv --reuid=65534 --regid=65534 --clear-groups)

job_bytes=$(numfmt --from=iec "$JOB_SIZE")
volume_bytes=$((job_bytes * JOBS))
mix=(--dedupe_percentage=75 --buffer_compress_percentage=50 --buffer_compress_chunk=512 --refill_buffers)

wait_ready() {
    for _ in $(seq 100); do
        (cd "$dir/work" && HOME=$dir/home "${as_client[@]}" nbdinfo "$1" >/dev/null 2>&1) && return
        sleep 0.1
    done
    echo "server did not start" >&2; cat "$dir/serve.log" >&2; exit 1
}

start() { # SERVER
    case $1 in
        fb-clear | fb-tls)
            rm -f "$dir/pool"*
            "$FB" pool create "$dir/pool" --size $((volume_bytes * 2)) >/dev/null
            "$FB" --pool "$dir/pool" volume create vol --size "$volume_bytes" >/dev/null
            local tls=(--tls off)
            [[ $1 == fb-tls ]] && tls=(--tls require --tls-certificates "$dir/certs")
            "$FB" --pool "$dir/pool" serve --listen "127.0.0.1:$PORT" "${tls[@]}" >"$dir/serve.log" 2>&1 &
            server_pid=$!
            uri="nbd://127.0.0.1:$PORT/vol"
            ;;
        nbdkit-clear | nbdkit-tls)
            rm -f "$dir/raw"
            truncate -s "$volume_bytes" "$dir/raw"
            local tls=(--tls=off)
            [[ $1 == nbdkit-tls ]] && tls=(--tls=require --tls-certificates "$dir/certs")
            nbdkit --foreground -p "$PORT" -i 127.0.0.1 "${tls[@]}" file "$dir/raw" >"$dir/serve.log" 2>&1 &
            server_pid=$!
            uri="nbd://127.0.0.1:$PORT/"
            ;;
    esac
    [[ $1 == *-tls ]] && uri=${uri/nbd:/nbds:}
    wait_ready "$uri"
}

stop_server() {
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=
}

# Server CPU seconds so far (user + system, the whole process).
server_cpu() {
    awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$server_pid/stat"
}

# run_fio WORKLOAD: prints "MiB/s CPU-s-per-GiB".
run_fio() {
    local args
    case $1 in
        4k-mix) args=(--rw=randwrite --bs=4k --iodepth=32 --numjobs="$JOBS" "${mix[@]}") ;;
        128k-mix) args=(--rw=write --bs=128k --iodepth=8 --numjobs=1 "${mix[@]}") ;;
        *) echo "unknown workload $1" >&2; exit 1 ;;
    esac
    local start end cpu0 cpu1
    cpu0=$(server_cpu)
    start=$(date +%s.%N)
    (cd "$dir/work" && HOME=$dir/home "${as_client[@]}" fio --name=tls --ioengine=nbd --uri="$uri" \
        --size="$JOB_SIZE" --offset_increment="$JOB_SIZE" --time_based --runtime="$RUNTIME" \
        --end_fsync=1 --group_reporting --output-format=json "${args[@]}") >"$dir/fio.json"
    end=$(date +%s.%N)
    cpu1=$(server_cpu)
    python3 -c '
import json, sys
start, end, cpu = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[4]) - float(sys.argv[3])
text = open(sys.argv[5]).read()
j = json.loads(text[text.index("{"):])["jobs"][0]
written = j["write"]["io_bytes"]
print(f"{written / (end - start) / 2**20:.1f} {cpu / (written / 2**30):.2f}")' \
        "$start" "$end" "$cpu0" "$cpu1" "$dir/fio.json"
}

declare -A mibs cpu
read -r -a servers <<<"${SERVERS:-fb-clear fb-tls nbdkit-clear nbdkit-tls}"
for w in $WORKLOADS; do
    for round in $(seq "$ROUNDS"); do
        order=("${servers[@]}")
        # Every other round in the opposite order.
        if ((round % 2 == 0)); then
            order=()
            for ((i = ${#servers[@]} - 1; i >= 0; i--)); do order+=("${servers[i]}"); done
        fi
        for s in "${order[@]}"; do
            start "$s"
            read -r rate seconds < <(run_fio "$w")
            stop_server
            echo "$w round $round $s: $rate MiB/s, server CPU $seconds s/GiB ($(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1 /proc/loadavg))"
            mibs["$w|$s"]=$(python3 -c "print(${mibs["$w|$s"]:-0} + $rate)")
            cpu["$w|$s"]=$(python3 -c "print(${cpu["$w|$s"]:-0} + $seconds)")
        done
    done
done
mean() { python3 -c "print(f'{$1 / $ROUNDS:.${2:-1}f}')"; }
ratio() { python3 -c "print(f'{$1 / $2:.2f}')"; }
echo
echo "| workload | server | clear (MiB/s) | TLS (MiB/s) | TLS / clear | CPU clear (s/GiB) | CPU TLS (s/GiB) | CPU TLS / clear |"
echo "|---|---|---|---|---|---|---|---|"
for w in $WORKLOADS; do
    for s in fb nbdkit; do
        [[ -n ${mibs["$w|$s-clear"]:-} && -n ${mibs["$w|$s-tls"]:-} ]] || continue
        c=$(mean "${mibs["$w|$s-clear"]}"); t=$(mean "${mibs["$w|$s-tls"]}")
        cc=$(mean "${cpu["$w|$s-clear"]}" 2); ct=$(mean "${cpu["$w|$s-tls"]}" 2)
        name=$([[ $s == fb ]] && echo fewerbytes || echo "nbdkit file")
        echo "| $w | $name | $c | $t | $(ratio "$t" "$c") | $cc | $ct | $(ratio "$ct" "$cc") |"
    done
done
echo
echo "(runtime ${RUNTIME}s per run, $ROUNDS rounds alternating, $JOBS jobs of $JOB_SIZE for 4k, files in $BENCH_DIR, $(nproc) CPUs)"
