"""The one ending of a run that stopped on request: the save in flight, the requeue, the exit.

Every stopped run ends here, whoever drives its loop: the stage commands
(:func:`hpc.preempt.stage.run_stage`), a user's own script
(:meth:`hpc.AgreedStop.requeue_and_exit` / :meth:`~hpc.AgreedStop.exit_code`) and
submitit's :class:`~hpc.submit.pretrain_job.PretrainJob`. :func:`finish_after_stop`, on every
rank after the checkpoint of the stop step was saved:

1. waits for that save when it is asynchronous (``save_checkpoint(..., blocking=False)``
   returned while the writer process still writes it): the requeue makes Slurm end the
   job (SIGTERM, then SIGKILL after ``KillWait``, the writer included), so a requeue
   that came first lost the checkpoint the next run was to resume from. A failed write is
   raised here on every rank (:class:`~hpc.errors.CheckpointError`), before any requeue;
2. requeues the job (:func:`hpc.preempt.requeue.requeue_after_stop`: the budget, ``scontrol
   requeue`` or the batch shell's marker, the bad hosts excluded), the outcome the same
   on every rank;
3. before a non-zero exit (75 requeued, 1 not requeued), closes the process group and
   ignores SIGTERM (:func:`close_before_failing_exit`).

The exit codes: 75 after a requeue (:data:`~hpc.errors.EXIT_REQUEUED`), 0 outside Slurm
(nothing to requeue: rerun the same command to resume), 1 when the job could not be
requeued. The batch host's ``hpc supervise`` has no ranks and no save in flight: it
requeues through the same core, :func:`hpc.preempt.requeue.requeue_job`.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Callable, Optional

from hpc.preempt.requeue import Outcome, requeue_after_stop

__all__ = ["finish_after_stop", "close_before_failing_exit"]


def finish_after_stop(step: int, checkpoint: Optional[object] = None, *,
                      signame: str = "the warning signal", rank: Optional[int] = None,
                      before_requeue: Optional[Callable[[], None]] = None,
                      environ: Optional[Mapping[str, str]] = None,
                      close: bool = True) -> Outcome:
    """End a run that stopped after ``step`` (collective: every rank calls it).

    Args:
        step: The step the run stopped after.
        checkpoint: That step's checkpoint (a path, for the messages; None: none).
        signame: The signal that asked for the stop (for the messages).
        rank: This process's global rank (default: the process group's).
        before_requeue: Run on rank 0 just before ``scontrol requeue`` (submitit jobs
            write their resubmission here); an exception cancels the requeue.
        environ: Variables to read (default ``os.environ``).
        close: Before a non-zero ``exit_code``, close the process group and ignore
            SIGTERM (:func:`close_before_failing_exit`); False leaves that to a caller
            that exits later.

    Returns:
        The :class:`~hpc.preempt.requeue.Outcome`, the same on every rank; after a
        non-zero ``exit_code`` (with ``close``) the process group is closed: exit with it.

    Raises:
        CheckpointError: on every rank, when the save in flight failed (nothing was
            requeued; the checkpoints before it are intact).
    """
    from hpc.checkpoint.asyncsave import settle
    from hpc.sync.agree import world

    settle()  # the save in flight is on disk before Slurm may end the job
    outcome = requeue_after_stop(step, None if checkpoint is None else str(checkpoint),
                                 signame=signame,
                                 rank=world()[0] if rank is None else rank,
                                 before_requeue=before_requeue, environ=environ)
    if outcome.exit_code and close:
        close_before_failing_exit()
    return outcome


def close_before_failing_exit() -> None:
    """Before every rank's agreed non-zero exit: close the group and ignore SIGTERM.

    Left open, the failure teardown aborts the group, gloo SIGABRTs the rank, srun kills
    its peers and the job ends FAILED 15:0, not 1. Once the first rank exits, srun
    (--kill-on-bad-exit) TERMs the others; Python restores SIG_DFL for its own handlers
    at shutdown, so a peer still exiting would die 'Terminated' (15:0). Ignored, the
    TERM cannot; srun's SIGKILL still follows for a rank that does not end.
    """
    from hpc.bootstrap.distributed import teardown

    teardown()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
