"""Rank 1 fails first but takes 2 s to exit; rank 0 fails 0.5 s later and exits at once.

hpc run must name rank 1 (its failure mark is older), not the rank that exited first.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

from hpc.watchdog import marks

rank = int(os.environ["RANK"])
if rank == 1:
    atexit.register(time.sleep, 2.0)  # a slow teardown, after the mark is written
marks.install(rank)
if rank == 1:
    raise RuntimeError("rank 1 broke first")
time.sleep(0.5)
sys.exit(3)  # "because the peer died"
