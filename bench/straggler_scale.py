"""Benchmark: the straggler verdict's cost per window at thousands of simulated ranks.

Every rank of a job judges each window (every ``HPC_STRAGGLER_EVERY`` = 20 steps) from
the same gathered table (:func:`hpc.health.straggler.judge`, pure), so its cost is paid
once per window on every rank. This times ``judge`` on tables of N ranks, 8 per host,
healthy (a few percent of noise) and with one slow host, after the baseline windows (so
every rule runs), for N = 4 (the local case), 1,024, 4,096 and 8,192; and, in the same
run, the per-rank reference of the O(N^2) rule it replaced (the median of the other
hosts' ranks computed for each rank: ``--quadratic-up-to`` ranks, default 2,048; 59 s a
window at 8,192 before) against today's :func:`~hpc.health.straggler.references`::

    python bench/straggler_scale.py            # --repeats 5

Prints the median of ``--repeats`` calls per size, ms per window, and the speed-up over
the quadratic rule where both ran. No process group, no torch: the verdict alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpc.health.straggler import Baselines, Rules, judge, references  # noqa: E402


def table(n: int, rng: random.Random, slow_host: int | None) -> list[list[float]]:
    """One window's rows (compute, wait, wall, steps) of ``n`` ranks, 8 per host."""
    rows = []
    for r in range(n):
        compute = 0.100 * rng.uniform(0.97, 1.03) * (1.8 if r // 8 == slow_host else 1.0)
        wait = 0.030 * rng.uniform(0.9, 1.1)
        rows.append([compute, wait, compute + wait, 20.0])
    return rows


def quadratic(compute: dict[int, float], hosts: list[str]) -> dict[int, float]:
    """The rule as it was: for each rank, the median of the other hosts' ranks (of the
    other ranks on one host)."""
    out = {}
    for r in compute:
        others = [c for q, c in compute.items() if q != r and hosts[q] != hosts[r]]
        others = others or [c for q, c in compute.items() if q != r]  # one host
        out[r] = statistics.median(others) if others else compute[r]
    return out


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 1024, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quadratic-up-to", type=int, default=2048)
    args = parser.parse_args()
    rng = random.Random(0)
    rules = Rules()
    print(f"{'ranks':>6} {'judge healthy':>14} {'judge slow host':>16} {'references':>11} "
          f"{'quadratic':>10} {'speed-up':>9}")
    for n in args.sizes:
        hosts = [f"node{r // 8}" for r in range(n)]
        baselines = Baselines()
        for _ in range(rules.baseline):
            baselines.add(table(n, rng, None), rules.baseline)
        healthy, slow = table(n, rng, None), table(n, rng, 1 if n > 8 else None)
        t_ok = timed(lambda: judge(healthy, baselines, rules, hosts, set()), args.repeats)
        t_slow = timed(lambda: judge(slow, baselines, rules, hosts, {8, 9}), args.repeats)
        compute = {r: row[0] for r, row in enumerate(slow)}
        t_ref = timed(lambda: references(compute, hosts), args.repeats)
        if n <= args.quadratic_up_to:
            assert quadratic(compute, hosts) == references(compute, hosts)
            t_quad = timed(lambda: quadratic(compute, hosts), max(1, args.repeats // 2))
            quad, ratio = f"{1e3 * t_quad:8.1f}ms", f"{t_quad / t_ref:8.0f}x"
        else:
            quad, ratio = f"{'-':>10}", f"{'-':>9}"
        print(f"{n:6d} {1e3 * t_ok:12.2f}ms {1e3 * t_slow:14.2f}ms {1e3 * t_ref:9.2f}ms "
              f"{quad} {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
