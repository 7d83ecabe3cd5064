"""Start-up benchmark: how fast do ranks rendezvous once the last one is ready?

Runs ``hpc run --nproc N`` several times for each mode and reports medians of
  * rendezvous latency: from the moment the *last* rank is ready to call init
    (torch imported) until every rank has finished init;
  * total: from launch to every rank initialised.
Modes: ``hpc`` (``hpc.init_torch``: master store first, socket probe, pre-flight) and
``env`` (plain ``torch.distributed.init_process_group("gloo", "env://")``), same launcher.
The modes alternate launch by launch, so both see the same load on the machine.

For ``hpc`` it then prints the time of each phase of ``init_torch`` as the code
records it (:mod:`hpc.bootstrap.phases`), medians over the launches, for the rank that
was ready last (its phases are the critical path) and for rank 0 (whose
``preflight.wait`` is mostly waiting for the others to arrive), with ``import hpc``
and the imports ``init_torch`` makes outside a phase (both in the measured window).
Without compiled bytecode (a source checkout under ``PYTHONDONTWRITEBYTECODE=1``)
those imports compile every module at each launch, while torch, installed, has its
bytecode; ``--bytecode`` compiles hpc's first (``compileall``, what ``pip install``
does), so that a launch measures the rendezvous rather than the compiler.

    python bench/startup.py [--nproc 2 4] [--repeats 5] [--bytecode]
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def worker(mode: str, out: str) -> None:
    import torch.distributed as dist

    ready = time.time()
    if mode == "hpc":
        import hpc
        from hpc.bootstrap import phases

        imported = time.time()
        hpc.init_torch()
        done = time.time()
        # what the bench window holds besides init_torch's phases: importing hpc, and
        # the modules init_torch imports on first use outside a phase
        spent = {"import hpc": imported - ready, **phases.times()}
        spent["imports in init_torch"] = done - imported - sum(phases.times().values())
    else:
        dist.init_process_group("gloo", init_method="env://")
        done = time.time()
        spent = {}
    rows: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (ready, done, spent))
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(rows, fh)
    dist.destroy_process_group()


def measure(nproc: int, mode: str) -> tuple[float, float, dict[str, float], dict[str, float]]:
    """(rendezvous s, total s, phases of the last-ready rank, phases of rank 0)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "hpc", "run", "--nproc", str(nproc), "--",
                        sys.executable, __file__, "--worker", mode, tmp.name],
                       check=True, timeout=120, stdout=subprocess.DEVNULL)
        with open(tmp.name) as fh:
            rows = json.load(fh)
    last = max(range(len(rows)), key=lambda r: rows[r][0])
    all_done = max(r[1] for r in rows)
    return all_done - rows[last][0], all_done - t0, rows[last][2], rows[0][2]


def _phase_table(last: list[dict[str, float]], rank0: list[dict[str, float]]) -> None:
    names: list[str] = []
    for spent in (*last, *rank0):
        names += [n for n in spent if n not in names]

    def med(runs: list[dict[str, float]], name: str) -> str:
        return f"{1000 * statistics.median(r.get(name, 0.0) for r in runs):.2f}"

    print(f"      {'phase':<22} {'last rank ms':>12} {'rank 0 ms':>10}")
    for name in names:
        print(f"      {name:<22} {med(last, name):>12} {med(rank0, name):>10}")
    total = [{"sum": sum(r.values())} for r in last], [{"sum": sum(r.values())} for r in rank0]
    print(f"      {'(sum)':<22} {med(total[0], 'sum'):>12} {med(total[1], 'sum'):>10}",
          flush=True)


def _bytecode(compile_it: bool) -> str:
    """Compile hpc's bytecode when asked; say whether a launch finds it."""
    import hpc

    package = os.path.dirname(hpc.__file__)
    if compile_it:
        compileall.compile_dir(package, quiet=1)
    cached = importlib.util.cache_from_source(os.path.join(package, "__init__.py"))
    if os.path.exists(cached):
        return f"compiled ({os.path.dirname(cached)})"
    return ("none: every launch compiles hpc's modules"
            + (" (PYTHONDONTWRITEBYTECODE=1)" if sys.dont_write_bytecode else ""))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bytecode", action="store_true",
                   help="compile hpc's bytecode before measuring (as pip install does)")
    p.add_argument("--worker", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    print(f"hpc bytecode: {_bytecode(args.bytecode)}", flush=True)
    print(f"{'nproc':>5} {'mode':>5} {'rendezvous ms (median)':>23} {'max':>8} "
          f"{'launch->init s':>15}", flush=True)
    for nproc in args.nproc:
        runs: dict[str, list[Any]] = {"hpc": [], "env": []}
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(measure(nproc, mode))
        for mode, rows in runs.items():
            lat, tot, last, rank0 = zip(*rows)
            print(f"{nproc:>5} {mode:>5} {1000 * statistics.median(lat):>23.1f} "
                  f"{1000 * max(lat):>8.1f} {statistics.median(tot):>15.2f}", flush=True)
            if mode == "hpc":
                _phase_table(list(last), list(rank0))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HPC_CONNECT_TIMEOUT", "60")
    sys.exit(main())
