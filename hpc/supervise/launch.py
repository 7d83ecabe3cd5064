"""How ``hpc supervise`` starts one attempt of the step: its command line.

Pure. Three ways, one per template:

- one task per rank (``slurm/pretrain.sbatch``): ``srun --ntasks-per-node=T COMMAND``; each
  task is a rank and finds its layout in the step's ``SLURM_*`` variables;
- one torchrun per host (``slurm/torchrun.sbatch``, ``--torchrun NPROC``): ``srun
  --ntasks-per-node=1 python -m torch.distributed.run --nnodes N --nproc-per-node NPROC
  --rdzv-endpoint HEAD:PORT ...``: the rendezvous lives on the attempt's first host (the
  allocation's first may be the one left out) on a port of its own per attempt;
- one mpirun (``slurm/mpirun.sbatch``, ``--mpirun LAUNCHER``): ``LAUNCHER -np N --host
  h1:T,h2:T COMMAND`` (MPICH's hydra: ``-hosts``), which starts its daemons through its
  own srun; the ranks get ``MASTER_ADDR`` (the attempt's first host, where rank 0 runs)
  and a ``MASTER_PORT`` of the attempt (:func:`mpirun_env`).

The srun ones run with ``--kill-on-bad-exit=1`` (one failed task ends the step), ``--overlap`` (a
cancelled step whose host is cut off keeps its CPUs until Slurm hears from that host
again; only one attempt runs at a time), ``--nodelist`` (the attempt's hosts) and the
attempt's job name (how the supervisor finds the step to cancel it).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from hpc.environments.base import derive_port
from hpc.environments.slurm import slurm_port

__all__ = ["srun_argv", "mpirun_argv", "mpirun_env", "rendezvous_port"]


def rendezvous_port(environ: Mapping[str, str], attempt: int) -> int:
    """torchrun's rendezvous port: the template's (slot 63 of the job's port rule) for the
    first attempt, another one for each later attempt (the first host may be another)."""
    if attempt == 0:
        return slurm_port(environ, step=63)
    job = environ.get("SLURM_JOB_ID") or "0"
    return derive_port(job, "torchrun", attempt)


def srun_argv(command: Sequence[str], hosts: Sequence[str], per_node: int, name: str, *,
              srun_args: Sequence[str] = (), torchrun: int = 0, attempt: int = 0,
              environ: Mapping[str, str] | None = None,
              python: str = sys.executable) -> list[str]:
    """The attempt's command line.

    Args:
        command: What the step runs: the rank's command, or with ``torchrun`` what follows
            torchrun's own options (``-m hpc pretrain ...``, ``--no-python CMD``, ``train.py``).
        hosts: The attempt's hosts; the first holds the rendezvous.
        per_node: Ranks per host.
        name: The step's job name.
        srun_args: More srun options for every attempt.
        torchrun: Workers per host under torchrun; 0: one srun task per rank.
        attempt: 0 for the first attempt (torchrun's port).
        environ: The job's variables (torchrun's port and rendezvous id).
        python: The interpreter that runs torchrun.
    """
    n = len(hosts)
    tasks = 1 if torchrun else per_node
    argv = ["srun", "--label", "--kill-on-bad-exit=1", "--overlap", f"--job-name={name}",
            f"--nodes={n}", f"--ntasks={n * tasks}", f"--ntasks-per-node={tasks}",
            f"--nodelist={','.join(hosts)}", *srun_args]
    if not torchrun:
        return [*argv, *command]
    env = dict(environ or {})
    job = env.get("SLURM_JOB_ID") or "0"
    return [*argv, python, "-m", "torch.distributed.run", "--nnodes", str(n),
            "--nproc-per-node", str(torchrun), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{hosts[0]}:{rendezvous_port(env, attempt)}",
            "--rdzv-id", f"{job}-{attempt}", *command]


def mpirun_argv(launcher: Sequence[str], command: Sequence[str], hosts: Sequence[str],
                per_node: int, *, open_mpi: bool) -> list[str]:
    """``LAUNCHER -np N --host h1:T,... COMMAND``: ``launcher`` is the mpirun and its own
    options (``python -m hpc.preempt.shield mpirun --mca ...``); ``open_mpi`` picks the
    host option's spelling (Open MPI ``--host``, MPICH's hydra ``-hosts``)."""
    spec = ",".join(f"{h}:{per_node}" for h in hosts)
    return [*launcher, "-np", str(len(hosts) * per_node),
            "--host" if open_mpi else "-hosts", spec, *command]


def mpirun_env(hosts: Sequence[str], environ: Mapping[str, str], attempt: int) -> dict[str, str]:
    """The master of an mpirun attempt: rank 0 runs on its first host (the allocation's
    first, the master without mpi4py, may be the host left out); a port of its own."""
    job = environ.get("SLURM_JOB_ID") or "0"
    return {"MASTER_ADDR": hosts[0], "MASTER_PORT": str(derive_port(job, "mpi", attempt))}
