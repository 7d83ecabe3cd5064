"""How long from a collective timeout to the stuck-rank report and to the job's end?

Runs ``tests/integration/scripts/hang.py`` (rank ``--rank`` stops making progress at
step 20; the others all_reduce with ``--timeout`` seconds of collective timeout) under
each launcher available here and timestamps every output line. The timeout fires
``--timeout`` seconds after the rank froze (the others enter the next all_reduce at
once), so ``report`` and ``end`` are given relative to that moment.

    python bench/hang_timing.py [--timeout 10] [--mode sleep|stop|exit] [--launchers ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HANG = str(ROOT / "tests" / "integration" / "scripts" / "hang.py")


def commands(nranks: int) -> dict[str, list[str]]:
    py = sys.executable
    torchrun = shutil.which("torchrun", path=str(Path(py).parent)) or "torchrun"
    return {
        "hpc run": [py, "-m", "hpc", "run", "--nproc", str(nranks), "--", HANG],
        "torchrun": [torchrun, "--nproc-per-node", str(nranks), HANG],
        "mpirun": ["mpirun.openmpi", "-np", str(nranks), py, HANG],
        "srun": ["srun", "--time=3", "-N2", f"--ntasks-per-node={nranks // 2}", py, HANG],
    }


def measure(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, object]:
    """Run ``argv``; times of the freeze line, the first report line, and the end."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: dict[str, float] = {}
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.monotonic()
            lines.append(line)
            if "hangs at step" in line:
                seen.setdefault("froze", now)
            if "never entered" in line and "has made no progress" in line:
                seen.setdefault("warning", now)
            elif "never entered it" in line:
                seen.setdefault("report", now)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    end = time.monotonic()
    reader.join(5)
    froze = seen.get("froze", start)
    fires = froze + timeout
    culprit = next((line.strip() for line in lines if "never entered all_reduce" in line
                    and ("it is at" in line or "did not answer" in line)), "")
    return {"code": code, "report": seen.get("report", float("nan")) - fires,
            "warning": seen.get("warning", float("nan")) - froze,
            "end": end - fires, "culprit": culprit[-110:], "lines": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--mode", default="sleep", choices=["sleep", "stop", "exit"])
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--nranks", type=int, default=4)
    parser.add_argument("--launchers", nargs="*", default=None)
    parser.add_argument("--show", action="store_true", help="print every output line")
    args = parser.parse_args()
    env = dict(os.environ, HANG_MODE=args.mode, HANG_RANK=str(args.rank), HANG_STEP="20",
               PG_TIMEOUT=str(args.timeout), PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    env.setdefault("HPC_HANG_TIMEOUT", str(args.timeout / 2))
    print(f"mode={args.mode} rank={args.rank} of {args.nranks}, collective timeout "
          f"{args.timeout:g}s; times in seconds after the timeout fired")
    print("warning: after the freeze; report, end: after the timeout fired")
    print(f"{'launcher':10} {'exit':>5} {'warning':>7} {'report':>7} {'end':>6}  culprit line")
    for name, argv in commands(args.nranks).items():
        if args.launchers and name.replace(" ", "-") not in args.launchers:
            continue
        if shutil.which(argv[0]) is None and not os.path.exists(argv[0]):
            print(f"{name:10} (not installed)")
            continue
        r = measure(argv, env, args.timeout)
        print(f"{name:10} {r['code']:>5} {r['warning']:>7.1f} {r['report']:>7.1f} "
              f"{r['end']:>6.1f}  {r['culprit']}")
        if args.show:
            print("".join(r["lines"]))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
