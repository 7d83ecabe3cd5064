"""``hpc check``'s phases on every rank: local figures, pairs in rounds, ring, verdict.

Units are the job's nodes when it spans several (a pair = every rank of two nodes), else
its ranks (one node: each pair of ranks, e.g. GPU to GPU). Pairs run in rounds of disjoint
pairs (:func:`~hpc.check.verdict.round_robin`), or one at a time (``serial``): every rank
creates every pair's group in the same order, as ``torch.distributed.new_group``
requires, and members time their pair. The pairs the rule would flag are then timed
again, each alone, and keep their better figure (:func:`~hpc.check.verdict.remeasure`);
when a rank's compute is flagged, every rank times its GEMM and copy once more, together,
and keeps its better figures.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from dataclasses import dataclass, field
from typing import Any

from hpc.check.verdict import (
    Figure,
    Finding,
    Pair,
    Thresholds,
    best_of,
    judge_compute,
    remeasure,
    round_robin,
)

__all__ = ["CheckOptions", "Results", "gather_local", "measure", "units_of"]

logger = logging.getLogger(__name__)

LATENCY_BYTES = 4


@dataclass(frozen=True)
class CheckOptions:
    """Sizes and budgets of the measurements (``None``: the device's default)."""

    size: int | None = None          # all_reduce bytes: 4 MiB on CPU, 64 MiB on GPU
    gemm: int | None = None          # GEMM n: 1024 on CPU, 8192 on GPU
    copy: int | None = None          # copied bytes: 64 MiB on CPU, 1 GiB on GPU
    budget: float = 0.3              # seconds per timing (after one warm-up)
    thresholds: Thresholds = field(default_factory=Thresholds)
    serial: bool = False             # one pair at a time instead of rounds of disjoint pairs

    def resolved(self, cuda: bool) -> CheckOptions:
        """These options with the device's defaults filled in."""
        mib = 1 << 20
        floor = self.thresholds.latency_floor
        if floor is None:  # the device's: 1 ms for gloo over TCP, 100 us for NCCL
            floor = 100e-6 if cuda else 1e-3
        return dataclasses.replace(
            self, size=self.size or (64 * mib if cuda else 4 * mib),
            gemm=self.gemm or (8192 if cuda else 1024),
            copy=self.copy or (1024 * mib if cuda else 64 * mib),
            thresholds=dataclasses.replace(self.thresholds, latency_floor=floor))


@dataclass
class Results:
    """Everything measured, as the master holds it after gathering."""

    rows: list[dict[str, Any]]           # per rank, sorted by rank
    unit_kind: str                       # "node" or "rank"
    labels: list[str]                    # unit names (hostnames for nodes)
    members: list[list[int]]             # ranks of each unit
    pairs: dict[Pair, Figure]
    ring: Figure | None
    settings: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)
    #: pairs timed again alone: (the first figure, the one alone); ``pairs`` holds the best
    remeasured: dict[Pair, tuple[Figure, Figure]] = field(default_factory=dict)


def gather_local(opts: CheckOptions, device: Any, rank: int) -> dict[str, Any]:
    """This rank's GEMM FLOP/s, copy bytes/s and GPU visibility."""
    import torch

    from hpc.check import measure as m

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    row: dict[str, Any] = {"rank": rank, "host": socket.gethostname(), "device": str(device),
                           "threads": torch.get_num_threads()}
    row["gemm"] = m.time_gemm(int(opts.gemm or 0), dtype, device, opts.budget)
    row["copy"] = m.time_copy(int(opts.copy or 0), device, opts.budget)
    row.update(m.gpu_visibility(device))
    return row


def units_of(rows: list[dict[str, Any]]) -> tuple[str, list[str], list[list[int]]]:
    """(kind, labels, member ranks): one unit per host in order of its first rank when
    the ranks span several hosts, else one unit per rank ("rank 1 (host)")."""
    hosts: dict[str, list[int]] = {}
    for r in rows:
        hosts.setdefault(r["host"], []).append(r["rank"])
    if len(hosts) > 1:
        return "node", list(hosts), list(hosts.values())
    return "rank", [f"rank {r['rank']} ({r['host']})" for r in rows], [[r["rank"]] for r in rows]


def _figure(nbytes: int, device: Any, budget: float, group: Any, ranks: int) -> Figure:
    from hpc.check.measure import time_all_reduce

    seconds = time_all_reduce(nbytes, device, budget, group)
    latency = time_all_reduce(LATENCY_BYTES, device, budget / 2, group, per_op=True)
    return Figure(ranks, nbytes, seconds, latency)


def measure_pairs(members: list[list[int]], rank: int, opts: CheckOptions, device: Any,
                  rounds: list[list[Pair]]) -> dict[Pair, Figure]:
    """Time the unit pairs of each round, the pairs of a round at the same time (members
    of one pair only see their own figure)."""
    import torch.distributed as dist

    mine: dict[Pair, Figure] = {}
    for number, pairs in enumerate(rounds, 1):
        groups = {p: dist.new_group(sorted(members[p[0]] + members[p[1]])) for p in pairs}
        for p, group in groups.items():
            ranks = members[p[0]] + members[p[1]]
            if rank in ranks:
                mine[p] = _figure(int(opts.size or 0), device, opts.budget, group, len(ranks))
        logger.debug("round %d done: %s", number, pairs)
        dist.barrier()
        for group in groups.values():
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
    return mine


def measure(opts: CheckOptions, device: Any, rank: int, world: int) -> Results | None:
    """Run every phase on this rank; the master gets the :class:`Results`, others None."""
    import torch.distributed as dist

    rows = _gather_rows(gather_local(opts, device, rank), world)
    if judge_compute(rows, opts.thresholds):
        # Flagged: every rank times its GEMM and copy once more, at the same time as
        # before (like with like), and keeps its better figures: a time slice lost to
        # another process is not a slow node.
        retimed = _gather_rows(gather_local(opts, device, rank), world)
        for first, second in zip(rows, retimed):
            first["timed_twice"] = {k: (first[k], second[k]) for k in ("gemm", "copy")}
            first.update(gemm=max(first["gemm"], second["gemm"]),
                         copy=max(first["copy"], second["copy"]))
    kind, labels, members = units_of(rows)
    rounds = round_robin(len(members))
    if opts.serial:
        rounds = [[p] for r in rounds for p in r]
    pairs = _gather_pairs(measure_pairs(members, rank, opts, device, rounds), world)
    remeasured = _remeasure_flagged(members, rank, opts, device, world, pairs)
    ring = _figure(int(opts.size or 0), device, opts.budget, None, world) if world > 1 else None
    settings = {"world": world, "backend": dist.get_backend(), "device": device.type,
                "size": opts.size, "gemm": opts.gemm, "copy": opts.copy,
                "budget": opts.budget, "serial": opts.serial,
                "thresholds": dataclasses.asdict(opts.thresholds)}
    if rank != 0:
        return None
    return Results(rows, kind, labels, members, pairs, ring, settings, remeasured=remeasured)


#: Passes of "time the flagged pairs again alone": a pair timed alone raises the reference
#: (the median of each unit's best pair), which can flag a pair the first pass let by.
REMEASURE_PASSES = 3


def _remeasure_flagged(members: Any, rank: int, opts: CheckOptions, device: Any, world: int,
                       pairs: dict[Pair, Figure]) -> dict[Pair, tuple[Figure, Figure]]:
    """Time every pair the rule flags again alone, until no pair not yet timed alone is
    flagged; ``pairs`` keeps each pair's better figure. Returns pair -> (first, alone).

    Every rank judges the same gathered figures, so all agree on what to time again."""
    remeasured: dict[Pair, tuple[Figure, Figure]] = {}
    for _ in range(REMEASURE_PASSES):
        again = [p for p in remeasure(len(members), pairs, opts.thresholds)
                 if p not in remeasured]
        if not again:
            break
        alone = _gather_pairs(measure_pairs(members, rank, opts, device,
                                            [[p] for p in again]), world)
        remeasured.update({p: (pairs[p], alone[p]) for p in again})
        pairs.update({p: best_of(pairs[p], alone[p]) for p in again})
    return remeasured


def _gather_rows(row: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Every rank's local figures, on every rank, by rank."""
    import torch.distributed as dist

    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    return sorted(rows, key=lambda r: r["rank"])


def _gather_pairs(mine: dict[Pair, Figure], world: int) -> dict[Pair, Figure]:
    """Every rank's pair figures, on every rank."""
    import torch.distributed as dist

    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    pairs: dict[Pair, Figure] = {}
    for part in parts:
        pairs.update(part)
    return pairs
