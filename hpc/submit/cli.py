"""The ``hpc submit`` command line (the API is :mod:`hpc.submit`).

The flags of the job's layout are the fields of :class:`~hpc.submit.options.SubmitOptions`
(flag names, help, defaults and types come from the field's metadata); this module adds
``--wait``, ``--wait-timeout`` and the target. Importing it imports neither torch nor
submitit, so ``hpc --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from collections.abc import Sequence
from typing import Any

from hpc._command import subcommand
from hpc.errors import SubmitError
from hpc.submit.options import SubmitOptions

__all__ = ["add_parser", "main", "split_target"]

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
  hpc submit --array 4 -N 1 --gpus-per-node 2 -- --out runs/sweep/{task}   (4 jobs)
"""


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


def _option_flags(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`~hpc.submit.options.SubmitOptions` field, from its metadata."""
    hints = typing.get_type_hints(SubmitOptions)
    for f in dataclasses.fields(SubmitOptions):
        meta = f.metadata
        kw = dict(meta["argparse"])
        default = meta["cli_default"]
        if default is dataclasses.MISSING:  # a repeatable flag collects into a fresh list
            default = [] if kw.get("action") == "append" else f.default
        kind = next((t for t in (hints[f.name], *typing.get_args(hints[f.name]))
                     if t in (int, float)), None)
        if kind is not None:
            kw.setdefault("type", kind)
        p.add_argument(*meta["flags"], dest=f.name, default=default,
                       help=meta["help"].format(default=default), **kw)


def _build(p: argparse.ArgumentParser) -> None:
    _option_flags(p)
    a = p.add_argument
    a("--wait", action="store_true",
      help="follow rank 0's log until the job ends (through requeues); exit with its status")
    a("--wait-timeout", type=float, default=None, metavar="S",
      help="with --wait: give up after S seconds (the job keeps running)")
    a("cmd", nargs=argparse.REMAINDER, help="-- [pretrain] [options] | -m pkg.mod [args] "
      "| pkg.mod:func [args]")


def _options(args: argparse.Namespace, kind: str) -> SubmitOptions:
    """The :class:`SubmitOptions` the flags describe (each field's ``parse`` applied)."""
    values = {}
    for f in dataclasses.fields(SubmitOptions):
        value, parse = getattr(args, f.name), f.metadata["parse"]
        values[f.name] = parse(value) if parse is not None else value
    if values["name"] is None:
        values["name"] = ("hpc-pretrain" if kind == "pretrain" else
                          "hpc-" + kind.split(":", 1)[1].split(":")[0].split(".")[-1])
    return SubmitOptions(**values)


def _target(kind: str, rest: list[str]) -> tuple[Any, list[str]]:
    if kind == "pretrain":
        from hpc.pretrain.cli import add_flags  # the one pretrain parser
        from hpc.pretrain.cli import config_from_args
        from hpc.submit.pretrain_job import PretrainJob

        parser = argparse.ArgumentParser(prog="hpc submit ... -- pretrain")
        add_flags(parser)
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
    from hpc.submit.executor import submit, submit_array

    try:
        kind, rest = split_target(args.cmd)
        target, targs = _target(kind, rest)
        options = _options(args, kind)
        jobs = (submit_array(target, targs, options=options) if options.is_array
                else [submit(target, targs, options=options)])
    except SubmitError as e:
        print(f"hpc submit: {e}", file=sys.stderr)
        return 2
    for job in jobs:
        print(job.describe(), flush=True)
    if not args.wait:
        return 0
    status = 0
    for job in jobs:  # an array: each task's log in turn; the worst status
        try:
            status = max(status, job.follow(timeout=args.wait_timeout))
        except SubmitError as e:
            print(f"hpc submit: {e}", file=sys.stderr)
            status = max(status, 1)
        except KeyboardInterrupt:
            print(f"\nhpc submit: stopped following; job {job.job_id} keeps running "
                  f"(scancel {job.job_id} to cancel it)", file=sys.stderr)
            return 130
    return status


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


main = subcommand(add_parser)