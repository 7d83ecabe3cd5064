"""Failure marks of a rank killed by a signal, and the failing-process flag."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.watchdog import failure
from hpc.watchdog.failure import read_mark
from tests.helpers.paths import ROOT

_ABORT = """
import os, sys
from hpc.watchdog import failure
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


_INSTALLED = ("from hpc.watchdog import failure\nimport sys\nfailure.watch()\n"
              "failure.install(0, {'HPC_ERROR_DIR': sys.argv[1]})\n")


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
    proc = _python(_INSTALLED + "failure.note_failure('pretrain diverged')\nsys.exit(1)\n",
                   str(tmp_path))
    assert proc.returncode == 1, proc
    mark = read_mark(str(tmp_path), 0)
    assert mark is not None and mark[1] == failure.GENERIC_MESSAGE
    proc = _python(_INSTALLED + "raise ValueError('bad batch')\n", str(tmp_path / "raised"))
    assert proc.returncode == 1, proc
    mark = read_mark(str(tmp_path / "raised"), 0)  # the exception's, not the generic one
    assert mark is not None and mark[1] == "ValueError: bad batch", mark


def test_a_bare_sys_exit_with_a_failing_status_marks_its_rank(tmp_path: Path) -> None:
    """The dying rank of tests/integration/test_slurm.py::test_dying_rank_ends_job."""
    proc = _python(_INSTALLED + "sys.exit(3)\n", str(tmp_path))
    assert proc.returncode == 3, proc
    mark = read_mark(str(tmp_path), 0)
    assert mark is not None and mark[1] == failure.GENERIC_MESSAGE, mark
    proc = _python(_INSTALLED + "sys.exit('no data')\n", str(tmp_path / "text"))
    assert proc.returncode == 1 and read_mark(str(tmp_path / "text"), 0) is not None


def test_failed_notes_uncaught_exceptions_and_entry_points() -> None:
    code = ("from hpc.watchdog import failure\nimport atexit\nfailure.watch()\n"
            "atexit.register(lambda: print('FAILED', failure.failed()))\n")
    assert "FAILED False" in _python(code).stdout
    assert "FAILED True" in _python(code + "raise SystemError('x')\n").stdout
    assert "FAILED True" in _python(code + "failure.note_failure()\n").stdout


def _mark(directory: Path, rank: int, when: float, message: str) -> None:
    failure.write_mark(str(directory), rank, message, when)


def test_first_failure_is_the_earliest_start_not_the_first_exit(tmp_path: Path) -> None:
    _mark(tmp_path, 0, 105.0, "RuntimeError: Connection closed by peer")
    _mark(tmp_path, 1, 100.0, "RuntimeError: rank 1 broke first")
    _mark(tmp_path, 2, 101.0, failure.GENERIC_MESSAGE)  # exited, maybe with 0
    # rank 0 was seen to fail first (exit at 106), rank 1 is still exiting
    first = failure.first_failure(str(tmp_path), {0: 106.0}, [1, 2, 3])
    assert first is not None
    assert (first.rank, first.began, first.running) == (1, 100.0, True)
    assert first.message == "RuntimeError: rank 1 broke first"
    assert first.host == socket.gethostname() and first.pid == os.getpid()


def test_first_failure_counts_a_generic_mark_only_for_ranks_seen_to_fail(tmp_path: Path) -> None:
    _mark(tmp_path, 2, 99.0, failure.GENERIC_MESSAGE)
    _mark(tmp_path, 3, 100.0, "ValueError: bad batch")
    assert failure.first_failure(str(tmp_path), {}).rank == 3  # type: ignore[union-attr]
    first = failure.first_failure(str(tmp_path), {2: None, 3: None})
    assert first is not None and (first.rank, first.began) == (2, 99.0)
    assert failure.first_failure(str(tmp_path / "none"), {5: None}) is None  # no time at all
    assert failure.first_failure(str(tmp_path), {5: 98.0}).rank == 5  # type: ignore[union-attr]


def test_a_rank_killed_by_a_signal_comes_before_the_peers_that_lost_it(tmp_path: Path) -> None:
    """Rank 3 is SIGKILLed (no Python ran: no mark); ranks 0 and 2 fail on the connection
    it closed. On a loaded host the launcher sees the death after rank 0 marked its loss."""
    lost = "RuntimeError: [pair.cc:553] Connection closed by peer [10.200.0.12]:57567"
    _mark(tmp_path, 0, 100.0, lost)
    _mark(tmp_path, 2, 100.2, lost)
    seen = {0: 100.5, 2: 100.6, 3: 101.0}  # hpc run's exit times
    first = failure.first_failure(str(tmp_path), seen, (), signalled=[3])
    assert first is not None and (first.rank, first.began) == (3, 100.0)
    # srun's lines carry no time: a rank it saw killed before it cancelled the step
    first = failure.first_failure(str(tmp_path), dict.fromkeys([0, 2, 3]), signalled=[3])
    assert first is not None and first.rank == 3
    # without the signal (srun's own cancellation killed it), or dead long after the loss:
    # the loss came first
    assert failure.first_failure(str(tmp_path), dict.fromkeys([0, 2, 3])).rank == 0  # type: ignore[union-attr]
    late = {**seen, 3: 100.0 + failure.PEER_LOSS_WINDOW + 1}
    assert failure.first_failure(str(tmp_path), late, (), signalled=[3]).rank == 0  # type: ignore[union-attr]


def test_a_killed_rank_does_not_come_before_a_rank_that_failed_in_its_own_code(
        tmp_path: Path) -> None:
    _mark(tmp_path, 1, 99.0, "ValueError: bad batch")
    _mark(tmp_path, 0, 100.0, "RuntimeError: Connection closed by peer")
    first = failure.first_failure(str(tmp_path), dict.fromkeys([0, 1, 3]), signalled=[3])
    assert first is not None and first.rank == 1
    # the watchdog's verdict that a rank never entered a collective is not a lost peer,
    # even when the collective timed out
    stuck = tmp_path / "stuck"
    stuck.mkdir()
    _mark(stuck, 2, 98.0, "all_reduce #9 timed out (reported by rank 0): rank 2 (node2, "
                          "pid 41) never entered it.")
    first = failure.first_failure(str(stuck), dict.fromkeys([2, 3]), signalled=[3])
    assert first is not None and first.rank == 2
