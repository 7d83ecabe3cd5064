"""Benchmark: how long a checkpoint blocks training, synchronous, asynchronous and sharded, in one run.

One ``hpc run --nproc N`` job (gloo, CPU) holds a replicated state of ``--mib`` MiB (an
MLP's weights and Adam's two moments: a third each) and trains it through blocks of
``--steps`` steps, saving every ``--every`` steps with ``hpc.save_checkpoint``:
synchronously (``sync``), with ``blocking=False`` (``async``) or with ``sharded=True``
(``sharded``: every rank writes its share, synchronously); the modes alternate block by
block (the order reverses each repetition) so drift and other jobs hit both alike. A step is the
optimizer's update of the whole state plus one small all_reduce (no gradient sync: the
ranks apply the same update, as after one, and the wire would dominate the figures).

Per mode, the median over ``--reps`` blocks of:

* ``blocked``: seconds ``save_checkpoint`` kept rank 0 from training (for ``async``: the
  copy into shared memory);
* ``waited``: seconds ``hpc.wait_for_checkpoint()``, called just before each save, waited
  for the previous one (``async`` only: when saves come faster than the writer writes,
  each waits for the last; 0 when the writer keeps up);
* ``step``: the median step time of the steps *between* saves (for ``async`` the writer
  is writing during them: on a machine with few cores it takes CPU from the ranks);
* ``written``: the bytes rank 0 wrote per save (``sharded``: its shards, ``.metadata``
  and ``hpc-meta.pt``; the issue's goal: <= 1/N of the state plus metadata).

Then the ratio async/sync of ``blocked`` (the issue's goal: <= 10 %) and of ``step``::

    flock /tmp/hpc-heavy.lock python bench/checkpoint.py --every 6   # --nproc 4 --mib 512 --reps 5
    flock /tmp/hpc-heavy.lock python bench/checkpoint.py --every 6 --srun '-p four -N4 --ntasks-per-node=1'
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

MODES = ("sync", "async", "sharded")


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--mib", type=float, default=512, help="the state: weights + Adam")
    ap.add_argument("--steps", type=int, default=12, help="steps per block")
    ap.add_argument("--every", type=int, default=4, help="save every N steps")
    ap.add_argument("--reps", type=int, default=5, help="blocks per mode")
    ap.add_argument("--dir", default="/var/tmp/hpc-bench-checkpoint",
                    help="where the checkpoints go (a disk, not a tmpfs)")
    ap.add_argument("--srun", metavar="ARGS", default=None,
                    help="launch with srun ARGS instead of hpc run, e.g. the test cluster's "
                    "'-p four -N4 --ntasks-per-node=1' (--dir must be shared)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    if args.worker:
        return _worker(args)
    here = Path(__file__).resolve()
    launch = ([sys.executable, "-m", "hpc", "run", "--nproc", str(args.nproc), "--"]
              if args.srun is None else ["srun", *args.srun.split()])
    cmd = [*launch, sys.executable, str(here), "--worker", "--mib", str(args.mib),
           "--steps", str(args.steps), "--every", str(args.every), "--reps", str(args.reps),
           "--dir", args.dir]
    env = {**os.environ, "HPC_ALLOW_CPU": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, env=env, cwd=here.parents[1]).returncode


def _worker(args: argparse.Namespace) -> int:
    import torch
    from torch import nn

    import hpc

    info = hpc.init_torch(seed=0)
    width = int((args.mib * 2**20 / 4 / 3 / 2) ** 0.5)
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # Adam's moments exist: the state is its full size from the first save
    tick = torch.zeros(1)
    results: dict[str, list[tuple[float, float, int, float]]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            results[mode].append(_block(args, info.rank, mode, model, opt, tick))
    if info.rank == 0:
        _report(args, info.world_size, results)
    return 0


def _block(args: argparse.Namespace, rank: int, mode: str, model: "object", opt: "object",
           tick: "object") -> tuple[float, float, int, float]:
    """One block: (median blocked s per save, median step s between saves, bytes/save)."""
    import torch.distributed as dist

    import hpc

    directory = Path(args.dir) / mode
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    hpc.barrier()
    blocked, waited, steps, written = [], [], [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        opt.step()  # type: ignore[attr-defined]
        dist.all_reduce(tick)  # type: ignore[arg-type]
        if step % args.every:
            steps.append(time.perf_counter() - t0)
            continue
        t1 = time.perf_counter()
        hpc.wait_for_checkpoint()  # the previous save, if the writer is still at it
        t2 = time.perf_counter()
        path = hpc.save_checkpoint(directory, step, model=model, optimizer=opt, keep=2,
                                   blocking=mode != "async", sharded=mode == "sharded")
        blocked.append(time.perf_counter() - t2)
        waited.append(t2 - t1)
        if mode == "sync":
            written.append(path.stat().st_size if rank == 0 else 0)
        elif mode == "sharded" and rank == 0:
            written.append(_rank0_bytes(path))
    hpc.wait_for_checkpoint()
    if mode == "async" and rank == 0:
        written = [p.stat().st_size for p in directory.glob("ckpt-*.pt")]
    hpc.barrier()
    return (statistics.median(blocked), statistics.median(steps), int(max(written or [0])),
            statistics.median(waited))


def _rank0_bytes(path: Path) -> int:
    """The bytes rank 0 wrote into a sharded checkpoint (its manifest says whose)."""
    import json

    files = json.loads((path / "hpc-manifest.json").read_text())["files"]
    return sum(f["size"] for f in files.values() if f["rank"] == 0)


def _report(args: argparse.Namespace, world: int,
            results: dict[str, list[tuple[float, float, int, float]]]) -> None:
    med = {m: [statistics.median(x[i] for x in results[m]) for i in range(4)] for m in MODES}
    print(f"\ncheckpoint of {args.mib:.0f} MiB (weights + Adam), {world} ranks, a save every "
          f"{args.every} steps, {args.reps} blocks of {args.steps} steps per mode (medians)")
    print(f"{'mode':<6} {'blocked per save':>17} {'waited for the last':>20} "
          f"{'step between saves':>19} {'rank 0 wrote':>13}")
    for mode in MODES:
        blocked, step, written, waited = med[mode]
        print(f"{mode:<6} {blocked:>15.3f} s {waited:>18.3f} s {step * 1e3:>16.1f} ms "
              f"{written / 2**20:>9.0f} MiB")
    for mode in MODES[1:]:
        print(f"{mode} / sync: blocked {med[mode][0] / med['sync'][0]:.3f}x, step "
              f"{med[mode][1] / med['sync'][1]:.2f}x, rank 0 wrote "
              f"{med[mode][2] / med['sync'][2]:.3f}x")
    print("per block (blocked s, step ms): " + "; ".join(
        f"{m} " + ", ".join(f"{b:.3f}/{s * 1e3:.0f}" for b, s, _, _ in results[m])
        for m in MODES))


if __name__ == "__main__":
    sys.exit(main())
