"""bench/device_check.sh and bench/nccl_check.py on a machine without a GPU.

The GPU check must fail (not pass, not skip) without CUDA; nccl_check's own logic is
tested here by its ``--cpu-dry-run`` (the same checks on a one-rank gloo group).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

torch = pytest.importorskip("torch")

no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                             reason="a GPU is visible: bench/device_check.sh runs for real")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=sys.executable)


def test_device_check_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "device_check.sh")], check=True,
                   timeout=30)


@no_cuda
def test_device_check_fails_without_cuda(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device_check.sh")],
                          check=False, capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env=dict(_env(), OUT=str(tmp_path)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "device_check: FAIL: no CUDA device" in out and "HINT" in out, out
    assert "nccl_check" not in out.split("CUDA available?")[1], out  # stopped at once
    assert "device_check: FAIL" in (tmp_path / "device_check.log").read_text()


@no_cuda
def test_nccl_check_fails_without_cuda() -> None:
    proc = subprocess.run([sys.executable, "bench/nccl_check.py"], capture_output=True,
                          text=True, timeout=120, check=False, cwd=ROOT, env=_env())
    assert proc.returncode == 3, proc
    assert "nccl_check: FAIL: no CUDA device" in proc.stderr and "HINT" in proc.stderr


def test_nccl_check_dry_run_passes_on_gloo() -> None:
    """The script's checks themselves, on gloo and the CPU (the CUDA-only ones left out)."""
    proc = subprocess.run([sys.executable, "bench/nccl_check.py", "--cpu-dry-run"],
                          check=False, capture_output=True, text=True, timeout=120, cwd=ROOT, env=_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count(": PASS ") == 6 and "FAIL" not in out, out
