"""Benchmark: what the straggler detector and the replica hash check cost per step, at
their defaults, on vs off in one run.

One ``hpc run --nproc N`` job (gloo, CPU) trains an MLP (``hpc.sync_gradients``, Adam;
~10-50 ms a step on a small machine) through blocks of ``--steps`` steps, each with
one of three :class:`hpc.AgreedStop` objects, interleaved (the order rotates each
repetition) so drift and other jobs hit every setting alike:

* ``off``: ``HPC_STRAGGLER=0 HPC_SDC=off`` (the agreed stop's all_reduce every step);
* ``detector``: ``HPC_STRAGGLER=1`` (every 20 steps the rows ride in an all_gather
  instead of the all_reduce, then the verdicts), ``HPC_SDC=off``;
* ``both``: the defaults, the detector and the replica check every 100 steps
  (BLAKE2b of the parameters and the Adam state, one all_gather).

Each block's time is the slowest rank's; per setting the median of ``--reps`` blocks,
and the ratio to ``off``; also the part of it spent in ``stop(step)``. A block of 100
steps holds 5 straggler windows and one replica check. On a shared machine blocks vary
by a few percent, more than the overhead: the last two lines time the check itself
(``check_replicas``, per call and per step at ``HPC_SDC_EVERY=100``) and a window's
verdicts (``receive``, at ``HPC_STRAGGLER_EVERY=20``) on rank 0. The detector's stall meter (a thread that wakes every 5 ms) is started
once per process and then runs under every setting; its own cost is the ``off``
blocks timed before it started (``off, no meter``) against the interleaved ``off``
ones (not interleaved: a rough figure). The bad-node ledger is off (``HPC_LEDGER_TTL=0``)::

    flock /tmp/hpc-heavy.lock python bench/health_overhead.py   # --nproc 2 --steps 100 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

SETTINGS = {
    "off": {"HPC_STRAGGLER": "0", "HPC_SDC": "off"},
    "detector": {"HPC_STRAGGLER": "1", "HPC_SDC": "off"},
    "both": {"HPC_STRAGGLER": "1", "HPC_SDC": "stop"},
}


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100, help="steps per block")
    ap.add_argument("--reps", type=int, default=5, help="blocks per setting")
    ap.add_argument("--width", type=int, default=768, help="the MLP's hidden width")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    if args.worker:
        return _worker(args)
    cmd = [sys.executable, "-m", "hpc", "run", "--nproc", str(args.nproc), "--", "python",
           os.path.abspath(__file__), "--worker", "--steps", str(args.steps), "--reps",
           str(args.reps), "--width", str(args.width), "--batch", str(args.batch)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_STRAGGLER", "HPC_SDC"))}
    env["HPC_LEDGER_TTL"] = "0"  # a verdict of this bench is no strike against the host
    return subprocess.run(cmd, env=env, check=False).returncode


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn

    import hpc
    from hpc.health import divergence
    from hpc.health.step import StepHealth
    from hpc.preempt.guard import PreemptGuard

    info = hpc.init_torch(seed=0)
    torch.set_num_threads(1)
    w = args.width
    model = nn.Sequential(nn.Linear(512, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                          nn.Linear(w, 10))
    hpc.sync_model(model)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    g = torch.Generator().manual_seed(info.rank)
    x, y = torch.randn(args.batch, 512, generator=g), torch.randint(0, 10, (args.batch,),
                                                                     generator=g)
    guard = PreemptGuard().install()
    done = {name: 0 for name in SETTINGS}  # each setting's steps so far (its own count)

    spent: dict[str, list[float]] = {}  # "name.method": seconds of each call

    def timed(name: str, health: Any, method: str) -> None:
        inner, calls = getattr(health, method), spent.setdefault(f"{name}.{method}", [])

        def wrapper(*a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a)
            finally:
                calls.append(time.perf_counter() - t0)

        setattr(health, method, wrapper)

    def stop_for(name: str) -> Any:
        health = StepHealth(info.rank, info.world_size, model=model, optimizer=opt,
                            environ=SETTINGS[name], run_dir=None)
        timed(name, health, "check_replicas")  # the hash check (a digest, a gather)
        timed(name, health, "receive")  # a window's verdicts (the rows came in the stop)
        return hpc.AgreedStop(guard, health=health)

    def block(name: str, stop: Any) -> tuple[float, float]:
        """Seconds per step of one block, and of them in ``stop(step)`` (the slowest
        rank's of each)."""
        stop.health.skip()  # the blocks between this setting's are not its steps
        dist.barrier()
        clock = time.perf_counter
        t0, inside = clock(), 0.0
        for _ in range(args.steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            hpc.sync_gradients(model)
            opt.step()
            done[name] += 1
            t1 = clock()
            stop(done[name])
            inside += clock() - t1
        t = torch.tensor([clock() - t0, inside], dtype=torch.float64) / args.steps
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0]), float(t[1])

    # The warm-up and the off blocks before any stall meter runs.
    plain = stop_for("off")
    block("off", plain)
    no_meter = [block("off", plain) for _ in range(max(2, args.reps // 2))]
    stops = {name: stop_for(name) for name in SETTINGS}  # "detector" starts the meter
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in SETTINGS}
    names = list(SETTINGS)
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            times[name].append(block(name, stops[name]))
        if info.rank == 0:
            print(f"rep {rep + 1} (ms/step, in stop): " + "  ".join(
                f"{n} {1e3 * times[n][-1][0]:.2f}, {1e3 * times[n][-1][1]:.3f}"
                for n in names), flush=True)
    if info.rank == 0:
        _report(args, times, no_meter)
        named = divergence.named_state(model, opt)
        mb = sum(t.numel() * t.element_size() for _, t in named) / 2**20
        step = statistics.median(t for t, _ in times["off"])
        for key, every, what in (("both.check_replicas", 100, f"replica check ({len(named)} "
                                  f"tensors, {mb:.1f} MiB)"),
                                 ("detector.receive", 20, "straggler window (verdicts)")):
            per = statistics.median(spent[key]) if spent.get(key) else float("nan")
            print(f"{what}: {1e3 * per:.2f} ms a call (median of {len(spent.get(key, []))}), "
                  f"every {every} steps: {1e3 * per / every:.3f} ms a step, "
                  f"{100 * per / every / step:.2f} % of the step (rank 0)")
    return 0


def _report(args: argparse.Namespace, times: dict[str, list[tuple[float, float]]],
            no_meter: list[tuple[float, float]]) -> None:
    off = statistics.median(t for t, _ in times["off"])
    off_in = statistics.median(i for _, i in times["off"])
    print(f"\n{args.steps} steps a block, median of {args.reps} blocks per setting "
          "(slowest rank's ms per step; 'in stop': of it in stop(step), where the "
          "detector and the check run):")
    print(f"{'setting':<14} {'ms/step':>8} {'vs off':>8} {'in stop':>8} {'+ vs off':>9}"
          f" {'as % of step':>12}   blocks (ms/step)")
    for name, ts in [*times.items(), ("off, no meter", no_meter)]:
        med, med_in = statistics.median(t for t, _ in ts), statistics.median(i for _, i in ts)
        print(f"{name:<14} {1e3 * med:8.3f} {100 * (med / off - 1):+7.2f}% "
              f"{1e3 * med_in:8.3f} {1e3 * (med_in - off_in):+9.3f} "
              f"{100 * (med_in - off_in) / off:+11.2f}%   "
              + " ".join(f"{1e3 * t:.2f}" for t, _ in ts))
    print("('off, no meter': blocks before the stall meter started, not interleaved)")
    ratios = [b[0] / o[0] for b, o in zip(times["both"], times["off"])]
    print(f"per-repetition both/off: {' '.join(f'{r:.4f}' for r in ratios)}; median "
          f"{statistics.median(ratios):.4f}")

if __name__ == "__main__":
    sys.exit(main())
