"""hpc.submit.watch: job states, exit statuses and the first failing rank."""

from __future__ import annotations

from pathlib import Path

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
