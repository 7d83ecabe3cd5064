"""Keep training when a node dies: ``hpc supervise`` runs the job's step from the batch
shell and restarts it inside the allocation without the host that failed.

- :mod:`hpc.supervise.verdict`: pure, why an attempt failed (the host's fault or the
  program's) from srun's (torchrun's, mpirun's) lines, the failure marks and the nodes' Slurm states;
- :mod:`hpc.supervise.plan`: pure, the next attempt's hosts (spares fill in), the restart
  budget and the no-progress limit, requeue without the bad hosts when none is left;
- :mod:`hpc.supervise.launch`: pure, an attempt's command line (srun per rank, torchrun
  per host, or one mpirun);
- :mod:`hpc.supervise.hosts`: the allocation, the hosts' Slurm states, and whether they
  answer on slurmd's port;
- :mod:`hpc.supervise.supervisor`: the loop (the attempt, scancel, the ledger, requeue);
- :mod:`hpc.supervise.cli`: ``hpc supervise``.

Runs on the batch host; imports no torch. The ranks only write the progress file
(:func:`hpc.save_checkpoint` does), which :mod:`hpc.checkpoint.progress` (its writer's
room) defines and reads.
"""

__all__: list[str] = []
