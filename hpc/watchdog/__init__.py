"""After init: which rank failed or is stuck, and ending the whole job when one fails.

* :mod:`hpc.watchdog.tracker` — the sequence number of every world collective;
* :mod:`hpc.watchdog.monitor` — the watchdog thread of every rank: the stuck-rank
  report on a hang or a failed collective, and one failing rank ends the job;
* :mod:`hpc.watchdog.report` — the report's text;
* :mod:`hpc.watchdog.marks` — the failure mark every rank writes when it begins to
  fail, the failing-process flag, and their readers;
* :mod:`hpc.watchdog.launchlog` — the parser of what srun, slurmstepd, torchrun and
  mpirun print when ranks fail;
* :mod:`hpc.watchdog.failure` — the one "which rank failed first" rule over both,
  read by ``hpc run``, ``hpc first-failure`` and ``hpc submit --wait``.

:func:`hpc.init_torch` starts the watchdog; nothing here imports :mod:`hpc.bootstrap`.
"""
