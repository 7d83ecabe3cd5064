"""``hpc pretrain``: supernet pretraining on digits (or your data) under any launcher.

Runs unchanged under ``hpc run --nproc N``, ``torchrun``, ``srun`` and ``mpirun``: it
only calls :func:`hpc.init_torch`. Exit status 0 when the run completed or stopped
cleanly at a checkpoint, 1 on a configuration/checkpoint error (same on every rank).

The warning signal (``HPC_PREEMPT_SIGNAL``, default USR2; ``#SBATCH --signal=USR2@120``)
stops every rank at the same step with a checkpoint; in a Slurm batch job the master then
runs ``scontrol requeue`` (budget ``HPC_MAX_REQUEUES``) and every rank exits with 75, or
1 when the job could not be requeued (see :mod:`hpc.preempt.requeue`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from hpc._command import add_fields, add_stage_parser, subcommand
from hpc._command import config_from_args as config_of  # this module's own takes args only
from hpc.preempt.stage import run_stage
from hpc.pretrain.config import SAMPLINGS, PretrainConfig

__all__ = ["add_flags", "add_parser", "config_from_args", "main"]


EPILOG = """examples:
  hpc run --nproc 4 -- hpc pretrain --out runs/digits
  torchrun --nproc-per-node 4 -m hpc pretrain --out runs/digits
  srun --ntasks 8 hpc pretrain --out $SCRATCH/digits      # resumes on requeue
  hpc pretrain --data my.npz --epochs 30 --out runs/mine  # keys x_train,y_train,x_val,y_val
"""


#: Flags that are plain config fields (type and default from :class:`PretrainConfig`).
FIELD_HELP = {
    "epochs": "epochs",
    "batch_size": "samples per rank per step",
    "lr": "peak learning rate, cosine to 0",
    "momentum": "SGD momentum",
    "weight_decay": "weight decay",
    "label_smoothing": "label smoothing",
    "seed": "seed of weights, split, order, archs",
    "val_fraction": "digits held out for validation",
    "width": "supernet channels",
    "ops": "each block's candidate operations, comma-separated (conv3x3, conv5x5, "
    "sepconv3x3, identity)",
    "val_archs": "sub-networks validated per epoch",
    "val_every": "validate every N epochs, 0 = last only",
    "recal_samples": "train images recalibrating BatchNorm per validated sub-net, 0 = off",
    "keep": "checkpoints kept",
    "distill_temperature": "softmax temperature of --distill",
    "distill_weight": "share of the distillation loss under --distill, 1 = teacher only",
    "virtual_ranks": "train as N ranks would, on any number of processes that divides N "
    "(each plays N/processes ranks a step); default: one rank per process",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``hpc pretrain`` on ``p`` (also the parser of ``hpc submit -- pretrain``)."""
    d = PretrainConfig()
    a = p.add_argument
    add_fields(p, PretrainConfig, FIELD_HELP)
    a("--optimizer", choices=("sgd", "adamw"), default=d.optimizer,
      help=f"optimizer (default {d.optimizer}, Nesterov momentum)")
    a("--data", default=None, metavar="FILE",
      help="an .npz/.pt file with x_train,y_train,x_val,y_val, or digits-hard (shifted, "
      "noisy, half the training images) (default: sklearn digits)")
    a("--out", default=d.out, metavar="DIR",
      help=f"run directory, written by rank 0 (default {d.out})")
    a("--no-out", dest="out", action="store_const", const=None,
      help="write nothing: no run directory, no checkpoints")
    a("--resume", nargs="?", const="auto", default=d.resume, metavar="PATH",
      help="resume from PATH (a checkpoint or directory); default: auto-resume from "
      "DIR/checkpoints when it holds any")
    a("--no-resume", dest="resume", action="store_const", const="never",
      help="never resume; refuse a DIR that holds checkpoints")
    a("--ckpt-every", type=int, default=d.ckpt_every,
      help="also checkpoint every N steps (default: epoch ends and stops only)")
    a("--ckpt-async", action=argparse.BooleanOptionalAction, default=d.ckpt_async,
      help="write the checkpoints taken during training in a writer process while "
      "training goes on (the stop's and the last one are waited for)")
    a("--ckpt-sharded", action=argparse.BooleanOptionalAction, default=d.ckpt_sharded,
      help="save checkpoints in PyTorch's distributed-checkpoint layout (ckpt-<step>.dcp/), "
      "every rank writing its share; resumable at another world size with --elastic")
    a("--max-steps", type=int, default=None,
      help="stop with a checkpoint after this global step (schedule still spans --epochs)")
    a("--sampling", choices=SAMPLINGS, default=d.sampling,
      help="sub-networks per step: uniform (each rank its own draw) or sandwich (the largest "
      "and the smallest beside two random ones, the positions rotating over ranks and steps) "
      "(default %(default)s)")
    a("--distill", action="store_true",
      help="in-place distillation (with --sampling sandwich): ranks that do not train the "
      "largest sub-network learn from its soft labels on their own batch")
    a("--elastic", action="store_true",
      help="allow resuming with a different number of ranks (not exact)")
    a("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    a("--overlap", action=argparse.BooleanOptionalAction, default=d.overlap,
      help="send gradients during backward instead of after it (same results)")
    a("--check-sync", action="store_true",
      help="debug: verify after every step that all ranks hold identical weights")
    a("--no-deterministic", dest="deterministic", action="store_false",
      help="let cuDNN autotune (faster convolutions on GPUs; resume no longer bitwise)")
    a("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING"),
      help="console level on local masters (default INFO)")


def config_from_args(args: argparse.Namespace) -> PretrainConfig:
    """The :class:`PretrainConfig` an ``hpc pretrain`` command line describes."""
    return config_of(PretrainConfig, args)


def _pretrain(cfg: PretrainConfig, stop_requested: Any) -> Any:
    from hpc.pretrain.loop import pretrain

    cfg.setup_logging = False  # the command has set it up
    return pretrain(cfg, stop_requested=stop_requested)


def _run(args: argparse.Namespace) -> int:
    """Run ``hpc pretrain`` with parsed ``args``; return the exit status."""
    return run_stage("pretrain", lambda: config_from_args(args), _pretrain,
                     lambda cfg: Path(cfg.out) / "pretrain.log" if cfg.out else None,
                     lambda result, cfg: (result.step, cfg.max_steps, result.checkpoint),
                     log_level=args.log_level)


def add_parser(sub: Any) -> None:
    """Register ``hpc pretrain`` (no torch import here: ``hpc --help`` stays fast)."""
    add_stage_parser(sub, "pretrain", "distributed supernet pretraining (digits by default)",
                     __doc__, EPILOG, add_flags, _run)


main = subcommand(add_parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
