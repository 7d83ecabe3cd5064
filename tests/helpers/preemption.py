"""Real preemption on the test cluster: its ``preemptible`` partition (PriorityTier=1,
PreemptMode=REQUEUE) and the ``urgent`` one (PriorityTier=2) over the same two nodes; an
urgent job makes Slurm send SIGTERM to every task of the preemptible job it needs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers.requires import in_ci
from tests.helpers.slurm import require_slurm, sbatch_nowait


def require_preemption_partitions() -> None:
    """Skip (fail in CI) unless the test cluster has the preemptible and urgent partitions."""
    require_slurm()
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], check=False, capture_output=True, text=True,
                         timeout=20).stdout.split()
    if "preemptible" not in out or "urgent" not in out:
        msg = (f"the test cluster has no preemptible/urgent partitions (sinfo: {out}); "
               "restart it from this checkout: bin/hpc-testcluster down && bin/hpc-testcluster up")
        if in_ci():
            pytest.fail(msg)
        pytest.skip(msg)


def preempt(tmp_path: Path, env: dict[str, str], cancel_after: list[str]) -> str:
    """An urgent 2-node exclusive job: Slurm preempts the preemptible job for it."""
    return sbatch_nowait(["-p", "urgent", "-N2", "--exclusive", "-o",
                          str(tmp_path / "urgent-%j.out"), "--wrap", "sleep 8"],
                         tmp_path, env, cancel_after)


def sacct_history(job_ids: list[str]) -> str:
    """sacct's rows for ``job_ids``, one per run (``--duplicates``: requeued runs too)."""
    return subprocess.run(["sacct", "-j", ",".join(job_ids), "--duplicates", "-X", "-n", "-P",
                           "-o", "JobID,Partition,State,ExitCode,Start,End"],
                          check=False, capture_output=True, text=True, timeout=30).stdout


def assert_no_failure_marks(job_dir: Path) -> None:
    """No rank of any run of the job left a failure mark in ``job_dir/failures-*/``: a
    clean run and the agreed exit 75 after a requeue are not failures."""
    from hpc.watchdog.marks import read_mark

    runs = sorted(job_dir.glob("failures-*"))
    assert runs, f"no failures-<restart>/ in {job_dir}: the test looks in the wrong place"
    marks = {f"{d.name}/{p.name}": read_mark(str(d), int(p.stem)) for d in runs
             for p in d.iterdir() if p.stem.isdigit()}
    marked = {name: mark for name, mark in marks.items() if mark is not None}
    assert not marked, f"failure marks after a run that did not fail: {marked}"
