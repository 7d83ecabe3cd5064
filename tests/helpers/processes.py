"""Helpers for integration tests that start real processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    """os.environ without launcher variables and HPC_* knobs (conftest cleared them),
    plus ``extra``."""
    env = dict(os.environ)
    env.setdefault("HPC_CONNECT_TIMEOUT", "30")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc``'s whole process group (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def run_group(argv: Sequence[str], *, timeout: float, input: str | None = None,
              **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True)`` in a session of its own.

    On a timeout the whole process group is killed (a launcher *and* its ranks, which
    would otherwise sit in a collective for minutes), then TimeoutExpired is raised with
    the output so far.
    """
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            text=True, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
    finally:
        if proc.poll() is None:  # KeyboardInterrupt, pytest-timeout: no orphans
            kill_group(proc)
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def hpc_run(nproc: int, cmd: Sequence[str], *, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``hpc run --nproc N -- CMD`` as a real subprocess, with a timeout.

    A command starting with ``python``/``python3`` or a ``.py`` path runs with this
    interpreter. A timeout kills ``hpc run`` and its ranks (:func:`run_group`).
    """
    argv = [sys.executable, "-m", "hpc", "run", "--nproc", str(nproc), "--", *cmd]
    return run_group(argv, timeout=timeout, env=env or clean_env(), cwd=ROOT)


def script(name: str) -> str:
    """Path of a script in tests/integration/scripts."""
    return str(SCRIPTS / name)


def require_slurm() -> None:
    """Skip (fail in CI) unless the local test cluster answers with two idle nodes."""
    require("sbatch", "Slurm client (bin/hpc-testcluster up installs it)")
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False,
                             capture_output=True,
                             text=True, timeout=20).stdout
    except subprocess.TimeoutExpired:
        out = ""
    nodes = [line.split() for line in out.splitlines() if line.strip()]
    if len(nodes) < 2:
        msg = f"no 2-node Slurm cluster answering (sinfo: {out.strip() or 'nothing'}); run bin/hpc-testcluster up"
        if in_ci():
            pytest.fail(msg)
        pytest.skip(msg)


def slurm_env(**extra: str) -> dict[str, str]:
    """Environment for sbatch/srun from tests: this venv first on PATH, root-safe MPI."""
    env = clean_env(**extra)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("HPC_PYTHON", sys.executable)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def sbatch_wait(args: Sequence[str], workdir: Path, *, timeout: float = 240,
                env: dict[str, str] | None = None) -> tuple[int, int, str]:
    """``sbatch --wait ARGS`` from ``workdir``; returns (job id, exit code, output file text).

    The job's output goes to ``workdir/slurm-<id>.out`` unless ARGS set ``--output``.
    On a timeout the job is cancelled before the error propagates.
    """
    proc = subprocess.Popen(["sbatch", "--wait", "--parsable", *args], cwd=workdir,
                            env=env or slurm_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    job_id = ""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        job_id = out.strip().split(";")[0]
        if job_id:
            subprocess.run(["scancel", job_id], check=False, timeout=20)
        raise
    job_id = out.strip().split(";")[0].splitlines()[0] if out.strip() else ""
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch failed (rc {proc.returncode}): {err}")
    outputs = sorted(workdir.glob(f"*{job_id}*.out"))
    text = "\n".join(p.read_text(errors="replace") for p in outputs)
    return int(job_id), proc.returncode, text
