"""Benchmark: the cost of ``hpc.AgreedStop`` per call, next to one training step.

Measured in one run, round-robin, median over ``--repeats`` blocks of ``--calls`` calls:

* ``stop(step), every=1``   one ``all_reduce(MAX)`` of a 1-element int32 per call;
* ``stop(step), every=K``   the collective on every K-th call only (``--every``);
* ``local flag only``       ``guard()``: no collective (the floor: what a loop that polls
  without agreeing pays, and what a loop fusing the flag into its own all_reduce pays);
* ``train step``            one step of ``docs/examples/train_preemptible.py``'s model
  (forward, backward, ``sync_gradients``, SGD, scheduler), batch 32.

Prints microseconds per call and the ratio to a training step. Run::

    flock /tmp/hpc-heavy.lock hpc run --nproc 2 -- python bench/agreed_stop.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

import hpc


def _block(fn: Callable[[int], object], calls: int, start: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(start + i)
    dist.barrier()
    return (time.perf_counter() - t0) / calls


def _train_step() -> Callable[[int], object]:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))
    hpc.sync_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10**6)
    x, y = torch.randn(32, 32), torch.randint(0, 10, (32,))

    def step(_: int) -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        hpc.sync_gradients(model)
        opt.step()
        sched.step()

    return step


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args(argv)
    info = hpc.init_torch(seed=0)
    every1 = hpc.AgreedStop()
    everyk = hpc.AgreedStop(every1.guard, every=args.every)
    cases = {"stop(step), every=1": every1,
             f"stop(step), every={args.every}": everyk,
             "local flag only": lambda _: every1.guard(),
             "train step": _train_step()}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.repeats + 1):  # round 0 warms up
        for name, fn in cases.items():
            t = _block(fn, args.calls, r * args.calls)
            if r:
                times[name].append(t)
    if info.rank == 0:
        step = statistics.median(times["train step"])
        print(f"world size {info.world_size}, backend {dist.get_backend()}, "
              f"median of {args.repeats} x {args.calls} calls")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"  {name:<24} {med * 1e6:9.1f} us/call  ({min(ts) * 1e6:.1f}-"
                  f"{max(ts) * 1e6:.1f})  {med / step:6.3f}x of a train step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
