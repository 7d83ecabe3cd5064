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
import logging
import sys
from typing import Any

from hpc._command import add_fields, add_stage_parser, config_from_args, subcommand
from hpc.preempt.stage import run_stage
from hpc.search.config import SearchConfig

__all__ = ["add_parser", "main"]

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


def _build(p: argparse.ArgumentParser) -> None:
    add_fields(p, SearchConfig, HELP)
    p.add_argument("--no-resume", dest="resume", action="store_const", const="never",
                   default="auto", help="never resume; refuse an OUT that holds a search")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no tqdm bar")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING"),
                   help="console level on local masters (default INFO)")


def _run(args: argparse.Namespace) -> int:
    """Run ``hpc search`` with parsed ``args``; return the exit status."""
    from hpc.search.search import search

    return run_stage("search", lambda: config_from_args(SearchConfig, args), search,
                     lambda cfg: cfg.out_dir / "search.log",
                     lambda result, cfg: (result.generations, cfg.max_generations,
                                          result.out), log_level=args.log_level)


def add_parser(sub: Any) -> None:
    """Register ``hpc search`` (no torch import here: ``hpc --help`` stays fast)."""
    add_stage_parser(sub, "search", "search a pretrained supernet for its best sub-network",
                     __doc__, EPILOG, _build, _run)


main = subcommand(add_parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
