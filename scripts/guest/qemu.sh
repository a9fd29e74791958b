#!/usr/bin/env bash
# Puts Debian's qemu-system-x86_64 (7.2 on bookworm) in a private folder without
# installing it: installing qemu-system-x86 would replace the machine's qemu-utils
# (a 10.x backport the NBD client tests use). `apt-get download` fetches the
# packages, `dpkg -x` unpacks them under $FEWERBYTES_GUEST_CACHE/qemu-system-x86, and
# a wrapper there (bin/qemu-system-x86_64) runs QEMU with LD_LIBRARY_PATH,
# QEMU_MODULE_DIR (TCG itself is a module) and -L for the firmware.
#
#   scripts/guest/qemu.sh        # prints the wrapper's path; does nothing if present
#
# Needs apt-get (Debian) and network access to the machine's apt mirror the first time.
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [[ -x $FB_QEMU ]] && "$FB_QEMU" --version >/dev/null 2>&1; then
    echo "$FB_QEMU"
    exit 0
fi
fb_need apt-get apt
fb_need dpkg-deb dpkg

mkdir -p "$FB_GUEST_CACHE"
exec 9>"$FB_GUEST_CACHE/qemu.lock"
flock 9
if [[ -x $FB_QEMU ]] && "$FB_QEMU" --version >/dev/null 2>&1; then
    echo "$FB_QEMU"
    exit 0
fi

work=$(mktemp -d "$FB_GUEST_CACHE/qemu-build.XXXXXX")
chown _apt "$work" 2>/dev/null || true  # apt-get download drops to _apt where it can
trap 'rm -rf "$work"' EXIT
# The packages whose files QEMU needs and that are not on a Debian machine with
# qemu-utils, plus any other library QEMU depends on that this machine lacks.
packages=(qemu-system-x86 qemu-system-common qemu-system-data seabios ipxe-qemu
    libcapstone4 libfdt1 libslirp0 libvdeplug2)
while read -r dep; do
    [[ -z $dep ]] && continue
    if ! dpkg-query -W -f='${Status}' "$dep" 2>/dev/null | grep -q 'install ok installed'; then
        [[ " ${packages[*]} " == *" $dep "* ]] || packages+=("$dep")
    fi
done < <(apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks \
    --no-replaces --no-enhances qemu-system-x86 | awk '/Depends:/ && $2 !~ /^</ {print $2}')

echo "qemu.sh: downloading ${packages[*]}" >&2
(cd "$work" && apt-get download -q "${packages[@]}" >&2) || {
    echo "qemu.sh: apt-get download failed; running apt-get update and retrying" >&2
    apt-get update -q >&2
    (cd "$work" && apt-get download -q "${packages[@]}" >&2)
}
mkdir -p "$work/root"
for deb in "$work"/*.deb; do
    dpkg-deb -x "$deb" "$work/root"
done

root=$FB_QEMU_DIR/root
missing=$(LD_LIBRARY_PATH="$work/root/usr/lib/x86_64-linux-gnu" ldd "$work/root/usr/bin/qemu-system-x86_64" | awk '/not found/ {print $1}')
[[ -z $missing ]] || fb_die "qemu-system-x86_64 still lacks libraries: $missing (add their packages to scripts/guest/qemu.sh)"

rm -rf "$FB_QEMU_DIR"
mkdir -p "$FB_QEMU_DIR/bin"
mv "$work/root" "$root"
cat >"$FB_QEMU" <<WRAPPER
#!/bin/sh
# Debian's qemu-system-x86_64, unpacked privately by scripts/guest/qemu.sh.
export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export QEMU_MODULE_DIR="$root/usr/lib/x86_64-linux-gnu/qemu"
exec "$root/usr/bin/qemu-system-x86_64" -L "$root/usr/share/qemu" -L "$root/usr/share/seabios" -L "$root/usr/lib/ipxe/qemu" "\$@"
WRAPPER
chmod +x "$FB_QEMU"
"$FB_QEMU" --version >&2
echo "$FB_QEMU"
