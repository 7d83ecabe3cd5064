"""Start-up benchmark: how fast do ranks rendezvous once the last one is ready?

Runs ``hpc run --nproc N`` several times for each mode and reports medians of
  * rendezvous latency: from the moment the *last* rank is ready to call init
    (torch imported) until every rank has finished init;
  * total: from launch to every rank initialised.
Modes: ``hpc`` (``hpc.init_torch``: master store first, socket probe, pre-flight) and
``env`` (plain ``torch.distributed.init_process_group("gloo", "env://")``), same launcher.

    python bench/startup.py [--nproc 2 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(mode: str, out: str) -> None:
    import torch.distributed as dist

    ready = time.time()
    if mode == "hpc":
        import hpc

        hpc.init_torch()
    else:
        dist.init_process_group("gloo", init_method="env://")
    done = time.time()
    rows: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (ready, done))
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(rows, fh)
    dist.destroy_process_group()


def measure(nproc: int, mode: str) -> tuple[float, float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "hpc", "run", "--nproc", str(nproc), "--",
                        sys.executable, __file__, "--worker", mode, tmp.name],
                       check=True, timeout=120, stdout=subprocess.DEVNULL)
        rows = json.load(open(tmp.name))
    last_ready = max(r[0] for r in rows)
    all_done = max(r[1] for r in rows)
    return all_done - last_ready, all_done - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--worker", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    print(f"{'nproc':>5} {'mode':>5} {'rendezvous ms (median)':>23} {'max':>8} "
          f"{'launch->init s':>15}")
    for nproc in args.nproc:
        for mode in ("hpc", "env"):
            lat, tot = zip(*(measure(nproc, mode) for _ in range(args.repeats)))
            print(f"{nproc:>5} {mode:>5} {1000 * statistics.median(lat):>23.1f} "
                  f"{1000 * max(lat):>8.1f} {statistics.median(tot):>15.2f}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HPC_CONNECT_TIMEOUT", "60")
    sys.exit(main())
