"""``hpc submit --array 2`` on the real cluster: a run directory per task, and the warning
signal to ONE task requeues that task only (``<array job>_<task>``, not the whole array).

Task 1 gets ``scancel --signal=USR2 <array>_1`` once it has a checkpoint; it must be
requeued exactly once (history REQUEUED, COMPLETED; ``Restarts=1``) while task 0 runs
through untouched (COMPLETED, ``Restarts=0``); both tasks run the same config, so task
0 is task 1's uninterrupted reference: the final weights must be bitwise equal.

Run under the shared lock: ``flock /tmp/hpc-heavy.lock pytest -m slurm tests/integration/test_submit_array.py``
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc.submit import watch as jobwatch
from tests.helpers.paths import ROOT
from tests.helpers.slurm import require_slurm, slurm_env, wait_for_file
from tests.helpers.step_hooks import slowed
from tests.helpers.tiny_pretrain import (
    ENV,
    TINY_ARGS,
    assert_each_step_once,
    assert_same_final_weights,
)

pytestmark = pytest.mark.slurm
torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("submitit")


def _restarts(job_id: str) -> str:
    text = subprocess.run(["scontrol", "show", "job", job_id], check=False,
                          capture_output=True, text=True, timeout=20).stdout
    return next((w for w in text.split() if w.startswith("Restarts=")), text)


@pytest.mark.timeout(300)
def test_array_tasks_have_own_run_dirs_and_requeue_alone(tmp_path: Path) -> None:
    require_slurm()
    env = slurm_env()
    envs = [f"--env={k}={v}" for k, v in {**ENV, **slowed(0.4, runs=1)}.items()]
    cmd = [sys.executable, "-m", "hpc", "submit", "--array", "2", "-N", "2", "-G", "0",
           "--tasks-per-node", "2", "-p", "debug", "--time", "5", "--signal-delay", "60",
           "--log-dir", str(tmp_path / "logs"), *envs, "--", *TINY_ARGS,
           "--out", str(tmp_path / "sweep" / "{task}")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    ids = [line.split()[2].rstrip(":") for line in proc.stdout.splitlines()
           if line.startswith("submitted job ")]
    try:
        assert len(ids) == 2 and ids[0].endswith("_0") and ids[1].endswith("_1"), proc.stdout
        assert f"run:    {tmp_path / 'sweep' / '1'} (checkpoints" in proc.stdout
        run0, run1 = tmp_path / "sweep" / "0", tmp_path / "sweep" / "1"
        wait_for_file(run1 / "checkpoints" / "ckpt-00000006.pt", ids[1], timeout=150)
        subprocess.run(["scancel", "--signal=USR2", ids[1]], check=True, timeout=20)
        last = [jobwatch.wait(i, timeout=200) for i in ids]
        history = {i: [r.word for r in jobwatch.history(i)] for i in ids}
        restarts = {i: _restarts(i) for i in ids}
        print(f"history {history} {restarts}", file=sys.stderr)
        assert [r.word for r in last] == ["COMPLETED", "COMPLETED"], history
        assert history == {ids[0]: ["COMPLETED"], ids[1]: ["REQUEUED", "COMPLETED"]}
        assert restarts == {ids[0]: "Restarts=0", ids[1]: "Restarts=1"}
        assert_each_step_once(run0)
        assert_each_step_once(run1)
        assert_same_final_weights(run1, run0)
    finally:
        for job_id in ids:
            subprocess.run(["scancel", job_id], check=False, timeout=20)
