"""Rank HANG_RANK stops making progress before step HANG_STEP; the others all_reduce.

HANG_MODE: ``sleep`` (sleeps in Python), ``stop`` (SIGSTOPs itself), ``exit``
(``os._exit(9)`` mid-step). ``PG_TIMEOUT`` is the collective timeout (seconds).
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
t = torch.ones(4)
for step in range(1000):
    if info.rank == hang_rank and step == hang_step:
        print(f"rank {info.rank} pid {os.getpid()} hangs at step {step} ({mode})", flush=True)
        if mode == "exit":
            os._exit(9)
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)  # HANG-LINE
    dist.all_reduce(t)
    time.sleep(0.05)  # the watchdog publishes progress every 0.5 s
print("UNREACHABLE", flush=True)
