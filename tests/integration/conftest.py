"""Fixtures the integration modules share (the Slurm ones ask for the test cluster)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc.errors import SubmitError
from hpc.submit import watch as jobwatch
from tests.conftest import LAUNCHER_VARS
from tests.helpers.paths import ROOT
from tests.helpers.preemption import assert_no_failure_marks, require_preemption_partitions
from tests.helpers.slurm import require_slurm, sbatch_wait, slurm_env


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


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of one uninterrupted ``slurm/pretrain.sbatch`` run of the tiny
    pretrain (4 ranks, :mod:`tests.helpers.tiny_pretrain`): the reference every stopped,
    requeued or restarted run of that configuration must end bitwise equal to. One for
    the session: each module that made its own spent ~35 s on the same numbers."""
    from tests.helpers.tiny_pretrain import ENV, TINY_ARGS

    require_slurm()
    base = tmp_path_factory.mktemp("tiny-reference")
    ref = base / "run"
    with pytest.MonkeyPatch.context() as mp:  # session fixtures run before conftest's clearing
        for key in [k for k in os.environ if LAUNCHER_VARS.match(k)]:
            mp.delenv(key)
        env = slurm_env(**ENV)
    ref_id, rc, text = sbatch_wait(["-p", "debug", str(ROOT / "slurm" / "pretrain.sbatch"),
                                    *TINY_ARGS, "--out", str(ref)], base, timeout=180, env=env)
    assert rc == 0, text[-3000:]
    assert_no_failure_marks(base / "hpc-logs" / str(ref_id))  # a clean run leaves none
    return ref
