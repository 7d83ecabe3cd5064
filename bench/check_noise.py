"""How often does ``hpc check`` cry wolf on a busy machine, and does it still see a bad link?

Runs the 4-node check on the test cluster (``srun -p four -N4 --ntasks-per-node=1``)
``--runs`` times healthy and ``--runs`` times with node3's link throttled (``tc tbf`` 50
Mbit/s inside its namespace), alternating, while ``--load`` busy processes (outside the
cluster, like another job on the same cores) keep the CPUs loaded. Prints each verdict
and the tally; for the healthy runs also the noise floor: the lowest ratio of a pair's
busbw to the reference and the highest latency over the latency reference seen.

    flock /tmp/hpc-heavy.lock python bench/check_noise.py --runs 20 --load 2

Needs root (``tc`` in the node namespace) and ``bin/hpc-testcluster up``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TBF = ["tbf", "rate", "50mbit", "burst", "64kb", "latency", "50ms"]


def tc(*args: str) -> None:
    subprocess.run(["ip", "netns", "exec", "hpc-node3", "tc", "qdisc", *args, "dev", "eth0",
                    "root", *([] if args[0] == "del" else TBF)], check=False,
                   capture_output=True, timeout=20)


def check(out: Path, extra: list[str]) -> tuple[str, dict | None, float]:
    start = time.monotonic()
    proc = subprocess.run(["srun", "-p", "four", "-N4", "--ntasks-per-node=1", "--time=3",
                           "-J", "hpc-check-noise", sys.executable, "-m", "hpc", "check",
                           "--out", str(out), *extra], capture_output=True, text=True,
                          timeout=300, check=False)
    wall = time.monotonic() - start
    lines = [x for x in proc.stdout.splitlines() if "VERDICT:" in x]
    line = lines[0].split("VERDICT:", 1)[1].strip() if lines else f"no verdict: {proc.stderr[-300:]}"
    data = json.loads((out / "hpc-check.json").read_text()) if (out / "hpc-check.json").exists() \
        else None
    return line, data, wall


def ratios(data: dict) -> tuple[float, float]:
    """(lowest busbw / median best-pair busbw, highest latency / median best-pair latency)."""
    units = data["units"]
    pairs = data["pairs"]
    best_bw = [max(p["busbw"] for p in pairs if u in (p["a"], p["b"])) for u in units]
    best_lat = [min(p["latency"] for p in pairs if u in (p["a"], p["b"])) for u in units]
    ref_bw, ref_lat = statistics.median(best_bw), statistics.median(best_lat)
    return (min(p["busbw"] for p in pairs) / ref_bw, max(p["latency"] for p in pairs) / ref_lat)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--load", type=int, default=2, help="busy processes beside the check")
    ap.add_argument("--healthy-only", action="store_true")
    ap.add_argument("extra", nargs="*", help="more `hpc check` options (after --)")
    args = ap.parse_args()
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.load)]
    tally: dict[str, list[str]] = {"healthy": [], "throttled": []}
    floor_bw, worst_lat, walls = [], [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.runs):
                for kind in ("healthy",) if args.healthy_only else ("healthy", "throttled"):
                    out = Path(tmp, f"{kind}-{i}")
                    tc("del")
                    if kind == "throttled":
                        tc("add")
                    try:
                        line, data, wall = check(out, args.extra)
                    finally:
                        tc("del")
                    walls.append(wall)
                    tally[kind].append(line)
                    if kind == "healthy" and data:
                        bw, lat = ratios(data)
                        floor_bw.append(bw)
                        worst_lat.append(lat)
                    print(f"{kind:9} run {i + 1:2}: {wall:5.1f} s  {line[:150]}", flush=True)
    finally:
        for p in spin:
            p.kill()
    ok = sum(x.startswith("OK") for x in tally["healthy"])
    named = sum(x.startswith("FLAGGED node3: slow node node3") for x in tally["throttled"])
    print(f"\nload: {args.load} busy processes; runs: {args.runs} each; median wall "
          f"{statistics.median(walls):.1f} s")
    print(f"healthy:   {ok}/{len(tally['healthy'])} OK "
          f"({len(tally['healthy']) - ok} flagged)")
    if floor_bw:
        print(f"           noise floor: lowest pair busbw {min(floor_bw):.2f}x the reference "
              f"(median of runs {statistics.median(floor_bw):.2f}x); highest pair latency "
              f"{max(worst_lat):.1f}x the reference (median {statistics.median(worst_lat):.1f}x)")
    if not args.healthy_only:
        print(f"throttled: {named}/{len(tally['throttled'])} named node3 alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
