"""Slurm jobs through submitit: submit, run on the nodes, watch, survive preemption.

* :mod:`hpc.submit.options` — :class:`SubmitOptions` (the schema) and its readers, extra
  sbatch options;
* :mod:`hpc.submit.executor` — :func:`submit` and the submitit executor;
* :mod:`hpc.submit.cli` — the ``hpc submit`` command line;
* :mod:`hpc.submit.payload` — what runs on every task of the job: a module or a function;
* :mod:`hpc.submit.pretrain_job` — :class:`PretrainJob`, ``hpc pretrain`` as such a job;
* :mod:`hpc.submit.handle` — :class:`SubmittedJob`: logs, watching, the result;
* :mod:`hpc.submit.watch` — ``sacct`` state, requeue history, the first failing rank.

What runs in every rank of such a job (the agreed stop, the requeue, checkpoints) is
:mod:`hpc.preempt` and :mod:`hpc.checkpoint`: they work under any launcher.

Served lazily: importing :mod:`hpc.submit` imports neither torch nor submitit.
"""

from __future__ import annotations

from hpc._lazy import lazy_attributes

__all__ = ["SubmitOptions", "SubmittedJob", "make_executor", "parse_sbatch",
           "sbatch_long_options", "submit"]

_LAZY = {"submit": "hpc.submit.executor", "make_executor": "hpc.submit.executor",
         "SubmitOptions": "hpc.submit.options", "parse_sbatch": "hpc.submit.options",
         "sbatch_long_options": "hpc.submit.options", "SubmittedJob": "hpc.submit.handle"}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
