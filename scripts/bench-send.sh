#!/usr/bin/env bash
# Bytes on the wire of `volume send`: full and incremental streams of the test guest's
# Debian rootfs, against the sizes other tools would ship (docs/benchmarks.md, "Send
# streams").
#
#   scripts/bench-send.sh
#   IMAGE=/path/to/disk.raw BENCH_DIR=/mnt/disk scripts/bench-send.sh
#
# Pool A imports the rootfs as `template`, and `twice` (the rootfs written twice, one
# after the other: a 6 GiB disk whose second half repeats its first). `vm1` is a thin
# clone of the template, written through NBD with qemu-io as a guest would: 64 MiB of
# the template's own bytes copied elsewhere (files copied in the guest), 16 MiB of
# random data, and 16 MiB of data overwritten with zeros. Pool B receives each stream,
# and every received volume is exported and compared with its source.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-/var/cache/fewerbytes-test/guest-bookworm-r4/root.img}
BENCH_DIR=${BENCH_DIR:-/var/tmp}
[[ -r $IMAGE ]] || { echo "no image at $IMAGE (scripts/guest/build-image.sh makes it; or set IMAGE)" >&2; exit 1; }

cargo build --release -q
FB=$PWD/target/release/fewerbytes
dir=$(mktemp -d "$BENCH_DIR/fewerbytes-bench-send.XXXXXX")
server_pid=
cleanup() {
    [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT

A=(--pool "$dir/a.pool")
B=(--pool "$dir/b.pool")
"$FB" pool create "$dir/a.pool" --size 24G >/dev/null
"$FB" pool create "$dir/b.pool" --size 24G >/dev/null
image_bytes=$(stat -c %s "$IMAGE")
image_mib=$((image_bytes >> 20))

"$FB" "${A[@]}" volume import template "$IMAGE" >/dev/null
dd if="$IMAGE" of="$dir/twice.raw" bs=1M conv=sparse,notrunc status=none
dd if="$IMAGE" of="$dir/twice.raw" bs=1M seek="$image_mib" conv=sparse,notrunc status=none
"$FB" "${A[@]}" volume import twice "$dir/twice.raw" >/dev/null
rm "$dir/twice.raw"

# vm1: a clone of the template, written through NBD.
"$FB" "${A[@]}" volume clone template vm1 --thin >/dev/null
"$FB" "${A[@]}" serve --socket "$dir/a.sock" --no-tcp >"$dir/serve.log" 2>&1 &
server_pid=$!
for _ in $(seq 100); do [[ -S $dir/a.sock ]] && break; sleep 0.1; done
# The 16 MiB window, 1 MiB aligned, holding the most data (overwritten with zeros:
# files deleted and trimmed), and the template's first 64 MiB of non-zero blocks
# outside it (copied files).
zero_at=$(python3 - "$IMAGE" "$dir/copied" <<'PY'
import sys
image, copied = sys.argv[1], sys.argv[2]
block, mib = 4096, 1 << 20
counts = []
with open(image, "rb") as f:
    while chunk := f.read(mib):
        counts.append(sum(1 for i in range(0, len(chunk), block) if any(chunk[i:i + block])))
best = max(range(len(counts) - 15), key=lambda m: sum(counts[m:m + 16]))
want = 64 * mib
with open(image, "rb") as f, open(copied, "wb") as out:
    for m in range(len(counts)):
        chunk = f.read(mib)
        if best <= m < best + 16 or counts[m] == 0:
            continue
        for i in range(0, len(chunk), block):
            if want > 0 and any(chunk[i:i + block]):
                out.write(chunk[i:i + block])
                want -= block
assert want == 0, "the image holds less than 64 MiB of data outside the window"
print(best * mib)
PY
)
head -c 16M /dev/urandom >"$dir/random"
uri="nbd+unix:///vm1?socket=$dir/a.sock"
qemu-io -f raw \
    -c "write -s $dir/copied 2304M 64M" \
    -c "write -s $dir/random 2400M 16M" \
    -c "write -z $zero_at 16M" \
    "$uri" >/dev/null
kill "$server_pid"
wait "$server_pid" || true
server_pid=

row() { printf '| %s | %s | %s |\n' "$1" "$2" "$3"; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

send() {    # name, args...: the stream's bytes and seconds
    local name=$1
    shift
    local start end
    start=$(date +%s.%N)
    "$FB" "${A[@]}" volume send "$@" >"$dir/$name.fbs" 2>"$dir/$name.send.log"
    end=$(date +%s.%N)
    bytes=$(stat -c %s "$dir/$name.fbs")
    seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
}

receive() { # stream name, volume, args...: receive into B
    local stream=$1 volume=$2
    shift 2
    "$FB" "${B[@]}" volume receive "$volume" "$@" <"$dir/$stream.fbs" 2>>"$dir/receive.log"
}

same() {    # volume [B's name]: A's and B's exports are the same bytes
    local theirs=${2:-$1}
    "$FB" "${A[@]}" volume export "$1" "$dir/a-$1.raw" >/dev/null
    "$FB" "${B[@]}" volume export "$theirs" "$dir/b-$theirs.raw" >/dev/null
    cmp "$dir/a-$1.raw" "$dir/b-$theirs.raw"
    rm "$dir/a-$1.raw" "$dir/b-$theirs.raw"
}

allocated=$(($(stat -c %b "$IMAGE") * 512))
qemu-img convert -f raw -O qcow2 "$IMAGE" "$dir/t.qcow2"
qcow2=$(stat -c %s "$dir/t.qcow2")
qemu-img convert -c -f raw -O qcow2 "$IMAGE" "$dir/t.qcow2"
qcow2c=$(stat -c %s "$dir/t.qcow2")
rm "$dir/t.qcow2"

echo "| what | bytes | send time |"
echo "|---|---:|---:|"
row "rootfs: raw image" "$(mib "$image_bytes")" "–"
row "rootfs: allocated in the raw file" "$(mib "$allocated")" "–"
row "rootfs: \`qemu-img convert -O qcow2\`" "$(mib "$qcow2")" "–"
row "rootfs: \`qemu-img convert -c -O qcow2\`" "$(mib "$qcow2c")" "–"
send template template
row "rootfs: \`volume send template\` (full)" "$(mib "$bytes")" "$seconds s"
receive template template
same template
send twice twice
row "rootfs twice (6 GiB): raw image" "$(mib $((2 * image_bytes)))" "–"
row "rootfs twice: \`volume send twice\` (full)" "$(mib "$bytes")" "$seconds s"
receive twice twice
same twice
row "vm1: raw changed blocks (96 MiB written: 64 MiB copied, 16 random, 16 zeroed)" "$(mib $((96 << 20)))" "–"
send vm1-full vm1
row "vm1: \`volume send vm1\` (full, no base)" "$(mib "$bytes")" "$seconds s"
send vm1-inc vm1 --from template
row "vm1: \`volume send vm1 --from template\` (incremental)" "$(mib "$bytes")" "$seconds s"
receive vm1-inc vm1
same vm1
# Two-way: vm1 with no base, to a pool that holds the template; tee keeps a copy of
# what the sender wrote, the bytes on the wire one way (the answer coming back is 20
# bytes and a bit per offered digest).
start=$(date +%s.%N)
"$FB" "${A[@]}" volume send vm1 \
    --to "tee $dir/vm1-2way.fbs | $FB --pool $dir/b.pool volume receive vm1-2way --negotiate-with template" \
    2>"$dir/vm1-2way.send.log"
end=$(date +%s.%N)
seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
row "vm1: \`volume send vm1 --to '… receive vm1 --negotiate-with template'\` (two-way, no base)" "$(mib "$(stat -c %s "$dir/vm1-2way.fbs")")" "$seconds s"
same vm1 vm1-2way
echo
grep -h "^Sent" "$dir"/*.send.log
echo "every received volume equals its source"
