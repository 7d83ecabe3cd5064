"""``hpc tune``: train the searched sub-network as a plain model with DDP, any launcher.

Reads ``SEARCH/search.json``, exports the best sub-network from the supernet checkpoint
the search used (only the chosen operations, BatchNorm recalibrated) and fine-tunes it
with DistributedDataParallel. Writes ``OUT/tune.json``, ``metrics.csv``/``.png``,
``model.pt`` (loads without the supernet: ``hpc.search.export.load_model``) and
checkpoints; a rerun resumes, the warning signal stops and requeues as in
``hpc pretrain``. ``--from-scratch`` trains the same architecture from a fresh
initialisation (the baseline). Exit status as ``hpc pretrain``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from hpc._command import add_fields, add_stage_parser, config_from_args, subcommand
from hpc.preempt.stage import run_stage
from hpc.search.config import TuneConfig

__all__ = ["add_parser", "main"]

logger = logging.getLogger(__name__)

EPILOG = """examples:
  hpc run --nproc 2 -- hpc tune --search runs/digits/search                 # SEARCH/tune/
  hpc run --nproc 2 -- hpc tune --search runs/digits/search --from-scratch  # SEARCH/scratch/
  srun --ntasks 4 hpc tune --search $SCRATCH/digits/search --epochs 30
"""

HELP = {
    "search": "hpc search output directory (holds search.json)",
    "epochs": "epochs",
    "batch_size": "samples per rank per step",
    "lr": "peak learning rate, cosine to 0",
    "momentum": "SGD momentum (Nesterov)",
    "weight_decay": "weight decay",
    "label_smoothing": "label smoothing",
    "seed": "seed of the data order (and of the weights with --from-scratch)",
    "recal_samples": "train images recalibrating BatchNorm before export",
    "out": "output directory, written by rank 0 (default SEARCH/tune or SEARCH/scratch)",
    "ckpt_every": "also checkpoint every N steps",
    "keep": "checkpoints kept",
    "max_steps": "stop with a checkpoint after this global step",
}


def _build(p: argparse.ArgumentParser) -> None:
    add_fields(p, TuneConfig, HELP)
    p.add_argument("--from-scratch", action="store_true",
                   help="same architecture, fresh weights (the baseline)")
    p.add_argument("--resume", nargs="?", const="auto", default="auto", metavar="PATH",
                   help="resume from PATH (checkpoint or directory); default: auto")
    p.add_argument("--no-resume", dest="resume", action="store_const", const="never",
                   help="never resume; refuse an OUT that holds checkpoints")
    p.add_argument("--elastic", action="store_true",
                   help="allow resuming with a different number of ranks (not exact)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING"),
                   help="console level on local masters (default INFO)")


def _run(args: argparse.Namespace) -> int:
    """Run ``hpc tune`` with parsed ``args``; return the exit status."""
    from hpc.search.tune import tune

    return run_stage("tune", lambda: config_from_args(TuneConfig, args), tune,
                     lambda cfg: cfg.out_dir / "tune.log",
                     lambda result, cfg: (result.step, cfg.max_steps, result.checkpoint),
                     log_level=args.log_level)


def add_parser(sub: Any) -> None:
    """Register ``hpc tune`` (no torch import here: ``hpc --help`` stays fast)."""
    add_stage_parser(sub, "tune", "fine-tune the searched sub-network with DDP", __doc__,
                     EPILOG, _build, _run)


main = subcommand(add_parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
