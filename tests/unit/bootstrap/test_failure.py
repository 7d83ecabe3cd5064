"""Failure marks of a rank killed by a signal, and the failing-process flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hpc.bootstrap.failure import read_mark
from tests.helpers import ROOT

_ABORT = """
import os, sys
from hpc.bootstrap import failure
failure.install(3, {"HPC_ERROR_DIR": sys.argv[1]})
os.abort()   # what the NCCL watchdog does on a collective timeout
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=60, check=False, env=env, cwd=ROOT)


def test_sigabrt_leaves_a_mark(tmp_path: Path) -> None:
    """No Python runs after abort(): faulthandler's C handler writes the mark."""
    proc = _python(_ABORT, str(tmp_path))
    assert proc.returncode == -6, proc
    mark = read_mark(str(tmp_path), 3)
    assert mark is not None, list(tmp_path.iterdir())
    when, message = mark
    assert message.startswith("Fatal Python error: Aborted"), message
    assert str(tmp_path / "3.fault") in message
    assert abs(when - (tmp_path / "3.fault").stat().st_mtime) < 1e-6


def test_a_rank_that_did_not_fail_has_no_mark(tmp_path: Path) -> None:
    proc = _python("from hpc.bootstrap import failure\nimport sys\n"
                   "failure.install(0, {'HPC_ERROR_DIR': sys.argv[1]})\n", str(tmp_path))
    assert proc.returncode == 0, proc
    # a clean exit writes the (generic) json mark the launcher reads for failed ranks
    # only; the fault file stays empty
    assert (tmp_path / "0.fault").read_text() == ""
    assert read_mark(str(tmp_path), 5) is None


def test_failed_notes_uncaught_exceptions_and_entry_points() -> None:
    code = ("from hpc.bootstrap import failure\nimport atexit\nfailure.watch()\n"
            "atexit.register(lambda: print('FAILED', failure.failed()))\n")
    assert "FAILED False" in _python(code).stdout
    assert "FAILED True" in _python(code + "raise SystemError('x')\n").stdout
    assert "FAILED True" in _python(code + "failure.note_failure()\n").stdout
