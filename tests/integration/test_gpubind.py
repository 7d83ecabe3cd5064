"""The one-GPU-per-nccl-rank check across real processes, with made-up GPU identities.

The real GPU path (two ranks on one H200) is in ``test_cuda.py``; this runs everywhere.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers.paths import script
from tests.helpers.processes import hpc_run


@pytest.mark.timeout(90)
def test_two_ranks_on_one_gpu_fail_fast_on_every_rank() -> None:
    t0 = time.monotonic()
    proc = hpc_run(2, [script("gpu_claims.py"), "--same"], timeout=60)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "RESULT ok" not in out
    assert "RESULT raised LaunchEnvironmentError rank=0" in out, out
    assert "RESULT raised LaunchEnvironmentError rank=1" in out, out
    assert ("ranks 0 and 1 would share one GPU under nccl: Fake GPU 80GB "
            "(GPU-0f0e0d0c-fake)") in out, out
    assert "rank 1: rank 0 aborted start-up: ranks 0 and 1 would share" in out, out
    assert "HINT: start one task per GPU" in out and "backend='gloo'" in out, out
    assert elapsed < 30, f"took {elapsed:.0f}s: the refusal should be immediate"


@pytest.mark.timeout(90)
def test_one_gpu_per_rank_passes() -> None:
    proc = hpc_run(3, [script("gpu_claims.py"), "--distinct"], timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert sorted(line.split("RESULT ok ")[1] for line in proc.stdout.splitlines()
                  if "RESULT ok" in line) == ["rank=0", "rank=1", "rank=2"], out
