"""Every rank but the last "has a GPU" (an injected device probe): the pre-flight must
refuse the mix on every rank before init_process_group, which would hang on it.

The probe stands in for ``torch.cuda`` on this CPU host: ranks with a "GPU" report the
default GPU backend (cpu:gloo,cuda:nccl) on the CPU device, so nothing touches CUDA; the
last rank reports gloo, as a rank that sees no GPU does.
"""

import os

import torch

import hpc
from hpc.bootstrap import distributed
from hpc.bootstrap.backend import DEFAULT_GPU_BACKEND

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
has_gpu = rank != world - 1
distributed._pick_device = lambda info, backend: (
    (DEFAULT_GPU_BACKEND if has_gpu else "gloo"), torch.device("cpu"))
hpc.init_torch()
print(f"UNREACHABLE rank={rank}", flush=True)
