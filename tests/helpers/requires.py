"""Tools a test needs: skip without them, fail instead under ``.ci/run``."""

from __future__ import annotations

import os
import shutil

import pytest


def in_ci() -> bool:
    """True under .ci/run, where missing MPI/Slurm must fail instead of skip."""
    return os.environ.get("HPC_CI") == "1"


def require(tool: str, what: str) -> str:
    """Path of ``tool``; skip (or fail in CI) with a reason when it is missing."""
    path = shutil.which(tool)
    if path is None:
        msg = f"{what} not installed ({tool} not on PATH)"
        if in_ci():
            pytest.fail(f"{msg}; .ci/run must provide it")
        pytest.skip(msg)
    return path
