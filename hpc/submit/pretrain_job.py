"""``hpc pretrain`` as a submitit job: :class:`PretrainJob`, on every task of the job.

It does the agreed stop itself (:mod:`hpc.preempt.requeue`): its guard replaces
submitit's signal handler; after the checkpoint of the agreed step the master writes
``checkpoint()``'s resubmission over the job's submission pickle and runs ``scontrol
requeue``; every rank then exits with 75, leaving no result, and the restarted job
resumes from the run directory.

This module imports submitit: only jobs and ``hpc submit`` import it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any

from hpc.errors import SubmitError
from hpc.preempt.guard import PreemptGuard
from hpc.preempt.requeue import (
    EXIT_REQUEUED,
    close_before_failing_exit,
    requeue_after_stop,
    stopped_by_request,
)
from hpc.pretrain.config import PretrainConfig
from hpc.submit.payload import _Requeueable, _submitit_logs_once

__all__ = ["PretrainJob"]


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
