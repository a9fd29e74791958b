# shellcheck shell=bash disable=SC2034  # variables for the scripts that source this
# Sourced by the scripts in scripts/guest/: where the cached guest image and the
# private QEMU live, and small helpers. Not meant to be run on its own.
#
# FEWERBYTES_GUEST_CACHE (default /var/cache/fewerbytes-test) holds, per Debian
# release and recipe version, the private qemu-system-x86_64 and the guest image.
# Deleting it makes the next run build everything from nothing, as on a fresh CI
# machine.

FB_GUEST_CACHE=${FEWERBYTES_GUEST_CACHE:-/var/cache/fewerbytes-test}
FB_GUEST_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Bump when the guest recipe (packages, rootfs files, image size) changes: the
# image cached under the old name is then rebuilt.
FB_GUEST_RECIPE=4
FB_GUEST_SUITE=bookworm
FB_GUEST_DIR=$FB_GUEST_CACHE/guest-$FB_GUEST_SUITE-r$FB_GUEST_RECIPE
FB_QEMU_DIR=$FB_GUEST_CACHE/qemu-system-x86
# The wrapper that runs the private QEMU with its libraries, modules and firmware.
FB_QEMU=$FB_QEMU_DIR/bin/qemu-system-x86_64

fb_die() {
    echo "$(basename "$0"): $*" >&2
    exit 1
}

# fb_need TOOL PACKAGE: fail, naming the package, unless TOOL is on PATH (sbin too).
fb_need() {
    PATH="$PATH:/usr/sbin:/sbin" command -v "$1" >/dev/null 2>&1 ||
        fb_die "missing \`$1\`: install the Debian package $2 (.ci/run and scripts/test.sh do)"
}

# The Debian mirror this machine's apt uses (first URI of the main archive), so that
# debootstrap fetches from the same place on CI's fresh machine as here.
fb_debian_mirror() {
    local uri=
    if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
        uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    fi
    if [[ -z $uri && -f /etc/apt/sources.list ]]; then
        uri=$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /^(https?|file):/) { print $i; exit } }' /etc/apt/sources.list)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

# The accelerator for a guest: FEWERBYTES_GUEST_ACCEL (kvm or tcg) if set, else kvm
# only if it runs the guest's own kernel here. /dev/kvm may exist yet be a hypervisor
# that cannot run a stock Debian kernel (it fails an MSR assertion, or stops on an
# emulation failure), so the probe boots KERNEL without a root file system under KVM
# and wants the kernel's own "Kernel panic" about it within 60 s. The answer is
# cached per boot of the host (keyed by its boot id).
fb_guest_accel() {
    local kernel=$1
    if [[ -n ${FEWERBYTES_GUEST_ACCEL:-} ]]; then
        echo "$FEWERBYTES_GUEST_ACCEL"
        return
    fi
    local boot_id probe_file
    boot_id=$(cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo unknown)
    probe_file=$FB_GUEST_CACHE/kvm-probe-$boot_id
    mkdir -p "$FB_GUEST_CACHE"
    # Guests start side by side (the boot storm): one probes while the others wait on
    # the lock, and the answer appears whole (renamed into place), never half written.
    # (An empty answer once made QEMU list its accelerators and exit 0, no guest run.)
    (
        flock 9
        if [[ ! -s $probe_file ]]; then
            local answer=tcg log
            if [[ -c /dev/kvm ]]; then
                log=$(mktemp -t fb-kvm-probe.XXXXXX)
                timeout 60 "$FB_QEMU" -accel kvm -cpu host -m 256 -nodefaults -display none \
                    -serial "file:$log" -monitor none -no-reboot -kernel "$kernel" \
                    -append "console=ttyS0 panic=-1 root=/dev/nonexistent" >/dev/null 2>&1 || true
                grep -q 'Kernel panic' "$log" && answer=kvm
                rm -f "$log"
            fi
            echo "$answer" >"$probe_file.tmp.$$"
            mv "$probe_file.tmp.$$" "$probe_file"
        fi
    ) 9>"$probe_file.lock"
    local accel
    accel=$(cat "$probe_file")
    [[ $accel == kvm || $accel == tcg ]] || fb_die "accelerator probe left '$accel' in $probe_file"
    echo "$accel"
}

# fb_proc_cpu_ticks PID: user + system CPU time of PID in clock ticks (/proc/PID/stat).
fb_proc_cpu_ticks() {
    # Fields after the ")" that ends the command name: utime is the 12th, stime the 13th.
    sed 's/^.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'
}

# fb_proc_hwm_kib PID: the peak resident set size of PID (VmHWM, KiB).
fb_proc_hwm_kib() {
    awk '/^VmHWM:/ {print $2}' "/proc/$1/status"
}

# fb_proc_write_bytes PID: bytes PID caused to be sent to the block layer (/proc/PID/io).
fb_proc_write_bytes() {
    awk '/^write_bytes:/ {print $2}' "/proc/$1/io"
}

# fb_allocated_bytes FILE...: bytes allocated on the drive for the files (sparse-aware).
fb_allocated_bytes() {
    local total=0 blocks
    for f in "$@"; do
        blocks=$(stat -c %b "$f")
        total=$((total + blocks * 512))
    done
    echo "$total"
}

# fb_json FILE EXPR: a value from a JSON document (python3, expression on `j`).
fb_json() {
    python3 -c 'import json, sys; j = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"
}

# fb_console_ok LOG: the guest's unit finished cleanly (its "done" line, no FAILED).
fb_console_ok() {
    grep -aq 'FEWERBYTES-GUEST done' "$1" && ! grep -aq 'FEWERBYTES-GUEST FAILED' "$1"
}

# fb_umount_under DIR: unmounts everything mounted at or below DIR (deepest first),
# e.g. the /proc and /sys a failed debootstrap leaves mounted in its target, so that
# removing DIR never reaches into the host's /proc, /sys or /dev.
fb_umount_under() {
    local dir target
    dir=$(realpath -m "$1")
    while read -r target; do
        umount -l "$target" 2>/dev/null || true
    done < <(awk -v d="$dir" '$2 == d || index($2, d "/") == 1 {print $2}' /proc/self/mounts | sort -r)
}
