"""Gradient exchange across hosts, node by node (internal): :class:`NodeLane`.

Where a group's ranks span several hosts with several ranks on each, gloo's flat ring
knows nothing of hosts: with 2 nodes x 2 ranks every hop that crosses nodes carries
~1.5x a mean's bytes. Here, per step:

1. every rank packs into its region of its node's shared memory (:class:`~hpc.sync._shm.
   ShmLane` over the node's ranks) and the node's ranks meet in a barrier;
2. each rank takes *its slice* of every bucket (slice ``l`` of ``L`` for the node's rank
   ``l``): of a mean, the sum over its node's regions (in local rank order); of a
   broadcast whose owner is on this node, the owner's slice. It then exchanges that
   slice with the ranks of the same local index on the other nodes (one *cross* group
   per local index): a summing ``all_reduce`` for a mean, a ``broadcast`` from the
   owner's node for a broadcast. Every rank's link carries ``1/L`` of the traffic, and a
   node sends about ``2 (N-1)/N`` of a mean's bytes (all-reduce's minimum), not ``1.5x``;
3. each rank publishes its slice in its own region, a second barrier, and every rank
   copies the others' slices.

Results are bitwise equal on every rank: a slice is summed once per node, in a fixed
order, and the cross-node collective hands the same bits to every node; the other ranks
copy them. The order of the sums differs from DDP's ring (within rounding; documented).

It applies when :func:`hierarchy_problem` finds none: two or more nodes, the same number
of ranks (two or more) on each. Otherwise a group spread over hosts keeps the process
group's own transport, and a group on one host the one-host lane; the choice is made from
one gathered list, so identically on every rank (:func:`open_exchange`).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from hpc.errors import HPCError
from hpc.sync._shm import ShmLane, barrier
from hpc.sync._shm_region import SHM_DIR, open_lane, try_open
from hpc.sync.agree import all_true

__all__ = ["NodeLane", "NodeBroadcast", "Topology", "node_key", "topology_of", "topology",
           "hierarchy_problem", "subgroups", "open_exchange", "NodeReduce",
           "node_collectives", "ranks_on_node"]

logger = logging.getLogger(__name__)


def _begin(name: str, group: Optional[Any]) -> Optional[int]:
    """Count a staged exchange as one world collective for the watchdog (its subgroup
    calls are not wrapped): every rank begins it at the same point of its world
    collectives, so a rank frozen before it is named as never having entered it."""
    from hpc.watchdog import tracker

    world = group is None or group is dist.group.WORLD
    return tracker.begin(name) if world else None


def _end(seq: Optional[int], name: str, run: Callable[[], None]) -> None:
    """``run()``, then complete :func:`_begin`'s ``seq`` (a job failure raised inside is
    reported as the watchdog's wrapped collectives report theirs)."""
    from hpc.watchdog import tracker

    try:
        run()
    except Exception as e:
        instead = tracker.end(seq, name, e)
        if instead is not None:
            raise instead from e
        raise
    tracker.end(seq, name)


def node_key() -> str:
    """What ranks that can share memory have in common: the host's name and the device
    of its ``/dev/shm`` (containers on one host with a private ``/dev/shm`` each are
    different nodes for this purpose; the lane's opening checks it anyway)."""
    try:
        dev = os.stat(SHM_DIR).st_dev
    except OSError:
        dev = -1
    return f"{socket.gethostname()}:{dev}"


@dataclass(frozen=True)
class Topology:
    """The group's ranks by node: ``nodes[n]`` lists node ``n``'s group ranks in
    order; nodes are numbered by their first rank."""

    nodes: tuple[tuple[int, ...], ...]

    def node_of(self, rank: int) -> int:
        return next(n for n, ranks in enumerate(self.nodes) if rank in ranks)

    def local_of(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)


def topology_of(keys: Sequence[str]) -> Topology:
    """Pure: the nodes of a group whose rank ``r`` reported ``keys[r]``."""
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    return Topology(tuple(tuple(r) for r in nodes.values()))


def hierarchy_problem(topo: Topology) -> Optional[str]:
    """Why the node-by-node exchange does not apply to ``topo`` (None: it does)."""
    counts = [len(r) for r in topo.nodes]
    if len(counts) < 2:
        return "every rank is on one node"
    if len(set(counts)) > 1:
        return (f"the nodes run different numbers of ranks ({', '.join(map(str, counts))}"
                "), so the ranks of one local index do not make a group on every node")
    if counts[0] < 2:
        return "one rank per node: there is nothing to share inside a node"
    return None


class NodeLane:
    """This rank's view of the node-by-node exchange (see the module docstring).

    Args:
        lane: The node's shared-memory lane (its ranks are the node's local ranks).
        topo: The group's nodes.
        rank: This rank in the group.
        local_group, cross_group: This rank's node, and its local index across nodes.
        cross_ranks: Global rank of each node's member of ``cross_group``.
    """

    def __init__(self, lane: ShmLane, topo: Topology, rank: int, local_group: Any,
                 cross_group: Any, cross_ranks: Sequence[int]) -> None:
        self.lane, self.topo, self.rank = lane, topo, rank
        self.node = topo.node_of(rank)
        self.local_group, self.cross_group = local_group, cross_group
        self.cross_ranks = list(cross_ranks)
        self._node_of = {r: n for n, ranks in enumerate(topo.nodes) for r in ranks}
        self._local_of = {r: ranks.index(r) for ranks in topo.nodes for r in ranks}

    #: The slices go across nodes as their owners packed them: the owners turn a
    #: broadcast's ``-0.0`` into ``+0.0`` (see :attr:`ShmLane.signs_zeros`).
    signs_zeros = False

    @property
    def local_ranks(self) -> int:
        """Ranks on this node (they share its lane)."""
        return self.lane.local_ranks

    @property
    def nodes(self) -> int:
        return len(self.topo.nodes)

    def place(self, plan: Sequence[Any]) -> None:
        """Start a step: every bucket's slot; ``flat`` = this rank's slot where it packs
        (its own broadcasts, every mean), else None."""
        self.lane.begin_step()
        sizes = [b.numel * b.key[1].itemsize for b in plan]
        for b, off in zip(plan, ShmLane.offsets(sizes)):
            b.slot = off
            mine = b.kind == "mean" or b.owner == self.rank
            b.flat = self.lane.slot(self.lane.rank, off, b.numel, b.key[1]) if mine else None

    #: What the watchdog calls the exchange (one world collective per step).
    NAME = "sync_gradients across nodes"

    def exchange(self, plan: Sequence[Any], arena: Any, group: Optional[Any]) -> None:
        """After packing: every bucket's result into a private buffer from ``arena``."""
        seq = _begin(self.NAME, group)
        _end(seq, self.NAME, lambda: self._exchange(plan, arena))

    def _exchange(self, plan: Sequence[Any], arena: Any) -> None:
        lane = self.lane
        barrier(self.local_group)  # the node has packed
        outs = [arena.take(torch.device("cpu"), b.key[1], b.numel, b.numel) for b in plan]
        sent = []  # (bucket, slice bounds, the slice, its cross-node Work), in plan order
        for b, out in zip(plan, outs):
            lo, hi = lane.slices(out.numel(), out.itemsize)[lane.rank]
            if lo == hi:
                continue
            part = out[lo:hi]
            if b.kind == "mean":
                lane.sum_part(b.slot, lo, hi, part)
                work = dist.all_reduce(part, group=self.cross_group, async_op=True)
            else:
                node = self._node_of[b.owner]
                if node == self.node:
                    part.copy_(lane.part(self._local_of[b.owner], b.slot, lo, hi, out.dtype))
                work = dist.broadcast(part, self.cross_ranks[node], group=self.cross_group,
                                      async_op=True)
            sent.append((b, lo, hi, part, work))
        from hpc.watchdog import tracker

        for b, lo, hi, part, work in sent:  # publish each slice as soon as it is back
            tracker.wait(work)
            if b.owner != self.rank:  # an owner's own slot already holds its slice
                lane.part(lane.rank, b.slot, lo, hi, part.dtype).copy_(part)
        barrier(self.local_group)  # every rank of the node has published its slices
        for b, out in zip(plan, outs):
            lane.gather_slices(b.slot, out)
            b.flat = out

    def barriers(self, plan: Sequence[Any]) -> int:
        """Collectives :meth:`exchange` runs for ``plan`` on this rank: two barriers in
        the node, one cross-node collective per bucket with a slice for this rank."""
        def has_slice(b: Any) -> bool:
            lo, hi = self.lane.slices(b.numel, b.key[1].itemsize)[self.lane.rank]
            return lo < hi
        return 2 + sum(map(has_slice, plan))


#: Per group (None: the world): its topology, gathered once per process.
_TOPOLOGY: dict[Any, Topology] = {}
#: Per group: this rank's node group, cross group and the cross group's global ranks,
#: built once per process (each gloo group opens connections: never one per call).
_SUBGROUPS: dict[Any, tuple[Any, Any, list[int]]] = {}


def topology(group: Optional[Any]) -> Topology:
    """The group's ranks by node (:func:`node_key`); collective on the first call per
    group and process (one ``all_gather_object``), cached after it."""
    key = _key(group)
    topo = _TOPOLOGY.get(key)
    if topo is None:
        keys: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(keys, node_key(), group=group)
        topo = _TOPOLOGY[key] = topology_of(keys)
    return topo


def _key(group: Optional[Any]) -> Any:
    """The process group object itself (a new world after a re-initialisation is a new
    key: nothing cached for the old one is reused)."""
    return dist.group.WORLD if group is None else group


def subgroups(topo: Topology, group: Optional[Any]) -> tuple[Any, Any, list[int]]:
    """This rank's node group, its cross group (the ranks of its local index on every
    node) and the cross group's members as global ranks, node by node. Built once per
    group and process, only by their members (``use_local_synchronization``), each rank
    its node's group first: no rank waits for a group it is not in."""
    cached = _SUBGROUPS.get(_key(group))
    if cached is not None:
        return cached
    rank = dist.get_rank(group)

    def world(ranks: Sequence[int]) -> list[int]:
        return [_global(group, r) for r in ranks]

    node = topo.node_of(rank)
    local = topo.nodes[node].index(rank)
    cross = world([ranks[local] for ranks in topo.nodes])
    # new_group's default timeout is torch's 30 minutes, not the parent's: a dead peer
    # would hold the subgroups' collectives that long after the world's had timed out.
    timeout = _timeout_of(group)
    local_group = dist.new_group(world(topo.nodes[node]), timeout=timeout,
                                 use_local_synchronization=True)
    cross_group = dist.new_group(cross, timeout=timeout, use_local_synchronization=True)
    cached = _SUBGROUPS[_key(group)] = (local_group, cross_group, cross)
    return cached


def _global(group: Optional[Any], rank: int) -> int:
    """Group rank ``rank`` as a global rank (what collectives on subgroups take)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _timeout_of(group: Optional[Any]) -> Optional[timedelta]:
    """The collective timeout ``group`` was created with (None where torch hides it)."""
    pg = dist.group.WORLD if group is None else group
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):  # pragma: no cover - private API moved
        return None


def open_exchange(half: int, group: Optional[Any], want: Optional[bool],
                  required: bool = False) -> Optional[Any]:
    """Collectively open the shared-memory exchange that fits the group: the one-host
    :class:`~hpc.sync._shm.ShmLane` when every rank is on one node, a :class:`NodeLane`
    across nodes (:func:`hierarchy_problem`), or None (the same on every rank).

    ``want`` from :func:`~hpc.sync._shm_region.lane_wanted` (None: decided without
    asking); ``required``: raise :class:`HPCError` instead of returning None."""
    if want is None:
        return open_lane(half, group, want, required)
    topo = topology(group)
    if len(topo.nodes) == 1:
        return open_lane(half, group, want, required)
    why = hierarchy_problem(topo)
    lane = None
    if why is None:
        lane, why = _open_nodes(half, topo, group, want)
    if lane is None:
        if required:
            raise HPCError(
                f"sync_gradients: shm=True, but the shared-memory exchange across "
                f"{len(topo.nodes)} nodes cannot be opened: {why}.\nIt needs the same "
                "number of ranks (2 or more) on every node, each node's ranks seeing one "
                f"{SHM_DIR}.\nHINT: launch as many ranks on every node (Slurm: "
                "--ntasks-per-node), or pass shm=None to fall back to the process "
                "group's own transport.")
        logger.info("sync_gradients: no node-by-node exchange across %d nodes (%s); "
                    "using the process group's transport", len(topo.nodes), why)
    return lane


def _open_nodes(half: int, topo: Topology, group: Optional[Any], want: bool
                ) -> tuple[Optional[NodeLane], str]:
    """Every node opens its lane (agreeing ``want`` inside the node); a
    :class:`NodeLane` where every node could, else None and why (on every rank)."""
    local_group, cross_group, cross_ranks = subgroups(topo, group)
    lane, why = try_open(half, local_group, want)
    if not all_true(lane is not None, group) or lane is None:
        return None, why or "another node could not open its shared memory"
    return NodeLane(lane, topo, dist.get_rank(group), local_group, cross_group,
                    cross_ranks), ""


class NodeBroadcast:
    """``sync_model``'s broadcast from group rank ``src`` across nodes, in two stages:
    to the ranks of ``src``'s local index on the other nodes (one copy per node on the
    wire, where gloo's flat broadcast sends one per rank), then inside every node from
    that rank. Exact copies: bitwise on every rank."""

    NAME = "sync_model broadcast across nodes"

    def __init__(self, topo: Topology, group: Optional[Any], src: int) -> None:
        self.group = group
        rank = dist.get_rank(group)
        self.local_group, self.cross_group, cross = subgroups(topo, group)
        index = topo.local_of(src)
        self.first = topo.local_of(rank) == index  # in src's cross group
        self.src = cross[topo.node_of(src)]
        leader = topo.nodes[topo.node_of(rank)][index]
        self.leader = _global(group, leader)

    def start(self, flat: torch.Tensor) -> tuple[Optional[int], Any]:
        """Stage one, asynchronously, where this rank takes part; a handle for
        :meth:`finish` (counted by the watchdog as one collective)."""
        seq = _begin(self.NAME, self.group)
        if not self.first:
            return seq, None
        return seq, dist.broadcast(flat, self.src, group=self.cross_group, async_op=True)

    def finish(self, flat: torch.Tensor, handle: tuple[Optional[int], Any]) -> None:
        """Wait for stage one, then stage two (inside the node; every rank calls this
        in the same order)."""
        seq, work = handle
        _end(seq, self.NAME, lambda: self._rest(flat, work))

    def _rest(self, flat: torch.Tensor, work: Any) -> None:
        from hpc.watchdog import tracker

        if work is not None:
            tracker.wait(work)
        tracker.wait(dist.broadcast(flat, self.leader, group=self.local_group,
                                    async_op=True))


class NodeReduce:
    """``sync_model``'s summing ``all_reduce`` across nodes, in three stages: the sum
    inside the node, each local rank's ``1/L`` slice of it summed with the same local
    index on the other nodes, the slices shared inside the node. A node sends about
    ``2 (N-1)/N`` of the bytes, gloo's flat ring ``1.5x`` at 2x2. Every rank ends with
    the same bits (each stage hands one result to all of its group)."""

    NAME = "sync_model mean across nodes"

    def __init__(self, topo: Topology, group: Optional[Any]) -> None:
        self.group = group
        rank = dist.get_rank(group)
        self.local_group, self.cross_group, _ = subgroups(topo, group)
        node = topo.nodes[topo.node_of(rank)]
        self.index = node.index(rank)
        self.members = [_global(group, r) for r in node]

    def start(self, flat: torch.Tensor) -> tuple[Optional[int], Any]:
        """Stage one: the node's sum, asynchronously; a handle for :meth:`finish`."""
        seq = _begin(self.NAME, self.group)
        return seq, dist.all_reduce(flat, group=self.local_group, async_op=True)

    def finish(self, flat: torch.Tensor, handle: tuple[Optional[int], Any]) -> None:
        """Stages two and three (every rank calls this in the same order)."""
        seq, work = handle
        _end(seq, self.NAME, lambda: self._rest(flat, work))

    def _rest(self, flat: torch.Tensor, work: Any) -> None:
        from hpc.watchdog import tracker

        tracker.wait(work)
        per = -(-flat.numel() // len(self.members))
        parts = [(min(flat.numel(), i * per), min(flat.numel(), (i + 1) * per))
                 for i in range(len(self.members))]
        lo, hi = parts[self.index]
        if lo < hi:
            tracker.wait(dist.all_reduce(flat[lo:hi], group=self.cross_group,
                                         async_op=True))
        for member, (lo, hi) in zip(self.members, parts):
            if lo < hi:
                tracker.wait(dist.broadcast(flat[lo:hi], member, group=self.local_group,
                                            async_op=True))


def ranks_on_node(group: Optional[Any]) -> int:
    """How many ranks of ``group`` run on this rank's node (collective on the first
    call per group, as :func:`topology`)."""
    topo = topology(group)
    return len(topo.nodes[topo.node_of(dist.get_rank(group))])


def node_collectives(group: Optional[Any], src: int
                     ) -> tuple[Optional[NodeBroadcast], Optional[NodeReduce]]:
    """``sync_model``'s node-by-node broadcast and reduce where the group spans nodes
    that way (:func:`hierarchy_problem`), else (None, None); the same on every rank.
    Collective on the first call per group."""
    topo = topology(group)
    if hierarchy_problem(topo) is not None:
        return None, None
    return NodeBroadcast(topo, group, src), NodeReduce(topo, group)
