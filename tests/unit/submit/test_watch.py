"""hpc.submit.watch: job states, exit statuses and the first failing rank."""

from __future__ import annotations

import io
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
