"""NCCL hang check: the watchdog names a rank whose GPU is stuck before an all_reduce.

An NCCL collective returns once queued, so the watchdog asks the GPU (CUDA events,
:mod:`hpc.watchdog.device`) which collectives it reached and finished. This runs two
NCCL ranks (two GPUs, or two ranks on one GPU where NCCL >= 2.30 with
``NCCL_MULTI_RANK_GPU_ENABLE=1``) under ``hpc run`` with ``HPC_HANG_TIMEOUT=3``. After
a few in-step all_reduces rank 1's GPU sleeps in a kernel (``torch.cuda._sleep``,
about :data:`SLEEP` seconds) before the next all_reduce; both hosts queue it at once
and wait in ``torch.cuda.synchronize()``. Rank 0's GPU waits in the all_reduce, so
rank 0's watchdog must log the hang warning naming rank 1 ("never entered all_reduce
#5 ... its host queued up to #5, which its GPU has not reached"); then the sleep ends
and the job exits 0.

Exit status: 0 pass, 1 fail, 3 without CUDA (a GPU check that passes without a GPU
would prove nothing), 77 when the machine cannot hold two NCCL ranks (one GPU and
NCCL < 2.30).

    python bench/nccl_hang_check.py        # on a GPU node, from the repository root
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXIT_NO_CUDA, EXIT_SKIP = 3, 77
#: Seconds rank 1's GPU sleeps before the all_reduce (the warning comes after 3 s).
SLEEP = 12.0
#: The all_reduce rank 1's GPU does not reach: 3 in step, a barrier, then this one.
STUCK = 5


def verdict(out: str) -> str | None:
    """What is wrong with the run's output (None: the check passed)."""
    named = re.search(rf"rank 1 \(\S+, pid \d+\) never entered all_reduce #{STUCK}\b", out)
    if "possible hang" not in out:
        return "no hang warning: the watchdog did not see rank 0 waiting on its GPU"
    if not named:
        return f"the warning does not name rank 1 as never having entered all_reduce #{STUCK}"
    if "which its GPU has not reached" not in out:
        return "the warning does not say that rank 1's GPU is behind its host"
    if re.search(r"rank 0 \(\S+, pid \d+\) never entered", out):
        return "the warning blames rank 0, whose GPU only waited"
    if out.count("WORKER done") != 2:
        return "the ranks did not both finish after the sleep"
    return None


def _cycles_per_second(torch: object) -> float:
    """``torch.cuda._sleep`` spins for clock cycles: time a short one."""
    cuda = torch.cuda  # type: ignore[attr-defined]
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    cuda._sleep(1_000_000)  # warm up
    cuda.synchronize()
    start.record()
    cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / (start.elapsed_time(end) / 1000.0)


def worker() -> int:
    import torch
    import torch.distributed as dist

    import hpc

    info = hpc.init_torch(timeout=120)
    t = torch.ones(1024, device=hpc.device())
    for _ in range(STUCK - 2):
        dist.all_reduce(t)
    cycles = int(_cycles_per_second(torch) * SLEEP) if info.rank == 1 else 0
    torch.cuda.synchronize()
    dist.barrier()  # host and GPU of both ranks in step here
    torch.cuda.synchronize()
    if info.rank == 1:
        print(f"rank 1: GPU sleeps {SLEEP:.0f}s ({cycles} cycles) before all_reduce "
              f"#{STUCK}", flush=True)
        torch.cuda._sleep(cycles)
    dist.all_reduce(t)  # rank 1's GPU reaches it only after the sleep
    start = time.monotonic()
    torch.cuda.synchronize()
    print(f"WORKER done rank={info.rank} value={t[0].item():.0f} waited "
          f"{time.monotonic() - start:.1f}s", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker()
    import torch

    if not torch.cuda.is_available():
        print("nccl_hang_check: FAIL: no CUDA device (torch.cuda.is_available() is False; "
              f"torch {torch.__version__}, CUDA build {torch.version.cuda}).\n"
              "This check stalls one rank's GPU before an NCCL all_reduce; without a GPU "
              "it proves nothing (the CPU tests use a fake device: "
              "tests/unit/watchdog/test_device.py).\n"
              "HINT: run it on a GPU node (srun --gpus=2 python bench/nccl_hang_check.py).",
              file=sys.stderr)
        return EXIT_NO_CUDA
    env = dict(os.environ, HPC_HANG_TIMEOUT="3", PYTHONUNBUFFERED="1",
               HPC_CONNECT_TIMEOUT=os.environ.get("HPC_CONNECT_TIMEOUT", "60"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    if torch.cuda.device_count() >= 2:
        layout = "two GPUs"
    else:
        v = torch.cuda.nccl.version()
        v = v if isinstance(v, tuple) else (v // 10000, v // 100 % 100, 0)
        if tuple(v) < (2, 30, 0):
            print(f"nccl_hang_check: SKIP: one GPU and NCCL {'.'.join(map(str, v))} < 2.30 "
                  "cannot hold two NCCL ranks.\nHINT: run it with two GPUs visible.",
                  flush=True)
            return EXIT_SKIP
        layout = "two ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1)"
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    print(f"nccl_hang_check: {layout}, torch {torch.__version__}", flush=True)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hpc", "run", "--nproc", "2", "--", sys.executable,
         str(Path(__file__).resolve()), "--worker"], check=False, capture_output=True,
        text=True, timeout=SLEEP + 90, cwd=ROOT, env=env)
    out = proc.stdout + proc.stderr
    print(out[-6000:], flush=True)
    wrong = f"rc={proc.returncode}" if proc.returncode != 0 else verdict(out)
    elapsed = time.monotonic() - start
    if wrong:
        print(f"nccl_hang_check: FAIL ({elapsed:.0f}s): {wrong}", flush=True)
        return 1
    print(f"nccl_hang_check: PASS ({elapsed:.0f}s): rank 1, whose GPU slept before "
          f"all_reduce #{STUCK}, was named by rank 0's hang warning", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
