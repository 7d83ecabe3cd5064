"""Rank FAIL_RANK exits with code 3 after init; the others block in a collective."""

import os
import sys

import torch
import torch.distributed as dist

import hpc

info = hpc.init_torch(timeout=600)
if info.rank == int(os.environ.get("FAIL_RANK", "1")):
    print(f"rank {info.rank} failing on purpose", flush=True)
    sys.exit(3)
t = torch.ones(1)
dist.all_reduce(t)  # never completes: one rank is gone
print("UNREACHABLE", flush=True)
