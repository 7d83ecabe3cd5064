"""``hpc search``: the best sub-network of a pretrained supernet, under any launcher.

Loads the newest checkpoint of an ``hpc pretrain`` run on every rank, scores sub-networks
(exhaustively when the space has at most ``--budget``, else by evolution with exactly
``--budget`` evaluations), splits each generation across the ranks and writes
``OUT/search.json`` and ``OUT/pareto.png`` from the global master. The same seed gives
the same result on any number of ranks. Exit status 0 when the search completed or
stopped at a checkpoint, 1 on a run/checkpoint/constraint error, 2 on invalid arguments;
75 after a Slurm requeue (the warning signal, as in ``hpc pretrain``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from collections.abc import Sequence
from typing import Any, Optional

from hpc.pretrain.search_config import SearchConfig

__all__ = ["add_fields", "add_parser", "main"]

logger = logging.getLogger(__name__)

EPILOG = """examples:
  hpc run --nproc 4 -- hpc search --run runs/digits                 # RUN/search/
  hpc run --nproc 4 -- hpc search --run runs/digits --max-params 20000 --out runs/small
  srun --ntasks 8 hpc search --run $SCRATCH/digits --budget 200    # resumes on requeue
then: hpc run --nproc 2 -- hpc tune --search runs/digits/search
"""

HELP = {
    "run": "pretrain run directory (its --out)",
    "budget": "sub-networks evaluated (exhaustive when the space is this small)",
    "max_params": "keep sub-networks with at most P parameters",
    "max_latency_ms": "keep sub-networks whose median latency on rank 0 is <= L ms",
    "seed": "seed of the evolutionary draws",
    "population": "candidates per generation (= checkpoint interval)",
    "top_k": "parents: the best K so far",
    "mutation_prob": "per-choice mutation probability",
    "recal_samples": "train images recalibrating BatchNorm per candidate",
    "latency_batch": "batch size of the latency measurement",
    "latency_repeats": "timed forward passes per sub-network (median kept)",
    "out": "output directory, written by rank 0 (default RUN/search)",
    "max_generations": "stop with a checkpoint after this generation",
}


def add_fields(p: argparse.ArgumentParser, cls: Any, helps: dict[str, str]) -> None:
    """One ``--flag`` per field named in ``helps``: the field's type and default."""
    defaults, types = cls(), typing.get_type_hints(cls)
    for name, text in helps.items():
        kind = types[name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = args[0] if args else kind
        default = getattr(defaults, name)
        metavar = name.split("_")[-1].upper() if kind is str else None
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                       metavar=metavar, help=f"{text} (default {default})")


def _build(p: argparse.ArgumentParser) -> None:
    add_fields(p, SearchConfig, HELP)
    p.add_argument("--no-resume", dest="resume", action="store_const", const="never",
                   default="auto", help="never resume; refuse an OUT that holds a search")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no tqdm bar")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING"),
                   help="console level on local masters (default INFO)")


def _config(args: argparse.Namespace, cls: Any) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def _run(args: argparse.Namespace) -> int:
    """Run ``hpc search`` with parsed ``args``; return the exit status."""
    from hpc.errors import HPCError
    from hpc.submit.preempt import PreemptGuard, requeue_after_stop, stopped_by_request

    try:  # first: the warning signal must not kill a rank that is still importing torch
        guard = PreemptGuard().install()
    except HPCError as e:
        print(f"hpc search: {e}", file=sys.stderr)
        return 2
    cfg = _config(args, SearchConfig)
    try:
        cfg.validate()
    except ValueError as e:
        print(f"hpc search: {e}", file=sys.stderr)
        return 2
    import hpc
    from hpc.pretrain.search import search

    info = hpc.init_torch(seed=cfg.seed)
    hpc.setup_logging(info, level=getattr(logging, args.log_level),
                      log_file=cfg.out_dir / "search.log")
    try:
        result = search(cfg, stop_requested=guard)
    except (HPCError, ValueError, FileNotFoundError, TypeError) as e:
        logger.error("%s", e)
        return 1
    if stopped_by_request(result.status, result.generations, cfg.max_generations):
        return requeue_after_stop(result.generations, result.out, rank=info.rank,
                                  signame=guard.signal_name).exit_code
    return 0


def add_parser(sub: Any) -> None:
    """Register ``hpc search`` (no torch import here: ``hpc --help`` stays fast)."""
    p = sub.add_parser("search", help="search a pretrained supernet for its best "
                       "sub-network", description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _build(p)
    p.set_defaults(func=_run)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hpc.pretrain.search_cli ARGS``: the same as ``hpc search ARGS``."""
    from hpc.cli.main import run_subcommand

    return run_subcommand(add_parser, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
