"""Datasets for pretraining, and the per-rank batch order that makes resume exact.

The default is scikit-learn's bundled digits (1797 8x8 images, no download) with a
seeded stratified train/validation split, scaled to zero mean and unit variance with
the training split's statistics. Users pass their own tensors as an ``.npz`` or ``.pt``
file with four keys:

=============  ================================================  ======================
key            shape                                             dtype
=============  ================================================  ======================
``x_train``    ``(N, C, H, W)``, or ``(N, H, W)`` for 1 channel  float (used as given)
``y_train``    ``(N,)``, class indices ``0..K-1``                integer
``x_val``      ``(M, C, H, W)``, or ``(M, H, W)``                float
``y_val``      ``(M,)``                                          integer
=============  ================================================  ======================
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DistributedSampler

__all__ = ["PretrainData", "load_digits", "load_digits_hard", "load_file", "load_data",
           "epoch_batches", "steps_per_epoch", "val_shard", "KEYS", "BUILTIN", "HARD_CANVAS",
           "HARD_NOISE", "HARD_KEEP"]

#: Keys of a user data file.
KEYS = ("x_train", "y_train", "x_val", "y_val")


@dataclasses.dataclass
class PretrainData:
    """Train and validation tensors (whole splits, held in memory on every rank).

    Attributes:
        x_train: ``(N, C, H, W)`` float32 images.
        y_train: ``(N,)`` int64 labels.
        x_val: ``(M, C, H, W)`` float32 images.
        y_val: ``(M,)`` int64 labels.
        name: Where the data came from (logged and stored in ``config.json``).
    """

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    name: str = "custom"

    @property
    def in_channels(self) -> int:
        """Channels of the images."""
        return int(self.x_train.shape[1])

    @property
    def num_classes(self) -> int:
        """Highest label + 1 over both splits."""
        return int(max(self.y_train.max().item(), self.y_val.max().item())) + 1

    def to(self, device: Union[str, torch.device]) -> "PretrainData":
        """The same splits on ``device`` (small datasets live on the GPU entirely)."""
        return PretrainData(self.x_train.to(device), self.y_train.to(device),
                            self.x_val.to(device), self.y_val.to(device), self.name)


def _checked(tensors: dict[str, Tensor], source: str) -> PretrainData:
    missing = [k for k in KEYS if k not in tensors]
    if missing:
        raise ValueError(
            f"{source} lacks {missing}; it holds {sorted(tensors)}.\n"
            f"A data file needs the four keys {list(KEYS)}.\n"
            "HINT: np.savez(path, x_train=..., y_train=..., x_val=..., y_val=...).")
    x_train, x_val = (tensors[k].float() for k in ("x_train", "x_val"))
    x_train, x_val = (x.unsqueeze(1) if x.dim() == 3 else x for x in (x_train, x_val))
    y_train, y_val = (tensors[k].long().reshape(-1) for k in ("y_train", "y_val"))
    problems = []
    for xs, ys, split in ((x_train, y_train, "train"), (x_val, y_val, "val")):
        if xs.dim() != 4:
            problems.append(f"x_{split} has shape {tuple(xs.shape)}, not (N, C, H, W)")
        elif xs.shape[0] != ys.shape[0]:
            problems.append(f"x_{split} has {xs.shape[0]} rows but y_{split} {ys.shape[0]}")
        if ys.numel() and int(ys.min()) < 0:
            problems.append(f"y_{split} has negative labels (min {int(ys.min())})")
    if not problems and x_train.shape[1:] != x_val.shape[1:]:
        problems.append(f"x_train images are {tuple(x_train.shape[1:])} but x_val "
                        f"images {tuple(x_val.shape[1:])}")
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems) + ".\n"
                         "HINT: store images as (N, C, H, W) floats and labels as (N,) "
                         "class indices 0..K-1.")
    return PretrainData(x_train, y_train, x_val, y_val, name=source)


def load_digits(seed: int = 0, val_fraction: float = 0.2) -> PretrainData:
    """scikit-learn's digits with a stratified split seeded by ``seed``, standardised."""
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    bunch = sk_load_digits()
    x = bunch.images.astype(np.float32)[:, None] / 16.0
    y = bunch.target.astype(np.int64)
    x_train, x_val, y_train, y_val = train_test_split(
        x, y, test_size=val_fraction, random_state=seed, stratify=y)
    mean, std = float(x_train.mean()), float(x_train.std())
    x_train, x_val = (x_train - mean) / std, (x_val - mean) / std
    return PretrainData(torch.from_numpy(np.ascontiguousarray(x_train)),
                        torch.from_numpy(y_train), torch.from_numpy(np.ascontiguousarray(x_val)),
                        torch.from_numpy(y_val), name="sklearn-digits")


#: ``--data`` names of the built-in data sets (anything else is a file path).
BUILTIN = ("digits", "digits-hard")
#: The canvas side, the noise (in pixel units of [0, 1]) and the share of the training
#: split kept of :func:`load_digits_hard`.
HARD_CANVAS, HARD_NOISE, HARD_KEEP = 12, 0.3, 0.5


def load_digits_hard(seed: int = 0, val_fraction: float = 0.2) -> PretrainData:
    """A harder digits, for telling sub-networks apart (where plain digits saturates).

    Generated from scikit-learn's digits with the same seeded stratified split as
    :func:`load_digits`: each 8x8 image is placed at a random offset on a
    :data:`HARD_CANVAS` x :data:`HARD_CANVAS` canvas (0..4 pixels each way), Gaussian
    noise of standard deviation :data:`HARD_NOISE` is added, and only :data:`HARD_KEEP`
    of the training split is kept (stratified). Train and validation images get their
    own random streams, all derived from ``seed``; standardised with the training split's
    statistics.
    """
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    bunch = sk_load_digits()
    x = bunch.images.astype(np.float32) / 16.0
    y = bunch.target.astype(np.int64)
    x_train, x_val, y_train, y_val = train_test_split(
        x, y, test_size=val_fraction, random_state=seed, stratify=y)
    x_train, _, y_train, _ = train_test_split(x_train, y_train, train_size=HARD_KEEP,
                                              random_state=seed, stratify=y_train)

    def distort(images: np.ndarray, stream: int) -> np.ndarray:
        rng = np.random.default_rng([seed, stream])
        room = HARD_CANVAS - 8
        out = np.zeros((len(images), 1, HARD_CANVAS, HARD_CANVAS), np.float32)
        for i, (dy, dx) in enumerate(rng.integers(0, room + 1, size=(len(images), 2))):
            out[i, 0, dy:dy + 8, dx:dx + 8] = images[i]
        return out + rng.normal(0.0, HARD_NOISE, out.shape).astype(np.float32)

    x_train, x_val = distort(x_train, 1), distort(x_val, 2)
    mean, std = float(x_train.mean()), float(x_train.std())
    x_train, x_val = (x_train - mean) / std, (x_val - mean) / std
    return PretrainData(torch.from_numpy(x_train), torch.from_numpy(y_train),
                        torch.from_numpy(x_val), torch.from_numpy(y_val), name="digits-hard")


def load_file(path: Union[str, Path]) -> PretrainData:
    """Load a user ``.npz`` (numpy) or ``.pt`` (dict of tensors) data file.

    ``.pt`` files are read with ``torch.load(weights_only=True)``: plain tensors only.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist.\n"
                                "HINT: pass --data with an existing .npz or .pt file, or "
                                f"one of the built-in sets: {', '.join(BUILTIN)}.")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            tensors = {k: torch.from_numpy(np.asarray(npz[k])) for k in npz.files}
    elif path.suffix in (".pt", ".pth"):
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"cannot read {path} as a dict of tensors: {e}.\n"
                             "HINT: torch.save({'x_train': ..., ...}, path) with tensors "
                             "only.") from e
        if not isinstance(loaded, dict):
            raise ValueError(f"{path} holds a {type(loaded).__name__}, not a dict.\n"
                             f"HINT: save a dict with the keys {list(KEYS)}.")
        tensors = {str(k): torch.as_tensor(v) for k, v in loaded.items()}
    else:
        raise ValueError(f"data file {path} has suffix {path.suffix!r}; valid: .npz, .pt.\n"
                         "HINT: save with np.savez or torch.save.")
    return _checked(tensors, str(path))


def load_data(path: Optional[str] = None, seed: int = 0,
              val_fraction: float = 0.2) -> PretrainData:
    """:func:`load_digits` for no ``path`` or ``"digits"``, :func:`load_digits_hard` for
    ``"digits-hard"``, else :func:`load_file`."""
    if not path or path == "digits":
        return load_digits(seed, val_fraction)
    if path == "digits-hard":
        return load_digits_hard(seed, val_fraction)
    return load_file(path)


def _sampler(n: int, world: int, rank: int, seed: int) -> DistributedSampler:
    # Padding (drop_last=False) repeats a few samples so every rank gets the same count;
    # the loader below then drops each rank's incomplete last batch so every step has
    # the same global batch.
    return DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True,
                              seed=seed, drop_last=False)


def steps_per_epoch(n: int, world: int, batch_size: int) -> int:
    """Steps in one epoch: full per-rank batches of the padded per-rank share."""
    return (-(-n // world)) // batch_size


def epoch_batches(n: int, world: int, rank: int, seed: int, epoch: int, batch_size: int,
                  start: int = 0) -> list[Tensor]:
    """This rank's index batches for ``epoch``, from batch ``start`` on.

    The order is :class:`DistributedSampler`'s with ``set_epoch(epoch)``: a pure
    function of ``(n, world, rank, seed, epoch)``, so skipping the first ``start``
    batches resumes mid-epoch exactly.
    """
    sampler = _sampler(n, world, rank, seed)
    sampler.set_epoch(epoch)
    order = torch.tensor(list(sampler), dtype=torch.long)
    steps = steps_per_epoch(n, world, batch_size)
    return [order[i * batch_size:(i + 1) * batch_size] for i in range(start, steps)]


def val_shard(n: int, world: int, rank: int) -> Tensor:
    """Indices of the validation samples this rank scores (each sample exactly once)."""
    return torch.arange(rank, n, world, dtype=torch.long)
