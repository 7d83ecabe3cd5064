"""hpc.submit.handle: SubmittedJob reads what the batch script of its job writes."""

from __future__ import annotations

import shutil
import subprocess
import types
from pathlib import Path

import pytest

from hpc.submit import SubmitOptions, SubmittedJob, make_executor


def _exported_marks_dir(options: SubmitOptions, job_id: str, restart: int) -> str:
    """``HPC_ERROR_DIR`` as the job's batch script sets it, run by bash for that run."""
    ex = make_executor(options)
    text = ex._executor._make_submission_file_text("CMD", "uid")  # what sbatch would get
    line = next((ln for ln in text.splitlines() if ln.startswith("export HPC_ERROR_DIR=")),
                None)
    assert line is not None, f"no HPC_ERROR_DIR in the batch script:\n{text}"
    proc = subprocess.run(["bash", "-c", f'{line}\nprintf %s "$HPC_ERROR_DIR"'],
                          env={"SLURM_JOB_ID": job_id, "SLURM_RESTART_COUNT": str(restart)},
                          capture_output=True, text=True, timeout=30, check=True)
    return proc.stdout


@pytest.mark.parametrize("log_dir", ["hpc-logs", "my logs", "it's $HOME"])
def test_wait_reads_the_failure_marks_where_the_batch_script_puts_them(
        tmp_path: Path, log_dir: str) -> None:
    """A space (or a quote, a ``$``) in the log dir: quoted in the script, not in the path."""
    pytest.importorskip("submitit")
    if shutil.which("srun") is None:
        pytest.skip("no srun: submitit refuses to build a Slurm executor")
    options = SubmitOptions(log_dir=str(tmp_path / log_dir))
    exported = _exported_marks_dir(options, "42", 1)
    assert exported == str((tmp_path / log_dir).resolve() / "42" / "failures-1")
    job = SubmittedJob(types.SimpleNamespace(job_id="42", num_tasks=4), options)
    assert job.marks(1) == Path(exported)

    from hpc.watchdog.failure import first_by_marks
    from hpc.watchdog.marks import write_mark

    Path(exported).mkdir(parents=True)
    write_mark(exported, 3, "RuntimeError: rank 3 broke first", 1_000_000_001.0)
    assert "rank 3 broke first" in (first_by_marks(job.marks(1)) or "")


def test_describe_counts_the_spare_nodes_apart() -> None:
    options = SubmitOptions(nodes=2, spare_nodes=1, tasks_per_node=2)
    paths = types.SimpleNamespace(stdout="/l/42_0_log.out", stderr="/l/42_0_log.err")
    task = types.SimpleNamespace(paths=paths)
    job = types.SimpleNamespace(job_id="42", num_tasks=4, task=lambda rank: task)
    first = SubmittedJob(job, options).describe()
    assert first.startswith("submitted job 42: 2 node(s) x 2 task(s) + 1 spare node(s) under "
                            "hpc supervise (1 CPU/task)"), first
