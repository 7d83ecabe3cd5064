"""Rank 1 raises after a collective; every rank prints how its group was torn down.

Teardown is observed by wrapping torch's destroy/abort functions (the real ones still
run): the failing rank must abort its group, the clean rank destroy it.
"""

import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import hpc


def _spy(name: str, fn):
    def wrapper(*args, **kwargs):
        print(f"TEARDOWN {name} rank={rank}", flush=True)
        return fn(*args, **kwargs)
    return wrapper


info = hpc.init_torch(backend="gloo", timeout=60)
rank = info.rank
dist.destroy_process_group = _spy("destroy", dist.destroy_process_group)
c10d._abort_process_group = _spy("abort", c10d._abort_process_group)
t = torch.ones(1)
dist.all_reduce(t)
if rank == 1:
    time.sleep(1.0)  # rank 0 finishes its clean exit first
    raise RuntimeError("rank 1 failing on purpose")
print(f"DONE rank={rank} sum={t.item()}", flush=True)
