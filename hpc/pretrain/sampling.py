"""Which sub-network each rank trains at each step, and what it learns from.

Pure. Two recipes (``PretrainConfig.sampling``):

- ``uniform``: every rank draws its own sub-network from ``arch_generator(seed, rank,
  step)`` (single-path one-shot training);
- ``sandwich`` (BigNAS, AttentiveNAS): the largest and the smallest sub-network are
  trained beside random ones, BigNAS's four a step (largest, smallest, two random) spread
  over the ranks. Rank ``r`` at step ``s`` takes position ``(r + s) mod P`` with ``P =
  max(world, 4)``: position 0 trains the largest, position 1 the smallest, the others draw
  as under ``uniform``. With 4 ranks or more every step trains the largest and the
  smallest once; with fewer, the four positions take turns over consecutive steps (every
  rank passes through each of them every 4 steps), so the middle candidates still get
  trained. The roles rotate, so the largest (the slowest step) moves from rank to rank
  instead of holding one back every step.

In-place distillation (``distill``): a rank that does not train the largest sub-network
first runs the largest on its own batch without gradients (the teacher) and learns from
its soft labels (:func:`distill_loss`); the rank that trains the largest learns from the
labels. Each rank's teacher is computed on its own batch, so no logits cross the network.

Everything is a pure function of ``(seed, rank, world, step)``: nothing to checkpoint,
and a resume replays the same sub-networks. Under ``virtual_ranks`` the rank and world
are the virtual ones (:mod:`hpc.pretrain.learn`), so the schedule does not depend on the
number of processes. A space that offers ``largest()`` and
``smallest()`` (the default :class:`~hpc.pretrain.space.Supernet` does) supports both.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from hpc.pretrain.config import SAMPLINGS
from hpc.pretrain.space import arch_generator

__all__ = ["SAMPLINGS", "LARGEST", "SMALLEST", "RANDOM", "role", "arch_for", "distill_loss",
           "check_space"]

#: BigNAS's sub-networks a step: the largest, the smallest and two random ones.
POSITIONS = 4
#: The roles of :func:`role`.
LARGEST, SMALLEST, RANDOM = "largest", "smallest", "random"


def role(rank: int, world: int, step: int) -> str:
    """The sandwich role of ``rank`` at ``step``: ``"largest"``, ``"smallest"`` or
    ``"random"`` (module docstring)."""
    position = (rank + step) % max(world, POSITIONS)
    return (LARGEST, SMALLEST)[position] if position < 2 else RANDOM


def arch_for(space: Any, sampling: str, seed: int, rank: int, world: int, step: int) -> Any:
    """The sub-network ``rank`` trains at ``step`` under ``sampling``."""
    if sampling == "sandwich":
        which = role(rank, world, step)
        if which == LARGEST:
            return space.largest()
        if which == SMALLEST:
            return space.smallest()
    return space.sample(arch_generator(seed, rank, step))


def distill_loss(logits: Tensor, teacher: Tensor, target: Tensor, *, temperature: float,
                 weight: float, label_smoothing: float = 0.0) -> Tensor:
    """``(1 - weight) * CE(logits, target) + weight * T^2 * KL(teacher_T || student_T)``.

    ``*_T`` are the softmaxes at temperature ``T``; the ``T^2`` keeps the gradient's scale
    independent of ``T`` (Hinton et al.). ``weight`` 1 learns from the teacher alone, as
    BigNAS's and OFA's in-place distillation do.
    """
    t = float(temperature)
    kd = F.kl_div(F.log_softmax(logits / t, dim=1), F.log_softmax(teacher.detach() / t, dim=1),
                  reduction="batchmean", log_target=True) * (t * t)
    if weight >= 1.0:
        return kd
    ce = F.cross_entropy(logits, target, label_smoothing=label_smoothing)
    return (1.0 - weight) * ce + weight * kd


def check_space(space: Any, sampling: str, distill: bool) -> None:
    """Refuse a recipe the space cannot serve (fact, cause, HINT)."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling={sampling!r} is not a sampling recipe.\n"
                         f"HINT: use one of {', '.join(SAMPLINGS)}.")
    if (sampling == "sandwich" or distill) and not (
            callable(getattr(space, "largest", None)) and callable(getattr(space, "smallest",
                                                                            None))):
        what = "--sampling sandwich" if sampling == "sandwich" else "--distill"
        raise ValueError(f"{what} needs the search space's largest and smallest "
                         f"sub-networks, but {type(space).__qualname__} has no largest() "
                         "and smallest().\nHINT: add both methods to the space (each "
                         "returns an arch), or train with --sampling uniform and no --distill.")
