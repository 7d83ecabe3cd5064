"""Gradient averaging for models whose ranks use different parameters (supernets).

Call :func:`sync_gradients` (or a reusable :class:`GradSync`) after ``backward()`` on
every rank. Afterwards every parameter's ``.grad`` is the mean over ranks, where a rank
that did not use a parameter contributes zero; a parameter no rank used keeps
``grad=None`` and is not sent. The values are bitwise equal on every rank and follow
DDP's arithmetic (each gradient multiplied by ``1/world_size``, then summed).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from hpc._collective import active_world, check_same_tensors, comm_device

__all__ = ["sync_gradients", "GradSync", "DEFAULT_BUCKET_BYTES"]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024

ModuleOrParams = Union[torch.nn.Module, Iterable[torch.Tensor]]


def _named(module_or_params: ModuleOrParams) -> list[tuple[str, torch.Tensor]]:
    if isinstance(module_or_params, torch.nn.Module):
        return [(n, p) for n, p in module_or_params.named_parameters() if p.requires_grad]
    seen: set[int] = set()
    out = []
    for i, p in enumerate(module_or_params):
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            out.append((f"param[{i}]", p))
    return out


class GradSync:
    """Averages ``.grad`` of a fixed parameter list across ranks; reuse it every step.

    Args:
        module_or_params: A module (its trainable parameters, in ``parameters()``
            order) or an iterable of parameters. Every rank must pass the same list.
        bucket_bytes: Target size of one all_reduce.
        group: Process group (default: the world).
    """

    def __init__(self, module_or_params: ModuleOrParams, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 group: Optional[Any] = None) -> None:
        self.named = _named(module_or_params)
        self.params = [p for _, p in self.named]
        self.bucket_bytes = bucket_bytes
        self.group = group
        self._checked = False

    @torch.no_grad()
    def sync(self) -> None:
        """Average the gradients now (collective: every rank calls it after backward).

        Raises:
            ModelMismatchError: On the first call, when ranks hold different parameter
                lists.
        """
        ws = active_world(self.group)
        if not ws:
            return
        if not self._checked:
            check_same_tensors(self.named, "sync_gradients", self.group)
            self._checked = True
        dev = comm_device(self.group)
        mask = torch.tensor([p.grad is not None for p in self.params], dtype=torch.uint8,
                            device=dev)
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=self.group)
        union = [p for p, m in zip(self.params, mask.tolist()) if m]
        scale = 1.0 / ws
        for bucket in self._buckets(union):
            p0 = bucket[0]
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=p0.dtype,
                               device=comm_device(self.group, p0.device))
            off = 0
            for p in bucket:
                n = p.numel()
                if p.grad is not None:
                    torch.mul(p.grad.reshape(-1), scale, out=flat[off:off + n])
                off += n
            dist.all_reduce(flat, group=self.group)
            off = 0
            for p in bucket:
                n = p.numel()
                view = flat[off:off + n].view_as(p)
                if p.grad is None:
                    p.grad = view.to(p.device).clone()
                else:
                    p.grad.copy_(view)
                off += n

    __call__ = sync

    def _buckets(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        open_: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        sizes: dict[tuple[Any, ...], int] = {}
        out: list[list[torch.Tensor]] = []
        for p in params:
            key = (p.device, p.dtype)
            nbytes = p.numel() * p.element_size()
            if key in open_ and sizes[key] + nbytes > self.bucket_bytes:
                out.append(open_.pop(key))
            if key not in open_:
                open_[key], sizes[key] = [], 0
            open_[key].append(p)
            sizes[key] += nbytes
        out.extend(open_.values())
        return out


_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, GradSync]" = weakref.WeakKeyDictionary()


def sync_gradients(module_or_params: ModuleOrParams, *,
                   group: Optional[Any] = None) -> None:
    """Average ``.grad`` across ranks after ``backward()`` (see :class:`GradSync`).

    For a module the :class:`GradSync` (and its buffers) is cached and reused.
    """
    if not active_world(group):
        return
    if isinstance(module_or_params, torch.nn.Module) and group is None:
        gs = _CACHE.get(module_or_params)
        if gs is None:
            gs = _CACHE[module_or_params] = GradSync(module_or_params)
        gs.sync()
        return
    GradSync(module_or_params, group=group).sync()
