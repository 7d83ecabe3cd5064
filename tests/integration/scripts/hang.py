"""Rank HANG_RANK stops making progress before step HANG_STEP; the others all_reduce.

HANG_MODE: ``sleep`` (sleeps in Python), ``stop`` (SIGSTOPs itself), ``exit``
(``os._exit(9)`` mid-step). ``PG_TIMEOUT`` is the collective timeout (seconds).
HANG_OP: what the others run each step, ``all_reduce`` (default) or ``sync_gradients``
(rank r trains layer r % 2 of two, ``users=`` passed: at world size 2 each layer is its
owner's broadcast, sent as ``isend``/``irecv``, or with the shared-memory exchange one
barrier; across nodes one node-by-node exchange; the watchdog must count those as
collectives too).
"""

import os
import signal
import time

import torch
import torch.distributed as dist

import hpc

info = hpc.init_torch(timeout=float(os.environ.get("PG_TIMEOUT", "10")))
hang_rank = int(os.environ.get("HANG_RANK", "1"))
hang_step = int(os.environ.get("HANG_STEP", "3"))
mode = os.environ.get("HANG_MODE", "sleep")
op = os.environ.get("HANG_OP", "all_reduce")
t = torch.ones(4)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
users = [list(model[r % 2].parameters()) for r in range(info.world_size)]
for step in range(1000):
    if info.rank == hang_rank and step == hang_step:
        print(f"rank {info.rank} pid {os.getpid()} hangs at step {step} ({mode})", flush=True)
        if mode == "exit":
            os._exit(9)
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)  # HANG-LINE
    if op == "sync_gradients":
        model.zero_grad(set_to_none=True)
        model[info.rank % 2](torch.ones(2, 64)).sum().backward()
        hpc.sync_gradients(model, users)
    else:
        dist.all_reduce(t)
    time.sleep(0.05)  # the watchdog publishes progress every 0.5 s
print("UNREACHABLE", flush=True)
