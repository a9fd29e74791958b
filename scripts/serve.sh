#!/usr/bin/env bash
# The one serve command: builds fewerbytes and serves a pool over NBD.
#
# With no pool yet, `fewerbytes serve` creates ./fewerbytes.pool (a 16 GiB sparse
# file) holding one volume, disk0, and serves it on the unix socket
# ./fewerbytes.pool.sock and on 127.0.0.1:10809. Arguments are passed to `serve`
# (e.g. --pool PATH, --listen 127.0.0.1:10810, --read-only). Ctrl-C flushes and exits.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
# --quiet hides cargo's progress, and with it "Blocking waiting for file lock" while
# another cargo builds here: say what the wait is for.
echo "serve.sh: building fewerbytes (the first build takes a few minutes)..." >&2
cargo build --release --quiet --manifest-path "$repo/Cargo.toml" -p fewerbytes
exec "$repo/target/release/fewerbytes" serve "$@"
