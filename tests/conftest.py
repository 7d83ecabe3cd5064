"""Shared fixtures: launcher variables are cleared for every test and leaks fail it."""

from __future__ import annotations

import os
import re

import pytest

#: Variables any launcher reads; tests must not inherit them nor leave them behind.
LAUNCHER_VARS = re.compile(
    r"^(SLURM_\w+|OMPI_\w+|PMI_\w+|PMIX_\w+|MPI_LOCAL\w+|MV2_\w+|HYDI_\w+|TORCHELASTIC_\w+|"
    r"RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|NODE_RANK|NNODES|"
    r"MASTER_ADDR|MASTER_PORT|HPC_LAUNCHER|HPC_RUN_ID)$"
)


@pytest.fixture(autouse=True)
def clean_launcher_env(monkeypatch: pytest.MonkeyPatch):
    """Clear launcher variables before the test; fail it if it leaks new ones."""
    for key in [k for k in os.environ if LAUNCHER_VARS.match(k)]:
        monkeypatch.delenv(key)
    yield
    leaked = sorted(k for k in os.environ if LAUNCHER_VARS.match(k))
    if leaked:
        for key in leaked:
            del os.environ[key]
        pytest.fail(f"test leaked launcher variables into os.environ: {leaked}")
