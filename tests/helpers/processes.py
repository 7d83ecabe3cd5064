"""Real processes for the integration tests: each in a session of its own, with a timeout
that kills the whole group (a launcher and its ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.paths import ROOT


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without launcher variables and HPC_* knobs (conftest cleared them),
    plus ``extra``."""
    env = dict(os.environ)
    env.setdefault("HPC_CONNECT_TIMEOUT", "30")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def timeout_scale() -> float:
    """``HPC_TEST_TIMEOUT_SCALE`` (default 1): how much longer every timeout of a test run
    is, the tests' own (conftest scales pytest-timeout's) and their processes'
    (:func:`run_group`). ``.ci/run`` sets it for its background lane, whose tests run at
    a low CPU weight: no test there has a deadline, only guards against a hang."""
    return float(os.environ.get("HPC_TEST_TIMEOUT_SCALE") or 1)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL ``proc``'s whole process group (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def run_group(argv: Sequence[str], *, timeout: float, input: str | None = None,
              **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True)`` in a session of its own.

    On a timeout (``timeout`` times :func:`timeout_scale`) the whole process group is
    killed (a launcher *and* its ranks, which would otherwise sit in a collective for
    minutes), then TimeoutExpired is raised with the output so far.
    """
    timeout *= timeout_scale()
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


def start_hpc_run(pid_dir: Path, cmd: Sequence[str], *, nproc: int = 2,
                  env: dict[str, str] | None = None, merge_stderr: bool = False
                  ) -> tuple[subprocess.Popen[str], list[int]]:
    """``hpc run --nproc N -- CMD`` in a session of its own (this interpreter, output
    piped; stderr into stdout with ``merge_stderr``), once every rank wrote its pid to
    ``pid_dir/pid<rank>``: the process and the ranks' pids. The test fails (and the group
    is killed) when they have not within 40 s or the run ended first."""
    argv = [sys.executable, "-m", "hpc", "run", "--nproc", str(nproc), "--", *cmd]
    proc = subprocess.Popen(argv, env=env or clean_env(), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 40
    while not all((pid_dir / f"pid{r}").exists() for r in range(nproc)):
        if time.monotonic() > deadline or proc.poll() is not None:
            kill_group(proc)
            pytest.fail(f"ranks did not start: {proc.communicate()}")
        time.sleep(0.02)
    return proc, [int((pid_dir / f"pid{r}").read_text()) for r in range(nproc)]
