"""Stragglers while training runs: the rank (and host) that sets everybody's pace.

In a synchronous job one slow rank makes every other rank wait in the next collective,
so step times alone say the job is slow, not who. What tells them apart is how a step's
time splits: a rank's **compute** time is its step's wall time minus the time its host
was blocked in world collectives (:attr:`hpc.watchdog.tracker.Progress.waited`), and
its **wait** is the rest. The slow rank computes longest and waits least; the others
wait for it.

Per rank, :class:`StepClock` splits each step (from one step boundary to the next).
Every ``every`` steps (a *window*) each rank's summary (:data:`FIELDS`) travels in a
collective the loop makes anyway (:class:`hpc.AgreedStop`'s, ``hpc pretrain``'s
metrics reduce), and :func:`judge` reads the table, the same on every rank:

* **relative**: a rank whose window compute time is above ``relative`` (1.3) times its
  reference, the median of the ranks on other hosts (a whole slow node is not its own
  reference; on one host, of the other ranks);
* **individual**: a rank whose window compute time is above ``individual`` times its
  own baseline (the median of its first :attr:`Rules.baseline` windows), when at most
  half the ranks are and not all (more is the job slowing, not a rank);
* **link**: no rank computes slower, yet the median step took ``individual`` times
  its baseline and the ranks spent most of it waiting: the wire, not a rank, is slow.
  :func:`hpc.health.step.probe_links` then times one transfer from each host's first
  rank to the next host's and to the previous one's, one at a time, and
  :func:`slow_links` names a host whose sends (or receives) are slow with both partners
  (:attr:`Rules.link` times the others' median).

A window's compute time is the mean over its steps (``Rules.trim``, 0 by default, can
drop its slowest steps; a stop that lands in one short step must count). A checkpoint
the master writes through :func:`hpc.save_checkpoint` counts as waiting
(:class:`hpc.watchdog.tracker.aside`), validation in ``hpc pretrain`` as no step.
A rank is named only when what it computes above its reference is at least
:attr:`Rules.share` of the median step (it costs the job that much: an 8 ms excess in
a 130 ms step that the wire slowed is not the cause), and more than :attr:`Rules.floor_s` (2 ms: a busy node deschedules a
process for that long, which looks like a stall); never more than half the ranks (that
is the job slowing, not a rank); and only when it is so in two windows in a row (a
busy machine makes single windows of any rank look slow).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

__all__ = ["FIELDS", "Finding", "Rules", "StepClock", "Baselines", "judge", "probe_shifts",
           "ranks_text", "references", "slow_links"]

#: What each rank reports per window, in this order: trimmed mean compute seconds per
#: step, mean wait seconds per step, mean wall seconds per step, steps in the window.
FIELDS = ("compute", "wait", "wall", "steps")


@dataclass(frozen=True)
class Rules:
    """Thresholds of the straggler verdicts (see the module's docstring)."""

    relative: float = 1.3
    individual: float = 1.5
    #: A rank's compute above the reference must be at least this share of the median
    #: step, two windows in a row: a rank that costs the job less is not named.
    share: float = 0.15
    trim: float = 0.0
    floor_s: float = 0.002
    baseline: int = 3
    #: Fraction of the median step spent waiting above which a slow job is the wire's.
    link_wait: float = 0.5
    #: A probed transfer this many times the others' median (and ``floor_s`` more) is a
    #: slow link: links that fail are slow by orders of magnitude, probes of a healthy
    #: one vary by 2-3x.
    link: float = 5.0


class StepClock:
    """This rank's per-step split of wall time into compute and wait.

    Args:
        waited: Seconds blocked in collectives so far (:func:`hpc.watchdog.tracker.waited`).
        clock: A monotonic clock.
    """

    def __init__(self, waited: Callable[[], Optional[float]],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._waited, self._clock = waited, clock
        self._last: Optional[tuple[float, float]] = None
        self.steps: list[tuple[float, float]] = []  #: (compute, wait) of this window's steps

    def mark(self) -> Optional[float]:
        """A step boundary: record the step since the last one; its compute seconds
        (None at the first boundary, or when nothing counts waits)."""
        now, waited = self._clock(), self._waited()
        last, self._last = self._last, (now, waited or 0.0)
        if last is None or waited is None:
            return None
        wall, wait = now - last[0], max(0.0, waited - last[1])
        compute = max(0.0, wall - wait)
        self.steps.append((compute, wait))
        return compute

    def skip(self) -> None:
        """The time until the next boundary is not a step (validation, a checkpoint)."""
        self._last = None

    def shift(self, seconds: float) -> None:
        """Count ``seconds`` of the current step as neither compute nor wait (time the
        rank spent on the detector itself)."""
        if self._last is not None:
            self._last = (self._last[0] + seconds, self._last[1])

    def window(self, trim: float) -> list[float]:
        """This window's :data:`FIELDS`, and a new window."""
        steps, self.steps = self.steps, []
        if not steps:
            return [0.0, 0.0, 0.0, 0.0]
        computes = sorted(c for c, _ in steps)
        keep = computes[:max(1, len(computes) - int(len(computes) * trim))]
        wait = sum(w for _, w in steps) / len(steps)
        wall = sum(c + w for c, w in steps) / len(steps)
        return [sum(keep) / len(keep), wait, wall, float(len(steps))]


@dataclass
class Baselines:
    """Every rank's first windows: its own "normal" compute and wall time."""

    compute: list[list[float]] = field(default_factory=list)
    wall: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Each rank's medians, once computed (they change only while windows are added).
        self._medians: dict[int, tuple[float, float]] = {}

    def add(self, table: Sequence[Sequence[float]], n: int) -> None:
        if not self.compute:
            self.compute = [[] for _ in table]
            self.wall = [[] for _ in table]
        for r, row in enumerate(table):
            if row[3] > 0 and len(self.compute[r]) < n:
                self.compute[r].append(row[0])
                self.wall[r].append(row[2])
                self._medians.pop(r, None)

    def ready(self, n: int) -> bool:
        return bool(self.compute) and all(len(c) >= n for c in self.compute)

    def of(self, r: int) -> tuple[float, float]:
        """Rank ``r``'s baseline (median compute, median wall): computed once per rank
        once its windows are in, not at every verdict (8,192 ranks: 2 medians each)."""
        if r not in self._medians:
            self._medians[r] = (statistics.median(self.compute[r]),
                                statistics.median(self.wall[r]))
        return self._medians[r]


@dataclass(frozen=True)
class Finding:
    """One verdict of :func:`judge`."""

    kind: str                  #: "relative", "individual" or "link" (a suspicion to probe)
    ranks: tuple[int, ...]     #: the slow ranks (empty for "link")
    factor: float              #: their compute (wall, for "link") over the reference
    reference_s: float         #: the median (relative) or baseline (individual, link)
    others_waited: float       #: the other ranks' median share of the step spent waiting
    note: str = ""             #: for "link": "sending" or "receiving"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ranks"] = list(self.ranks)
        return d


def references(compute: dict[int, float], hosts: Optional[Sequence[str]]) -> dict[int, float]:
    """Each rank's reference compute time: the median of the ranks on other hosts (a
    whole slow node is not its own reference), else of the other ranks.

    O(N log N) for N ranks: one sort of every rank's time, then for each host the median
    of the sorted list without that host's entries, found by skipping their positions
    (O(ranks of the host)); not one median per rank over the N - 1 others (O(N^2): 59 s
    a window at 8,192 ranks, ``bench/straggler_scale.py``)."""
    ranks = list(compute)
    order = sorted(range(len(ranks)), key=lambda i: compute[ranks[i]])
    values = [compute[ranks[i]] for i in order]
    where = {ranks[i]: p for p, i in enumerate(order)}  # rank -> its position in values
    groups: dict[Any, list[int]] = {}
    for r in ranks:
        groups.setdefault(r if hosts is None else hosts[r], []).append(r)
    out = {}
    for members in groups.values():
        if len(members) < len(ranks):  # other hosts exist: their median, the same for all
            median = _median_without(values, sorted(where[r] for r in members))
            out.update(dict.fromkeys(members, median))
        else:  # one host: each rank against the others
            for r in members:
                out[r] = (_median_without(values, [where[r]]) if len(ranks) > 1
                          else compute[r])
    return out


def _median_without(values: Sequence[float], removed: Sequence[int]) -> float:
    """The median of sorted ``values`` without the positions ``removed`` (sorted, fewer
    than ``len(values)``), as :func:`statistics.median` gives it."""
    n = len(values) - len(removed)

    def kth(k: int) -> float:  # the k-th smallest remaining value
        at = k
        for p in removed:  # each removed position at or before it pushes it one further
            if p > at:
                break
            at += 1
        return values[at]

    if n % 2:
        return kth(n // 2)
    return (kth(n // 2 - 1) + kth(n // 2)) / 2


def judge(table: Sequence[Sequence[float]], baselines: Baselines,
          rules: Rules = Rules(), hosts: Optional[Sequence[str]] = None,
          suspects: Optional[set[int]] = None) -> list[Finding]:
    """The verdicts on one window's table (one row of :data:`FIELDS` per rank; ``hosts``:
    each rank's host).

    Pure but for ``suspects``: the ranks over the thresholds in the window before; the
    set is replaced by this window's, and only a rank in both is named (two windows in a
    row; ``None``: one window suffices). The same table gives every rank the same
    verdicts. ``baselines`` must already hold the
    windows before this one (the caller adds this window after judging)."""
    before = set(suspects or ())
    if suspects is not None:
        suspects.clear()
    rows = [list(r) for r in table]
    live = [r for r, row in enumerate(rows) if row[3] > 0]
    if len(live) < 2:
        return []
    compute = {r: rows[r][0] for r in live}
    step = statistics.median(rows[r][2] for r in live)
    ref = references(compute, hosts)

    def costly(r: int, reference: float, factor: float) -> bool:
        excess = compute[r] - reference
        if compute[r] <= factor * reference or excess <= rules.floor_s \
                or excess < rules.share * step:
            return False
        if suspects is not None:
            suspects.add(r)
        return r in before or suspects is None

    found: list[Finding] = []
    slow = [r for r in live if costly(r, ref[r], rules.relative)]
    if slow and 2 * len(slow) <= len(live):
        found.append(Finding("relative", tuple(slow),
                             max(compute[r] / max(ref[r], 1e-12) for r in slow),
                             statistics.median(ref[r] for r in slow),
                             _waited(rows, live, slow)))
    else:
        slow = []
    if not baselines.ready(rules.baseline):
        return found
    own = {r: baselines.of(r) for r in live}
    alone = [r for r in live if r not in slow and costly(r, own[r][0], rules.individual)]
    if alone and 2 * len(alone) <= len(live) and len(alone) < len(live):
        base = statistics.median(own[r][0] for r in alone)
        found.append(Finding("individual", tuple(alone),
                             max(compute[r] / max(own[r][0], 1e-12) for r in alone), base,
                             _waited(rows, live, alone)))
    if not found:
        wall = step  # the median step
        base_wall = statistics.median(own[r][1] for r in live)
        waited = _waited(rows, live, [])
        if wall > rules.individual * base_wall and wall - base_wall > rules.floor_s \
                and waited > rules.link_wait:
            found.append(Finding("link", (), wall / max(base_wall, 1e-12), base_wall, waited))
    return found


def probe_shifts(hosts: int) -> tuple[int, ...]:
    """The link probe's partners: each host sends to the next host and to the one before
    (the same one with two hosts)."""
    return (1,) if hosts == 2 else (1, -1)


def _slow(durations: Sequence[float], rules: Rules) -> list[int]:
    """Indices whose duration is :attr:`Rules.link` times the median of the others' or
    more, at most half of them."""
    out = []
    for i, d in enumerate(durations):
        others = statistics.median([x for j, x in enumerate(durations) if j != i])
        if d > rules.link * others and d - others > rules.floor_s:
            out.append(i)
    return out if 2 * len(out) <= len(durations) else []


def slow_links(seconds: Sequence[Sequence[float]], shifts: Sequence[int],
               rules: Rules = Rules()) -> list[tuple[int, str, float, float]]:
    """The hosts with a slow link from :func:`~hpc.health.step.probe_links`'s table
    (``seconds[k][i]``: host ``i`` to host ``i + shifts[k]``): ``(host index, "sending" or
    "receiving", factor, the median transfer's seconds)``.

    A host whose transfers to both partners are slow sends slowly; one whose transfers
    from both are slow receives slowly. With two hosts the direction is the sender's."""
    n = len(seconds[0]) if seconds else 0
    senders = [set(_slow(row, rules)) for row in seconds]
    receivers = [{(i + s) % n for i in slow} for s, slow in zip(shifts, senders)]
    out = []
    for kind, sets, of in (("sending", senders, lambda k, i: i),
                           ("receiving", receivers, lambda k, i: (i - shifts[k]) % n)):
        for host in sorted(set.intersection(*sets) if sets else set()):
            times = [seconds[k][of(k, host)] for k in range(len(seconds))]
            rest = [t for k, row in enumerate(seconds) for i, t in enumerate(row)
                    if i != of(k, host)]
            median = statistics.median(rest) if rest else 0.0
            out.append((host, kind, min(times) / max(median, 1e-12), median))
        if out:
            return out
    return out


def _waited(rows: Sequence[Sequence[float]], live: Sequence[int],
            exclude: Sequence[int]) -> float:
    """The other ranks' median share of their step spent waiting."""
    skip = set(exclude)
    shares = [rows[r][1] / rows[r][2] for r in live if r not in skip and rows[r][2] > 0]
    return statistics.median(shares) if shares else math.nan


def ranks_text(ranks: Sequence[int]) -> str:
    """``(4, 5)`` -> ``"ranks 4-5"``; ``(2,)`` -> ``"rank 2"``; ``(1, 3)`` -> ``"ranks 1,3"``."""
    rs = sorted(ranks)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    if rs == list(range(rs[0], rs[-1] + 1)):
        return f"ranks {rs[0]}-{rs[-1]}"
    return "ranks " + ",".join(map(str, rs))
