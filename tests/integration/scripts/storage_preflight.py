"""Every rank runs ``hpc.checkpoint.storage.preflight(DIR, NEED)`` ``--times`` times and
prints one line per check: ``STORAGE {"rank", "host", "ok", "error", "s", "fsync_s",
"hosts"}`` (JSON; ``error`` is the CheckpointError's message, ``s`` the seconds the check
took on this rank). Exits 0 either way: the test compares the ranks' lines.

``--remove``: remove DIR afterwards on every rank (a node-local directory, e.g. under
/dev/shm, exists once per node) and print ``LEFT {"rank", "exists"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import time

import hpc
from hpc.checkpoint.storage import preflight
from hpc.errors import CheckpointError

parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("need", type=int)
parser.add_argument("--times", type=int, default=1)
parser.add_argument("--remove", action="store_true")
args = parser.parse_args()

info = hpc.init_torch(backend="gloo")
host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
try:
    for _ in range(args.times):
        row = {"rank": info.rank, "host": host, "gethostname": socket.gethostname(),
               "ok": False, "error": None, "fsync_s": None, "hosts": None}
        start = time.perf_counter()
        try:
            report = preflight(args.directory, args.need)
            row.update(ok=True, fsync_s=report.fsync_s, hosts=list(report.hosts))
        except CheckpointError as e:
            row["error"] = str(e)
        row["s"] = time.perf_counter() - start
        print("STORAGE " + json.dumps(row), flush=True)
finally:
    if args.remove:
        shutil.rmtree(args.directory, ignore_errors=True)
        print("LEFT " + json.dumps({"rank": info.rank,
                                    "exists": os.path.exists(args.directory)}), flush=True)
