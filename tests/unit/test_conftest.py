"""The test-suite's own guards (tests/conftest.py), run on throwaway test files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import ROOT

SKIPPING = '''
import pytest

def test_skips():
    pytest.skip("no foo installed")

@pytest.mark.cuda
def test_cuda_skips():
    pytest.skip("no GPU")

def test_passes():
    pass
'''
MODULE_SKIP = '''
import pytest
pytest.importorskip("surely_not_installed_xyz")

def test_never():
    pass
'''
CONFTEST = ("from tests.conftest import (clean_launcher_env, pytest_make_collect_report,\n"
            "                            pytest_runtest_makereport)\n")


def _pytest(tmp_path: Path, ci: bool, body: str,
            **extra: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_it.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if k != "HPC_CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if ci:
        env["HPC_CI"] = "1"
    env.update(extra)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           str(tmp_path)], check=False, capture_output=True, text=True,
                          timeout=60,
                          env=env, cwd=tmp_path)


def test_under_ci_a_skip_fails_except_cuda(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, True, SKIPPING)
    assert proc.returncode == 1, proc.stdout
    assert "1 failed, 1 passed, 1 skipped" in proc.stdout, proc.stdout
    assert "test_skips skipped under HPC_CI=1: Skipped: no foo installed" in proc.stdout


def test_outside_ci_skips_stay_skips(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, False, SKIPPING)
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 2 skipped" in proc.stdout, proc.stdout


def test_under_ci_a_module_level_importorskip_fails(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, True, MODULE_SKIP)
    assert proc.returncode != 0, proc.stdout
    assert "skipped under HPC_CI=1" in proc.stdout and "surely_not_installed_xyz" in proc.stdout


def test_exported_hpc_knobs_do_not_reach_tests(tmp_path: Path) -> None:
    """A developer's exported HPC_CONNECT_TIMEOUT / HPC_PREEMPT_SIGNAL is cleared."""
    body = ("import os\n\ndef test_env():\n"
            "    assert 'HPC_CONNECT_TIMEOUT' not in os.environ\n"
            "    assert 'HPC_PREEMPT_SIGNAL' not in os.environ\n"
            "    assert os.environ['HPC_TORCH_SPEC'] == 'torch==0'\n")
    proc = _pytest(tmp_path, False, body, HPC_CONNECT_TIMEOUT="3", HPC_PREEMPT_SIGNAL="INT",
                   HPC_TORCH_SPEC="torch==0")
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout
