"""What the test modules share, one module per concern; a test module never imports
another test module (``tests/unit/test_layout.py`` checks it).

* :mod:`tests.helpers.paths`: the repository root and ``tests/integration/scripts``;
* :mod:`tests.helpers.requires`: skip (fail under ``HPC_CI=1``) when a tool is missing;
* :mod:`tests.helpers.processes`: real subprocesses with a timeout that kills the whole
  process group, ``hpc run`` among them;
* :mod:`tests.helpers.demo`: what ``python -m hpc demo`` prints under a launcher, checked;
* :mod:`tests.helpers.mpi`: Open MPI / MPICH launcher environments, with or without mpi4py;
* :mod:`tests.helpers.slurm`: the local test cluster: its environment, ``srun``/``salloc``
  and ``sbatch`` under a time limit and a job name, waiting on what a job does;
* :mod:`tests.helpers.preemption`: the preemptible/urgent partitions and the urgent job;
* :mod:`tests.helpers.tiny_pretrain`: the tiny pretrain of the requeue tests, and the checks
  that a resumed run ended bitwise as its uninterrupted reference;
* :mod:`tests.helpers.step_hooks`: the ``HPC_STEP_HOOK`` that slows a job's first runs
  (the nodes import it by name);
* :mod:`tests.helpers.envdumps`: the captured launch environments in ``tests/fixtures/env/``.

The fixtures several modules share (``cluster``, ``job``, ``cancel_after``,
``preemption_partitions``) are in ``tests/integration/conftest.py``.
"""
