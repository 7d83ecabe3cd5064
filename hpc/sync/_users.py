"""``users=`` of :mod:`hpc.sync.grads`: the caller says who used which parameter.

When every rank can compute every rank's choices (a supernet's paths drawn from the
seed, the rank and the step), the step's agreement round is not needed. These helpers
turn what the caller passed into the ``(world_size, n_params)`` matrix the plan is made
from, and refuse what cannot be right locally.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Union

import torch

from hpc.errors import HPCError
from hpc.sync._collective import same_on_all_ranks

__all__ = ["Users", "check_agreed", "check_own_row", "users_matrix"]

#: Who used what, passed by the caller: one iterable of parameters per rank, or a
#: ``(world_size, n_params)`` bool/integer tensor (columns in parameter order).
Users = Union[torch.Tensor, Sequence[Iterable[torch.Tensor]]]  # noqa: UP007 (runtime, 3.9)


def users_matrix(users: Users, ws: int, index: dict[int, int],
                  named: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """``users`` as a ``(ws, n)`` uint8 CPU tensor; HPCError when malformed."""
    n = len(named)
    if isinstance(users, torch.Tensor):
        if tuple(users.shape) != (ws, n) or users.is_floating_point():
            raise HPCError(
                f"sync_gradients: users is a {users.dtype} tensor of shape "
                f"{tuple(users.shape)}; the tensor form needs ({ws}, {n}) (world size x "
                "parameters), bool or integer.\nHINT: one row per rank, one column per "
                "parameter in parameters() order, or pass one iterable of parameters "
                "per rank.")
        return users.detach().to("cpu").ne(0).to(torch.uint8)
    rows = list(users)
    if len(rows) != ws:
        raise HPCError(
            f"sync_gradients: users has {len(rows)} entries for a world size of {ws}.\n"
            "It needs one iterable of used parameters per rank, in rank order.\nHINT: "
            "build it with one entry for every rank of the group.")
    out = torch.zeros(ws, n, dtype=torch.uint8)
    for r, row in enumerate(rows):
        cols = []
        for t in row:
            i = index.get(id(t))
            if i is None:
                raise HPCError(
                    f"sync_gradients: users[{r}] holds a tensor of shape "
                    f"{tuple(t.shape)} that is not one of the {n} parameters being "
                    "synced.\nOnly trainable parameters of the synced module count.\n"
                    "HINT: list the module's own parameters (requires_grad=True), not "
                    "copies or buffers.")
            cols.append(i)
        out[r, cols] = 1
    return out


def check_own_row(mine: torch.Tensor, row: torch.Tensor, rank: int,
                  named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """HPCError when this rank has a gradient its own row of ``users`` leaves out.

    A listed parameter without a gradient is fine (it contributes zeros, as in DDP);
    a gradient nobody else knows about would be silently dropped.
    """
    missing = (mine.bool() & ~row.bool()).nonzero().flatten().tolist()
    if missing:
        raise HPCError(
            f"sync_gradients: rank {rank} has a gradient for {named[missing[0]][0]!r} "
            f"({len(missing)} parameter(s) in all) that users[{rank}] does not list.\n"
            "The other ranks plan from users, so that gradient would be left out of the "
            "mean.\nHINT: compute users from the same paths forward() used on every "
            "rank, or leave users out to exchange them (one extra round trip).")


def check_agreed(matrix: torch.Tensor, group: Any | None = None) -> None:
    """Raise HPCError on every rank unless all ranks passed the same ``matrix``.

    Collective (one hash ``all_reduce``); :class:`hpc.sync.GradSync` runs it on its
    first call with ``users``.
    """
    if not same_on_all_ranks(matrix.numpy().tobytes(), group):
        raise HPCError(
            "sync_gradients: ranks passed different users on their first call "
            "with users=.\nEvery rank plans its collectives from users, so "
            "different values would pair mismatched buckets.\nHINT: compute "
            "every rank's row the same way on every rank (e.g. from the seed, "
            "that rank's number and the step).")
