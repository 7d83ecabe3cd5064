"""CPU threads per rank: one rank must not run as many threads as its host has cores.

Without ``OMP_NUM_THREADS`` every rank's torch starts one intra-op thread per core of
the host; two ranks per node under ``srun`` then trained 11x slower on our test cluster
than with one thread each. :func:`plan` (called by :func:`hpc.init_torch`) picks

* nothing, when ``OMP_NUM_THREADS`` is set (torch honours it);
* under an srun step with ``SLURM_CPUS_PER_TASK``: that many (at most the CPUs this
  process may run on);
* with several ranks per node otherwise: the CPUs this process may run on
  (``os.sched_getaffinity``) when the launcher bound it to a subset, else the host's
  CPUs divided by the node's ranks;
* nothing for a single process;

and returns ``OMP_NUM_THREADS`` for that count (:func:`thread_env`; child processes,
data-loader workers), which :func:`hpc.init_torch` exports (:mod:`hpc.bootstrap.distributed`
writes the environment) before :func:`set_torch_threads` calls
``torch.set_num_threads``. It warns when ``SLURM_CPUS_PER_TASK`` promises more CPUs than
the task is bound to: srun of Slurm 22.05-23.02 does not inherit ``--cpus-per-task``
from ``sbatch``/``salloc`` (``SRUN_CPUS_PER_TASK`` or ``srun -c`` fix it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Optional

from hpc.environments import DistInfo
from hpc.environments.slurm import in_step

__all__ = ["plan", "plan_threads", "set_torch_threads", "thread_env", "cpu_share",
           "usable_cpus"]

logger = logging.getLogger(__name__)


def plan_threads(info: DistInfo, environ: Mapping[str, str], usable: int,
                 host_cpus: int) -> tuple[Optional[int], tuple[str, ...]]:
    """The thread count for this rank (None: leave torch alone) and warnings (pure).

    Args:
        info: This process's layout.
        environ: The launch variables.
        usable: CPUs this process may run on (``len(os.sched_getaffinity(0))``).
        host_cpus: CPUs of the host (``os.cpu_count()``).
    """
    warnings: tuple[str, ...] = ()
    raw = environ.get("SLURM_CPUS_PER_TASK", "").strip()
    per_task = int(raw) if raw.isdigit() and int(raw) > 0 and in_step(environ) else 0
    if per_task and usable < per_task:
        warnings = (
            f"slurm: SLURM_CPUS_PER_TASK={per_task} but this task may run on only {usable} "
            "CPU(s) (os.sched_getaffinity); its threads will share them.\n"
            "srun of Slurm 22.05-23.02 does not take --cpus-per-task from sbatch/salloc, "
            "so srun bound each task to fewer CPUs than the job asked for.\n"
            "HINT: export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK before srun, or run "
            "srun --cpus-per-task=N (the templates in slurm/ and hpc submit do).",
        )
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None, warnings
    if per_task:
        return max(1, min(per_task, usable)), warnings
    if info.local_world_size > 1:
        return cpu_share(info.local_world_size, usable, host_cpus), warnings
    return None, warnings


def cpu_share(local_ranks: int, usable: int, host_cpus: int) -> int:
    """CPUs one of ``local_ranks`` ranks on a host should use (pure): the CPUs it may
    run on when the launcher bound it to a subset (``usable < host_cpus``), else its
    equal part of the host's."""
    if usable < host_cpus:
        return max(1, usable)
    return max(1, host_cpus // max(1, local_ranks))


def rank_share(local_ranks: int) -> int:
    """:func:`cpu_share` for this process, one of ``local_ranks`` ranks on its host."""
    return cpu_share(local_ranks, usable_cpus(), os.cpu_count() or 1)


def usable_cpus() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``; the host's elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def thread_env(threads: Optional[int]) -> dict[str, str]:
    """The variables that hand ``threads`` on to child processes (pure):
    ``OMP_NUM_THREADS``, or none when torch is left alone (``None``)."""
    return {} if threads is None else {"OMP_NUM_THREADS": str(threads)}


def plan(info: DistInfo, environ: Optional[Mapping[str, str]] = None
         ) -> tuple[Optional[int], dict[str, str]]:
    """:func:`plan_threads` for this process, its warnings logged.

    Args:
        info: This process's layout.
        environ: The launch variables (default ``os.environ``).

    Returns:
        The thread count (None: leave torch alone) and :func:`thread_env` of it, for
        the caller to export before :func:`set_torch_threads`.
    """
    env = os.environ if environ is None else environ
    threads, warnings = plan_threads(info, env, usable_cpus(), os.cpu_count() or 1)
    for warning in warnings:
        logger.warning("%s", warning)
    return threads, thread_env(threads)


def set_torch_threads(threads: Optional[int]) -> None:
    """``torch.set_num_threads(threads)``; nothing for None (torch left alone)."""
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)
    logger.debug("%d CPU thread(s) per rank", threads)
