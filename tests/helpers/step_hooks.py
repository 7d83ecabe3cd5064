"""Step hooks the cluster tests install through ``HPC_STEP_HOOK`` (see hpc.preempt.requeue).

``HPC_STEP_HOOK=tests.helpers.step_hooks:sleep`` sleeps ``HPC_TEST_STEP_SLEEP`` seconds
at every poll of the job's ``PreemptGuard`` (once per step), in the first
``HPC_TEST_SLEEP_RUNS`` runs of the job only (``SLURM_RESTART_COUNT`` below it; unset:
every run). A signal sent once a checkpoint exists then lands in the middle of the run;
sleeping does not change the results. :func:`slowed` gives the variables a job needs,
``PYTHONPATH`` included, so the nodes import this module. :func:`holding` ties a job's
length to a fault the test injects from outside: every rank waits at one step until the
test says the fault is in place.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from tests.helpers.paths import ROOT


def sleep() -> None:
    """Sleep ``HPC_TEST_STEP_SLEEP`` seconds unless this run is past ``HPC_TEST_SLEEP_RUNS``."""
    runs = int(os.environ.get("HPC_TEST_SLEEP_RUNS") or 0)
    if runs and int(os.environ.get("SLURM_RESTART_COUNT") or 0) >= runs:
        return
    time.sleep(float(os.environ.get("HPC_TEST_STEP_SLEEP") or 0))


def slowed(seconds: float, runs: int = 0) -> dict[str, str]:
    """Variables for a job whose steps sleep ``seconds`` (in its first ``runs`` runs; 0: all)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {"HPC_STEP_HOOK": f"{__name__}:sleep", "HPC_TEST_STEP_SLEEP": str(seconds),
           "PYTHONPATH": path}
    if runs:
        env["HPC_TEST_SLEEP_RUNS"] = str(runs)
    return env


_polls = 0

#: Seconds :func:`hold` waits for its release file at most (a test that died without
#: releasing leaves the job to go on, not to wait until its time limit).
HOLD_MAX_S = 300.0


def hold() -> None:
    """:func:`sleep`, and at the ``HPC_TEST_HOLD_AT``-th poll (step) of this process, wait
    until the file ``HPC_TEST_RELEASE`` exists. A test that injects a fault from outside
    the job (a node crashed, a link cut) once the checkpoint before that step exists
    writes the file after the fault is in place: the run cannot end first, however slow
    the host. A relaunch that resumes past the start finds the file and does not wait."""
    global _polls
    sleep()
    _polls += 1
    if _polls != int(os.environ.get("HPC_TEST_HOLD_AT") or 0):
        return
    release = Path(os.environ["HPC_TEST_RELEASE"])
    if release.exists():
        return
    print(f"step hook: rank {os.environ.get('SLURM_PROCID', '?')} holds at poll {_polls} "
          f"until {release} exists", file=sys.stderr, flush=True)
    deadline = time.monotonic() + HOLD_MAX_S
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def holding(at: int, release: Path, seconds: float = 0.0) -> dict[str, str]:
    """Variables for a job whose steps sleep ``seconds`` and whose every rank holds at its
    ``at``-th step until ``release`` exists (:func:`hold`)."""
    return {**slowed(seconds), "HPC_STEP_HOOK": f"{__name__}:hold",
            "HPC_TEST_HOLD_AT": str(at), "HPC_TEST_RELEASE": str(release)}


def kill_rank() -> None:
    """SIGKILL this process at its ``HPC_TEST_KILL_AT``-th poll when it is global rank
    ``HPC_TEST_KILL_RANK`` (``SLURM_PROCID``; ``RANK`` under ``hpc run``), in every attempt
    and run: a fault that follows the rank wherever it runs, unlike ``HPC_FAULT``, which
    the supervisor gives the first attempt only."""
    global _polls
    rank = os.environ.get("SLURM_PROCID") or os.environ.get("RANK")  # srun; hpc run
    if rank != os.environ.get("HPC_TEST_KILL_RANK"):
        return
    _polls += 1
    if _polls >= int(os.environ.get("HPC_TEST_KILL_AT") or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def killing(rank: int, at: int) -> dict[str, str]:
    """Variables for a job whose rank ``rank`` SIGKILLs itself at its ``at``-th step poll."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {"HPC_STEP_HOOK": f"{__name__}:kill_rank", "HPC_TEST_KILL_RANK": str(rank),
            "HPC_TEST_KILL_AT": str(at), "PYTHONPATH": path}


def shape_bug() -> None:
    """A real bug at rank ``HPC_TEST_BUG_RANK``'s ``HPC_TEST_BUG_AT``-th step poll: a matrix
    product of mismatched shapes (torch's own RuntimeError, not an injected fault)."""
    global _polls
    if os.environ.get("SLURM_PROCID") != os.environ.get("HPC_TEST_BUG_RANK"):
        return
    _polls += 1
    if _polls >= int(os.environ.get("HPC_TEST_BUG_AT") or 1):
        import torch

        torch.zeros(4, 8) @ torch.zeros(9, 2)


def buggy(rank: int, at: int) -> dict[str, str]:
    """Variables for a job whose rank ``rank`` hits :func:`shape_bug` at its ``at``-th step."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {"HPC_STEP_HOOK": f"{__name__}:shape_bug", "HPC_TEST_BUG_RANK": str(rank),
            "HPC_TEST_BUG_AT": str(at), "PYTHONPATH": path}


def kill_rank_first_run() -> None:
    """:func:`kill_rank`, in every attempt of the job's first run only (``SLURM_RESTART_COUNT``
    unset or 0): a fault that follows the rank to a spare, and is gone after a requeue."""
    if int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0:
        kill_rank()


def killing_first_run(rank: int, at: int) -> dict[str, str]:
    """:func:`killing` for :func:`kill_rank_first_run`."""
    return {**killing(rank, at), "HPC_STEP_HOOK": f"{__name__}:kill_rank_first_run"}


def usr2_rank() -> None:
    """``kill -USR2`` of this process at its ``HPC_TEST_USR2_AT``-th step poll when it is
    global rank ``HPC_TEST_USR2_RANK`` (``RANK`` under ``hpc run``, ``SLURM_PROCID`` under
    srun): a real signal to one rank, at a step the test chooses."""
    global _polls
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID")
    if rank != os.environ.get("HPC_TEST_USR2_RANK"):
        return
    _polls += 1
    if _polls == int(os.environ.get("HPC_TEST_USR2_AT") or 1):
        os.kill(os.getpid(), signal.SIGUSR2)


def signalling(rank: int, at: int) -> dict[str, str]:
    """Variables for a run whose rank ``rank`` gets SIGUSR2 at its ``at``-th step poll."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {"HPC_STEP_HOOK": f"{__name__}:usr2_rank", "HPC_TEST_USR2_RANK": str(rank),
            "HPC_TEST_USR2_AT": str(at), "PYTHONPATH": path}
