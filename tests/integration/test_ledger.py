"""The bad-node ledger on the real cluster: two live strikes keep ``hpc submit`` off a
node (the sbatch script says ``--exclude``, the job runs elsewhere), expired strikes do
not, and ``hpc nodes --clear`` gives the node back.

The strikes go against node1, the node Slurm would pick first for a 1-node job, so a job
that lands on node2 landed there because of the exclusion. The ledger is the test's own
(``HPC_STATE_DIR``, set by tests/conftest.py and inherited by the jobs).

Run under the shared lock: ``flock /tmp/hpc-heavy.lock pytest tests/integration/test_ledger.py``
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.ledger import Ledger
from tests.helpers.paths import ROOT
from tests.helpers.processes import run_group
from tests.helpers.requires import in_ci
from tests.helpers.slurm import slurm_env

pytestmark = pytest.mark.slurm

try:
    import submitit  # noqa: F401
except ImportError:  # pragma: no cover - submitit is in the test extra
    if in_ci():
        raise
    pytest.skip("submitit not installed (pip install submitit)", allow_module_level=True)

ONE_TASK = ["-N", "1", "-G", "0", "--tasks-per-node", "1", "--time", "3", "-p", "debug"]
HOUR = 3600.0


def _hpc(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_group([sys.executable, "-m", "hpc", *args], timeout=timeout, cwd=cwd,
                     env=slurm_env(PYTHONPATH=str(ROOT)))


def _job_id(text: str) -> str:
    m = re.search(r"submitted job (\d+)", text)
    assert m, text
    return m.group(1)


def _submission(logs: Path, job_id: str) -> str:
    """The sbatch script submitit handed to sbatch for the job."""
    return (logs / job_id / f"{job_id}_submission.sh").read_text()


def _strike(host: str, hours_ago: float, reason: str) -> None:
    Ledger(clock=lambda: time.time() - hours_ago * HOUR).add(host, reason, "check")


@pytest.mark.timeout(420)
def test_two_strikes_exclude_a_node_until_cleared_and_expired_ones_count_for_nothing(
        cluster: None, tmp_path: Path, cancel_after: list[str]) -> None:
    assert os.environ["HPC_STATE_DIR"].startswith(str(tmp_path.parent.parent))
    _strike("node1", 2, "slow node node1: busbw of all its 3 pairs 4.1..4.6 MB/s")
    _strike("node1", 1, "straggler: node1 (rank 0) 3.1x the median compute time")
    _strike("node2", 30, "slow compute on node2 (long ago)")
    _strike("node2", 26, "slow compute on node2 (long ago, again)")

    listed = _hpc(["nodes"], tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[-1] == "the next hpc submit excludes: node1", listed.stdout

    logs = tmp_path / "logs"
    first = _hpc(["submit", *ONE_TASK, "--log-dir", str(logs), "--wait", "--wait-timeout",
                  "240", "--", "-m", "tests.integration.submit_target", "x"], tmp_path,
                 timeout=300)
    text = first.stdout + first.stderr
    job = _job_id(text)
    cancel_after.append(job)
    assert first.returncode == 0, text[-4000:]
    assert ("  excluding node1 (2 strikes in 24 h from check, last: straggler: node1 (rank 0) "
            "3.1x the median compute time; hpc nodes --clear node1 to allow it)") in text, text
    assert "excluding node2" not in text  # its strikes expired
    script = _submission(logs, job)
    assert "#SBATCH --exclude=node1\n" in script, script
    assert "target rank 0/1 local 0 node2 device cpu sum=0 args=x" in text, text[-3000:]
    ran_on = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "NodeList"],
                            capture_output=True, text=True, timeout=30).stdout.split()
    assert ran_on == ["node2"], ran_on

    cleared = _hpc(["nodes", "--clear", "node1"], tmp_path)
    assert "cleared 2 strike(s) against node1" in cleared.stdout, cleared.stdout
    assert cleared.stdout.splitlines()[-1] == "the next hpc submit excludes: none"

    second = _hpc(["submit", *ONE_TASK, "--log-dir", str(logs), "--", "-m",
                   "tests.integration.submit_target"], tmp_path)
    text = second.stdout + second.stderr
    job = _job_id(text)
    cancel_after.append(job)
    assert second.returncode == 0, text
    assert "excluding" not in text, text
    assert "--exclude" not in _submission(logs, job)
    subprocess.run(["scancel", job], check=False, timeout=30)


def _state(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                          text=True, timeout=30).stdout.strip()


@pytest.mark.timeout(180)
def test_a_requeue_adds_the_bad_nodes_to_the_jobs_own_exclusions(
        cluster: None, tmp_path: Path, cancel_after: list[str]) -> None:
    """The master's requeue (:func:`hpc.preempt.requeue._decide`, run here for a real
    running job): the requeued job excludes the ledger's node1 beside its own node4."""
    from hpc.preempt import requeue

    job = subprocess.run(["sbatch", "--parsable", "--requeue", "-N1", "-p", "debug",
                          "--exclude=node4", "--time=3", "-o", str(tmp_path / "out"),
                          "--wrap", "sleep 120"], capture_output=True, text=True,
                         timeout=30, check=True).stdout.strip().split(";")[0]
    cancel_after.append(job)
    deadline = time.monotonic() + 90
    while _state(job) != "RUNNING":
        assert time.monotonic() < deadline, f"job {job} never ran: {_state(job)}"
        time.sleep(1)
    _strike("node1", 2, "slow node node1")
    _strike("node1", 1, "slow node node1 again")
    out = requeue._decide(7, None, "SIGUSR2", None, {"SLURM_JOB_ID": job})
    assert out.kind == "requeued", out.message
    assert out.message.endswith("; excluding node1 (node1: bad-node ledger, 2 live strikes; "
                                "hpc nodes --clear HOST allows one again)"), out.message
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                           text=True, timeout=30).stdout
    assert "ExcNodeList=node4,node1 " in shown, shown
    subprocess.run(["scancel", job], check=False, timeout=30)
