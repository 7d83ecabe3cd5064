"""The one "which rank failed first" rule over the failure marks and srun's lines."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from hpc.watchdog import failure
from hpc.watchdog.marks import GENERIC_MESSAGE, write_mark


def _mark(directory: Path, rank: int, when: float, message: str) -> None:
    write_mark(str(directory), rank, message, when)


def test_first_failure_is_the_earliest_start_not_the_first_exit(tmp_path: Path) -> None:
    _mark(tmp_path, 0, 105.0, "RuntimeError: Connection closed by peer")
    _mark(tmp_path, 1, 100.0, "RuntimeError: rank 1 broke first")
    _mark(tmp_path, 2, 101.0, GENERIC_MESSAGE)  # exited, maybe with 0
    # rank 0 was seen to fail first (exit at 106), rank 1 is still exiting
    first = failure.first_failure(str(tmp_path), {0: 106.0}, [1, 2, 3])
    assert first is not None
    assert (first.rank, first.began, first.running) == (1, 100.0, True)
    assert first.message == "RuntimeError: rank 1 broke first"
    assert first.host == socket.gethostname() and first.pid == os.getpid()


def test_first_failure_counts_a_generic_mark_only_for_ranks_seen_to_fail(tmp_path: Path) -> None:
    _mark(tmp_path, 2, 99.0, GENERIC_MESSAGE)
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


def test_describe_failure_takes_srun_and_slurmstepd_lines_without_marks(tmp_path: Path) -> None:
    log = tmp_path / "job.out"
    log.write_text("srun: error: node2: tasks 4-5: Killed\n"
                   "slurmstepd: error: *** STEP 12.0 ON node1 CANCELLED AT 2024-05-01T10:00:00 "
                   "DUE TO TIME LIMIT ***\n"
                   "srun: error: node1: task 0: Exited with exit code 1\n")
    assert failure.describe_failure([log, tmp_path / "missing.out"]) == [
        "first failure: ranks 4-5 on node2: Killed",
        "  then: rank 0 on node1: Exited with exit code 1",
        "  then: slurm: cancelled DUE TO TIME LIMIT"]
    assert failure.describe_failure([tmp_path / "missing.out"], tmp_path) == []
