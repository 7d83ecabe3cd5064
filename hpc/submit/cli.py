"""The ``hpc submit`` command line (the API is :mod:`hpc.submit`).

Importing this module imports neither torch nor submitit, so ``hpc --help`` stays fast.
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
from collections.abc import Sequence
from typing import Any

from hpc.errors import SubmitError

__all__ = ["add_parser", "main", "parse_time", "split_target"]

DESCRIPTION = """Submit `hpc pretrain` (or any module or function) as one multi-node Slurm
job through submitit: one task per GPU, every task runs the target in-process with the
SLURM_* variables that hpc.init_torch() reads.

Preemption and time limits: Slurm sends --signal (USR2) --signal-delay seconds before the
limit (or when you run `scancel --signal=USR2 ID`); every rank stops at the same step, the
master checkpoints, the job is requeued and resumes from the run directory, at most
--max-requeues times. Prints the job id, the log files and how to watch and cancel."""

EPILOG = """targets (after --):
  [pretrain] [hpc pretrain options]   default; e.g. -- --epochs 5 --out runs/x
  -m pkg.mod [args]                   python -m pkg.mod args on every task
  pkg.mod:func [args]                 func(*args) on every task

examples:
  hpc submit --nodes 2 --gpus-per-node 4 --time 2:00:00 -- --epochs 30 --out $SCRATCH/run1
  hpc submit --nodes 2 --gpus-per-node 0 --tasks-per-node 4 --wait -- --out runs/cpu
  hpc submit -N 1 --gpus-per-node 2 --sbatch account=proj --sbatch mail-type=END -- -m mypkg.train
"""


def parse_time(text: str) -> int:
    """Slurm time (``MIN``, ``MIN:SS``, ``H:MM:SS``, ``D-H[:MM[:SS]]``) -> whole minutes.

    Raises:
        argparse.ArgumentTypeError: not a Slurm time, or not positive.
    """
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Slurm time: use minutes (90), H:MM:SS (1:30:00) or "
            "D-HH:MM (1-12:00)")
    d, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if d is not None:  # days-hours[:minutes[:seconds]]
        seconds = ((d * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    elif c is not None:  # hours:minutes:seconds
        seconds = (a * 60 + b) * 60 + c
    elif b is not None:  # minutes:seconds
        seconds = a * 60 + b
    else:  # minutes
        seconds = a * 60
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"time {text!r} must be positive")
    return math.ceil(seconds / 60)


def split_target(cmd: Sequence[str]) -> tuple[str, list[str]]:
    """``[--] [pretrain] ARGS`` / ``-m MOD ARGS`` / ``MOD:FUNC ARGS`` -> (kind, rest).

    ``kind`` is ``pretrain``, ``module:<mod>`` or ``function:<spec>``.

    Raises:
        SubmitError: anything else (the message lists the three forms).
    """
    items = list(cmd)
    if items and items[0] == "--":
        items = items[1:]
    if not items or (items[0].startswith("-") and items[0] != "-m"):
        return "pretrain", items
    head = items[0]
    if head == "pretrain":
        return "pretrain", items[1:]
    if head == "-m":
        if len(items) < 2 or items[1].startswith("-"):
            raise SubmitError("-m needs a module name.\nHINT: hpc submit ... -- -m pkg.mod ARGS")
        return f"module:{items[1]}", items[2:]
    if ":" in head:
        return f"function:{head}", items[1:]
    raise SubmitError(
        f"unknown target {head!r}.\n"
        "HINT: after -- give one of: `pretrain [options]` (or just the options), "
        "`-m pkg.mod [args]`, `pkg.mod:func [args]`.")


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SubmitError(f"{what} {item!r} is not KEY=VALUE.\nHINT: e.g. {what} "
                              "OMP_NUM_THREADS=4")
        out[key] = value
    return out


def _build(p: argparse.ArgumentParser) -> None:
    from hpc.submit.preempt import DEFAULT_MAX_REQUEUES, DEFAULT_SIGNAL, VALID_SIGNALS

    a = p.add_argument
    a("--nodes", "-N", type=int, default=1, help="nodes (default 1)")
    a("--gpus-per-node", "-G", type=int, default=0,
      help="GPUs per node, one task per GPU (default 0: CPU tasks, see --tasks-per-node)")
    a("--tasks-per-node", type=int, default=None,
      help="tasks per node (default: --gpus-per-node, or 1 without GPUs)")
    a("--cpus-per-task", "-c", type=int, default=1, help="CPUs per task (default 1)")
    a("--partition", "-p", default=None, help="partition (default: the cluster's)")
    a("--time", "-t", type=parse_time, default=60, metavar="TIME",
      help="time limit: minutes, H:MM:SS or D-HH:MM (default 60 min)")
    a("--sbatch", action="append", default=[], metavar="KEY=VALUE",
      help="extra sbatch option, repeatable (e.g. account=proj, mail-type=END, exclusive)")
    a("--env", action="append", default=[], metavar="KEY=VALUE",
      help="variable exported in the job, repeatable")
    a("--log-dir", default="hpc-logs", metavar="DIR",
      help="logs and submitit files go to DIR/<job id>/ (default hpc-logs)")
    a("--name", "-J", default=None, help="job name (default hpc-<target>)")
    a("--signal", default=DEFAULT_SIGNAL, choices=VALID_SIGNALS,
      help=f"warning signal before the time limit (default {DEFAULT_SIGNAL}; USR1 may "
      "clash with NCCL)")
    a("--signal-delay", type=int, default=120, metavar="S",
      help="seconds before the time limit the signal comes (default 120)")
    a("--max-requeues", type=int, default=DEFAULT_MAX_REQUEUES, metavar="N",
      help=f"requeue budget (HPC_MAX_REQUEUES; default {DEFAULT_MAX_REQUEUES})")
    a("--python", default=None, help="interpreter on the nodes (default: this one)")
    a("--wait", action="store_true",
      help="follow rank 0's log until the job ends (through requeues); exit with its status")
    a("--wait-timeout", type=float, default=None, metavar="S",
      help="with --wait: give up after S seconds (the job keeps running)")
    a("cmd", nargs=argparse.REMAINDER, help="-- [pretrain] [options] | -m pkg.mod [args] "
      "| pkg.mod:func [args]")


def _target(kind: str, rest: list[str]) -> tuple[Any, list[str]]:
    if kind == "pretrain":
        from hpc.submit.payload import PretrainJob
        from hpc.pretrain.cli import _build as build_pretrain  # the one pretrain parser
        from hpc.pretrain.cli import config_from_args

        parser = argparse.ArgumentParser(prog="hpc submit ... -- pretrain")
        build_pretrain(parser)
        pargs = parser.parse_args(rest)
        cfg = config_from_args(pargs)
        try:
            cfg.validate()
        except ValueError as e:
            raise SubmitError(str(e)) from e
        return PretrainJob(cfg, log_level=pargs.log_level), []
    return kind.split(":", 1)[1], rest


def _run(args: argparse.Namespace) -> int:
    """Run ``hpc submit`` with parsed ``args``; return the exit status."""
    from hpc.submit.executor import submit
    from hpc.submit.options import SubmitOptions, parse_sbatch

    try:
        kind, rest = split_target(args.cmd)
        target, targs = _target(kind, rest)
        name = args.name or ("hpc-pretrain" if kind == "pretrain" else
                             "hpc-" + kind.split(":", 1)[1].split(":")[0].split(".")[-1])
        options = SubmitOptions(
            nodes=args.nodes, gpus_per_node=args.gpus_per_node,
            tasks_per_node=args.tasks_per_node, cpus_per_task=args.cpus_per_task,
            partition=args.partition, time_min=args.time, sbatch=parse_sbatch(args.sbatch),
            log_dir=args.log_dir, name=name, signal=args.signal,
            signal_delay_s=args.signal_delay, max_requeues=args.max_requeues,
            env=_pairs(args.env, "--env"), python=args.python)
        job = submit(target, targs, options=options)
    except SubmitError as e:
        print(f"hpc submit: {e}", file=sys.stderr)
        return 2
    print(job.describe(), flush=True)
    if not args.wait:
        return 0
    try:
        return job.follow(timeout=args.wait_timeout)
    except SubmitError as e:
        print(f"hpc submit: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nhpc submit: stopped following; job {job.job_id} keeps running "
              f"(scancel {job.job_id} to cancel it)", file=sys.stderr)
        return 130


def add_parser(sub: Any) -> None:
    """Register ``hpc submit``."""
    p = sub.add_parser("submit", help="submit hpc pretrain (or a module/function) as a "
                       "multi-node Slurm job with preemption-safe requeue",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _build(p)
    _strict(p)
    p.set_defaults(func=_run)


def _strict(p: argparse.ArgumentParser) -> None:
    """Reject unknown options here, with close matches and this parser's usage.

    argparse reports a subcommand's unknown options from the top-level parser, whose
    usage does not list them.
    """
    known = sorted(o for a in p._actions for o in a.option_strings if o.startswith("--"))
    parse = p.parse_known_args

    def strict(args: Any = None, namespace: Any = None) -> Any:
        ns, extras = parse(args, namespace)
        if extras:
            close = {e: difflib.get_close_matches(e.split("=")[0], known, n=1) for e in extras}
            maybe = "; ".join(f"{e} -> {c[0]}?" for e, c in close.items() if c)
            p.error(f"unknown option(s) {' '.join(extras)}" + (f" ({maybe})" if maybe else "")
                    + f". Valid options: {', '.join(known)}; the target goes after --")
        return ns, extras

    p.parse_known_args = strict  # type: ignore[method-assign]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hpc.submit ARGS``: the same as ``hpc submit ARGS``."""
    parser = argparse.ArgumentParser(prog="hpc submit", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _build(parser)
    return _run(parser.parse_args(argv))
