#!/usr/bin/env bash
# Boots the test guest (scripts/guest/build-image.sh) with its disk on an NBD export
# and waits until it powers off. Direct kernel boot (the guest's kernel and initrd),
# virtio disk with discard=unmap and cache=none, serial console to LOG, no network.
# Under KVM where KVM runs the guest's kernel, else TCG (see fb_guest_accel).
#
#   scripts/guest/boot.sh URI LOG [KERNEL-ARG...]
#   scripts/guest/boot.sh 'nbd+unix:///vm1?socket=/run/fb.sock' vm1.log fb.job=basic fb.seed=7
#
# URI: nbd+unix:///NAME?socket=PATH or nbd://HOST:PORT/NAME. LOG `-` puts the serial
# console on this terminal instead (log in as root, no password; Ctrl-A X quits QEMU).
# KERNEL-ARGs are added to the kernel command line (fb.job=basic|churn, fb.seed=N,
# fb.mib=N, fb.rounds=N run the test unit; without fb.job the guest boots to a login
# prompt on the console).
# Environment: GUEST_TIMEOUT (seconds, default 900; past it QEMU is killed and the
# exit status is 124), GUEST_MEM (MiB, default 512), GUEST_CPUS (default 1),
# FEWERBYTES_GUEST_ACCEL (kvm or tcg, default: probed), GUEST_QEMU_ARGS (more QEMU
# arguments, split on spaces: a second -drive, a -qmp socket). Exit status is QEMU's.
set -euo pipefail
source "$(dirname "$0")/common.sh"

[[ $# -ge 2 ]] || fb_die "usage: $0 URI LOG [KERNEL-ARG...]"
uri=$1 log=$2
shift 2
eval "$("$FB_GUEST_SCRIPTS/build-image.sh")"
accel=$(fb_guest_accel "$KERNEL")
cpu=max
[[ $accel == kvm ]] && cpu=host
if [[ $log == - ]]; then
    serial=mon:stdio
else
    serial=file:$log
    : >"$log"
fi
read -ra extra <<<"${GUEST_QEMU_ARGS:-}"
# no_timer_check: the kernel's check that the timer interrupt works counts ticks
# over a delay loop, which an emulated CPU on a busy host (TCG, seven guests on two
# cores) can run too slowly for; it then panics ("IO-APIC + timer doesn't work"),
# seen once in CI. Cloud images boot with it for the same reason.
exec timeout --kill-after=10 "${GUEST_TIMEOUT:-900}" "$QEMU" \
    -accel "$accel" -cpu "$cpu" -m "${GUEST_MEM:-512}" -smp "${GUEST_CPUS:-1}" \
    -nodefaults -no-user-config -display none -monitor none -no-reboot \
    -serial "$serial" -nic none \
    -kernel "$KERNEL" -initrd "$INITRD" \
    -append "root=/dev/vda rw console=ttyS0 panic=-1 quiet udev.event_timeout=600 no_timer_check $*" \
    -drive "file=$uri,format=raw,if=virtio,cache=none,discard=unmap,detect-zeroes=unmap" \
    "${extra[@]}"
