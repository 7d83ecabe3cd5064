"""A rank for hpc run's signal tests: writes its pid, then waits (no torch).

argv[1]: a directory for ``pid<rank>`` files; argv[2]: ``ignore-usr2`` (the stop request
is not honoured, so only a hard stop ends it), ``guard`` (a PreemptGuard: exit 0 on the
request) or ``plain`` (USR2's default action ends it).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

mode = sys.argv[2]
guard = None
if mode == "ignore-usr2":
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
elif mode == "guard":
    from hpc.preempt.guard import PreemptGuard

    guard = PreemptGuard().install()
Path(sys.argv[1], f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    if guard is not None and guard():
        print(f"rank {os.environ['RANK']} stopped at the agreed step", flush=True)
        sys.exit(0)
    time.sleep(0.05)
sys.exit(9)
