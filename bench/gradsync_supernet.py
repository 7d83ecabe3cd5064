"""Benchmark: gradient sync of a weight-sharing supernet, ``sync_gradients`` vs DDP.

A ~10M-parameter supernet (8 searchable blocks of 4 candidate ops, stem, head); every
rank draws a different random path every step, so the set of parameters with gradients
differs between ranks. Modes, each with its own copy of the model and SGD, interleaved
round-robin so that the ratios come from one run under the same machine load:

* ``nosync``    no communication at all: the compute ceiling;
* ``barrier``   no data moved, but ranks wait for each other every step: the ceiling
  of any synchronous method (the ranks' paths differ in cost, so the slower one sets
  the pace);
* ``ddp``       ``DistributedDataParallel(find_unused_parameters=True)``;
* ``pertensor`` one ``all_reduce`` per parameter (zeros where unused), the naive fix;
* ``gradsync``  ``hpc.GradSync.sync()`` after ``loss.backward()``;
* ``overlap``   ``hpc.GradSync.backward(loss)``: the sync overlapped with backward.

Run (2 ranks, gloo, one table per batch size on rank 0)::

    flock /tmp/hpc-heavy.lock hpc run --nproc 2 -- python bench/gradsync_supernet.py

Options: ``--batches 256,16`` (normal and communication-bound), ``--steps 20`` timed
steps per window, ``--repeats 5`` windows per mode (median), ``--dim 448``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

import hpc


class Supernet(nn.Module):
    """Stem, ``blocks`` searchable blocks of 4 candidate ops, head (~52 dim^2 params)."""

    def __init__(self, dim: int, blocks: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, dim)

        def ops() -> nn.ModuleList:
            return nn.ModuleList([
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()),
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                              nn.Linear(2 * dim, dim)),
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim // 4), nn.GELU(),
                              nn.Linear(dim // 4, dim)),
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim // 2), nn.ReLU(),
                              nn.Linear(dim // 2, dim)),
            ])

        self.blocks = nn.ModuleList(ops() for _ in range(blocks))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, path: Sequence[int]) -> torch.Tensor:
        x = self.stem(x)
        for block, choice in zip(self.blocks, path):
            x = x + block[choice](x)
        return self.head(x)


def per_tensor(model: nn.Module) -> None:
    """The naive fix: one all_reduce per parameter, zeros where unused."""
    ws = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(ws)


def run_mode(mode: str, model: nn.Module, opt: torch.optim.Optimizer,
             batches: list[tuple[torch.Tensor, torch.Tensor]], paths: list[list[int]],
             start: int, steps: int) -> float:
    """Time ``steps`` training steps; returns seconds (all ranks done)."""
    sync: Optional[Callable[[], None]] = None
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    if mode == "gradsync":
        gs = hpc.GradSync(model)
        sync = gs.sync
    elif mode == "overlap":
        gs = hpc.GradSync(model)
        backward = gs.backward
    elif mode == "barrier":
        sync = dist.barrier
    elif mode == "pertensor":
        def sync() -> None:
            per_tensor(model)
    dist.barrier()
    t0 = time.perf_counter()
    for k in range(start, start + steps):
        x, y = batches[k % len(batches)]
        opt.zero_grad(set_to_none=True)
        backward(nn.functional.cross_entropy(model(x, paths[k]), y))
        if sync is not None:
            sync()
        opt.step()
    dist.barrier()
    return time.perf_counter() - t0


def bench(batch: int, args: argparse.Namespace, info: hpc.DistInfo) -> dict[str, float]:
    torch.manual_seed(0)
    base = Supernet(args.dim)
    nparams = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(1 + info.rank)
    batches = [(torch.randn(batch, args.dim, generator=gen),
                torch.randint(0, 10, (batch,), generator=gen)) for _ in range(8)]
    total = (args.warmup + args.steps * args.repeats) * 1
    paths = [[int(c) for c in torch.randint(0, 4, (len(base.blocks),), generator=gen)]
             for _ in range(total + args.warmup)]
    models: dict[str, nn.Module] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    for mode in args.modes:
        m = copy.deepcopy(base)
        runner = nn.parallel.DistributedDataParallel(m, find_unused_parameters=True) \
            if mode == "ddp" else m
        models[mode] = runner
        opts[mode] = torch.optim.SGD(m.parameters(), lr=1e-3)
    for mode in args.modes:  # warm up (allocations, DDP's first iteration)
        run_mode(mode, models[mode], opts[mode], batches, paths, 0, args.warmup)
    times: dict[str, list[float]] = {m: [] for m in args.modes}
    for r in range(args.repeats):
        for mode in args.modes:
            start = args.warmup + r * args.steps
            times[mode].append(run_mode(mode, models[mode], opts[mode], batches, paths,
                                        start, args.steps))
    rates = {m: args.steps / statistics.median(t) for m, t in times.items()}
    if info.rank == 0:
        print(f"\nbatch {batch}, {nparams / 1e6:.1f}M params, world size "
              f"{info.world_size}, {torch.get_num_threads()} thread(s)/rank, "
              f"{args.repeats}x{args.steps} steps, median")
        print(f"{'mode':<10} {'steps/s':>8} {'vs ddp':>7} {'vs nosync':>9}")
        for mode in args.modes:
            rel = f"{rates[mode] / rates['ddp']:.2f}" if "ddp" in rates else "-"
            ceil = f"{rates[mode] / rates['nosync']:.2f}" if "nosync" in rates else "-"
            print(f"{mode:<10} {rates[mode]:8.2f} {rel:>7} {ceil:>9}")
        sys.stdout.flush()
    return rates


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,16")
    ap.add_argument("--dim", type=int, default=448)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default="nosync,barrier,ddp,pertensor,gradsync,overlap")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank")
    args = ap.parse_args(argv)
    args.modes = args.modes.split(",")
    info = hpc.init_torch(backend="gloo")
    threads = args.threads or max(1, (os.cpu_count() or 1) // info.local_world_size)
    torch.set_num_threads(threads)
    for batch in (int(b) for b in args.batches.split(",")):
        bench(batch, args, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
