"""``hpc submit`` of a user's own program on the real cluster, in the CPU layout, and a
job whose requeue budget is zero.

* ``-- -m tests.integration.submit_target ARGS`` and
  ``-- tests.integration.submit_target:main ARGS`` with ``-N 2 -G 0 --tasks-per-node 2``:
  4 tasks on 2 nodes, gloo, every rank's line in its own log; ``--wait`` shows submitit's
  start and completion lines once each (the target calls ``hpc.setup_logging``, whose root
  handler used to repeat them) and each state change once.
* ``--max-requeues 0`` and ``scancel --signal=USR2``: the job checkpoints, is NOT requeued
  (one run in ``sacct -D``), ends FAILED and ``hpc submit --wait`` exits 1 with the
  budget message.

Run under the shared lock:
``flock /tmp/hpc-heavy.lock pytest -m slurm tests/integration/test_submit_targets.py``
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.processes import kill_group, run_group
from tests.helpers.slurm import slurm_env
from tests.helpers.step_hooks import slowed

pytestmark = pytest.mark.slurm

pytest.importorskip("submitit")  # in the test extra; a skip fails under HPC_CI (conftest)

CPU_LAYOUT = ["-N", "2", "-G", "0", "--tasks-per-node", "2", "--time", "3"]
TINY_ARGS = ["--epochs", "2", "--batch-size", "32", "--width", "8", "--val-archs", "2",
             "--recal-samples", "64", "--ckpt-every", "3", "--no-progress"]


def _cancel(text: str) -> None:
    m = re.search(r"submitted job (\d+)", text)
    if m:
        subprocess.run(["scancel", m.group(1)], check=False, timeout=20)


def hpc_submit(args: list[str], cwd: Path, timeout: float = 150) -> tuple[int, str, str]:
    """``hpc submit ARGS --wait`` in its own process group: (exit status, output, job id)."""
    cmd = [sys.executable, "-m", "hpc", "submit", *args]
    try:
        proc = run_group(cmd, timeout=timeout, cwd=cwd, env=slurm_env(PYTHONPATH=str(ROOT)))
    except subprocess.TimeoutExpired as e:
        _cancel(str(e.stdout or ""))
        raise
    text = proc.stdout + proc.stderr
    m = re.search(r"submitted job (\d+)", text)
    assert m, text
    return proc.returncode, text, m.group(1)


def assert_each_state_once(text: str, job_id: str) -> None:
    states = re.findall(rf"^hpc submit: job {job_id} (\w+.*)$", text, re.MULTILINE)
    assert states and states[-1].startswith("COMPLETED"), text
    assert len(states) == len(set(states)), f"a state change printed twice: {states}"


@pytest.mark.timeout(320)
@pytest.mark.parametrize("target", [["-m", "tests.integration.submit_target"],
                                    ["tests.integration.submit_target:main"]],
                         ids=["module", "function"])
def test_user_target_on_the_cpu_layout(cluster: None, tmp_path: Path, target: list[str]
                                       ) -> None:
    status, text, job_id = hpc_submit(
        [*CPU_LAYOUT, "--log-dir", str(tmp_path / "logs"), "--wait", "--wait-timeout", "120",
         "--", *target, "a", "b c"], cwd=tmp_path)
    assert status == 0, text[-4000:]
    assert f"submitted job {job_id}: 2 node(s) x 2 task(s) (1 CPU/task)" in text
    assert "target rank 0/4 local 0 node1 device cpu sum=6 args=a b c" in text
    assert "logged by rank 0" in text  # the target's own hpc.setup_logging handler
    for line in ("Starting with JobEnvironment", "Job completed successfully",
                 "Exiting after successful completion"):
        assert text.count(line) == 1, f"{line!r} {text.count(line)} times:\n{text[-3000:]}"
    assert_each_state_once(text, job_id)
    logs = tmp_path / "logs" / job_id
    for rank in range(4):
        out = (logs / f"{job_id}_{rank}_log.out").read_text()
        node = "node1" if rank < 2 else "node2"
        assert f"target rank {rank}/4 local {rank % 2} {node} device cpu sum=6 args=a b c" \
            in out, out


@pytest.mark.timeout(240)
def test_max_requeues_zero_ends_the_job_with_the_budget_message(cluster: None,
                                                                 tmp_path: Path) -> None:
    out = tmp_path / "run"
    hook = [a for k, v in slowed(0.5).items() for a in ("--env", f"{k}={v}")]
    cmd = [sys.executable, "-m", "hpc", "submit", "-N", "2", "-G", "2", "--time", "5",
           "--max-requeues", "0", "--log-dir", str(tmp_path / "logs"), "--env",
           "OMP_NUM_THREADS=1", *hook, "--wait", "--wait-timeout", "150", "--",
           *TINY_ARGS, "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=slurm_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (out / "checkpoints" / "ckpt-00000006.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint 6"
            time.sleep(0.2)
        job_id = next(p.name for p in (tmp_path / "logs").iterdir() if p.name.isdigit())
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=20)
        text, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            kill_group(proc)
            text = proc.communicate()[0]
            _cancel(text)
    assert proc.returncode == 1, text[-4000:]
    m = re.search(r"stopped at step (\d+) on SIGUSR2; checkpoint (\S+)\. "
                  rf"Job {job_id} was not requeued: SLURM_RESTART_COUNT=0 reached "
                  r"HPC_MAX_REQUEUES=0\.", text)
    assert m, text[-4000:]
    assert Path(m.group(2)).exists() and m.group(2).endswith(f"ckpt-{int(m.group(1)):08d}.pt")
    assert "HINT: resubmit the same command" in text
    assert f"hpc submit: job {job_id} FAILED (exit code 1:0)" in text, text[-3000:]
    assert "REQUEUED" not in text
    runs = subprocess.run(["sacct", "-j", job_id, "-X", "-D", "-n", "-P", "-o", "State"],
                          check=False, capture_output=True, text=True,
                          timeout=30).stdout.split()
    assert runs == ["FAILED"], runs
