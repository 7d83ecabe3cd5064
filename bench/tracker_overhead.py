"""Benchmark: what the watchdog's collective tracking costs per collective.

Times, in one process, the same call untracked and wrapped by
:func:`hpc.watchdog.tracker.install` (what ``init_torch`` does unless
``HPC_WATCHDOG=0``): a no-op function (the wrapper's own cost), the same on a "CUDA"
tensor with fake device marks (the bookkeeping of :mod:`hpc.watchdog.device` without
the CUDA calls), a real gloo ``all_reduce`` of a 1-element tensor in a world of 1 (the
cheapest real collective), and, where CUDA is available, a real NCCL one with the CUDA
events (world of 1). Interleaved rounds, median per call::

    python bench/tracker_overhead.py            # --calls 20000 --rounds 7

The end-to-end figure (``HPC_WATCHDOG=0`` vs default on ``bench/gradsync_supernet.py``)
is in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

from hpc.watchdog import tracker


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def measure(name: str, module: Any, call: Callable[[Any], Any], calls: int,
            rounds: int, mark: Any = None) -> tuple[float, float]:
    """Median seconds per call of ``call(module)``, untracked and tracked (``mark``:
    the tracker's device marks, none by default)."""
    plain, tracked = [], []
    for _ in range(rounds):
        plain.append(_per_call(lambda: call(module), calls))
        tracker.install(tracker.Progress(), lambda *a: None, module, mark=mark)
        try:
            tracked.append(_per_call(lambda: call(module), calls))
        finally:
            tracker.uninstall(module)
    a, b = statistics.median(plain), statistics.median(tracked)
    print(f"{name:<22} {a * 1e6:9.2f} {b * 1e6:9.2f} {(b - a) * 1e6:+9.2f} {b / a:7.2f}x")
    return a, b


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    print(f"{'call':<22} {'plain us':>9} {'tracked':>9} {'+us':>9} {'ratio':>8}"
          f"   (median of {args.rounds} x {args.calls} calls)")
    fake = types.SimpleNamespace(all_reduce=lambda t, op=None, group=None, async_op=False: None,
                                 GroupMember=types.SimpleNamespace(WORLD=object()))
    measure("no-op all_reduce", fake, lambda m: m.all_reduce(1), args.calls, args.rounds)
    on_gpu = types.SimpleNamespace(is_cuda=True)
    measure("no-op, fake GPU marks", fake, lambda m: m.all_reduce(on_gpu), args.calls,
            args.rounds, mark=lambda t: lambda: True)

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(1)
        measure("gloo all_reduce, ws 1", dist, lambda m: m.all_reduce(t),
                max(1, args.calls // 10), args.rounds)
    finally:
        dist.destroy_process_group()
    if torch.cuda.is_available():
        from hpc.watchdog import device

        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda:0"))
        try:
            t = torch.ones(1, device="cuda:0")
            measure("nccl all_reduce, ws 1", dist, lambda m: m.all_reduce(t),
                    max(1, args.calls // 10), args.rounds, mark=device.cuda_marker())
            torch.cuda.synchronize()
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
