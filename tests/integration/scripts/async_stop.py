"""A user's own preemptible loop whose stop checkpoint is asynchronous.

``hpc.AgreedStop`` first; a checkpoint every ``--ckpt-every`` steps (blocking); at the
agreed stop ``save_checkpoint(..., blocking=False)`` and at once
``stop.requeue_and_exit(step, path)``: the requeue must wait for that save, still being
written by the writer process (started by this first asynchronous save), or the requeue's
end of the job loses it. ``STOP_AT=N``: rank 1 sends itself SIGUSR2 before step N, in the
job's first run only (``SLURM_RESTART_COUNT`` unset or 0). Prints
``rank R: resumed at step S`` and, at the end, ``rank R: done step S digest D``.

Usage: async_stop.py --out DIR [--steps N] [--ckpt-every K] [--mib M]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys

import hpc

stop = hpc.AgreedStop()  # first: the stop signal must not kill a rank importing torch

import torch  # noqa: E402
from torch import nn  # noqa: E402


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in [*model.state_dict().values(),
              *(v for s in opt.state.values() for v in s.values())]:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--ckpt-every", type=int, default=4)
    parser.add_argument("--mib", type=float, default=48)
    args = parser.parse_args()

    info = hpc.init_torch(seed=0)
    hpc.setup_logging(info)
    width = max(16, int((args.mib * 2**20 / 4 / 3 / 2) ** 0.5))  # 2 square layers, x3
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    restored = hpc.restore_checkpoint(args.out, model=model, optimizer=opt)
    start = restored.step if restored else 0
    print(f"rank {info.rank}: resumed at step {start}", flush=True)
    first_run = int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0
    stop_at = int(os.environ.get("STOP_AT") or 0) if first_run else 0
    for step in range(start, args.steps):
        if info.rank == 1 and step + 1 == stop_at:
            os.kill(os.getpid(), signal.SIGUSR2)  # the handler only sets the flag
        g = torch.Generator().manual_seed(1000 * step + info.rank)
        model(torch.randn(32, width, generator=g)).square().mean().backward()
        hpc.sync_gradients(model)
        opt.step()
        opt.zero_grad()
        if stop(step + 1):
            path = hpc.save_checkpoint(args.out, step + 1, model=model, optimizer=opt,
                                       blocking=False)
            print(f"rank {info.rank}: stopped at step {step + 1}", flush=True)
            stop.requeue_and_exit(step + 1, path)  # waits for that save, then requeues
        if (step + 1) % args.ckpt_every == 0:
            hpc.save_checkpoint(args.out, step + 1, model=model, optimizer=opt)
    print(f"rank {info.rank}: done step {args.steps} digest {digest(model, opt)}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
