"""A small data-parallel training loop watched by ``hpc.AgreedStop(model=, optimizer=)``.

Every step is a few forward/backward passes of a small MLP on this rank's own random
batch, the gradients averaged, an Adam step, then ``stop(step)``: the step boundary
where :class:`hpc.health.step.StepHealth` times the step (stragglers), compares the
replicas (``HPC_SDC_EVERY``) and applies ``HPC_FAULT``.

Environment:
    MODE: ``sync`` (``hpc.sync_gradients``, default) or ``ddp``
        (``DistributedDataParallel`` on gloo).
    STEPS: steps to run (default 200). WORK: passes per step (default 3).
    PID_DIR: each rank writes its pid to ``PID_DIR/pid<rank>`` before the first step.
    LOG_LEVEL: the log level (``DEBUG`` shows the replica checks and straggler windows).
    PG_TIMEOUT: the collective timeout in seconds (default 30).

Rank 0 prints ``done N steps`` once the loop ended without an exception.
"""

import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

import hpc

info = hpc.init_torch(seed=0, timeout=float(os.environ.get("PG_TIMEOUT", "30")))
hpc.setup_logging(info, level=getattr(logging, os.environ.get("LOG_LEVEL", "INFO")))
torch.set_num_threads(1)
mode = os.environ.get("MODE", "sync")
steps = int(os.environ.get("STEPS", "200"))
work = int(os.environ.get("WORK", "3"))

model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
hpc.sync_model(model)
if mode == "ddp":
    model = nn.parallel.DistributedDataParallel(model)
elif mode != "sync":
    raise SystemExit(f"MODE={mode!r}: sync or ddp")
opt = torch.optim.Adam(model.parameters(), 1e-3)
stop = hpc.AgreedStop(model=model, optimizer=opt)
g = torch.Generator().manual_seed(info.rank)
if os.environ.get("PID_DIR"):
    Path(os.environ["PID_DIR"], f"pid{info.rank}").write_text(str(os.getpid()))

t0 = time.perf_counter()
step = 0
for step in range(1, steps + 1):
    x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
    for i in range(work):
        opt.zero_grad()
        if mode == "ddp" and i < work - 1:
            with model.no_sync():  # one gradient all_reduce per step, as in sync mode
                nn.functional.cross_entropy(model(x), y).backward()
        else:
            nn.functional.cross_entropy(model(x), y).backward()
    if mode == "sync":
        hpc.sync_gradients(model)
    opt.step()
    if stop(step):
        break
if info.rank == 0:
    print(f"done {step} steps in {time.perf_counter() - t0:.1f}s", flush=True)
