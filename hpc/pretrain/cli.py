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
import logging
import sys
import typing
from collections.abc import Sequence
from typing import Any

from hpc.pretrain.config import PretrainConfig

__all__ = ["add_parser", "config_from_args", "main"]

logger = logging.getLogger(__name__)

EPILOG = """examples:
  hpc run --nproc 4 -- hpc pretrain --out runs/digits
  torchrun --nproc-per-node 4 -m hpc pretrain --out runs/digits
  srun --ntasks 8 hpc pretrain --out $SCRATCH/digits      # resumes on requeue
  hpc pretrain --data my.npz --epochs 30 --out runs/mine  # keys x_train,y_train,x_val,y_val
"""


def _build(p: argparse.ArgumentParser) -> None:
    d = PretrainConfig()
    types = typing.get_type_hints(PretrainConfig)
    a = p.add_argument

    def field(flag: str, help: str) -> None:
        """``--flag`` for the config field of that name: its type, its default, shown."""
        name = flag[2:].replace("-", "_")
        default = getattr(d, name)
        a(flag, type=types[name], default=default, help=f"{help} (default {default})")

    field("--epochs", "epochs")
    field("--batch-size", "samples per rank per step")
    field("--lr", "peak learning rate, cosine to 0")
    a("--optimizer", choices=("sgd", "adamw"), default=d.optimizer,
      help=f"optimizer (default {d.optimizer}, Nesterov momentum)")
    field("--momentum", "SGD momentum")
    field("--weight-decay", "weight decay")
    field("--label-smoothing", "label smoothing")
    field("--seed", "seed of weights, split, order, archs")
    a("--data", default=None, metavar="FILE",
      help="an .npz/.pt file with x_train,y_train,x_val,y_val (default: sklearn digits)")
    field("--val-fraction", "digits held out for validation")
    field("--width", "supernet channels")
    field("--val-archs", "sub-networks validated per epoch")
    field("--val-every", "validate every N epochs, 0 = last only")
    field("--recal-samples", "train images recalibrating BatchNorm per validated sub-net, "
          "0 = off")
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
    field("--keep", "checkpoints kept")
    a("--max-steps", type=int, default=None,
      help="stop with a checkpoint after this global step (schedule still spans --epochs)")
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
    names = PretrainConfig.__dataclass_fields__
    return PretrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def _run(args: argparse.Namespace) -> int:
    """Run ``hpc pretrain`` with parsed ``args``; return the exit status."""
    from hpc.errors import HPCError
    from hpc.preempt.requeue import stopped_by_request
    from hpc.preempt.stop import AgreedStop

    try:  # first: the warning signal must not kill a rank that is still importing torch
        stop = AgreedStop()  # installs the guard
    except HPCError as e:
        print(f"hpc pretrain: {e}", file=sys.stderr)
        return 2
    cfg = config_from_args(args)
    try:
        cfg.validate()
    except ValueError as e:
        print(f"hpc pretrain: {e}", file=sys.stderr)
        return 2
    cfg.setup_logging = False
    import hpc
    from hpc.pretrain.loop import pretrain

    info = hpc.init_torch(seed=cfg.seed)
    log_file = f"{cfg.out}/pretrain.log" if cfg.out else None
    hpc.setup_logging(info, level=getattr(logging, args.log_level), log_file=log_file)
    try:
        result = pretrain(cfg, stop_requested=stop.guard)  # agreed inside the loop
    except (HPCError, ValueError, FileNotFoundError) as e:
        logger.error("%s", e)
        from hpc.watchdog.failure import note_failure

        note_failure(type(e).__name__)  # the exit aborts the process group
        return 1
    if stopped_by_request(result.status, result.step, cfg.max_steps):
        return stop.exit_code(result.step, result.checkpoint, stopped=True)
    return 0 if result.status in ("completed", "stopped") else 1


def add_parser(sub: Any) -> None:
    """Register ``hpc pretrain`` (no torch import here: ``hpc --help`` stays fast)."""
    p = sub.add_parser("pretrain", help="distributed supernet pretraining (digits by default)",
                       description=__doc__, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _build(p)
    p.set_defaults(func=_run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hpc.pretrain.cli ARGS``: the same as ``hpc pretrain ARGS``."""
    from hpc.cli.main import run_subcommand

    return run_subcommand(add_parser, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
