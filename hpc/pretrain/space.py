"""Search spaces: the protocol the loop relies on, and the default digits supernet.

A search space is a weight-sharing supernet: an :class:`torch.nn.Module` holding every
candidate operation of every searchable block, plus two methods.

* ``sample(generator) -> arch`` draws one architecture (a sub-network) using only
  ``generator`` for randomness. ``arch`` is any small picklable value, typically a
  tuple with one candidate index per block.
* ``forward(x, arch) -> logits`` runs the sub-network ``arch`` on ``x``; only the chosen
  candidates' parameters take part (the others get no gradient on this rank, and
  :func:`hpc.sync_gradients` treats them as contributing zero).

The loop draws each rank's architecture from a fresh generator seeded with
:func:`derive_seed` ``(seed, rank, step)``, so the draw is a pure function of those three
numbers: it needs no state in checkpoints and replays exactly after a resume.

``hpc search`` also needs ``choices() -> list[int]`` (candidates per position, for
enumeration and mutation) and, for spaces other than :class:`Supernet`,
``subnet(arch) -> nn.Module`` (the standalone sub-network, see
:mod:`hpc.search.export`).

Rules for a search space of your own: create every candidate in ``__init__`` (no lazy
modules — every rank must hold the same parameter list); keep randomness in ``sample``
on the given generator; BatchNorm running statistics are averaged across ranks after
every step by the loop (see ``docs/pretrain.md``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from hpc.pretrain.config import OPS, check_ops

__all__ = ["SearchSpace", "Supernet", "derive_seed", "arch_generator", "build_op",
           "CANDIDATES", "VAL_STREAM"]

#: Pseudo-rank used to derive the validation architectures (identical on every rank).
VAL_STREAM = -1

#: Candidate operations of each block of the default supernet, by index (the default
#: ``ops``; any subset of them, in any order, also makes a supernet).
CANDIDATES = OPS


@runtime_checkable
class SearchSpace(Protocol):
    """What :func:`hpc.pretrain.pretrain` needs from a search space (an ``nn.Module``)."""

    def sample(self, generator: torch.Generator) -> Any:
        """Draw one architecture using only ``generator``."""

    def forward(self, x: Tensor, arch: Any) -> Tensor:
        """Logits of sub-network ``arch`` for the batch ``x``."""


def derive_seed(*keys: int) -> int:
    """A 63-bit seed that is a pure function of ``keys`` (e.g. ``seed, rank, step``).

    Uses BLAKE2b over the decimal keys, so neighbouring keys give unrelated seeds and the
    value is the same in every process, Python version and platform.
    """
    text = ",".join(str(int(k)) for k in keys).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def arch_generator(seed: int, rank: int, step: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive_seed` ``(seed, rank, step)``."""
    return torch.Generator().manual_seed(derive_seed(seed, rank, step))


def build_op(name: str, channels: int) -> nn.Module:
    """The candidate operation ``name`` of ``channels`` channels (a block of the supernet,
    and of a sub-network exported from it)."""
    if name == "identity":
        return nn.Identity()
    if name == "sepconv3x3":
        return nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False),
            nn.Conv2d(channels, channels, 1, bias=False),
            nn.BatchNorm2d(channels), nn.ReLU(inplace=True))
    kernel = {"conv3x3": 3, "conv5x5": 5}[name]
    return nn.Sequential(
        nn.Conv2d(channels, channels, kernel, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(channels), nn.ReLU(inplace=True))


class Supernet(nn.Module):
    """Default supernet for small images (8x8 digits, or anything >= 2x2).

    A fixed stem (3x3 conv, BN, ReLU), then ``blocks`` searchable blocks, each a choice
    among ``ops`` in a residual connection (so ``identity`` skips the block).
    After the first half of the blocks a 2x2 average pool halves the resolution; global
    average pooling and a linear head give the logits. ``len(ops) ** blocks``
    sub-networks (256 by default) share the weights.

    Args:
        in_channels: Channels of the input images.
        num_classes: Number of classes.
        width: Channels of every block.
        blocks: Number of searchable blocks.
        ops: The candidate operations of every block, by index (names from
            :data:`CANDIDATES`).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32,
                 blocks: int = 4, ops: Sequence[str] = CANDIDATES) -> None:
        super().__init__()
        if blocks < 1 or width < 1:
            raise ValueError(f"Supernet needs blocks >= 1 and width >= 1, got "
                             f"blocks={blocks}, width={width}.\n"
                             "HINT: use the defaults blocks=4, width=32.")
        self.candidates = check_ops(ops)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        self.blocks = nn.ModuleList(
            nn.ModuleList(build_op(name, width) for name in self.candidates)
            for _ in range(blocks))
        #: Parameters of each candidate of each block (the sandwich rule asks every step).
        self._op_sizes = [[sum(p.numel() for p in op.parameters()) for op in block]
                          for block in self.blocks]
        self.pool_after = blocks // 2
        self.pool = nn.AvgPool2d(2)
        self.head = nn.Linear(width, num_classes)

    def sample(self, generator: torch.Generator) -> tuple[int, ...]:
        """One candidate index per block, uniformly, drawn from ``generator``."""
        draw = torch.randint(len(self.candidates), (len(self.blocks),), generator=generator)
        return tuple(int(i) for i in draw)

    def largest(self) -> tuple[int, ...]:
        """The sub-network with the most parameters: each block's largest candidate
        (``conv5x5``), for the sandwich rule (:mod:`hpc.pretrain.sampling`)."""
        return self._by_size(max)

    def smallest(self) -> tuple[int, ...]:
        """The sub-network with the fewest parameters (each block ``identity``, or
        ``sepconv3x3`` when the ops leave identity out)."""
        return self._by_size(min)

    def _by_size(self, pick: Any) -> tuple[int, ...]:
        return tuple(pick(range(len(s)), key=lambda i, s=s: s[i]) for s in self._op_sizes)

    def choices(self) -> list[int]:
        """Number of candidates of each block (what search enumerates and mutates)."""
        return [len(self.candidates)] * len(self.blocks)

    def describe(self, arch: Sequence[int]) -> str:
        """Readable name of ``arch``, e.g. ``conv3x3-identity-conv5x5-sepconv3x3``."""
        return "-".join(self.candidates[i] for i in arch)

    def used_parameters(self, arch: Sequence[int]) -> list[nn.Parameter]:
        """The parameters ``forward(x, arch)`` uses (lets every rank compute every
        rank's, so :func:`hpc.sync_gradients` can skip its agreement round)."""
        used = [*self.stem.parameters(), *self.head.parameters()]
        for block, choice in zip(self.blocks, arch):
            used += block[choice].parameters()
        return used

    def forward(self, x: Tensor, arch: Sequence[int]) -> Tensor:  # type: ignore[override]
        """Logits of the sub-network ``arch``."""
        if len(arch) != len(self.blocks):
            raise ValueError(
                f"architecture {tuple(arch)} has {len(arch)} choices but the supernet "
                f"has {len(self.blocks)} blocks.\n"
                "HINT: draw architectures with this supernet's sample().")
        x = self.stem(x)
        for index, (block, choice) in enumerate(zip(self.blocks, arch)):
            if index == self.pool_after and index > 0:
                x = self.pool(x)
            op = block[choice]
            if not isinstance(op, nn.Identity):
                x = x + op(x)
        return self.head(x.mean(dim=(2, 3)))
