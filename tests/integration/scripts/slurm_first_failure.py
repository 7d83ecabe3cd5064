"""Rank 1 fails first but takes 4 s to exit; rank 0 fails 1 s later and exits at once.

So srun learns of rank 0's exit first and lists it first ("task 0: Exited"), while the
failure marks (HPC_ERROR_DIR) show that rank 1's failure began earlier. Each rank also
logs one warning through hpc.setup_logging (its own rank<r>.log in HPC_LOG_DIR).
"""

from __future__ import annotations

import atexit
import logging
import time

import hpc

info = hpc.init_torch(backend="gloo", timeout=60)
hpc.setup_logging(info)
logging.getLogger("first_failure").warning("rank %d about to fail", info.rank)
hpc.barrier()
if info.rank == 1:
    atexit.register(time.sleep, 4.0)  # a slow teardown, after the mark is written
    raise RuntimeError("rank 1 broke first")
time.sleep(1.0)
raise RuntimeError(f"rank {info.rank} failed because its peer did")
