"""A stage's life, the one shape of ``hpc pretrain``, ``hpc search`` and ``hpc tune``.

:func:`run_stage` runs a stage: the warning-signal guard first (a signal must not kill a
rank still importing torch), the config validated, ``init_torch``, logging into the
output directory, the stage, then, after an agreed stop, the one ending
(:func:`hpc.preempt.ending.finish_after_stop`: the save in flight, the requeue, the exit
code). Exit codes (the same on every rank): 0 completed or stopped cleanly, 2 a bad
command line, 1 an error in the stage (the process is then marked as failing, so its
exit aborts the process group instead of destroying it), 75 stopped and requeued.

The command lines that lead here (flags from the config dataclass) are
:mod:`hpc._command`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from hpc.preempt.requeue import Outcome

__all__ = ["Ended", "Progress", "live", "run_stage"]

logger = logging.getLogger(__name__)

#: ``progress(result, cfg) -> (position, stop position or None, checkpoint path)``.
Progress = Callable[[Any, Any], "tuple[int, Optional[int], Any]"]


@dataclasses.dataclass(frozen=True)
class Ended:
    """How a stage's life ended (the same ``code`` on every rank).

    Attributes:
        code: The exit status (0, 1, 2 or 75, see the module).
        result: What the stage returned (None when it raised or never ran).
        outcome: The one ending's :class:`~hpc.preempt.requeue.Outcome` after an agreed
            stop, else None.
        error: The exception that failed the stage (logged, marked), else None.
    """

    code: int
    result: Any = None
    outcome: Optional[Outcome] = None
    error: Optional[BaseException] = None


def run_stage(command: str, config: Callable[[], Any], stage: Callable[..., Any],
              log_file: Callable[[Any], Optional[Path]], progress: Progress, *,
              log_level: str = "INFO") -> int:
    """Run one stage command; return the exit status (:func:`live`'s ``code``)."""
    return live(command, config, stage, log_file, progress, log_level=log_level).code


def live(command: str, config: Callable[[], Any], stage: Callable[..., Any],
         log_file: Callable[[Any], Optional[Path]], progress: Progress, *,
         log_level: str = "INFO",
         before_requeue: Optional[Callable[[], None]] = None) -> Ended:
    """A stage's whole life: guard, config, init, logging, the stage, the one ending.

    Args:
        command: The command's name, for messages.
        config: Makes the stage's config (e.g. from the parsed command line); its
            ``validate()`` raises ``ValueError`` on a bad one.
        stage: ``stage(cfg, stop_requested=guard) -> result``; ``result.status`` is
            ``completed``, ``stopped`` or anything else for a failed run.
        log_file: The log file the global master writes for ``cfg`` (None: none).
        progress: Where the stage stopped, its limit and its checkpoint.
        log_level: Console level on local masters (``DEBUG``, ``INFO``, ``WARNING``).
        before_requeue: Run on the global master just before the requeue after a stop
            (submitit jobs write their resubmission); an exception cancels the requeue.
    """
    from hpc.errors import HPCError
    from hpc.preempt.stop import AgreedStop

    try:  # first: the warning signal must not kill a rank that is still importing torch
        stop = AgreedStop()  # installs the guard
    except HPCError as e:
        print(f"hpc {command}: {e}", file=sys.stderr)
        return Ended(2, error=e)
    cfg = config()
    try:
        cfg.validate()
    except ValueError as e:
        print(f"hpc {command}: {e}", file=sys.stderr)
        return Ended(2, error=e)
    from hpc.bootstrap.distributed import init_torch
    from hpc.log import setup_logging

    info = init_torch(seed=cfg.seed)
    setup_logging(info, level=getattr(logging, log_level), log_file=log_file(cfg))
    try:
        result = stage(cfg, stop_requested=stop.guard)  # agreed inside the loop
        return _end(command, result, cfg, progress, stop, before_requeue)
    except (HPCError, ValueError, FileNotFoundError, TypeError) as e:
        from hpc.watchdog.marks import mark_exception

        logger.error("%s", e)
        logger.debug("%s failed", command, exc_info=True)
        mark_exception(e)  # the rank's mark says what failed (hpc first-failure, supervise)
        return Ended(1, error=e)


def _end(command: str, result: Any, cfg: Any, progress: Progress, stop: Any,
         before_requeue: Optional[Callable[[], None]]) -> Ended:
    """How a stage that returned ``result`` ends: the one ending after a stop."""
    from hpc.preempt.ending import finish_after_stop
    from hpc.preempt.requeue import stopped_by_request

    position, limit, checkpoint = progress(result, cfg)
    if stopped_by_request(result.status, position, limit):
        outcome = finish_after_stop(position, checkpoint, signame=stop.signal_name,
                                    before_requeue=before_requeue)
        return Ended(outcome.exit_code, result, outcome)
    if result.status not in ("completed", "stopped"):
        from hpc.watchdog.marks import note_failure

        note_failure(f"{command} {result.status}")  # its exit aborts the process group
        return Ended(1, result)
    return Ended(0, result)
