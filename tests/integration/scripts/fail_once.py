"""Worker for the torchrun restart test: fails once, on one node only.

Every rank inits (``hpc.init_torch``) and all-reduces its rank; in the first attempt the
worker of node ``FAIL_GROUP_RANK`` (torchrun's ``GROUP_RANK``) then exits 3, leaving its
pre-flight keys in the agents' store. Only that node's agent counts a restart, so the
second attempt runs with ``TORCHELASTIC_RESTART_COUNT`` 1 on that node and 0 on the
other; it must meet anyway. ``FAIL_MARKER`` (a file) remembers that it failed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hpc

info = hpc.init_torch(seed=0)
import torch
import torch.distributed as dist

t = torch.tensor([float(info.rank)])
dist.all_reduce(t)
marker = Path(os.environ["FAIL_MARKER"])
count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
node = os.environ.get("GROUP_RANK")
if node == os.environ["FAIL_GROUP_RANK"] and not marker.exists():
    marker.write_text("failed once\n")
    print(f"rank {info.rank} (node {node}, restart count {count}): failing once", flush=True)
    sys.exit(3)
dist.barrier()
print(f"rank {info.rank}/{info.world_size} node {node} restart count {count}: "
      f"sum {t.item():.0f}", flush=True)
