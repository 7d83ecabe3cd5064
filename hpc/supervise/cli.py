"""``hpc supervise [OPTIONS] -- COMMAND``: the batch shell's step, restarted without a
failed host (:mod:`hpc.supervise.supervisor`).

Inside an sbatch allocation of N + K nodes (K = ``--spare-nodes``, default
``HPC_SPARE_NODES``), runs ``srun --kill-on-bad-exit=1`` of COMMAND on N of them with the
allocation's tasks per node. When the step fails because of a host (a rank killed by a
signal, a node DOWN or unreachable, a frozen node, a lost peer), relaunches it on the
other hosts plus a spare, resuming from the newest checkpoint; a failure of the program
(a Python exception, ``sys.exit(1)``) ends the job at once. Every decision is one line
starting ``hpc supervise:``. Submit with ``#SBATCH --no-kill`` so that Slurm keeps the job
when a node fails. Exit status: the step's, 75 when the job was requeued.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from hpc._command import subcommand

__all__ = ["add_parser", "main"]


def _run(args: argparse.Namespace) -> int:
    from hpc import envvars
    from hpc.supervise.supervisor import Options, supervise

    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        args.parser.error("a COMMAND to run is required, after --")
    spares = envvars.value("HPC_SPARE_NODES") if args.spare_nodes is None else args.spare_nodes
    restarts = (envvars.value("HPC_MAX_RESTARTS") if args.max_restarts is None
                else args.max_restarts)
    srun_args = tuple(a for a in (args.srun_arg or []))
    elastic = args.elastic or envvars.value("HPC_SUPERVISE_ELASTIC") == "1"
    return supervise(Options(tuple(command), int(spares), int(restarts), elastic,
                             srun_args, args.torchrun, tuple(shlex.split(args.mpirun or ""))))


def add_parser(sub: Any) -> None:
    """Register ``hpc supervise`` on the ``hpc`` subparsers ``sub``."""
    p = sub.add_parser("supervise", help="run the job's step; restart it without a failed host",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spare-nodes", type=int, default=None, metavar="K",
                   help="hosts of the allocation kept as spares (default HPC_SPARE_NODES, 0)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="restarts after host failures (default HPC_MAX_RESTARTS, 3); an "
                   "attempt that wrote no new checkpoint costs 2")
    p.add_argument("--elastic", action="store_true",
                   help="with no spare left, go on on fewer hosts (the command must allow a "
                   "world-size change, e.g. hpc pretrain --elastic) instead of requeueing (default "
                   "HPC_SUPERVISE_ELASTIC=1)")
    p.add_argument("--srun-arg", action="append", metavar="ARG",
                   help="one more srun option for every attempt (repeatable), e.g. "
                   "--srun-arg=--cpus-per-task=4")
    p.add_argument("--torchrun", type=int, default=0, metavar="NPROC",
                   help="run one torchrun per host with NPROC workers (COMMAND is what follows "
                   "torchrun's options: -m hpc pretrain ..., train.py, --no-python CMD); the "
                   "rendezvous is on each attempt's first host (slurm/torchrun.sbatch)")
    p.add_argument("--mpirun", default=None, metavar="LAUNCHER",
                   help="run the ranks with this mpirun command line (shell words, e.g. "
                   "'mpirun --mca btl tcp,self'), given -np and the attempt's hosts "
                   "(--host, -hosts for MPICH) each time (slurm/mpirun.sbatch)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND")
    p.set_defaults(func=_run, parser=p)


main = subcommand(add_parser)
