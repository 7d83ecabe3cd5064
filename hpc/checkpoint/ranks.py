"""What each rank keeps of its own: gathered on the master at a save, given back per rank.

Data-parallel training keeps the parameters and the optimizer state equal on every rank,
so a checkpoint holds the master's once (``payload["model"]``, ``["optimizer"]``). Three
things are each rank's own, and a checkpoint keeps them per rank, a list indexed by rank:

* ``"rng"``: its RNG states (:func:`~hpc.checkpoint.files.capture_rng`), always;
* ``"rank_buffers"``: its module buffers, e.g. BatchNorm's running statistics, **when they
  differ across ranks**: ``hpc.sync_gradients`` averages gradients and nothing else, so
  each rank's statistics follow its own shard of the data. One ``all_reduce`` of a hash
  of every rank's buffers (:func:`buffers_digest`) tells; when they agree (DDP's
  ``broadcast_buffers`` before a forward, ``hpc pretrain``'s averaged statistics, a model
  without buffers) nothing more is sent and the master's serve every rank;
* ``"rank_extra"``: what the script passed as ``rank_extra=`` (e.g. its own loss
  history), when it did.

All of them reach the master in the save's one ``gather_object``. A restore at the same
world size gives each rank its own back (:func:`model_state_for`,
:func:`rank_extra_for`). At another world size the saved ranks do not map onto the new
ones: the RNG is not restored, every rank loads the master's buffers (one warning, when
they differed) and ``rank_extra`` comes back empty (all ranks' stay in the payload).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from hpc.checkpoint.files import capture_rng
from hpc.sync.agree import same_on_all_ranks, world

__all__ = ["buffers_of", "buffers_digest", "gather_rank_states", "model_state_for",
           "rank_extra_for", "PER_RANK"]

logger = logging.getLogger(__name__)

#: The payload keys that hold one entry per rank.
PER_RANK = ("rng", "rank_buffers", "rank_extra")


def buffers_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``module.state_dict()`` that are not parameters: its persistent
    buffers (BatchNorm's ``running_mean``/``running_var``/``num_batches_tracked``), on
    the CPU, under their ``state_dict`` keys. ``module`` is the plain module (not DDP)."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return {key: value.detach().cpu() for key, value in module.state_dict().items()
            if key not in params and isinstance(value, torch.Tensor)}


def buffers_digest(buffers: dict[str, torch.Tensor]) -> bytes:
    """SHA-256 of the names, dtypes, shapes and bytes of ``buffers``: equal on two ranks
    exactly when their buffers are bitwise equal (bar a collision)."""
    h = hashlib.sha256()
    for key, value in buffers.items():
        h.update(f"{key}|{value.dtype}|{tuple(value.shape)};".encode())
        raw = value.contiguous().reshape(-1)
        if raw.numel():
            h.update(raw.view(torch.uint8).numpy().tobytes())
    return h.digest()


def gather_rank_states(module: nn.Module, rank_extra: Optional[dict[str, Any]] = None
                       ) -> Optional[dict[str, list[Any]]]:
    """Every rank's own states on rank 0, as payload entries; ``None`` elsewhere.

    Collective: one ``all_reduce`` (do the buffers differ?) and one ``gather_object``.
    The result holds ``"rng"`` always, ``"rank_buffers"`` only when the buffers differ
    across ranks and ``"rank_extra"`` only when a rank passed one.
    """
    rank, size = world()
    buffers = buffers_of(module)
    differ = not same_on_all_ranks(buffers_digest(buffers))
    mine = (capture_rng(), buffers if differ else None, rank_extra)
    if size == 1:
        states: Optional[list[Any]] = [mine]
    else:
        states = [None] * size if rank == 0 else None
        dist.gather_object(mine, states, dst=0)
    if states is None:
        return None
    out: dict[str, list[Any]] = {"rng": [s[0] for s in states]}
    if differ:
        out["rank_buffers"] = [s[1] for s in states]
    if any(s[2] is not None for s in states):
        out["rank_extra"] = [s[2] if s[2] is not None else {} for s in states]
    return out


def model_state_for(payload: dict[str, Any], rank: int, same_world: bool,
                    path: str = "") -> dict[str, Any]:
    """The state dict rank ``rank`` loads: the master's weights with its own buffers.

    At another world size (``same_world`` false) the master's buffers, with a warning
    from rank 0 when the saved ranks' buffers differed.
    """
    per_rank = payload.get("rank_buffers")
    if not per_rank:
        return payload["model"]
    if same_world:
        return {**payload["model"], **per_rank[rank]}
    if rank == 0:
        logger.warning(
            "checkpoint %s holds %d buffers per rank (e.g. BatchNorm running statistics) "
            "that differed across its %d ranks; at world size %d they do not map onto "
            "the ranks, so every rank starts from rank 0's.", path or "(payload)",
            len(per_rank[0]), len(per_rank), world()[1])
    return payload["model"]


def rank_extra_for(payload: dict[str, Any], rank: int, same_world: bool) -> dict[str, Any]:
    """Rank ``rank``'s own ``rank_extra`` at the same world size; ``{}`` otherwise (all
    saved ranks' stay in ``payload["rank_extra"]``)."""
    saved = payload.get("rank_extra")
    if not saved or not same_world:
        return {}
    return dict(saved[rank])
