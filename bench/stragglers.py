"""The straggler detector on the 4-node test cluster: false verdicts, noise floor, latency.

Runs ``hpc pretrain`` on ``srun -p four -N4 --ntasks-per-node=2`` (8 ranks, 11 steps an
epoch) ``--runs`` times healthy, ``--runs`` times with node3's link shaped (tc tbf, ``TBF``: 20
Mbit/s) and ``--runs`` times with rank 5 (node3) frozen 30 % of the time (SIGSTOP 60 ms /
SIGCONT 140 ms), the faults starting once step 60 is done. Prints, per run, the verdicts
and, for the faults, the steps and seconds from the fault to the first verdict naming
node3; then the tally and medians. For the healthy runs also the noise floor: over every
window, the highest compute ratio to the rank's reference (the median of the other
hosts' ranks) and the highest excess as a share of the step, next to the rule's
thresholds (1.3x, 2 ms and a 15 % share, two windows in a row).

    flock /tmp/hpc-heavy.lock python bench/stragglers.py --runs 5

Needs root (tc, signals to the ranks) and ``bin/hpc-testcluster up``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers: the driver

from tests.helpers.health import (  # noqa: E402
    TBF,
    WINDOW,
    duty_cycle,
    pretrain_on_four,
    rank_pid,
    tc_node3,
)

AT = 60
ROWS = re.compile(r"steps\): (.*)$")


def env() -> dict[str, str]:
    e = dict(os.environ)
    # HPC_LEDGER_TTL=0: the bench's faults are not the nodes' (no strikes in your ledger)
    e.update(HPC_ALLOW_CPU="1", PYTHONUNBUFFERED="1", HPC_CONNECT_TIMEOUT="60",
             HPC_LEDGER_TTL="0")
    e["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), e.get("PATH", "")])
    return e


def noise(lines: list[str]) -> tuple[float, float, float]:
    """Over the healthy windows (all but the first): (highest compute / reference, highest
    excess / median step, highest share a rank held two windows in a row), hosts = rank
    // 2."""
    worst_ratio = worst_share = worst_twice = 0.0
    before: list[float] = []
    for line in lines:
        m, rows = WINDOW.search(line), ROWS.search(line)
        if not (m and rows) or int(m[1]) < 20:
            continue
        table = [[float(x) for x in r.split()] for r in rows[1].split(";")]
        step = statistics.median(r[2] for r in table)
        shares = []
        for i, r in enumerate(table):
            ref = statistics.median(q[0] for j, q in enumerate(table) if j // 2 != i // 2)
            worst_ratio = max(worst_ratio, r[0] / ref)
            shares.append((r[0] - ref) / step)
        worst_share = max(worst_share, *shares)
        if before:
            worst_twice = max(worst_twice, *(min(a, b) for a, b in zip(before, shares)))
        before = shares
    return worst_ratio, worst_share, worst_twice


def one(kind: str, i: int, tmp: Path) -> dict:
    out = tmp / f"{kind}-{i}"
    job = f"hpc-bench-stragglers-{kind}"
    if kind == "healthy":
        run = pretrain_on_four(out, job, env(), epochs=12)
    elif kind == "link":
        tc_node3("del")
        try:
            run = pretrain_on_four(out, job, env(), epochs=12, at=AT,
                                   trigger=lambda: tc_node3("add", *TBF))
        finally:
            tc_node3("del")
    else:
        with duty_cycle(lambda: rank_pid(str(out), 5)) as start:
            run = pretrain_on_four(out, job, env(), epochs=12, at=AT, trigger=start)
    named = [v for v in run.verdicts if "node3" in v.hosts]
    wrong = [v for v in run.verdicts if v.hosts != ["node3"] or (kind != "healthy"
                                                                and v.end <= AT)]
    result = {"kind": kind, "rc": run.returncode, "verdicts": len(run.verdicts),
              "wrong": len(wrong) if kind != "healthy" else len(run.verdicts)}
    if kind != "healthy" and named and run.triggered_at is not None:
        result["steps"] = named[0].end - AT
        result["seconds"] = named[0].at - run.triggered_at
    if kind == "healthy":
        result["ratio"], result["share"], result["twice"] = noise(run.lines)
    print(f"{kind:8s} run {i}: rc {run.returncode}, {len(run.verdicts)} verdicts"
          + "".join(f"\n    {' '.join(v.hosts)} ({v.ranks}){v.what}steps {v.start}-{v.end}"
                    for v in run.verdicts)
          + (f"\n    first naming node3: {result['steps']} steps, {result['seconds']:.1f} s "
             "after the fault" if "steps" in result else "")
          + (f"\n    noise floor: ratio {result['ratio']:.2f}x, share {100 * result['share']:.0f} "
             f"%, two windows in a row {100 * result['twice']:.0f} %"
             if "ratio" in result else ""), flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--kinds", default="healthy,link,frozen")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    results = []
    with tempfile.TemporaryDirectory(prefix="hpc-stragglers-") as tmp:
        for i in range(args.runs):
            for kind in kinds:
                results.append(one(kind, i, Path(tmp)))
    print("\nsummary")
    for kind in kinds:
        rs = [r for r in results if r["kind"] == kind]
        line = f"  {kind:8s} {len(rs)} runs: {sum(r['rc'] == 0 for r in rs)} completed, " \
               f"{sum(r['wrong'] for r in rs)} false or misplaced verdicts"
        found = [r for r in rs if "steps" in r]
        if kind != "healthy":
            line += f", node3 named in {len(found)}/{len(rs)}"
            if found:
                line += (f", median {statistics.median(r['steps'] for r in found):g} steps / "
                         f"{statistics.median(r['seconds'] for r in found):.1f} s after the fault")
        else:
            line += (f"; noise floor: highest ratio {max(r['ratio'] for r in rs):.2f}x "
                     f"(rule 1.3x), highest share {100 * max(r['share'] for r in rs):.0f} % "
                     f"in one window, {100 * max(r['twice'] for r in rs):.0f} % two windows "
                     "in a row (rule 15 %, two in a row)")
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
