"""hpc.submit.executor: the sbatch script submitit would submit (rendered, not submitted)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from hpc.submit import SubmitOptions, make_executor
from hpc.submit.executor import COMPOSED, field_parameters


def test_executor_script_has_signal_requeue_kill_on_bad_exit_and_cpus(tmp_path: Path) -> None:
    pytest.importorskip("submitit")
    if shutil.which("srun") is None:
        pytest.skip("no srun: submitit refuses to build a Slurm executor")
    ex = make_executor(SubmitOptions(nodes=2, gpus_per_node=2, time_min=30, cpus_per_task=3,
                                     signal="USR2", signal_delay_s=90, max_requeues=5,
                                     log_dir=str(tmp_path), env={"A": "b c"}))
    text = ex._executor._make_submission_file_text("CMD", "uid")  # what sbatch would get
    for line in ("#SBATCH --signal=USR2@90", "#SBATCH --requeue", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --open-mode=append", "#SBATCH --time=30",
                 "export SUBMITIT_PREEMPT_SIGNAL=USR2", "export HPC_MAX_REQUEUES=5",
                 "export A='b c'", "--kill-on-bad-exit=1", "--cpus-per-task=3"):
        assert line in text, f"{line!r} missing:\n{text}"


def test_every_field_reaches_submitit() -> None:
    for f in dataclasses.fields(SubmitOptions):
        assert (f.metadata["submitit"] is None) == (f.name in COMPOSED), (
            f"SubmitOptions.{f.name}: give it a submitit parameter or compose it in "
            "make_executor (and list it in COMPOSED)")


def test_field_parameters_map_the_fields() -> None:
    assert field_parameters(SubmitOptions()) == {
        "nodes": 1, "tasks_per_node": 1, "cpus_per_task": 1, "timeout_min": 60,
        "name": "hpc", "slurm_signal_delay_s": 120, "slurm_max_num_timeout": 3,
        "slurm_python": None}
    params = field_parameters(SubmitOptions(gpus_per_node=2, partition="p"))
    assert (params["gpus_per_node"], params["tasks_per_node"]) == (2, 2)
    assert params["slurm_partition"] == "p"

