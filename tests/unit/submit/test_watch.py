"""hpc.submit.watch: job states, exit statuses and the first failing rank."""

from __future__ import annotations

import io
import socket
from pathlib import Path

import pytest

from hpc.submit import watch as jobwatch


def test_failure_summary_names_the_first_failing_rank(tmp_path: Path) -> None:
    log = tmp_path / "0.err"
    log.write_text("RuntimeError: Connection closed by peer\n"
                   "srun: error: node2: task 3: Killed\n"
                   "srun: error: node1: tasks 0-1: Exited with exit code 1\n")
    run = jobwatch.Run("26", "FAILED", "9:0", "", "", "node[1-2]")
    text = jobwatch.failure_summary(run, [log, tmp_path / "missing"])
    assert "first failure: rank 3 on node2: Killed" in text
    assert "then: ranks 0-1 on node1: Exited with exit code 1" in text
    assert jobwatch.exit_status(run) == 9
    assert jobwatch.exit_status(jobwatch.Run("1", "CANCELLED by 0", "0:15", "", "", "")) == 143
    assert jobwatch.exit_status(jobwatch.Run("1", "COMPLETED", "0:0", "", "", "")) == 0
    assert not jobwatch.is_terminal(jobwatch.Run("1", "REQUEUED", "0:0", "", "", ""))


def test_follow_prints_each_state_once_while_sacct_does_not_list_the_job_yet(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """sacct lists a new job only after a while: no row and a PENDING row are one state."""
    def run(state: str, code: str = "") -> jobwatch.Run:
        return jobwatch.Run("7", state, code, "", "", "")

    polls = iter([[], [], [run("PENDING")], [run("RUNNING")], [run("RUNNING")],
                  [run("COMPLETED", "0:0")]])
    monkeypatch.setattr(jobwatch, "history", lambda job_id, timeout=30: next(polls))
    monkeypatch.setattr(jobwatch.time, "sleep", lambda s: None)
    out = io.StringIO()
    assert jobwatch.follow("7", [tmp_path / "missing.err"], out=out, poll=0) == 0
    assert out.getvalue().splitlines() == ["hpc submit: job 7 PENDING",
                                           "hpc submit: job 7 RUNNING",
                                           "hpc submit: job 7 COMPLETED"]


def test_failure_summary_takes_the_first_failure_from_the_marks(tmp_path: Path) -> None:
    """srun lists rank 0 first (it exited first); rank 1's failure began earlier."""
    from hpc.watchdog.marks import write_mark

    log = tmp_path / "0.err"
    log.write_text("0: RuntimeError: peer gone\n"
                   "srun: error: node1: task 0: Exited with exit code 1\n"
                   "srun: error: node2: task 1: Exited with exit code 1\n")
    marks = tmp_path / "failures-0"
    marks.mkdir()
    write_mark(str(marks), 0, "RuntimeError: peer gone", 1_000_000_005.5)
    write_mark(str(marks), 1, "Traceback...\nRuntimeError: rank 1 broke first",
               1_000_000_001.25)
    run = jobwatch.Run("26", "FAILED", "1:0", "", "", "node[1-2]")
    text = jobwatch.failure_summary(run, [log], marks)
    first = text.splitlines()[1]
    assert first.startswith("first failure: rank 1 on ") and "(pid " in first
    assert first.endswith(f".250: RuntimeError: rank 1 broke first (by the failure marks in {marks})")
    assert "  srun: rank 0 on node1: Exited with exit code 1" in text
    # without marks (or an empty directory): srun's order, as before
    assert "first failure: rank 0 on node1" in jobwatch.failure_summary(run, [log], tmp_path / "x")
    # srun's first failed rank left no mark (SIGKILLed, no Python ran): it is the first
    log.write_text("srun: error: node2: tasks 2-3,5: Killed\n" + log.read_text())
    assert "first failure: ranks 2-3,5 on node2: Killed" in jobwatch.failure_summary(
        run, [log], marks)


def test_failure_summary_names_a_killed_rank_before_the_peers_that_lost_it(
        tmp_path: Path) -> None:
    """Rank 3 was SIGKILLed (no mark); ranks 0 and 2 only lost it, and srun listed them
    first (it learns of the exits in any order on a loaded host)."""
    from hpc.watchdog.marks import write_mark

    log = tmp_path / "0.err"
    log.write_text("srun: error: node2: task 2: Exited with exit code 1\n"
                   "srun: error: node2: task 3: Killed\n"
                   "srun: launch/slurm: _step_signal: Terminating StepId=26.0\n"
                   "srun: error: node1: tasks 0-1: Killed\n")
    marks = tmp_path / "failures-0"
    marks.mkdir()
    lost = "RuntimeError: Connection closed by peer [10.200.0.12]:57567"
    write_mark(str(marks), 0, lost, 1_000_000_003.0)
    write_mark(str(marks), 2, lost, 1_000_000_003.1)
    run = jobwatch.Run("26", "FAILED", "0:9", "", "", "node[1-2]")
    text = jobwatch.failure_summary(run, [log], marks).splitlines()
    assert text[1].startswith("first failure: rank 3 on node2: Killed (no mark of its own;"), text
    assert "  srun: rank 2 on node2: Exited with exit code 1" in text
    # rank 1, killed by srun's own cancellation, is no cause: the first loss is
    log.write_text(log.read_text().replace("task 3: Killed", "task 3: Exited with exit code 1"))
    first = jobwatch.failure_summary(run, [log], marks).splitlines()[1]
    assert first.startswith("first failure: rank 0 on ") and first.endswith(
        f"Connection closed by peer [10.200.0.12]:57567 (by the failure marks in {marks})"), first


def test_first_failure_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hpc.cli import failures
    from hpc.watchdog.marks import GENERIC_MESSAGE, write_mark

    assert failures.main([str(tmp_path)]) == 1
    assert "no failure marks in" in capsys.readouterr().err
    write_mark(str(tmp_path), 3, GENERIC_MESSAGE, 50.0)
    log = tmp_path / "job.out"
    log.write_text("srun: error: node2: task 3: Exited with exit code 2\n")
    assert failures.main([str(tmp_path)]) == 1  # a bare exit mark alone is no failure
    assert failures.main([str(tmp_path), "--log", str(log)]) == 0
    assert f"hpc: first failure: rank 3 on {socket.gethostname()}" in capsys.readouterr().err
