"""While training runs: stragglers, silent corruption, and faults injected on purpose.

* :mod:`hpc.health.step` — :class:`~hpc.health.step.StepHealth`, what a loop's step
  boundary calls (``hpc.AgreedStop``, ``hpc pretrain``);
* :mod:`hpc.health.straggler` — the compute/wait split of each step and the verdict rules;
* :mod:`hpc.health.divergence` — the replicated-state digest compared across ranks;
* :mod:`hpc.health.fault` — ``HPC_FAULT=rank:step:kind``.

It reads the watchdog's collective tracker (time blocked in collectives) and uses
:mod:`hpc.sync.agree` for its small collectives; nothing below it imports it.
"""
