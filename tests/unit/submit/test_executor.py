"""hpc.submit.executor: the sbatch script submitit would submit (rendered, not submitted)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hpc.submit import SubmitOptions, make_executor


def test_executor_script_has_signal_requeue_and_kill_on_bad_exit(tmp_path: Path) -> None:
    pytest.importorskip("submitit")
    if shutil.which("srun") is None:
        pytest.skip("no srun: submitit refuses to build a Slurm executor")
    ex = make_executor(SubmitOptions(nodes=2, gpus_per_node=2, time_min=30,
                                     signal="USR2", signal_delay_s=90, max_requeues=5,
                                     log_dir=str(tmp_path), env={"A": "b c"}))
    text = ex._executor._make_submission_file_text("CMD", "uid")  # what sbatch would get
    for line in ("#SBATCH --signal=USR2@90", "#SBATCH --requeue", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=2", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --open-mode=append", "#SBATCH --time=30",
                 "export SUBMITIT_PREEMPT_SIGNAL=USR2", "export HPC_MAX_REQUEUES=5",
                 "export A='b c'", "--kill-on-bad-exit=1"):
        assert line in text, f"{line!r} missing:\n{text}"
