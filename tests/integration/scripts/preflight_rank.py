"""One rank of a hand-made launch (RANK/WORLD_SIZE/MASTER_* set by the test) that runs
hpc.init_torch(backend="gloo") and prints ``INIT OK rank=R``.

``HPC_TEST_STALL_AFTER_INIT=S``: this rank sleeps S seconds right after its own
init_process_group returns (a rank stalled between init and its first collective), so
its peers wait for it in the pre-flight's init confirmation.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

import hpc

stall = float(os.environ.get("HPC_TEST_STALL_AFTER_INIT") or 0)
if stall:
    real_init = dist.init_process_group

    def stalled_init(*args: object, **kwargs: object) -> None:
        real_init(*args, **kwargs)
        time.sleep(stall)

    dist.init_process_group = stalled_init

info = hpc.init_torch(backend="gloo")
print(f"INIT OK rank={info.rank}", flush=True)
