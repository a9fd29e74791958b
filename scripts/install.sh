#!/bin/sh
# Install fewerbytes as a service: the binary, the systemd unit fewerbytes@.service, an
# example pool config and the service documentation. Safe to run again (an upgrade):
# it replaces what it installed and never touches an admin's /etc/fewerbytes/NAME.conf.
#
#   scripts/install.sh                      # cargo build --release, install under /usr/local
#   PREFIX=/opt/fewerbytes scripts/install.sh
#   DESTDIR=/tmp/stage scripts/install.sh   # stage into a directory (packaging, tests)
#   FEWERBYTES_BIN=path/to/fewerbytes scripts/install.sh   # install this binary, no build
#
# Then: docs/service.md, or the README's "Install as a service".
set -eu

cd "$(dirname "$0")/.."

PREFIX=${PREFIX:-/usr/local}
DESTDIR=${DESTDIR:-}
UNIT_DIR=${UNIT_DIR:-/etc/systemd/system}
CONFIG_DIR=/etc/fewerbytes

if [ -z "${FEWERBYTES_BIN:-}" ]; then
    cargo build --release -p fewerbytes
    FEWERBYTES_BIN=target/release/fewerbytes
fi
if [ ! -x "$FEWERBYTES_BIN" ]; then
    echo "install.sh: $FEWERBYTES_BIN is not an executable" >&2
    exit 1
fi

bin_dir=$DESTDIR$PREFIX/bin
doc_dir=$DESTDIR$PREFIX/share/doc/fewerbytes
unit_dir=$DESTDIR$UNIT_DIR
config_dir=$DESTDIR$CONFIG_DIR
mkdir -p "$bin_dir" "$doc_dir" "$unit_dir" "$config_dir"
# Where pool files live (the unit's StateDirectory=, also made by systemd at start):
# made here so that `pool create` can put a pool there before the first start.
install -d -m 0700 "$DESTDIR/var/lib/fewerbytes"

# Through a temporary name and a rename: a running server keeps its old binary, and
# nothing ever sees half a file.
install -m 0755 "$FEWERBYTES_BIN" "$bin_dir/.fewerbytes.new"
mv -f "$bin_dir/.fewerbytes.new" "$bin_dir/fewerbytes"

# The unit names the binary and its documentation by their paths under PREFIX.
sed -e "s|/usr/local/bin/fewerbytes|$PREFIX/bin/fewerbytes|g" \
    -e "s|/usr/local/share/doc/fewerbytes|$PREFIX/share/doc/fewerbytes|g" \
    packaging/systemd/fewerbytes@.service > "$unit_dir/.fewerbytes@.service.new"
chmod 0644 "$unit_dir/.fewerbytes@.service.new"
mv -f "$unit_dir/.fewerbytes@.service.new" "$unit_dir/fewerbytes@.service"

install -m 0644 packaging/systemd/EXAMPLE.conf "$config_dir/EXAMPLE.conf"
install -m 0644 docs/service.md "$doc_dir/service.md"

echo "install.sh: installed $PREFIX/bin/fewerbytes ($("$bin_dir/fewerbytes" --version))"
echo "install.sh: installed $UNIT_DIR/fewerbytes@.service and $CONFIG_DIR/EXAMPLE.conf${DESTDIR:+ under $DESTDIR}"

# Tell systemd about the new unit, but only on the live system it runs.
if [ -z "$DESTDIR" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    echo "install.sh: systemctl daemon-reload done"
fi

cat <<EOF
Next, for a pool named vms:
  cp $CONFIG_DIR/EXAMPLE.conf $CONFIG_DIR/vms.conf     # then edit FEWERBYTES_POOL and FEWERBYTES_LISTEN
  $PREFIX/bin/fewerbytes pool create /var/lib/fewerbytes/vms.pool --size 64G
  systemctl enable --now fewerbytes@vms
  journalctl -u fewerbytes@vms
EOF
