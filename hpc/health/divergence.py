"""Silent corruption: the rank whose replicated state no longer matches the others'.

Under data parallelism (``hpc.sync_gradients``, DDP, ``hpc pretrain``) every rank holds
the same parameters and optimizer state after every step, bit for bit: the same averaged
gradients go through the same optimizer. A bad GPU or DIMM that flips a bit breaks that
silently, and the next gradient sync spreads the damage. Every ``HPC_SDC_EVERY`` steps
:func:`check` digests that state (BLAKE2b over each tensor's bytes), compares the ranks'
digests in one small ``all_gather`` and, when they differ, gathers the per-tensor
digests to name the rank(s) that disagree with the majority, their host(s), the step and
the tensor(s).

Buffers (BatchNorm statistics) are not compared: under ``sync_gradients`` each rank keeps
its own. A CUDA tensor is copied to the host to be digested (a device-side checksum would
be cheaper; not done yet).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["Mismatch", "named_state", "tensor_digests", "combined", "majority", "check"]

logger = logging.getLogger(__name__)


def named_state(model: Any, optimizer: Any = None) -> list[tuple[str, Any]]:
    """The replicated tensors: ``model``'s parameters and ``optimizer``'s state for them,
    named (``fc.weight``, ``optimizer[fc.weight].exp_avg``), in a fixed order."""
    import torch

    named = list(model.named_parameters()) if model is not None else []
    out: list[tuple[str, Any]] = [(n, p) for n, p in named]
    if optimizer is not None:
        names = {id(p): n for n, p in named}
        i = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, v in sorted(optimizer.state.get(p, {}).items()):
                    if isinstance(v, torch.Tensor):
                        out.append((f"optimizer[{names.get(id(p), f'param {i}')}].{key}", v))
                i += 1
    return out


def tensor_digests(named: Iterable[tuple[str, Any]]) -> list[int]:
    """One 63-bit digest per tensor (its bytes, not its name)."""
    import torch

    out = []
    for _, t in named:
        t = t.detach()
        if t.layout != torch.strided:  # sparse and the like: not compared
            out.append(0)
            continue
        flat = t.reshape(-1).contiguous()
        if flat.device.type != "cpu":
            flat = flat.cpu()
        data = flat.view(torch.uint8).numpy() if flat.numel() else b""
        out.append(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(),
                                  "little") >> 1)
    return out


def combined(digests: Sequence[int]) -> int:
    """One 63-bit digest of a rank's per-tensor digests."""
    h = hashlib.blake2b(digest_size=8)
    for d in digests:
        h.update(d.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") >> 1


def majority(values: Sequence[Any]) -> tuple[Any, list[int]]:
    """The most common value and the indices that differ from it (ties: the value of
    the lowest index among the most common)."""
    counts = Counter(values)
    top = max(counts.values())
    value = next(v for v in values if counts[v] == top)
    return value, [i for i, v in enumerate(values) if v != value]


@dataclass(frozen=True)
class Mismatch:
    """What :func:`check` found."""

    step: int
    ranks: tuple[int, ...]          #: the ranks that disagree with the majority
    hosts: tuple[str, ...]          #: their hosts, in the same order
    tensors: tuple[str, ...]        #: the tensors where they disagree (first few)
    tied: bool                      #: no strict majority: which side is bad is a guess

    def message(self) -> str:
        who = ", ".join(f"rank {r} on {h}" for r, h in zip(self.ranks, self.hosts))
        what = ", ".join(self.tensors[:5]) + (" ..." if len(self.tensors) > 5 else "")
        tie = (" (no strict majority: the side named is the one without rank 0)"
               if self.tied else "")
        return (f"silent corruption: after step {self.step} the replicated state of {who} "
                f"differs from the other ranks'{tie}, in {what}.\n"
                "Every rank should hold the same parameters and optimizer state after a "
                "synced step; a rank that does not had a bit flipped (a bad GPU, DIMM or "
                "link) or stepped differently (a script that updates one rank's weights).\n"
                "HINT: drain or test the host(s) named (hpc check; the vendor's memory "
                "test), resume from the last checkpoint taken before the step, or set "
                "HPC_SDC=warn to go on, HPC_SDC=off where ranks legitimately differ.")


def check(step: int, named: Sequence[tuple[str, Any]], host: str,
          group: Optional[Any] = None) -> Optional[Mismatch]:
    """Compare the ranks' replicated state (collective: every rank calls it with the same
    ``step``); the :class:`Mismatch` on every rank, or None when all agree."""
    from hpc.sync.agree import gather_ints, gather_objects, world

    digests = tensor_digests(named)
    mine = combined(digests)
    rank, ws = world(group)
    alls = [r[0] for r in gather_ints([mine], group)]
    if len(set(alls)) == 1:
        return None
    per_rank = gather_objects((host, digests), group)
    hosts = [h for h, _ in per_rank]
    value, bad = majority(alls)
    tied = Counter(alls)[value] * 2 <= ws
    if tied and 0 in bad:  # no majority: keep rank 0's side as the reference
        bad = [r for r in range(ws) if alls[r] != alls[0]]
    ref = next(r for r in range(ws) if r not in bad)
    names = [n for n, _ in named]
    tensors = tuple(names[i] for i in range(len(names))
                    if any(per_rank[r][1][i] != per_rank[ref][1][i] for r in bad))
    return Mismatch(step, tuple(bad), tuple(hosts[r] for r in bad), tensors, tied)
