"""Failure marks of a rank killed by a signal, the failing-process flag, and the readers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.watchdog.marks import GENERIC_MESSAGE, marked, origin, read_mark, write_mark
from tests.helpers.paths import ROOT

_ABORT = """
import os, sys
from hpc.watchdog import marks
marks.install(3, {"HPC_ERROR_DIR": sys.argv[1]})
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


_INSTALLED = ("from hpc.watchdog import marks\nimport sys\nmarks.watch()\n"
              "marks.install(0, {'HPC_ERROR_DIR': sys.argv[1]})\n")


@pytest.mark.parametrize("end, status", [("", 0), ("sys.exit(0)\n", 0),
                                         ("sys.exit(75)\n", 75)],  # the agreed requeue exit
                         ids=["clean", "exit-0", "requeued"])
def test_a_rank_that_did_not_fail_has_no_mark(tmp_path: Path, end: str, status: int) -> None:
    proc = _python(_INSTALLED + end, str(tmp_path))
    assert proc.returncode == status, proc
    assert read_mark(str(tmp_path), 0) is None, (tmp_path / "0.json").read_text()
    assert not (tmp_path / "0.json").exists()
    assert (tmp_path / "0.fault").read_text() == ""  # faulthandler's file stays empty


def test_a_process_that_noted_its_failure_marks_the_start_of_its_exit(tmp_path: Path) -> None:
    proc = _python(_INSTALLED + "marks.note_failure('pretrain diverged')\nsys.exit(1)\n",
                   str(tmp_path))
    assert proc.returncode == 1, proc
    mark = read_mark(str(tmp_path), 0)
    assert mark is not None and mark[1] == GENERIC_MESSAGE
    proc = _python(_INSTALLED + "raise ValueError('bad batch')\n", str(tmp_path / "raised"))
    assert proc.returncode == 1, proc
    mark = read_mark(str(tmp_path / "raised"), 0)  # the exception's, not the generic one
    assert mark is not None and mark[1] == "ValueError: bad batch", mark


def test_a_bare_sys_exit_with_a_failing_status_marks_its_rank(tmp_path: Path) -> None:
    """The dying rank of tests/integration/test_slurm.py::test_dying_rank_ends_job."""
    proc = _python(_INSTALLED + "sys.exit(3)\n", str(tmp_path))
    assert proc.returncode == 3, proc
    mark = read_mark(str(tmp_path), 0)
    assert mark is not None and mark[1] == GENERIC_MESSAGE, mark
    proc = _python(_INSTALLED + "sys.exit('no data')\n", str(tmp_path / "text"))
    assert proc.returncode == 1 and read_mark(str(tmp_path / "text"), 0) is not None


def test_failed_notes_uncaught_exceptions_and_entry_points() -> None:
    code = ("from hpc.watchdog import marks\nimport atexit\nmarks.watch()\n"
            "atexit.register(lambda: print('FAILED', marks.failed()))\n")
    assert "FAILED False" in _python(code).stdout
    assert "FAILED True" in _python(code + "raise SystemError('x')\n").stdout
    assert "FAILED True" in _python(code + "marks.note_failure()\n").stdout


def test_the_readers_list_the_marked_ranks_and_where_each_ran(tmp_path: Path) -> None:
    write_mark(str(tmp_path), 2, "ValueError: bad batch", 10.0)
    write_mark(str(tmp_path), 5, "stuck since step 3", 9.0, ("node2", 4242))
    (tmp_path / "7.fault").write_text("Fatal Python error: Aborted\n")
    (tmp_path / "notes.txt").write_text("")
    assert marked(str(tmp_path)) == {2, 5, 7}
    assert marked(str(tmp_path / "missing")) == set()
    assert origin(str(tmp_path), 2) == (socket.gethostname(), os.getpid())
    assert origin(str(tmp_path), 5) == ("node2", 4242)  # the culprit's, not the reporter's
    assert origin(str(tmp_path), 7) == ("", 0)  # a faulthandler file names no host
    write_mark(str(tmp_path), 2, GENERIC_MESSAGE)  # the first mark stays
    assert read_mark(str(tmp_path), 2) == (10.0, "ValueError: bad batch")
