"""Preemption inside every rank, under any launcher: signal -> agreed stop -> requeue.

Runs in the ranks of ``hpc run``, torchrun, mpirun, srun and ``hpc submit`` alike and
knows nothing of submitit (:mod:`hpc.submit` builds on it, never the reverse):

* :mod:`hpc.preempt.guard` — the local stop request: :class:`PreemptGuard` (the
  warning and preemption signals, the stop file) and :class:`StopFlag` (a request from
  code), both polled once per step;
* :mod:`hpc.preempt.stop` — :class:`AgreedStop`: the stop every rank agrees on at the
  same step, then "requeue (or not) and exit";
* :mod:`hpc.preempt.ending` — the one ending of every stopped run,
  :func:`finish_after_stop`: wait for the save in flight, requeue, the exit code;
* :mod:`hpc.preempt.stage` — a stage's life (:func:`~hpc.preempt.stage.run_stage`):
  ``hpc pretrain``, ``hpc search`` and ``hpc tune`` from guard to exit code;
* :mod:`hpc.preempt.requeue` — the requeue decision: the budget, ``scontrol requeue``
  or the batch shell's marker (:func:`~hpc.preempt.requeue.requeue_job`, the core the
  batch host's ``hpc supervise`` uses too), the exit codes (and the table of variables
  read); :mod:`hpc.preempt.exclude` — the bad hosts added to a requeued job's
  ``ExcNodeList``;
* :mod:`hpc.preempt.shield` — ``python -m hpc.preempt.shield CMD``: a launcher run
  with SIGTERM blocked, for the batch templates.

Served lazily: importing :mod:`hpc.preempt` does not import torch.
"""

from __future__ import annotations

from hpc._lazy import lazy_attributes

__all__ = ["AgreedStop", "PreemptGuard", "StopFlag", "finish_after_stop"]

_LAZY = {"AgreedStop": "hpc.preempt.stop", "PreemptGuard": "hpc.preempt.guard",
         "StopFlag": "hpc.preempt.guard", "finish_after_stop": "hpc.preempt.ending"}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
