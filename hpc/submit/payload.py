"""What a submitit job runs on every task: a module or a function (``hpc pretrain``:
:mod:`hpc.submit.pretrain_job`).

submitit starts one Python process per Slurm task (``srun python -m
submitit.core._submit``) and calls the pickled callable in-process, with the task's
``SLURM_*`` variables set, so :func:`hpc.init_torch` detects the launch as for any
``srun`` step (submitit adds only ``SUBMITIT_*`` variables, which detection ignores).

All callables are ``submitit.helpers.Checkpointable``: their ``checkpoint()`` returns
the resubmission that resumes (``None`` once the requeue budget ``HPC_MAX_REQUEUES`` is
used up, which makes submitit give up instead of requeueing).

- :class:`~hpc.submit.pretrain_job.PretrainJob` does the agreed stop itself (the stage
  life of :mod:`hpc.preempt.stage`): its guard replaces submitit's signal handler; after
  the checkpoint of the agreed step the master writes ``checkpoint()``'s resubmission
  over the job's submission pickle and runs ``scontrol requeue``; every rank then exits
  with 75, leaving no result, and the restarted job resumes from the run directory.
- :class:`ModuleJob` and :class:`FunctionJob` keep submitit's own handler (bound to
  ``SUBMITIT_PREEMPT_SIGNAL``, which ``hpc submit`` sets to the chosen signal): on the
  signal the master resubmits the same call and requeues at once; the program must resume
  from its own checkpoints. A program with its own :class:`~hpc.preempt.stop.AgreedStop`
  replaces that handler, requeues the job itself and exits 75, which the job passes on
  as its exit (no result, no error: the requeued job runs the same call again).

This module imports submitit: only jobs and ``hpc submit`` import it.
"""

from __future__ import annotations

import logging
import runpy
import sys
from collections.abc import Sequence
from typing import Any, Callable, Optional

from submitit.helpers import Checkpointable, DelayedSubmission

from hpc._lazy import resolve_callable
from hpc.errors import EXIT_REQUEUED, SubmitError
from hpc.preempt.requeue import read_budget

__all__ = ["ModuleJob", "FunctionJob", "resolve_function"]

logger = logging.getLogger(__name__)


def _submitit_logs_once() -> None:
    """Keep submitit's log lines on its own handler only.

    submitit's logger has a stdout handler of its own and propagates to the root logger:
    once the target calls :func:`hpc.setup_logging` (or ``logging.basicConfig``), its
    start and completion lines came out twice, once in each format, and ``hpc submit
    --wait`` showed both. Called before any target code runs.
    """
    logging.getLogger("submitit").propagate = False


class _Requeueable(Checkpointable):
    """``checkpoint()`` resubmits :meth:`resumed` while the requeue budget lasts."""

    def resumed(self) -> "_Requeueable":
        """The callable the requeued job runs (default: the same)."""
        return self

    def checkpoint(self, *args: Any, **kwargs: Any) -> Optional[DelayedSubmission]:
        """submitit's hook: the resubmission, or ``None`` (no requeue) past the budget."""
        budget = read_budget()
        if not budget.left:
            logger.error("not requeueing: SLURM_RESTART_COUNT=%d reached HPC_MAX_REQUEUES=%d",
                         budget.restarts, budget.max_requeues)
            return None
        return DelayedSubmission(self.resumed(), *args, **kwargs)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    return e.code if isinstance(e.code, int) else 1


class ModuleJob(_Requeueable):
    """``python -m module args...`` in-process (``runpy``, ``sys.argv`` set); returns 0.

    A module that exits with :data:`~hpc.errors.EXIT_REQUEUED` (its
    :class:`~hpc.preempt.stop.AgreedStop` requeued the job) exits with it too: no
    result and no error, so the requeued job runs the same call again.

    Raises:
        SubmitError: the module exits with another non-zero status.
    """

    def __init__(self, module: str, args: Sequence[str] = ()) -> None:
        self.module, self.args = module, list(args)

    def __call__(self) -> int:
        _submitit_logs_once()
        sys.argv = [self.module, *self.args]
        try:
            runpy.run_module(self.module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = _exit_code(e)
            if code == EXIT_REQUEUED:  # a normal event: SystemExit, which submitit passes on
                sys.exit(EXIT_REQUEUED)
            if code:
                raise SubmitError(f"`python -m {self.module}` exited with status {code}.\n"
                                  "HINT: see this task's log for its error.") from None
        return 0


def resolve_function(spec: str) -> Callable[..., Any]:
    """``pkg.mod:func`` (or ``pkg.mod:Class.method``) -> the callable.

    Raises:
        SubmitError: the module does not import or has no such attribute.
    """
    return resolve_callable(spec, label=repr(spec), example="package.module:function",
                            where="on the nodes (same Python environment)", error=SubmitError)


class FunctionJob(_Requeueable):
    """``pkg.mod:func`` called as ``func(*args)`` on every task; returns its value."""

    def __init__(self, spec: str, args: Sequence[str] = ()) -> None:
        self.spec, self.args = spec, list(args)
        resolve_function(spec)  # fail at submission, not on the nodes

    def __call__(self) -> Any:
        _submitit_logs_once()
        return resolve_function(self.spec)(*self.args)
