#!/usr/bin/env python3
"""Ops in flight from a librbd client to the OSDs: its objecter's op_active, read every
0.2 s through the client's admin socket (argv[1]) until SIGTERM, then printed as
"MEAN MAX". Used by scripts/bench-rbd.sh and scripts/bench-rbd-cache.sh."""
import json
import signal
import socket
import struct
import sys
import time

samples = []


def report(*_):
    print("%.1f %d" % (sum(samples) / max(len(samples), 1), max(samples or [0])))
    sys.exit(0)


signal.signal(signal.SIGTERM, report)
while True:
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(sys.argv[1])
        s.sendall(b'{"prefix": "perf dump"}\0')
        n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
        data = b""
        while len(data) < n:
            data += s.recv(n - len(data))
        samples.append(json.loads(data)["objecter"]["op_active"])
    except (OSError, KeyError, ValueError, struct.error):
        pass  # the client is not up yet, or gone: no sample this time
    time.sleep(0.2)
