"""Who this process is in the job: the roles every room asks about, after or without init.

:func:`hpc.init_torch` records the layout it resolved and the device it bound
(:func:`set_current`); the accessors read them, or a fresh :func:`hpc.detect` of the
environment before init (a launcher's variables alone say the rank). The global master
(rank 0) writes the run's files; each node's local master (local rank 0) logs to the
console::

    if hpc.is_master():
        save_report(...)

    @hpc.master_only
    def plot(...): ...

This module holds no init: it sits below :mod:`hpc.bootstrap` and :mod:`hpc.log`, which
both read it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, TypeVar

from hpc.environments import DistInfo, detect

__all__ = ["info", "device", "is_dist", "get_rank", "get_local_rank", "get_world_size",
           "get_local_world_size", "get_node_rank", "is_master", "is_local_master",
           "master_only", "barrier", "set_current"]

F = TypeVar("F", bound=Callable[..., Any])

#: What init recorded: the layout and the device (None before init and after teardown).
_CURRENT: dict[str, Any] = {"info": None, "device": None}


def set_current(info: Optional[DistInfo], device: Any = None) -> None:
    """Record what :func:`hpc.init_torch` resolved (``None``: forget it, at teardown)."""
    _CURRENT.update(info=info, device=device)


def current() -> Optional[DistInfo]:
    """The layout init recorded, or None before init (no detection)."""
    return _CURRENT["info"]


def info() -> DistInfo:
    """The :class:`DistInfo` of :func:`init_torch`, or a fresh :func:`detect`."""
    return _CURRENT["info"] or detect()


def device() -> Any:
    """The device :func:`init_torch` bound (``cuda:i`` or ``cpu``)."""
    import torch

    return _CURRENT["device"] or torch.device("cpu")


def is_dist() -> bool:
    """True when torch.distributed is initialised with more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """Global rank (0 when not distributed)."""
    return info().rank


def get_local_rank() -> int:
    """Rank on this node."""
    return info().local_rank


def get_world_size() -> int:
    """Number of processes."""
    return info().world_size


def get_local_world_size() -> int:
    """Number of processes on this node."""
    return info().local_world_size


def get_node_rank() -> int:
    """Index of this node."""
    return info().node_rank


def is_master() -> bool:
    """True on global rank 0: the one that writes files."""
    return get_rank() == 0


def is_local_master() -> bool:
    """True on local rank 0 of each node: the one that logs to the console."""
    return get_local_rank() == 0


def master_only(fn: F) -> F:
    """Run ``fn`` on the global master only; other ranks get ``None``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if is_master() else None

    return wrapper  # type: ignore[return-value]


def barrier() -> None:
    """Block until every rank arrives (no-op when not distributed)."""
    import torch.distributed as dist

    if is_dist():
        dist.barrier()
