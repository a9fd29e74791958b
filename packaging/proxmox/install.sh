#!/bin/sh
# Install fewerbytes on a Proxmox VE host: the binary, the fewerbytes@.service unit and
# its example config (scripts/install.sh), then the storage plugin into
# /usr/share/perl5/PVE/Storage/Custom/, where pve-storage loads custom plugins from.
# Safe to run again (an upgrade).
#
#   packaging/proxmox/install.sh                 # cargo build --release, install
#   FEWERBYTES_BIN=path/to/fewerbytes packaging/proxmox/install.sh   # no build
#   DESTDIR=/tmp/stage packaging/proxmox/install.sh                  # stage (tests)
#
# Then docs/proxmox.md: a pool, its service, `pvesm add fewerbytes ...`.
set -eu

cd "$(dirname "$0")/../.."

PREFIX=${PREFIX:-/usr/local}
DESTDIR=${DESTDIR:-}
PERL_DIR=${PERL_DIR:-/usr/share/perl5}

scripts/install.sh

plugin_dir=$DESTDIR$PERL_DIR/PVE/Storage/Custom
doc_dir=$DESTDIR$PREFIX/share/doc/fewerbytes
mkdir -p "$plugin_dir" "$doc_dir"

# The plugin runs the binary by its installed path; through a temporary name and a
# rename, so that a Proxmox daemon never loads half a file.
sed -e "s|^our \$FEWERBYTES = '/usr/local/bin/fewerbytes';|our \$FEWERBYTES = '$PREFIX/bin/fewerbytes';|" \
    packaging/proxmox/PVE/Storage/Custom/FewerbytesPlugin.pm > "$plugin_dir/.FewerbytesPlugin.pm.new"
chmod 0644 "$plugin_dir/.FewerbytesPlugin.pm.new"
mv -f "$plugin_dir/.FewerbytesPlugin.pm.new" "$plugin_dir/FewerbytesPlugin.pm"
install -m 0644 docs/proxmox.md "$doc_dir/proxmox.md"

echo "install.sh: installed $PERL_DIR/PVE/Storage/Custom/FewerbytesPlugin.pm${DESTDIR:+ under $DESTDIR}"
cat <<EOF2
Next (docs/proxmox.md), for a pool named vms:
  systemctl restart pvedaemon pveproxy pvestatd pvescheduler   # load the plugin
  cp /etc/fewerbytes/EXAMPLE.conf /etc/fewerbytes/vms.conf
  $PREFIX/bin/fewerbytes pool create /var/lib/fewerbytes/vms.pool --size 64G
  systemctl enable --now fewerbytes@vms
  pvesm add fewerbytes vms --fewerbytes-pool /var/lib/fewerbytes/vms.pool \\
      --fewerbytes-socket /run/fewerbytes/vms.sock --fewerbytes-control-socket /run/fewerbytes/vms.ctl \\
      --content images
EOF2
