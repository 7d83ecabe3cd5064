"""Benchmark: wall time of a fixed-budget ``hpc search`` at 1, 2 and 4 ranks.

Runs ``hpc run --nproc N -- hpc search --run RUN --budget B`` for every N in
``--ranks`` on the same pretrain run, each rank with ``--threads`` torch threads
(default 1), and reports the search's own wall time (``wall_s`` in ``search.json``:
proposing, scoring, gathering and checkpointing, without process start-up) and the
whole command's, with the speed-up over the first world size. It then ASSERTS that
every world size evaluated the same sub-networks in the same order with the same
accuracies, losses and parameter counts, and chose the same best one; it exits 1 if
not. Without ``--run`` it first pretrains digits (``hpc pretrain`` defaults, 2 ranks)::

    flock /tmp/hpc-heavy.lock python bench/search_scaling.py --run runs/digits

Prints a Markdown table; ``--json FILE`` also writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

SAME = ("arch", "val_acc", "val_loss", "params")


def _hpc(nproc: int, args: Sequence[str], threads: int) -> float:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # hpc run keeps an existing value
    cmd = [sys.executable, "-m", "hpc", "run", "--nproc", str(nproc), "--", "hpc", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env,
                          check=False)
    if proc.returncode != 0:
        sys.exit(f"failed (rc {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def _key(found: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [tuple(str(r[k]) for k in SAME) for r in found["evaluated"]]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", help="pretrain run directory (default: pretrain one first)")
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", help="also write the raw numbers here")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="search-scaling-"))
    run = args.run or str(tmp / "pretrain")
    if not args.run:
        _hpc(2, ["pretrain", "--out", run, "--no-progress"], args.threads)
    rows, found = [], {}
    for n in args.ranks:
        out = tmp / f"search-{n}"
        total = _hpc(n, ["search", "--run", run, "--budget", str(args.budget),
                         "--out", str(out), "--no-progress"], args.threads)
        found[n] = json.loads((out / "search.json").read_text())
        rows.append({"ranks": n, "search_s": found[n]["wall_s"], "command_s": total,
                     "evaluations": found[n]["evaluations"]})
    base = rows[0]
    print(f"search of {base['evaluations']} sub-networks ({found[args.ranks[0]]['mode']}), "
          f"{args.threads} thread(s) per rank, {os.cpu_count()} CPUs\n")
    print("| ranks | search wall s | speed-up | whole command s | speed-up |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['search_s']:.2f} | {base['search_s'] / r['search_s']:.2f}x"
              f" | {r['command_s']:.2f} | {base['command_s'] / r['command_s']:.2f}x |")
    first = found[args.ranks[0]]
    best = {k: first["best"][k] for k in SAME}
    print(f"\nbest: {first['best']['arch_name']} val_acc {best['val_acc']:.4f} "
          f"params {best['params']}")
    same = all(_key(f) == _key(first) and {k: f["best"][k] for k in SAME} == best
               for f in found.values())
    print("identical results on all world sizes:", same)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "best": first["best"],
                                               "identical": same}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
