#!/usr/bin/env bash
# fewerbytes@.service under a real systemd: copies a Debian guest's root image (raw ext4
# with systemd as init, such as the guest the VM boot tests build), installs fewerbytes
# into the copy with scripts/install.sh, boots it under QEMU with a one-shot unit that
# drives the service, and checks what that unit reports. The original image is only read.
#
#   scripts/check-service-in-guest.sh ROOT_IMG [KERNEL INITRD]
#
# KERNEL and INITRD default to the image's own /boot/vmlinuz-* and /boot/initrd.img-*.
# Environment: QEMU (default qemu-system-x86_64), ACCEL (default tcg: KVM does not boot a
# stock kernel on the CI machines), FEWERBYTES_BIN (default:
# cargo build --release), WORK (default: a new directory under /var/tmp, removed after
# a pass). Root only (loop device, mount). Takes ~3 minutes under TCG on one core.
#
# What the guest checks, under systemd with the unit's whole sandbox in force:
# Type=notify start and STATUS=; both sockets in /run/fewerbytes, root-only; an NBD
# greeting on TCP; commands through --control-socket, and the hint without it; no
# capability, no_new_privs, a seccomp filter; a SIGKILL restarted by Restart=on-failure,
# the stale control socket cleared; a second instance serving a pool on a block device
# (/dev/vdb), whose stop leaves the first one's sockets; a pool on a loop device refused
# by the device policy; a config naming a missing pool failing with a priority-3 (error)
# journal line; systemctl stop giving Result=success, the sockets removed, and
# `fewerbytes check` clean.
set -euo pipefail
cd "$(dirname "$0")/.."

if (($# != 1 && $# != 3)); then
    echo "usage: $0 ROOT_IMG [KERNEL INITRD]" >&2
    exit 2
fi
root_img=$1
QEMU=${QEMU:-qemu-system-x86_64}
ACCEL=${ACCEL:-tcg}
WORK=${WORK:-$(mktemp -d /var/tmp/fb-service-guest.XXXXXX)}
mkdir -p "$WORK/mnt"
if [[ -z ${FEWERBYTES_BIN:-} ]]; then
    cargo build --release -p fewerbytes
    FEWERBYTES_BIN=$PWD/target/release/fewerbytes
fi

cp --sparse=always "$root_img" "$WORK/root.img"
truncate -s 1G "$WORK/device.img"    # the guest's /dev/vdb: a pool on a block device
loop=$(losetup -f --show "$WORK/root.img")
cleanup() {
    mountpoint -q "$WORK/mnt" && umount "$WORK/mnt"
    [[ -n ${loop:-} ]] && losetup -d "$loop" 2>/dev/null
    loop=
}
trap cleanup EXIT
mount "$loop" "$WORK/mnt"
guest=$WORK/mnt

if (($# == 3)); then
    cp "$2" "$WORK/vmlinuz"
    cp "$3" "$WORK/initrd.img"
else
    cp "$(ls "$guest"/boot/vmlinuz-* | tail -1)" "$WORK/vmlinuz"
    cp "$(ls "$guest"/boot/initrd.img-* | tail -1)" "$WORK/initrd.img"
fi

DESTDIR=$guest FEWERBYTES_BIN=$FEWERBYTES_BIN scripts/install.sh >/dev/null
# The guest's own test job (if any) must not run: it is asked for on the kernel command
# line, which this boot does not do.
cat >"$guest/usr/local/sbin/fb-service-check" <<'EOF'
#!/bin/bash
exec >/var/log/fb-service-check.log 2>&1
set -u
say() { echo "FBCHECK $*"; }
fb=/usr/local/bin/fewerbytes
pool=/var/lib/fewerbytes/vms.pool
ctl=/run/fewerbytes/vms.ctl
$fb pool create $pool --size 1G >/dev/null
$fb --pool $pool volume create disk0 --size 64M >/dev/null
sed -e "s|^FEWERBYTES_POOL=.*|FEWERBYTES_POOL=$pool|" /etc/fewerbytes/EXAMPLE.conf >/etc/fewerbytes/vms.conf
say "start rc=$(systemctl start fewerbytes@vms; echo $?)"
say "is-active=$(systemctl is-active fewerbytes@vms)"
say "$(systemctl show -p StatusText fewerbytes@vms)"
ls -l /run/fewerbytes | sed 's/^/FBCHECK ls: /'
say "tcp greeting=$(timeout 5 bash -c 'exec 3<>/dev/tcp/127.0.0.1/10809; head -c 8 <&3')"
say "clone rc=$($fb --pool $pool --control-socket $ctl volume clone disk0 vm1 >/dev/null; echo $?)"
$fb --pool $pool volume list 2>&1 | sed 's/^/FBCHECK without control socket: /'
grep -E "^(CapEff|CapBnd|NoNewPrivs|Seccomp):" /proc/"$(systemctl show -p MainPID --value fewerbytes@vms)"/status | tr -d '\t' | sed 's/^/FBCHECK proc: /'
systemctl kill -s KILL fewerbytes@vms
for _ in $(seq 60); do
    sleep 1
    [[ $(systemctl show -p NRestarts --value fewerbytes@vms) == 1 && $(systemctl is-active fewerbytes@vms) == active ]] && break
done
say "after SIGKILL: is-active=$(systemctl is-active fewerbytes@vms) $(systemctl show -p NRestarts fewerbytes@vms)"
FEWERBYTES_CONTROL_SOCKET=$ctl $fb --pool $pool volume list | sed 's/^/FBCHECK list: /'
# A second instance on a block device (/dev/vdb, a virtio disk: DeviceAllow=block-virtblk),
# beside the first; stopping it must leave the first one's sockets in /run/fewerbytes.
$fb pool create /dev/vdb >/dev/null
$fb --pool /dev/vdb volume create d0 --size 64M >/dev/null
printf 'FEWERBYTES_POOL=/dev/vdb\nFEWERBYTES_LISTEN=127.0.0.1:10811\n' >/etc/fewerbytes/dev.conf
say "device start rc=$(systemctl start fewerbytes@dev; echo $?)"
say "device clone rc=$($fb --pool /dev/vdb --control-socket /run/fewerbytes/dev.ctl volume clone d0 d1 >/dev/null; echo $?)"
say "device stop rc=$(systemctl stop fewerbytes@dev; echo $?) $(systemctl show -p Result fewerbytes@dev)"
say "first instance after the second stopped: $(ls /run/fewerbytes | tr '\n' ' ')list rc=$(FEWERBYTES_CONTROL_SOCKET=$ctl $fb --pool $pool volume list >/dev/null; echo $?)"
# The device policy in force: a pool on a loop device (not a kind the unit allows) is
# refused by the kernel when the service opens it.
truncate -s 256M /var/tmp/loop-pool.img
loopdev=$(losetup -f --show /var/tmp/loop-pool.img)
$fb pool create "$loopdev" >/dev/null
printf 'FEWERBYTES_POOL=%s\nFEWERBYTES_LISTEN=127.0.0.1:10812\n' "$loopdev" >/etc/fewerbytes/loop.conf
say "loop start rc=$(systemctl start fewerbytes@loop 2>/dev/null; echo $?)"
systemctl stop fewerbytes@loop
journalctl -u fewerbytes@loop -t fewerbytes -p err --no-pager -o cat | head -1 | sed 's/^/FBCHECK loop journal err: /'
losetup -d "$loopdev"
printf 'FEWERBYTES_POOL=/var/lib/fewerbytes/missing.pool\nFEWERBYTES_LISTEN=127.0.0.1:10810\n' >/etc/fewerbytes/bad.conf
say "bad start rc=$(systemctl start fewerbytes@bad 2>/dev/null; echo $?)"
systemctl stop fewerbytes@bad
journalctl -u fewerbytes@bad -t fewerbytes -p err --no-pager -o cat | head -1 | sed 's/^/FBCHECK bad journal err: /'
say "stop rc=$(systemctl stop fewerbytes@vms; echo $?)"
say "$(systemctl show -p Result fewerbytes@vms)"
say "sockets after stop=$(ls /run/fewerbytes | wc -l)"
$fb --pool $pool check | sed 's/^/FBCHECK check: /'
systemd-analyze security fewerbytes@vms 2>/dev/null | tail -1 | sed 's/^/FBCHECK /'
say done
sync
systemctl poweroff
EOF
chmod 755 "$guest/usr/local/sbin/fb-service-check"
cat >"$guest/etc/systemd/system/fb-service-check.service" <<'EOF'
[Unit]
Description=check fewerbytes@.service under systemd
After=local-fs.target network-online.target
[Service]
Type=oneshot
ExecStart=/usr/local/sbin/fb-service-check
[Install]
WantedBy=multi-user.target
EOF
ln -sf /etc/systemd/system/fb-service-check.service \
    "$guest/etc/systemd/system/multi-user.target.wants/fb-service-check.service"
cleanup

echo "check-service-in-guest: booting $WORK/root.img ($ACCEL)"
timeout --kill-after=10 900 "$QEMU" -accel "$ACCEL" -cpu max -m 768 -smp 1 -nodefaults \
    -no-user-config -display none -monitor none -no-reboot -nic none \
    -serial "file:$WORK/console.log" \
    -kernel "$WORK/vmlinuz" -initrd "$WORK/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 panic=-1" \
    -drive "file=$WORK/root.img,format=raw,if=virtio" \
    -drive "file=$WORK/device.img,format=raw,if=virtio"

loop=$(losetup -f --show "$WORK/root.img")
mount -o ro "$loop" "$WORK/mnt"
log=$(cat "$WORK/mnt/var/log/fb-service-check.log" 2>/dev/null || true)
cleanup
echo "$log"

failed=0
expect() {
    if ! grep -qF -- "$1" <<<"$log"; then
        echo "check-service-in-guest: MISSING: $1" >&2
        failed=1
    fi
}
expect "FBCHECK start rc=0"
expect "FBCHECK is-active=active"
expect "StatusText=Serving 1 volume of /var/lib/fewerbytes/vms.pool on /run/fewerbytes/vms.sock and tcp 127.0.0.1:10809"
expect "FBCHECK tcp greeting=NBDMAGIC"
expect "FBCHECK clone rc=0"
expect "FBCHECK without control socket: fewerbytes: error: no server answers on /var/lib/fewerbytes/vms.pool.ctl"
expect "FBCHECK proc: CapEff:0000000000000000"
expect "FBCHECK proc: NoNewPrivs:1"
expect "FBCHECK proc: Seccomp:2"
expect "FBCHECK after SIGKILL: is-active=active NRestarts=1"
expect "FBCHECK list: vm1"
expect "FBCHECK device start rc=0"
expect "FBCHECK device clone rc=0"
expect "FBCHECK device stop rc=0 Result=success"
expect "FBCHECK first instance after the second stopped: vms.ctl vms.sock list rc=0"
expect "FBCHECK loop start rc=1"
expect "Operation not permitted"
expect "FBCHECK bad start rc=1"
expect "FBCHECK bad journal err: fewerbytes: error: there is no pool at /var/lib/fewerbytes/missing.pool"
expect "FBCHECK stop rc=0"
expect "FBCHECK Result=success"
expect "FBCHECK sockets after stop=0"
expect "FBCHECK check: No problems found."
expect "FBCHECK done"
if ((failed)); then
    echo "check-service-in-guest: FAILED; console log and image kept in $WORK" >&2
    exit 1
fi
rm -rf "$WORK"
echo "check-service-in-guest: passed"
