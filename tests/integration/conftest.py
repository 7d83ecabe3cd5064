"""Fixtures the integration modules share (the Slurm ones ask for the test cluster)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest

from hpc.errors import SubmitError
from hpc.submit import watch as jobwatch
from tests.helpers.preemption import require_preemption_partitions
from tests.helpers.slurm import require_slurm


@pytest.fixture(scope="module")
def cluster() -> None:
    """The local test cluster answers with two nodes; skip (fail under HPC_CI=1) if not."""
    require_slurm()


@pytest.fixture
def job(cluster: None) -> Iterator[str]:
    """A unique job name; jobs still running under it are cancelled after the test."""
    name = f"hpct-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["scancel", f"--name={name}"], check=False, capture_output=True, timeout=30)


@pytest.fixture
def cancel_after(cluster: None) -> Iterator[list[str]]:
    """Job ids to scancel at teardown if still alive (a failed test leaves nothing running)."""
    ids: list[str] = []
    yield ids
    for job_id in ids:
        try:
            if not jobwatch.is_terminal(jobwatch.current(job_id)):
                subprocess.run(["scancel", job_id], timeout=20)
        except (SubmitError, subprocess.TimeoutExpired):
            subprocess.run(["scancel", job_id], timeout=20)


@pytest.fixture(scope="module")
def preemption_partitions() -> None:
    """The test cluster has its preemptible and urgent partitions; skip (fail in CI) if not."""
    require_preemption_partitions()
