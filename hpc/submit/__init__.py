"""Slurm jobs through submitit: submit, run on the nodes, watch, survive preemption.

* :mod:`hpc.submit.options` — :class:`SubmitOptions` (the schema) and its readers, extra
  sbatch options;
* :mod:`hpc.submit.executor` — :func:`submit` and the submitit executor;
* :mod:`hpc.submit.cli` — the ``hpc submit`` command line;
* :mod:`hpc.submit.payload` — what runs on every task of the job;
* :mod:`hpc.submit.handle` — :class:`SubmittedJob`: logs, watching, the result;
* :mod:`hpc.submit.watch` — ``sacct`` state, requeue history, the first failing rank;
* :mod:`hpc.preempt.requeue` — warning signal -> agreed stop -> checkpoint -> requeue
  (:mod:`hpc.preempt.guard`: the signals, the stop file and the stop request, :class:`PreemptGuard`);
* :mod:`hpc.preempt.stop` — :class:`AgreedStop`: the loop's agreed stop, then requeue and exit;
* :mod:`hpc.checkpoint.resume` — :func:`save_checkpoint` / :func:`restore_checkpoint` for any
  script (all ranks call, the master writes), on :mod:`hpc.checkpoint.files`'s files;
* :mod:`hpc.checkpoint.sampler` — :class:`ResumableSampler`, a mid-epoch resumable
  ``DistributedSampler``.

Served lazily: importing :mod:`hpc.submit` imports neither torch nor submitit.
"""

from __future__ import annotations

from hpc._lazy import lazy_attributes

__all__ = ["AgreedStop", "Restored", "ResumableSampler", "SubmitOptions", "SubmittedJob",
           "make_executor", "parse_sbatch", "restore_checkpoint", "save_checkpoint",
           "sbatch_long_options", "submit"]

_LAZY = {"submit": "hpc.submit.executor", "make_executor": "hpc.submit.executor",
         "SubmitOptions": "hpc.submit.options", "parse_sbatch": "hpc.submit.options",
         "sbatch_long_options": "hpc.submit.options", "SubmittedJob": "hpc.submit.handle",
         "save_checkpoint": "hpc.checkpoint.resume", "restore_checkpoint": "hpc.checkpoint.resume",
         "Restored": "hpc.checkpoint.resume", "ResumableSampler": "hpc.checkpoint.sampler",
         "AgreedStop": "hpc.preempt.stop"}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
