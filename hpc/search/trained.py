"""A pretrain run's supernet, loaded for search and tune, and what both measure on it.

:func:`load_run` loads one checkpoint of an ``hpc pretrain`` run on every rank (the
master chooses the file, as pretrain's resume does), :func:`recal_images` gives the fixed
training images that recalibrate BatchNorm — the same for every sub-network and on every
rank, independent of the world size — and :func:`measure_latency` times a module on its
device.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn

import hpc
from hpc.checkpoint.files import load_checkpoint, load_latest
from hpc.errors import CheckpointError
from hpc.pretrain.config import PretrainConfig
from hpc.pretrain.data import PretrainData, load_data
from hpc.pretrain.space import VAL_STREAM, Supernet, derive_seed
from hpc.sync.agree import broadcast_object

__all__ = ["LoadedRun", "load_run", "measure_latency", "recal_images"]


@dataclasses.dataclass
class LoadedRun:
    """A pretrain run's supernet at one checkpoint, with its data and settings."""

    space: nn.Module
    config: PretrainConfig
    data: PretrainData
    checkpoint: str
    step: int


def load_run(run: str, checkpoint: Optional[str] = None,
             space: Optional[nn.Module] = None, data: Optional[PretrainData] = None
             ) -> LoadedRun:
    """Load a pretrain run on every rank (collective): the master picks the checkpoint.

    Args:
        run: The pretrain run directory.
        checkpoint: A checkpoint file to use instead of the newest loadable one.
        space: The search space the run trained (default: the digits ``Supernet``
            sized from the data and the run's ``width``).
        data: The run's data (default: what its ``config.json`` names).

    Raises:
        CheckpointError: the run has no loadable checkpoint.
    """
    run_dir = Path(run)
    saved = _read_config(run_dir)
    cfg = PretrainConfig.from_dict(saved)
    path, error = None, None
    if hpc.is_master():
        try:
            found = (Path(checkpoint), None) if checkpoint else load_latest(
                run_dir / "checkpoints")
            path = str(found[0]) if found else None
            error = None if found else (
                f"{run_dir / 'checkpoints'} holds no checkpoint: the pretrain run never "
                "finished an epoch.\nHINT: run (or resume) hpc pretrain --out "
                f"{run_dir} first.")
        except CheckpointError as e:
            error = str(e)
    path, error = broadcast_object((path, error))
    if error is not None:
        raise CheckpointError(error)
    payload = load_checkpoint(path)
    data = data or load_data(cfg.data, cfg.seed, cfg.val_fraction)
    if space is None:
        if saved.get("space", "Supernet") != "Supernet":
            raise ValueError(
                f"{run_dir} trained a {saved['space']}, not the default Supernet.\n"
                "HINT: call hpc.search.search.search(cfg, space=YourSpace()) from "
                "Python with the same space.")
        space = Supernet(data.in_channels, data.num_classes, width=cfg.width,
                         ops=cfg.op_names())
    space.load_state_dict(payload["model"])
    dev = hpc.device()
    return LoadedRun(space.to(dev), cfg, data.to(dev), path, int(payload["step"]))


def _read_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{run_dir} holds no config.json, so it is not an hpc "
                              "pretrain run directory.\nHINT: pass --run the --out of "
                              "hpc pretrain.")
    return json.loads(path.read_text())


def recal_images(run: LoadedRun, n: int) -> Tensor:
    """The ``n`` fixed training images that recalibrate every candidate (world-free)."""
    n_train = int(run.data.x_train.shape[0])
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(
        derive_seed(run.config.seed, VAL_STREAM)))[:min(n, n_train)]
    return run.data.x_train[order.to(run.data.x_train.device)]


@torch.no_grad()
def measure_latency(net: nn.Module, x: Tensor, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of ``net(x)`` over ``repeats`` timed runs after ``warmup``."""
    net.eval()
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for _ in range(warmup):
        net(x)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        net(x)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
