"""Helpers for integration tests that start real processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "integration" / "scripts"


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


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without launcher variables (conftest cleared them), plus ``extra``."""
    env = dict(os.environ)
    env.setdefault("HPC_CONNECT_TIMEOUT", "30")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def hpc_run(nproc: int, cmd: Sequence[str], *, timeout: float = 120,
            env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """``hpc run --nproc N -- CMD`` as a real subprocess, with a timeout.

    A command starting with a ``.py`` path is run with this interpreter.
    """
    argv = [sys.executable, "-m", "hpc", "run", "--nproc", str(nproc), "--", *cmd]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=env or clean_env(), cwd=ROOT)


def script(name: str) -> str:
    """Path of a script in tests/integration/scripts."""
    return str(SCRIPTS / name)
