#!/usr/bin/env bash
# Builds the guest the VM tests boot: a minimal Debian (bookworm) with its kernel,
# systemd and the fewerbytes-guest-test unit (scripts/guest/rootfs/), as a raw ext4
# image, plus the kernel and initrd for direct kernel boot. Cached under
# $FEWERBYTES_GUEST_CACHE (default /var/cache/fewerbytes-test); a second run prints the
# paths at once. A fresh machine builds it from nothing (debootstrap: ~1.5 min,
# ~770 MiB downloaded and unpacked from the machine's own apt mirror).
#
#   scripts/guest/build-image.sh     # prints IMAGE=, KERNEL=, INITRD=, SIZE=, QEMU=
#
# Needs root, debootstrap and e2fsprogs (mkfs.ext4 -d).
set -euo pipefail
source "$(dirname "$0")/common.sh"

# The image's size: the guest's volume. Room for the unit's files and the churn job.
IMAGE_SIZE=3G

print_paths() {
    echo "IMAGE=$FB_GUEST_DIR/root.img"
    echo "KERNEL=$FB_GUEST_DIR/vmlinuz"
    echo "INITRD=$FB_GUEST_DIR/initrd.img"
    echo "SIZE=$IMAGE_SIZE"
    echo "QEMU=$FB_QEMU"
}

"$FB_GUEST_SCRIPTS/qemu.sh" >/dev/null
if [[ -f $FB_GUEST_DIR/done ]]; then
    print_paths
    exit 0
fi
[[ $(id -u) -eq 0 ]] || fb_die "building the guest needs root (debootstrap, device nodes)"
fb_need debootstrap debootstrap
fb_need mkfs.ext4 e2fsprogs
fb_need e2fsck e2fsprogs

mkdir -p "$FB_GUEST_CACHE"
exec 9>"$FB_GUEST_CACHE/guest.lock"
flock 9
if [[ -f $FB_GUEST_DIR/done ]]; then
    print_paths
    exit 0
fi

started=$(date +%s)
# Stage 1, shared by every recipe: the debootstrap tree, kept so that a change of
# the recipe rebuilds in a minute instead of downloading everything again.
base=$FB_GUEST_CACHE/debootstrap-$FB_GUEST_SUITE
if [[ ! -f $base.done ]]; then
    mirror=$(fb_debian_mirror)
    fb_umount_under "$base"
    rm -rf "$base"
    echo "build-image.sh: debootstrap $FB_GUEST_SUITE from $mirror into $base" >&2
    # minbase + what boots and tests: the kernel (its initramfs-tools pulls udev and
    # builds an initrd with MODULES=most, virtio_blk included), systemd as init, and
    # e2fsprogs/util-linux (fstrim) for the unit.
    debootstrap --variant=minbase \
        --include=linux-image-amd64,systemd-sysv,udev,e2fsprogs,util-linux \
        "$FB_GUEST_SUITE" "$base" "$mirror" >"$base.log" 2>&1 || {
        tail -30 "$base.log" >&2
        fb_umount_under "$base"
        fb_die "debootstrap failed (log: $base.log)"
    }
    rm -rf "$base"/var/cache/apt/archives/*.deb
    touch "$base.done"
fi

# Stage 2: this recipe's image.
build=$FB_GUEST_DIR.build
tree=$build/tree
fb_umount_under "$build"
rm -rf "$build"
mkdir -p "$build"
cp -a "$base" "$tree"

# The guest's configuration.
echo fbguest >"$tree/etc/hostname"
cat >"$tree/etc/fstab" <<'FSTAB'
/dev/vda / ext4 rw,errors=remount-ro 0 0
FSTAB
: >"$tree/etc/machine-id"
chroot "$tree" passwd -d root >/dev/null
install -m 0755 "$FB_GUEST_SCRIPTS/rootfs/fewerbytes-guest-test" "$tree/usr/local/sbin/"
install -m 0644 "$FB_GUEST_SCRIPTS/rootfs/fewerbytes-guest-test.service" "$tree/etc/systemd/system/"
ln -sf /etc/systemd/system/fewerbytes-guest-test.service \
    "$tree/etc/systemd/system/multi-user.target.wants/fewerbytes-guest-test.service"
# No login prompt on the serial console during a test job: the getty would hang up
# the console under the unit (vhangup) and take its output, and its process with it.
mkdir -p "$tree/etc/systemd/system/serial-getty@.service.d"
cp "$FB_GUEST_SCRIPTS/rootfs/no-getty-during-job.conf" "$tree/etc/systemd/system/serial-getty@.service.d/"
# Slow boots are not failures; the journal stays in memory; no getty on the (absent)
# VGA consoles during a job either.
mkdir -p "$tree/etc/systemd/system.conf.d" "$tree/etc/systemd/journald.conf.d" \
    "$tree/etc/systemd/system/getty@.service.d"
cp "$FB_GUEST_SCRIPTS/rootfs/slow-boot.conf" "$tree/etc/systemd/system.conf.d/"
cp "$FB_GUEST_SCRIPTS/rootfs/journald-volatile.conf" "$tree/etc/systemd/journald.conf.d/"
cp "$FB_GUEST_SCRIPTS/rootfs/no-getty-during-job.conf" "$tree/etc/systemd/system/getty@.service.d/"
# Timers that would wake during a test boot and do unrelated I/O.
for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer \
    systemd-tmpfiles-clean.timer dpkg-db-backup.timer; do
    ln -sf /dev/null "$tree/etc/systemd/system/$unit"
done

# The kernel and initrd for direct boot, checked for the virtio disk driver.
cp "$tree"/boot/vmlinuz-* "$build/vmlinuz"
cp "$tree"/boot/initrd.img-* "$build/initrd.img"
initrd_files=$(chroot "$tree" sh -c 'lsinitramfs /boot/initrd.img-*')
grep -q '/virtio_blk\.ko' <<<"$initrd_files" || fb_die "the guest's initrd has no virtio_blk module"

# Space the image does not need.
rm -rf "$tree"/var/cache/apt/archives/*.deb "$tree"/var/lib/apt/lists/* \
    "$tree"/usr/share/doc/* "$tree"/usr/share/man/* "$tree"/usr/share/locale/*
# Drivers a virtio guest never loads (about half of the kernel's modules).
for drivers in sound drivers/gpu drivers/media drivers/net/wireless drivers/staging \
    drivers/infiniband drivers/net/ethernet drivers/bluetooth drivers/iio drivers/isdn; do
    rm -rf "$tree"/usr/lib/modules/*/kernel/$drivers
done
chroot "$tree" sh -c 'depmod -a $(ls /usr/lib/modules)'

mkfs.ext4 -q -F -L fbguest -d "$tree" "$build/root.img" "$IMAGE_SIZE" >/dev/null
e2fsck -fn "$build/root.img" >/dev/null 2>&1 || fb_die "e2fsck -fn of the new image failed"
rm -rf "$tree"
echo "build-image.sh: built in $(($(date +%s) - started)) s: $(du -h --apparent-size "$build/root.img" | cut -f1) image, $(du -h "$build/root.img" | cut -f1) allocated" >&2
touch "$build/done"
rm -rf "$FB_GUEST_DIR"
mv "$build" "$FB_GUEST_DIR"
print_paths
