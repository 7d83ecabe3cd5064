"""A training loop that checkpoints every step with ``save_checkpoint(blocking=False)``,
and a user's own preemptible loop whose stop checkpoint is asynchronous.

An MLP of ``--mib`` MiB of state (weights and Adam's two moments), trained on batches
drawn from (rank, step), gradients averaged by ``hpc.sync_gradients``. It resumes from
``--out`` when that holds a checkpoint, prints ``saved <step>`` (master) after each
save returns, and at the end ``rank R: done step S digest D``, D hashing the weights and
the optimizer state. Killed anywhere and rerun, it must end with the uninterrupted
run's digest.

    PID_DIR: each rank writes its pid to ``PID_DIR/pid<rank>`` before the first step.
    STEP_SLEEP: seconds each step sleeps (default 0), so a save is in flight for a while.
    STOP_AT: rank 1 sends itself SIGUSR2 before step N, in the job's first run only
        (``SLURM_RESTART_COUNT`` unset or 0). ``hpc.AgreedStop`` (installed first) stops
        every rank at the same step; the stop's checkpoint is saved with
        ``blocking=False`` and at once ``stop.requeue_and_exit(step, path)``, which must
        wait for that save (its writer just started with ``--blocking``) before the
        requeue ends the job.

It prints ``rank R: resumed at step S`` after the restore and ``rank R: stopped at step
S`` at a stop.

Usage: async_ckpt.py --out DIR [--steps N] [--mib M] [--blocking] [--big-extra MIB]
                     [--ckpt-every K]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

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
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--mib", type=float, default=24)
    parser.add_argument("--blocking", action="store_true")
    parser.add_argument("--big-extra", type=float, default=0,
                        help="MiB of zeros added to the checkpoints from step 4 on")
    parser.add_argument("--ckpt-every", type=int, default=1, help="checkpoint every K steps")
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
    if os.environ.get("PID_DIR"):
        Path(os.environ["PID_DIR"], f"pid{info.rank}").write_text(str(os.getpid()))
    pause = float(os.environ.get("STEP_SLEEP", "0"))
    for step in range(start, args.steps):
        if info.rank == 1 and step + 1 == stop_at:
            os.kill(os.getpid(), signal.SIGUSR2)  # the guard's handler only sets the flag
        g = torch.Generator().manual_seed(1000 * step + info.rank)
        x = torch.randn(32, width, generator=g)
        model(x).square().mean().backward()
        hpc.sync_gradients(model)
        opt.step()
        opt.zero_grad()
        if stop(step + 1):
            path = hpc.save_checkpoint(args.out, step + 1, model=model, optimizer=opt,
                                       keep=2, blocking=False)
            print(f"rank {info.rank}: stopped at step {step + 1}", flush=True)
            stop.requeue_and_exit(step + 1, path)  # waits for that save, then requeues
        if (step + 1) % args.ckpt_every:
            continue
        extra = ({"pad": torch.zeros(int(args.big_extra * 2**18))}
                 if args.big_extra and step + 1 >= 4 else None)
        hpc.save_checkpoint(args.out, step + 1, model=model, optimizer=opt, keep=2,
                            blocking=args.blocking, extra=extra)
        if info.rank == 0:
            print(f"saved {step + 1}", flush=True)
        time.sleep(pause)
    hpc.wait_for_checkpoint()
    print(f"rank {info.rank}: done step {args.steps} digest {digest(model, opt)}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
