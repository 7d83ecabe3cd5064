"""What :func:`hpc.init_torch` runs, in call order.

* :mod:`hpc.bootstrap.distributed` — ``init_torch``/``teardown``, export, roles, barriers;
  the one writer of ``os.environ`` here: the other phases (:mod:`~hpc.bootstrap.threads`,
  :mod:`~hpc.bootstrap.interfaces`, ...) return the variables they want set and its export
  step applies them, in call order;
* :mod:`hpc.bootstrap.master` — the master address where the launcher gives none;
* :mod:`hpc.bootstrap.preflight` — the pre-flight before init (all ranks joined, no GPU shared);
  under torchrun scoped by :mod:`hpc.bootstrap.attempt`, the attempt id all ranks share;
  :mod:`hpc.bootstrap.interfaces` finds the interface that reaches the master (before it),
  :mod:`hpc.bootstrap.network` checks every node's network (in it);
* :mod:`hpc.bootstrap.backend` — the backend for the devices (``cpu:gloo,cuda:nccl``);
* :mod:`hpc.bootstrap.gpubind` — one GPU per nccl rank;
* :mod:`hpc.bootstrap.build` — a CPU-only torch where GPUs were granted: refused
  (``HPC_ALLOW_CPU=1`` accepts it);
* :mod:`hpc.bootstrap.threads` — CPU threads per rank (``SLURM_CPUS_PER_TASK``);
* :mod:`hpc.bootstrap.shutdown` — at exit: destroy, abort or end the group, by what happened.
* :mod:`hpc.bootstrap.phases` — how long each of these phases took (``bench/startup.py``).

After init, :mod:`hpc.watchdog` takes over (init starts its monitor and installs its
failure marks); nothing there imports this room.

Nothing here is imported by ``import hpc``; the public names are served by :mod:`hpc`.
"""
