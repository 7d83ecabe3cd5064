"""Fixtures the integration modules share (the Slurm ones ask for the test cluster)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest

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
