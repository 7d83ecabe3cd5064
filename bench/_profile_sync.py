"""Where one ``GradSync.sync`` step's time goes (``gradsync_supernet.py --profile``).

Wraps a :class:`hpc.GradSync`'s phases with exclusive timers (a phase's time excludes
the phases nested in it) and runs the benchmark's training loop:

* ``agreement``   issuing and waiting for the all_gather of who used what;
* ``plan``        planning buckets, taking buffers, zero-filling (``_build``);
* ``pack``        ``grad * (1/ws)`` into the flat buffers (``_pack``, and the fused
  ``_foreach`` packing of ``_pack_many``);
* ``issue``       issuing the collectives (``_launch_ready``);
* ``wait``        waiting for them (transfer time not hidden behind other work);
* ``barrier``     shared-memory exchange only: waiting until every rank has packed;
* ``combine``     shared-memory exchange only: reading the other ranks' buckets
  (broadcast copies, sums of means; reduce-scattered, this rank's slices and copying
  the others') into this rank's own buffers; a second barrier of the reduce-scatter
  counts as ``barrier``;
* ``rest``        the remainder of ``sync``: pointing ``.grad`` at the results, stats,
  Python bookkeeping.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hpc
from hpc.sync import _shm, grads

#: The lane's combining steps, timed as ``combine``.
_COMBINE = ("combine", "reduce_slice", "gather_slices")
_ORIG = {name: getattr(_shm.ShmLane, name) for name in _COMBINE}

PHASES = ("agreement", "plan", "pack", "issue", "wait", "barrier", "combine", "rest")


class _Timers:
    """Exclusive per-phase time: entering a phase pauses the enclosing one."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._stack: list[list[Any]] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            now = time.perf_counter()
            if self._stack:
                outer = self._stack[-1]
                self.total[outer[0]] += now - outer[1]
            self._stack.append([name, now])
            try:
                return fn(*a, **kw)
            finally:
                end = time.perf_counter()
                self.total[name] += end - self._stack.pop()[1]
                if self._stack:
                    self._stack[-1][1] = end
        return timed


class _TimedWork:
    def __init__(self, work: Any, wait: Callable[[], Any]) -> None:
        self._work, self.wait = work, wait

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _instrument(gs: hpc.GradSync, t: _Timers, users: bool) -> None:
    """Patch ``gs`` (and the module's collective entry points) with timers."""
    def timed_work(name: str, start: Callable[..., Any]) -> Callable[..., Any]:
        def issue(*a: Any, **kw: Any) -> Any:
            work = start(*a, **kw)
            return None if work is None else _TimedWork(work, t.wrap(name, work.wait))
        return issue

    grads.start_all_gather = timed_work("agreement", grads.start_all_gather)
    grads.start_bucket = timed_work("wait", grads.start_bucket)
    gs._begin = t.wrap("agreement", gs._begin)  # type: ignore[method-assign]
    gs._build = t.wrap("plan", gs._build)  # type: ignore[method-assign]
    gs._pack = t.wrap("pack", gs._pack)  # type: ignore[method-assign]
    gs._pack_many = t.wrap("pack", gs._pack_many)  # type: ignore[method-assign]
    gs._launch_ready = t.wrap("issue", gs._launch_ready)  # type: ignore[method-assign]
    gs.sync = t.wrap("rest", gs.sync)  # type: ignore[method-assign]
    _shm.start_max = timed_work("barrier", _shm.start_max)
    for name in _COMBINE:
        setattr(_shm.ShmLane, name, t.wrap("combine", _ORIG[name]))


def profile(model: nn.Module, batch: int, args: Any, info: hpc.DistInfo,
            groups: dict[str, Any], path_of: Callable[[int, int, int], list[int]]) -> None:
    """Print, on rank 0, each group's per-step phase times of ``sync`` (and users)."""
    gen = torch.Generator().manual_seed(1 + info.rank)
    x = torch.randn(batch, args.dim, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    steps = args.steps * args.repeats
    nblocks = len(model.blocks)
    combines = args.combine.split(",")
    for gname, group in groups.items():
        for use_users, combine in [(u, c) for u in (False, True) for c in combines]:
            orig = (grads.start_all_gather, grads.start_bucket, _shm.start_max)
            gs = hpc.GradSync(model, group=group)
            t = _Timers()
            _instrument(gs, t, use_users)
            per_step: list[float] = []
            ws = dist.get_world_size(group)
            try:
                for k in range(args.warmup + steps):
                    if gs._lane is not None and combine != "auto":
                        gs._lane.scatter = combine == "scatter"
                    for p in model.parameters():
                        p.grad = None
                    path = path_of(info.rank, k, nblocks)
                    nn.functional.cross_entropy(model(x, path), y).backward()
                    users = ([model.used(path_of(r, k, nblocks)) for r in range(ws)]
                             if use_users else None)
                    dist.barrier(group=group)  # time the sync, not the ranks' skew
                    if k == args.warmup:
                        t.total.clear()
                    t0 = time.perf_counter()
                    gs.sync(users=users)
                    if k >= args.warmup:
                        per_step.append(time.perf_counter() - t0)
            finally:
                grads.start_all_gather, grads.start_bucket, _shm.start_max = orig
                for name in _COMBINE:
                    setattr(_shm.ShmLane, name, _ORIG[name])
            if info.rank == 0:
                lane = gs._lane
                how = "" if lane is None else (" combine=scatter" if lane.scatter
                                               else " combine=direct")
                _report(gname, group, batch, use_users, t, per_step, gs.stats, steps,
                        how)


def _report(gname: str, group: Any, batch: int, use_users: bool, t: _Timers,
            per_step: list[float], stats: dict[str, int], steps: int,
            how: str = "") -> None:
    from _groups import describe_group
    mode = "sync(users=...)" if use_users else "sync()"
    print(f"\nprofile: {mode}{how}, batch {batch}, group {gname!r} "
          f"({describe_group(group)}), ws {dist.get_world_size(group)}, {steps} steps "
          f"after a barrier; last step {stats}")
    print(f"{'phase':<10} {'ms/step':>8} {'share':>6}")
    total = sum(t.total.values())
    for ph in PHASES:
        v = t.total.get(ph, 0.0)
        print(f"{ph:<10} {v / steps * 1e3:8.2f} {v / total:6.0%}")
    print(f"{'sync':<10} {statistics.median(per_step) * 1e3:8.2f} (median step)")
