"""Gradient averaging for models whose ranks use different parameters (supernets).

Call :func:`sync_gradients` (or a reusable :class:`GradSync`) after ``backward()`` on
every rank, or let :meth:`GradSync.backward` run the backward pass and overlap the
communication with it. Afterwards every parameter's ``.grad`` is the mean over ranks,
where a rank that did not use a parameter contributes zero; a parameter no rank used
keeps ``grad=None`` and is not sent. Results are bitwise equal on every rank.

One step (details and measurements in ``docs/sync.md``):

1. *Agreement*: one ``all_gather`` of who has which gradient, skipped when the caller
   passes ``users``.
2. A parameter used by one rank is *broadcast by its owner*; one used by several goes
   into a bucketed ``all_reduce``; one used by nobody is skipped. Where every rank is on
   this host and the parameters on the CPU, the buckets go through shared memory
   (:mod:`hpc.sync._shm`) instead of the process group; across hosts with the same
   number of ranks (2+) on each, node by node (:mod:`hpc.sync._nodes`).
3. DDP's arithmetic (``mul`` by ``1/world_size``, ``+0.0`` turning ``-0.0`` into
   ``+0.0``); a sum of two terms does not depend on the order, so at world size 2 the
   result equals ``DDP(find_unused_parameters=True)`` bit for bit; ``match_ddp=True``
   gets DDP's bits at any world size (DDP's bucket layout on the process group).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from hpc.errors import HPCError
from hpc.sync._collective import (
    GRAD_BUCKET_BYTES,
    GRAD_OVERLAP_BUCKET_BYTES,
    active_world,
    check_same_tensors,
    comm_device,
    start_all_gather,
    start_bucket,
)
from hpc.sync._pack import Layout
from hpc.sync._plan import Arena, Bucket, local_mask, make_plan, trainable
from hpc.sync._nodes import NodeLane, open_exchange
from hpc.sync._shm import ShmLane, half_bytes
from hpc.sync._shm_region import lane_wanted
from hpc.sync._threads import share_of_host
from hpc.sync._users import Users, check_agreed, check_own_row, users_matrix
from hpc.watchdog import tracker

__all__ = ["sync_gradients", "GradSync"]

logger = logging.getLogger(__name__)

ModuleOrParams = Union[torch.nn.Module, Iterable[torch.Tensor]]


@dataclass
class _Step:
    """One synchronisation in progress."""

    mine: torch.Tensor                 # uint8 (n,): this rank has a gradient
    users: torch.Tensor                # uint8 (ws * n,): everyone's, once gathered
    work: Any                          # the all_gather of ``users`` (None: done)
    overlap: bool = False              # started by backward(): plan in backward order
    ready: list[int] = field(default_factory=list)   # grads accumulated, not packed
    packed: set[int] = field(default_factory=set)
    counts: list[int] = field(default_factory=list)  # users per parameter
    plan: Optional[list[Bucket]] = None
    where: dict[int, tuple[Bucket, int]] = field(default_factory=dict)
    launched: int = 0


class GradSync:
    """Averages ``.grad`` of a fixed parameter list across ranks; reuse it every step.

    Either ``loss.backward(); gs.sync()`` or ``gs.backward(loss)``; the latter walks the
    autograd graph to learn which parameters will get gradients, exchanges that before
    backward runs, and sends each bucket from a post-accumulate-grad hook as soon as it
    is complete, so communication overlaps the rest of backward.

    Args:
        module_or_params: A module (its trainable parameters, in ``parameters()``
            order) or an iterable of parameters. Every rank must pass the same list.
        bucket_bytes: Bucket size for :meth:`sync` after backward (default 25 MiB,
            DDP's ``bucket_cap_mb``; ``match_ddp`` follows DDP's layout for this size).
        overlap_bucket_bytes: Bucket size for :meth:`backward` (default 4 MiB, so that
            sends start early).
        match_ddp: Reproduce ``DDP(find_unused_parameters=True)`` bit for bit at any
            world size (see the module docstring); at world size 2 the default already
            does.
        comm_dtype: Send float32 gradients in this dtype (``torch.bfloat16`` or
            ``torch.float16``) and convert the mean back: half the bytes, not bitwise
            equal to DDP (compare DDP's ``bf16_compress_hook``). Default: off.
        shm: Exchange through shared memory when every rank of the group is on this
            host and the parameters are on the CPU (see :mod:`hpc.sync._shm`), or node
            by node across hosts with as many ranks (2+) on each (shared memory inside
            a node, :mod:`hpc.sync._nodes`). None
            (default): when possible, unless ``HPC_SYNC_SHM=0``; True: required (an
            error if not possible); False: never.
        group: Process group (default: the world).

    Raises:
        HPCError: A parameter has a sparse gradient (not supported).
        ModelMismatchError: On the first sync, when ranks hold different parameter
            lists (names, shapes, dtypes); raised on every rank.
    """

    def __init__(self, module_or_params: ModuleOrParams, *,
                 bucket_bytes: int = GRAD_BUCKET_BYTES,
                 overlap_bucket_bytes: int = GRAD_OVERLAP_BUCKET_BYTES,
                 match_ddp: bool = False, comm_dtype: Optional[torch.dtype] = None,
                 shm: Optional[bool] = None, group: Optional[Any] = None) -> None:
        if comm_dtype not in (None, torch.bfloat16, torch.float16):
            raise HPCError(
                f"GradSync: comm_dtype={comm_dtype} is not supported.\nOnly the 16-bit "
                "float types halve the bytes of float32 gradients.\nHINT: pass "
                "comm_dtype=torch.bfloat16, torch.float16 or None (send as is).")
        self.named = trainable(module_or_params)
        self.params = [p for _, p in self.named]
        self.bucket_bytes = bucket_bytes
        self.overlap_bucket_bytes = overlap_bucket_bytes
        self.match_ddp = match_ddp
        self.comm_dtype = comm_dtype
        self.shm = shm
        self.group = group
        #: Figures of the last sync: parameters sent/skipped, bytes, collectives.
        self.stats: dict[str, int] = {}
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._layout = Layout(self.params, comm_dtype)
        self._numels, self._itemsizes = self._layout.numels, self._layout.itemsizes
        self._arena = Arena()
        self._checked = False
        self._step: Optional[_Step] = None
        self._hooks: list[Any] = []
        self._ddp_buckets: Optional[list[list[int]]] = None
        self._users_checked = False
        # the shared-memory exchange (one host, or node by node), if opened
        self._lane: Optional[Union[ShmLane, NodeLane]] = None

    # ------------------------------------------------------------------ public
    def sync(self, users: Optional[Users] = None) -> None:
        """Average the gradients now (collective: every rank calls it after backward).

        Args:
            users: Which parameters each rank used this step, when every rank can
                compute it (e.g. supernet paths drawn from the seed, the rank and the
                step): skips the agreement round. One iterable of parameters per rank,
                in rank order, or a ``(world_size, n_params)`` bool tensor; every rank
                must pass the same. A listed parameter without a gradient contributes
                zeros; a gradient that is not listed is an error.

        Raises:
            HPCError: ``users`` is malformed, omits a gradient this rank has, or (on
                the first call with ``users``) differs between ranks.
        """
        ws = active_world(self.group)
        st, self._step = self._step, None
        if not ws:
            return
        with torch.no_grad():
            if st is None:
                mine = local_mask(self.named, None)
                st = (self._begin(mine) if users is None
                      else self._given(mine, users, ws))
            self._finish(st, ws)

    __call__ = sync

    def backward(self, loss: torch.Tensor, users: Optional[Users] = None,
                 **kwargs: Any) -> None:
        """``loss.backward(**kwargs)`` with the sync overlapped, then :meth:`sync`.

        ``users`` as for :meth:`sync`: with it, the buckets are planned before backward
        starts and the first ones leave as soon as their gradients exist.
        """
        if not active_world(self.group):
            loss.backward(**kwargs)
            return
        if not self._hooks:
            ref = weakref.ref(self)
            for i, p in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda _p, i=i: _on_grad(ref, i)))
        mine = local_mask(self.named, loss)
        if users is None:
            self._step = self._begin(mine)
            self._step.overlap = True
        else:
            self._step = self._given(mine, users, dist.get_world_size(self.group),
                                     overlap=True)
        try:
            loss.backward(**kwargs)
        except BaseException:
            self._step = None
            raise
        self.sync()

    def close(self) -> None:
        """Remove the hooks :meth:`backward` installed."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ steps
    def _check_once(self) -> None:
        if not self._checked:
            check_same_tensors(self.named, "sync_gradients", self.group)
            want = lane_wanted(self.shm, self.params, self.match_ddp, self.group)
            self._lane = open_exchange(half_bytes(self._numels, self._itemsizes),
                                       self.group, want, bool(self.shm))
            self._checked = True

    def _given(self, mine: torch.Tensor, users: Users, ws: int,
               overlap: bool = False) -> _Step:
        """A step whose usage the caller passed: checked, planned, no agreement round."""
        self._check_once()
        matrix = users_matrix(users, ws, self._index, self.named)
        rank = dist.get_rank(self.group)
        row = matrix[rank]
        check_own_row(mine, row, rank, self.named)
        if not self._users_checked:
            check_agreed(matrix, self.group)
            self._users_checked = True
        st = _Step(row.clone(), matrix, None, overlap=overlap)
        self._build(st)
        return st

    def _begin(self, mine: torch.Tensor) -> _Step:
        self._check_once()
        ws = dist.get_world_size(self.group)
        dev = comm_device(self.group)
        mine_d = mine.to(dev)
        users = torch.empty(ws * len(self.params), dtype=torch.uint8, device=dev)
        return _Step(mine, users, start_all_gather(users, mine_d, self.group))

    def _build(self, st: _Step) -> None:
        """Plan the buckets from the gathered usage; allocate and zero-fill buffers."""
        ws = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        users = st.users.view(ws, -1).cpu().to(torch.int32)
        n = len(self.params)
        order = range(n - 1, -1, -1) if st.overlap else range(n)
        st.counts = users.sum(0).tolist()
        layout = None
        if self.match_ddp and ws > 2:  # DDP's bucket assignment, computed once
            self._ddp_buckets = (self._ddp_buckets
                                 or self._layout.ddp_buckets(self.bucket_bytes))
            layout = self._ddp_buckets
        st.plan = make_plan(users, self._numels, self._layout.keys, self._itemsizes, order,
                            self.overlap_bucket_bytes if st.overlap else self.bucket_bytes,
                            rank, layout)
        mine = st.mine.tolist()
        if self._lane is not None:
            self._lane.place(st.plan)
        for b in st.plan:
            device, dtype = b.key[0], b.key[1]
            if self._lane is None:
                # capacity = the bucket planned, not the mode's limit (25 MiB: ~6x CUDA)
                b.flat = self._arena.take(comm_device(self.group, device), dtype,
                                          b.numel, b.numel)
            elif b.flat is None:
                continue  # another rank's broadcast: read after the step's barrier
            for i, off in zip(b.idx, b.offsets):
                st.where[i] = (b, off)
                if b.kind == "mean" and not mine[i]:
                    b.flat[off:off + self._numels[i]].zero_()
        scale = 1.0 / ws
        for i in st.ready:
            self._pack(st, i, scale)
        st.ready = []

    def _pack(self, st: _Step, i: int, scale: float) -> None:
        b, off = st.where[i]
        self._layout.pack(b, off, i, scale, self._lane is None or not self._lane.signs_zeros)
        b.pending -= 1
        st.packed.add(i)

    def _pack_many(self, st: _Step, todo: list[int], scale: float) -> None:
        """:meth:`_pack` for many parameters, fused per bucket where it can be."""
        fused = []
        for i in todo:
            b, off = st.where[i]
            if not self._layout.fusable(b, i):
                self._pack(st, i, scale)
                continue
            fused.append((b, off, i))
            b.pending -= 1
            st.packed.add(i)
        self._layout.pack_fused(fused, scale)

    def _launch_ready(self, st: _Step) -> None:
        """Issue the next buckets, in plan order, while they are fully packed."""
        plan = st.plan or []
        while st.launched < len(plan) and plan[st.launched].pending == 0:
            b = plan[st.launched]
            st.launched += 1
            if self._lane is not None:
                continue  # shared memory: all buckets are read after one barrier
            src = b.owner
            if b.kind == "broadcast" and self.group is not None:
                src = dist.get_global_rank(self.group, b.owner)
            b.work = start_bucket(b.kind, b.flat, src, self.group, st.launched - 1)

    def _exchange(self, st: _Step, plan: list[Bucket], mine: list[int],
                  scale: float) -> None:
        """Pack and issue what backward did not; through shared memory, exchange."""
        rank = dist.get_rank(self.group)
        for b in plan[st.launched:]:
            if b.kind == "mean" or b.owner == rank:
                self._pack_many(st, [i for i in b.idx
                                     if mine[i] and i not in st.packed], scale)
            self._launch_ready(st)
        if self._lane is not None:
            self._lane.exchange(plan, self._arena, self.group)

    def _on_grad(self, i: int) -> None:
        """Post-accumulate-grad hook of parameter ``i`` (during :meth:`backward`)."""
        st = self._step
        if st is None:
            return
        with torch.no_grad():
            if st.plan is None:
                st.ready.append(i)
                if not st.work.is_completed():
                    return
                tracker.wait(st.work)
                st.work = None
                self._build(st)
            elif st.mine[i]:
                self._pack(st, i, 1.0 / dist.get_world_size(self.group))
            else:
                logger.warning("sync_gradients: %s got a gradient the autograd graph did "
                               "not predict; it is left out of this step's mean",
                               self.named[i][0])
            self._launch_ready(st)

    def _finish(self, st: _Step, ws: int) -> None:
        """Pack and issue what backward did not, wait, and point ``.grad`` at results."""
        if st.plan is None:
            if st.work is not None:
                tracker.wait(st.work)
                st.work = None
            self._build(st)
        plan = st.plan or []
        local_ranks = 1 if self._lane is None else self._lane.local_ranks
        try:
            with share_of_host(local_ranks):  # the lane's copies: see hpc.sync._threads
                self._exchange(st, plan, st.mine.tolist(), 1.0 / ws)
            sent = 0
            for b in plan:
                if b.work is not None:
                    tracker.wait(b.work)
                    b.work = None  # no Work outlives the step (or the group, at exit)
                flat = self._layout.widen(self._arena, b)
                for i, off in zip(b.idx, b.offsets):
                    if b.exact and not st.counts[i]:
                        continue  # zeros of a DDP-layout bucket: nobody used it
                    p = self.params[i]
                    view = self._layout.view(flat, off, i)
                    p.grad = view if view.device == p.device else view.to(p.device)
                    sent += 1
            barriers = None if self._lane is None else self._lane.barriers(plan)
            self.stats = self._layout.stats(plan, sent, barriers)
            self.stats["across_nodes"] = int(isinstance(self._lane, NodeLane))
        finally:
            self._arena.end_step()


def _on_grad(ref: "weakref.ReferenceType[GradSync]", i: int) -> None:
    gs = ref()
    if gs is not None:
        gs._on_grad(i)


#: Per module: the keyword options a cached :class:`GradSync` was built with, and it.
_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[dict[str, Any], GradSync]]" = (
    weakref.WeakKeyDictionary())


def sync_gradients(module_or_params: ModuleOrParams, users: Optional[Users] = None, *,
                   match_ddp: bool = False, comm_dtype: Optional[torch.dtype] = None,
                   shm: Optional[bool] = None, group: Optional[Any] = None) -> None:
    """Average ``.grad`` across ranks after ``backward()``; see :class:`GradSync`.

    ``users`` (optional, this step's) as for :meth:`GradSync.sync`: who used which
    parameter, when every rank can compute it; skips the agreement round.

    For a module (with the default group) one :class:`GradSync` is cached per module and
    reused, buffers included, as long as the call's options equal the ones it was built
    with (other options build, and cache, a new one); for a list of parameters (or with
    ``group``) a new one is built per call, without shared memory unless ``shm=True``.
    """
    if not active_world(group):
        return
    # Every keyword option, in one place: what GradSync is built with is the cache key,
    # so an option added here can never reuse a GradSync built with other settings.
    # ``users`` is this step's data, not an option.
    options: dict[str, Any] = {"match_ddp": match_ddp, "comm_dtype": comm_dtype,
                               "shm": shm, "group": group}
    if isinstance(module_or_params, torch.nn.Module) and group is None:
        cached = _CACHE.get(module_or_params)
        if cached is None or cached[0] != options:
            cached = _CACHE[module_or_params] = (options, GradSync(module_or_params, **options))
        cached[1].sync(users)
        return
    # Built for this call only: opening shared memory (three collectives, reserving
    # twice the gradients' bytes) would cost more than it saves once. shm=False sends
    # nothing for the lane (no agreement round either).
    options["shm"] = False if shm is None else shm
    GradSync(module_or_params, **options).sync(users)
