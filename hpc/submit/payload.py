"""What a submitit job runs on every task: ``hpc pretrain``, a module, or a function.

submitit starts one Python process per Slurm task (``srun python -m
submitit.core._submit``) and calls the pickled callable in-process, with the task's
``SLURM_*`` variables set, so :func:`hpc.init_torch` detects the launch as for any
``srun`` step (submitit adds only ``SUBMITIT_*`` variables, which detection ignores).

All callables are ``submitit.helpers.Checkpointable``: their ``checkpoint()`` returns
the resubmission that resumes (``None`` once the requeue budget ``HPC_MAX_REQUEUES`` is
used up, which makes submitit give up instead of requeueing).

- :class:`PretrainJob` does the agreed stop itself (:mod:`hpc.preempt.requeue`): its guard
  replaces submitit's signal handler; after the checkpoint of the agreed step the master
  writes ``checkpoint()``'s resubmission over the job's submission pickle and runs
  ``scontrol requeue``; every rank then exits with 75, leaving no result, and the
  restarted job resumes from the run directory.
- :class:`ModuleJob` and :class:`FunctionJob` keep submitit's own handler (bound to
  ``SUBMITIT_PREEMPT_SIGNAL``, which ``hpc submit`` sets to the chosen signal): on the
  signal the master resubmits the same call and requeues at once; the program must resume
  from its own checkpoints. A program with its own :class:`~hpc.preempt.stop.AgreedStop`
  replaces that handler, requeues the job itself and exits 75, which the job passes on
  as its exit (no result, no error: the requeued job runs the same call again).

This module imports submitit: only jobs and ``hpc submit`` import it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

from submitit.helpers import Checkpointable, DelayedSubmission

from hpc._lazy import resolve_callable
from hpc.errors import SubmitError
from hpc.preempt.guard import PreemptGuard
from hpc.preempt.requeue import (
    EXIT_REQUEUED,
    close_before_failing_exit,
    read_budget,
    requeue_after_stop,
    stopped_by_request,
)
from hpc.pretrain.config import PretrainConfig

__all__ = ["PretrainJob", "ModuleJob", "FunctionJob", "resolve_function"]

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


class PretrainJob(_Requeueable):
    """``hpc pretrain`` with ``config`` on every task; returns the :class:`PretrainResult`.

    Args:
        config: The run; ``config.out`` is required (it holds the checkpoints a requeued
            job resumes from) and is made absolute.
        log_level: Console level on local masters (``DEBUG``, ``INFO``, ``WARNING``).

    Raises:
        SubmitError: ``config.out`` is ``None``.
    """

    def __init__(self, config: PretrainConfig, log_level: str = "INFO") -> None:
        if not config.out:
            raise SubmitError(
                "a submitted pretrain run needs a run directory (out=None / --no-out): its "
                "checkpoints are what a preempted or requeued job resumes from.\n"
                "HINT: pass --out DIR on a filesystem every node mounts.")
        if log_level not in ("DEBUG", "INFO", "WARNING"):
            raise SubmitError(f"log_level={log_level!r} is not valid.\n"
                              "HINT: use one of: DEBUG, INFO, WARNING.")
        self.config = dataclasses.replace(config, out=str(Path(config.out).resolve()),
                                          setup_logging=False)
        self.config.validate()
        self.log_level = log_level

    def resumed(self) -> "PretrainJob":
        """The same run, resuming from its run directory."""
        return PretrainJob(dataclasses.replace(self.config, resume="auto"), self.log_level)

    def __call__(self) -> Any:
        _submitit_logs_once()
        guard = PreemptGuard().install()  # before torch: replaces submitit's handler
        import hpc
        from hpc.pretrain.loop import pretrain

        cfg = self.config
        info = hpc.init_torch(seed=cfg.seed)
        hpc.setup_logging(info, level=getattr(logging, self.log_level),
                          log_file=Path(cfg.out) / "pretrain.log")
        result = pretrain(cfg, stop_requested=guard)
        if not stopped_by_request(result.status, result.step, cfg.max_steps):
            return result
        outcome = requeue_after_stop(
            result.step, result.checkpoint, rank=info.rank, signame=guard.signal_name,
            before_requeue=self._write_resubmission if info.rank == 0 else None)
        if outcome.kind == "requeued":
            sys.exit(EXIT_REQUEUED)  # SystemExit: submitit writes no result; the job reruns
        if outcome.kind == "not-slurm":
            return result
        # Every rank agreed on this end (budget used up, requeue failed).
        close_before_failing_exit()
        raise SubmitError(outcome.message)

    def _write_resubmission(self) -> None:
        """Replace the job's submission pickle by :meth:`checkpoint`'s (master only)."""
        if "SUBMITIT_FOLDER" not in os.environ:
            return  # not started by submitit: the batch script reruns as it is
        from submitit.core import utils
        from submitit.core.job_environment import JobEnvironment

        paths = JobEnvironment().paths
        old = utils.DelayedSubmission.load(paths.submitted_pickle)
        new = self.checkpoint()
        if new is None:
            raise SubmitError("the requeue budget is used up")
        # Keep submitit's timeout bookkeeping (what its own signal handler does).
        new.set_timeout(getattr(old, "_timeout_min", 5), getattr(old, "_timeout_countdown", 0))
        with utils.temporary_save_path(paths.submitted_pickle) as tmp:
            new.dump(tmp)


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
