"""``hpc pretrain`` as a submitit job: :class:`PretrainJob`, on every task of the job.

It lives the stage's one life (:func:`hpc.preempt.stage.live`, as the ``hpc pretrain``
command does): the guard installed first (it replaces submitit's signal handler),
``init_torch``, the run, and after an agreed stop the one ending
(:func:`hpc.preempt.ending.finish_after_stop`: the save in flight waited for, then the
requeue), with one submitit step before the requeue: the master writes
``checkpoint()``'s resubmission over the job's submission pickle. Every rank then exits
with 75, leaving no result, and the restarted job resumes from the run directory.

This module imports submitit: only jobs and ``hpc submit`` import it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from hpc.errors import EXIT_REQUEUED, SubmitError
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
        from hpc.preempt.stage import live

        _submitit_logs_once()
        cfg = self.config
        ended = live("pretrain", lambda: cfg, _pretrain, lambda c: Path(c.out) / "pretrain.log",
                     lambda result, c: (result.step, c.max_steps, result.checkpoint),
                     log_level=self.log_level, before_requeue=self._write_resubmission)
        if ended.code == EXIT_REQUEUED:
            sys.exit(EXIT_REQUEUED)  # SystemExit: submitit writes no result; the job reruns
        if ended.code == 0:
            return ended.result  # completed, or stopped outside Slurm (rerun to resume)
        if ended.error is not None:
            raise ended.error
        # Every rank agreed on this end (budget used up, requeue failed, a failed run).
        raise SubmitError(ended.outcome.message if ended.outcome is not None else
                          f"hpc pretrain ended with status {ended.result.status!r}.\n"
                          "HINT: see this task's log for its error.")

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


def _pretrain(cfg: PretrainConfig, stop_requested: Any) -> Any:
    from hpc.pretrain.loop import pretrain

    return pretrain(cfg, stop_requested=stop_requested)
