"""The agreed stop for a training loop, and "requeue (or not) and exit" at its end.

A preemption signal reaches some ranks and not others, and at different moments. A loop
that stopped on its own rank's flag would leave the others waiting in the next
collective. :class:`AgreedStop` turns the local requests of a
:class:`~hpc.preempt.guard.PreemptGuard` into one answer every rank gets at the same
step: one ``all_reduce(MAX)`` of a one-element tensor, on the steps where
``step % every == 0`` (a rule all ranks know in advance, so they reduce together)::

    stop = hpc.AgreedStop()              # installs the guard: first thing in the script
    ...
    for step in ...:
        train_step()
        if stop(step):                   # True on every rank at the same step
            hpc.save_checkpoint("ckpt", step, model=model, ...)
            stop.requeue_and_exit(step, "ckpt")   # exits 75 when requeued

``requeue_and_exit`` is the one ending of every stopped run
(:func:`~hpc.preempt.ending.finish_after_stop`): it waits for the save in flight (a
``save_checkpoint(..., blocking=False)`` of the stop step is on disk before Slurm may end
the job), then requeues. The exit codes are those of ``hpc pretrain``: 75 after a
requeue, 0 outside Slurm (rerun to resume), 1 when the job could not be requeued. Cost per call at 2 ranks over gloo: ``python bench/agreed_stop.py`` (see
``docs/preemptible.md``); ``every=k`` divides it by ``k`` and delays the stop by at most
``k - 1`` steps.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn, Optional

from hpc.preempt.ending import close_before_failing_exit, finish_after_stop
from hpc.preempt.guard import PreemptGuard

__all__ = ["AgreedStop"]


class AgreedStop:
    """An agreed-stop check, cheap enough to call every step.

    Args:
        guard: The signal source (default: a new :class:`PreemptGuard`, installed now:
            ``HPC_PREEMPT_SIGNALS``, else the warning signal and TERM).
        every: Agree only on steps that are multiples of ``every`` (the same on every
            rank); other calls return False without a collective.
        model, optimizer: The replicated state to compare across ranks every
            ``HPC_SDC_EVERY`` steps (silent-corruption check; none without ``model``).
        health: The :class:`~hpc.health.step.StepHealth` to run at each call instead
            of one made at the first call from ``model``, ``optimizer`` and the ``HPC_*``
            settings (a loop that chooses its own, e.g. ``environ=``).

    Each call is also a step boundary of :class:`hpc.health.step.StepHealth`: the
    straggler detector's timing (its rows ride in this call's collective once per
    ``HPC_STRAGGLER_EVERY`` steps, an all_gather instead of the all_reduce), the
    corruption check and ``HPC_FAULT``.

    Attributes:
        stopped: True once a call returned True.
        step: The step of that call.
    """

    def __init__(self, guard: Optional[PreemptGuard] = None, *, every: int = 1,
                 model: Any = None, optimizer: Any = None, health: Any = None) -> None:
        if int(every) < 1:
            raise ValueError(f"AgreedStop: every={every} must be >= 1 (1: every step).")
        self.guard = guard if guard is not None else PreemptGuard().install()
        self.every = int(every)
        self.stopped = False
        self.step: Optional[int] = None
        self._watched = (model, optimizer)
        self._health: Any = health

    @property
    def health(self) -> Any:
        """The :class:`~hpc.health.step.StepHealth` of this loop (made at the first
        call, once the process group exists)."""
        if self._health is None:
            from hpc.health.step import StepHealth
            from hpc.sync.agree import world

            rank, ws = world()
            self._health = StepHealth(rank, ws, model=self._watched[0],
                                      optimizer=self._watched[1])
        return self._health

    @property
    def requested(self) -> bool:
        """This rank's own request (no collective, no step hook)."""
        return self.guard.requested

    @property
    def signal_name(self) -> str:
        """The signal that asked for the stop (for messages)."""
        return self.guard.signal_name

    def __call__(self, step: int) -> bool:
        """True on every rank once any rank got a stop signal (collective on due steps).

        Call it on every rank after each step with the same ``step``. It runs the
        guard's step hook (``HPC_STEP_HOOK``) on every call.
        """
        local = self.guard()
        health = self.health
        health.boundary(step)
        if self.stopped:
            return True
        if step % self.every:
            return False
        if health.due(step, self.every):
            agreed = self._agree_with_rows(local, health, step)
        else:
            agreed = self._agree(local)
        if agreed:
            self.stopped, self.step = True, int(step)
        return agreed

    def _agree(self, local: bool) -> bool:
        from hpc.sync.agree import any_true  # torch: only once the loop runs

        return any_true(local)

    def _agree_with_rows(self, local: bool, health: Any, step: int) -> bool:
        """The agreement and the straggler rows in one all_gather."""
        from hpc.sync.agree import gather_rows

        table = gather_rows([1.0 if local else 0.0, *health.row()])
        health.receive(step, [row[1:] for row in table])
        return any(row[0] > 0 for row in table)

    def exit_code(self, step: int, checkpoint: Optional[str] = None, *,
                  stopped: Optional[bool] = None) -> int:
        """The exit status after the loop: the one ending when it stopped (collective).

        Args:
            step: The last step done.
            checkpoint: That step's checkpoint (for the messages).
            stopped: Whether the loop ended on a stop request (default
                ``stopped``; loops that agree on their own pass it).

        Returns:
            0 when the loop was not stopped, else the outcome of
            :func:`~hpc.preempt.ending.finish_after_stop` (the save in flight waited
            for, then 75 requeued, 0 not a Slurm job, 1 not requeued), the same on every
            rank. The process group stays open: :meth:`requeue_and_exit` closes it
            before a non-zero exit.

        Raises:
            CheckpointError: on every rank, when the save in flight failed.
        """
        if not (self.stopped if stopped is None else stopped):
            return 0
        return finish_after_stop(step, checkpoint, signame=self.signal_name,
                                 close=False).exit_code

    def requeue_and_exit(self, step: int, checkpoint: Optional[str] = None) -> NoReturn:
        """:meth:`exit_code`, then ``sys.exit`` with it (collective).

        Before a non-zero exit, the process group is closed and SIGTERM ignored
        (:func:`~hpc.preempt.ending.close_before_failing_exit`: srun's TERM to a peer
        still shutting down would turn the agreed exit into a failed job).
        """
        code = self.exit_code(step, checkpoint)
        sys.stdout.flush()
        if code:
            close_before_failing_exit()
        sys.exit(code)
