"""Benchmark: ``hpc pretrain`` training throughput at 1, 2 and 4 ranks vs a plain loop.

Each rank keeps a per-rank batch of ``--batch-size`` (weak scaling: the global batch
grows with the ranks). For every world size the pretrain loop runs ``--repeats`` times
as ``hpc run --nproc N`` (gloo, no run directory, validation only at the end) and
reports its global training samples/s (time inside training steps only: sample,
forward, backward, ``sync_gradients``, optimizer, the per-step all_reduce). The baseline
is the same loop in one plain process without torch-hpc (``bench/plain_loop.py``).
Every process uses ``--threads`` torch threads (default 1). Medians over the repeats::

    flock /tmp/hpc-heavy.lock /work/venv/bin/python bench/pretrain_throughput.py

Prints a Markdown table; ``--json FILE`` also writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent


def worker(args: argparse.Namespace) -> int:
    """One rank of a measured run (launched by :func:`main` through ``hpc run``)."""
    import hpc
    from hpc.pretrain import PretrainConfig, pretrain

    cfg = PretrainConfig(epochs=args.epochs, batch_size=args.batch_size, width=args.width,
                         out=None, progress=False, val_every=0, val_archs=1,
                         recal_samples=0, setup_logging=False, overlap=args.overlap)
    result = pretrain(cfg)
    if hpc.is_master():
        print("THROUGHPUT " + json.dumps({"world": result.world_size, "steps": result.step,
                                          "samples_per_s": result.samples_per_s}),
              flush=True)
    return 0


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # hpc run keeps an existing value
    else:
        env.pop("OMP_NUM_THREADS", None)  # torch default; hpc run: cores / ranks
    return env


def launch(nproc: int, args: argparse.Namespace, overlap: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "hpc", "run", "--nproc", str(nproc), "--",
           str(HERE / "pretrain_throughput.py"), "--worker", "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--width", str(args.width)]
    if overlap:
        cmd.append("--overlap")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(args))
    for line in proc.stdout.splitlines():
        if "THROUGHPUT " in line:
            return json.loads(line.split("THROUGHPUT ", 1)[1])
    raise RuntimeError(f"rank 0 printed no THROUGHPUT line (rc {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def plain(args: argparse.Namespace, steps: int) -> float:
    cmd = [sys.executable, "-c",
           "import sys; sys.path.insert(0, sys.argv[1]); from plain_loop import plain_loop;"
           "print(plain_loop(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))",
           str(HERE), str(steps), str(args.batch_size), str(args.width)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(args),
                         check=True).stdout
    return float(out.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", default="1,2,4", help="world sizes (default 1,2,4)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per setting (median)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    ap.add_argument("--width", type=int, default=32, help="supernet width (default 32)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process, 0 = defaults (default 1: with 2 "
                    "threads a tiny model loses most of its speed to OpenMP spin-waits "
                    "as soon as anything else runs)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--overlap", action="store_true",
                    help="also time each world size with PretrainConfig(overlap=True) "
                    "(GradSync.backward), interleaved with the default")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    ranks = [int(r) for r in args.ranks.split(",")]
    rows: dict[str, list[float]] = {"plain": []}
    steps_1 = args.epochs * (1437 // args.batch_size)
    for _ in range(args.repeats):  # interleaved, so load changes hit every setting
        rows["plain"].append(plain(args, steps_1))
        for n in ranks:
            rows.setdefault(f"hpc x{n}", []).append(launch(n, args)["samples_per_s"])
            if args.overlap and n > 1:
                rows.setdefault(f"hpc x{n} overlap", []).append(
                    launch(n, args, overlap=True)["samples_per_s"])
    base = statistics.median(rows["plain"])
    print(f"pretrain throughput: digits, width {args.width}, batch {args.batch_size}/rank, "
          f"{args.epochs} epochs/run, median of {args.repeats}, {os.cpu_count()} CPU cores, "
          f"{args.threads or 'default'} thread(s)/process")
    print("| setting | samples/s (median) | runs | vs plain |")
    print("|---|---:|---|---:|")
    for name, values in rows.items():
        med = statistics.median(values)
        runs = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {name} | {med:.0f} | {runs} | {med / base:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
