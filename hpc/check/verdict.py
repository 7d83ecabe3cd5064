"""The outlier rule of ``hpc check``: pure functions of the measured figures.

Definitions (those of nccl-tests, ``doc/PERFORMANCE.md``), for an ``all_reduce`` of
``S`` bytes over ``n`` ranks that takes ``t`` seconds:

* ``algbw = S / t``;
* ``busbw = algbw * 2 (n - 1) / n``: the bandwidth each rank's link really carries in a
  ring all_reduce, comparable across ``n`` (for a pair, ``busbw = algbw``).

The rule, robust to a minority of bad units because every reference is a median:

* **ranks** -- a rank's GEMM or memory-copy figure below ``threshold x`` the median of all
  ranks flags its node ("slow compute").
* **pairs** -- the reference bandwidth is the median, over units, of each unit's *best*
  pair (its fastest partner); a pair below ``threshold x`` that reference (or below the
  absolute floor ``min_busbw``) is slow. With 3 or more units, a unit all of whose pairs
  are slow is a slow NODE, and a slow pair between two units that are not slow nodes is a
  slow LINK. With 2 units the single pair is its own reference: only the floor can flag it.
  Latency is judged the same way on ``1 / latency`` with ``latency_threshold``, and never
  at or below ``latency_floor`` (scheduler noise on a busy host is of that order).
* **like with like** -- on a CPU a rank's GEMM and copy are divided by its threads, so a
  node that splits its cores between two ranks is not half as fast as one with a single
  rank; pairs the rounds flag are re-measured alone (:func:`remeasure`) and keep their
  better figure (:func:`best_of`), so contention between the concurrent pairs of a round
  (a shared uplink, cross-socket PCIe) is not mistaken for a slow link.

A unit is a node when the job spans several nodes, else a rank.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Figure", "Finding", "PairJudgement", "Thresholds", "algbw", "best_of", "busbw",
           "judge_compute", "judge_gpus", "judge_network", "judge_pairs", "judge_ranks",
           "remeasure", "round_robin", "strikes", "verdict_line", "STRIKING"]

Pair = tuple[int, int]


def algbw(nbytes: float, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth in bytes/s: ``size / time``."""
    if seconds <= 0:
        raise ValueError(f"all_reduce time must be positive, got {seconds}")
    return nbytes / seconds


def busbw(alg: float, n: int) -> float:
    """nccl-tests' all_reduce bus bandwidth: ``algbw * 2 (n - 1) / n`` (``n`` ranks)."""
    if n < 1:
        raise ValueError(f"an all_reduce needs at least 1 rank, got n={n}")
    return alg * 2 * (n - 1) / n


def round_robin(n: int) -> list[list[Pair]]:
    """Every pair of ``n`` units exactly once, in rounds of disjoint pairs (circle method).

    ``n - 1`` rounds for even ``n``, ``n`` for odd (one unit sits each round out); the
    pairs of one round run at the same time, so the check takes O(n) rounds, not O(n^2).
    """
    units: list[int | None] = list(range(n))
    if n % 2:
        units.append(None)
    m = len(units)
    rounds: list[list[Pair]] = []
    for _ in range(m - 1):
        pairs = []
        for k in range(m // 2):
            a, b = units[k], units[m - 1 - k]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        units = [units[0], units[-1], *units[1:-1]]
    return [r for r in rounds if r]


@dataclass(frozen=True)
class Finding:
    """One flagged thing: ``kind`` ``node``/``link``/``compute``/``gpu``, the hostnames
    (or rank labels) it names, and the sentence for the verdict line."""

    kind: str
    names: tuple[str, ...]
    text: str


def judge_ranks(values: Sequence[float], threshold: float) -> tuple[float, list[int]]:
    """(median, indices of values below ``threshold x median``); higher is better."""
    if not values:
        return float("nan"), []
    ref = statistics.median(values)
    return ref, [i for i, v in enumerate(values) if v < threshold * ref]


@dataclass(frozen=True)
class PairJudgement:
    """What :func:`judge_pairs` found: the reference, every slow pair, and of those the
    units explained as slow nodes and the pairs left as slow links."""

    reference: float
    slow_pairs: tuple[Pair, ...]
    slow_units: tuple[int, ...]
    slow_links: tuple[Pair, ...]


def judge_pairs(n: int, values: Mapping[Pair, float], threshold: float,
                floor: float = 0.0, good_enough: float = math.inf) -> PairJudgement:
    """Apply the pair rule (module docstring) to ``values[(i, j)]``, higher is better.

    Args:
        n: Number of units (indices ``0..n-1``).
        values: Figure of each measured pair ``(i, j)``, ``i < j``.
        threshold: A pair is slow below ``threshold x reference``.
        floor: Absolute minimum (same unit as ``values``); 0 disables it.
        good_enough: A pair at or above this is never slow (latency's absolute floor, as
            ``1 / latency_floor``); infinity disables it.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    best = [max((v for p, v in values.items() if u in p), default=None) for u in range(n)]
    known = [b for b in best if b is not None]
    if not known:
        return PairJudgement(float("nan"), (), (), ())
    ref = statistics.median(known)
    limit = min(max(threshold * ref, floor), good_enough)
    slow = tuple(sorted(p for p, v in values.items() if v < limit))
    units: list[int] = []
    if n >= 3:
        for u in range(n):
            mine = [p for p in values if u in p]
            if len(mine) >= 2 and all(p in slow for p in mine):
                units.append(u)
    links = tuple(p for p in slow if p[0] not in units and p[1] not in units)
    return PairJudgement(ref, slow, tuple(units), links)


#: The findings that name a bad host, each a strike in the bad-node ledger
#: (:mod:`hpc.ledger`). A slow link names two hosts, either of which may be fine: no strike.
STRIKING = ("node", "compute", "gpu")


def strikes(findings: Sequence[Finding],
            host_of: Mapping[str, str] | None = None) -> dict[str, str]:
    """Host -> reason (its findings' sentences): one strike per host that a
    :data:`STRIKING` finding names; ``host_of`` maps a unit label (``rank 2 (a)``) to its
    host, labels that are hosts map to themselves."""
    out: dict[str, str] = {}
    for f in findings:
        if f.kind not in STRIKING:
            continue
        for name in f.names:
            host = (host_of or {}).get(name, name)
            out[host] = f"{out[host]}; {f.text}" if host in out else f.text
    return out


def verdict_line(findings: Sequence[Finding], summary: str) -> str:
    """``VERDICT: OK: summary`` or ``VERDICT: FLAGGED hostA, hostB: finding; ...``."""
    if not findings:
        return f"VERDICT: OK: {summary}"
    names: list[str] = []
    for f in findings:
        names += [n for n in f.names if n not in names]
    return f"VERDICT: FLAGGED {', '.join(names)}: " + "; ".join(f.text for f in findings)


@dataclass(frozen=True)
class Figure:
    """One timed all_reduce: over ``ranks`` ranks, ``seconds`` for ``nbytes``, and the
    ``latency`` (seconds) of a 4-byte one."""

    ranks: int
    nbytes: int
    seconds: float
    latency: float

    @property
    def algbw(self) -> float:
        """Bytes/s, ``nbytes / seconds``."""
        return algbw(self.nbytes, self.seconds)

    @property
    def busbw(self) -> float:
        """Bytes/s, ``algbw * 2 (ranks - 1) / ranks``."""
        return busbw(self.algbw, self.ranks)




def best_of(a: Figure, b: Figure) -> Figure:
    """The better of two timings of one pair, metric by metric (noise only slows a link
    down: its best time is what it can do)."""
    if (a.ranks, a.nbytes) != (b.ranks, b.nbytes):
        raise ValueError(f"not the same measurement: {a} vs {b}")
    return Figure(a.ranks, a.nbytes, min(a.seconds, b.seconds), min(a.latency, b.latency))


@dataclass(frozen=True)
class Thresholds:
    """The knobs of the rule: ``compute`` and ``bandwidth`` are fractions of the median
    (flag below), ``latency`` likewise on 1/latency; ``min_busbw`` bytes/s, 0 = off;
    ``latency_floor`` seconds: a latency at or below it is never slow, 0 = off, ``None``
    = the device's default (:meth:`hpc.check.runner.CheckOptions.resolved`)."""

    compute: float = 0.5
    bandwidth: float = 0.5
    latency: float = 0.25
    min_busbw: float = 0.0
    latency_floor: float | None = None


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g} GB/s" if x >= 1e9 else f"{x / 1e6:.3g} MB/s"


def _per_thread(row: Mapping[str, object]) -> int:
    """What a CPU rank's figures are divided by: its threads (1 on a GPU, or unknown)."""
    if str(row.get("device", "cpu")).startswith("cuda"):
        return 1
    return max(1, int(row.get("threads") or 1))  # type: ignore[call-overload]


def judge_compute(rows: Sequence[Mapping[str, object]], t: Thresholds) -> list[Finding]:
    """Slow-compute findings: a rank's GEMM or copy below ``t.compute x`` the median, per
    thread on a CPU (like with like: two ranks that split a node's cores each get half
    of it, and are not slow for that)."""
    out: list[Finding] = []
    threads = [_per_thread(r) for r in rows]
    per = " per thread" if any(k > 1 for k in threads) else ""
    for key, what, unit, scale in (("gemm", "GEMM", "GFLOP/s", 1e9),
                                   ("copy", "memory copy", "GB/s", 1e9)):
        values = [float(r[key]) / k for r, k in zip(rows, threads)]  # type: ignore[arg-type]
        ref, slow = judge_ranks(values, t.compute)
        for i in slow:
            host = str(rows[i]["host"])
            out.append(Finding("compute", (host,), (
                f"slow compute on {host}: rank {rows[i]['rank']} {what} "
                f"{values[i] / scale:.3g} {unit}{per} < {t.compute:g}x the median "
                f"{ref / scale:.3g}")))
    return out


def _no_gpu(value: str) -> bool:
    return value.strip() in ("", "-1", "NoDevFiles", "none")


def judge_gpus(rows: Sequence[Mapping[str, object]]) -> list[Finding]:
    """GPU-visibility findings: GPUs granted but unseen, nodes seeing fewer GPUs than
    others, and two ranks of one node on the same GPU."""
    out: list[Finding] = []
    for r in rows:
        host, granted = str(r["host"]), r.get("CUDA_VISIBLE_DEVICES")
        if isinstance(granted, str) and not _no_gpu(granted) and not r.get("gpus"):
            why = "" if r.get("torch_cuda") else " (this torch is built without CUDA)"
            out.append(Finding("gpu", (host,), f"rank {r['rank']} on {host}: "
                               f"CUDA_VISIBLE_DEVICES={granted} but torch sees no GPU{why}"))
    counts: dict[str, int] = {}
    for r in rows:
        counts[str(r["host"])] = max(counts.get(str(r["host"]), 0), int(r.get("gpus") or 0))
    most = max(counts.values(), default=0)
    for host, c in counts.items():
        if c < most:
            out.append(Finding("gpu", (host,), f"{host} sees {c} GPU(s), another node {most}"))
    seen: dict[tuple[str, str], object] = {}
    for r in rows:
        if r.get("gpu_uuid"):
            key = (str(r["host"]), str(r["gpu_uuid"]))
            if key in seen:
                out.append(Finding("gpu", (key[0],), f"ranks {seen[key]} and {r['rank']} on "
                                   f"{key[0]} share one GPU ({r.get('gpu_name')})"))
            seen.setdefault(key, r["rank"])
    return out


def judge_network(labels: Sequence[str], pairs: Mapping[Pair, Figure],
                  t: Thresholds) -> list[Finding]:
    """Slow node / slow link findings from the pairs' busbw and latency."""
    out: list[Finding] = []
    n = len(labels)
    for metric, values, j in _network_rules(n, pairs, t):

        def show(v: float, metric: str = metric) -> str:
            return _gb(v) if metric == "busbw" else f"{1e6 / v:.3g} us"

        for u in j.slow_units:
            mine = sorted(values[p] for p in values if u in p)
            out.append(Finding("node", (labels[u],), (
                f"slow node {labels[u]}: {metric} of all its {len(mine)} pairs "
                f"{show(mine[0])}..{show(mine[-1])}, reference {show(j.reference)}")))
        for a, b in j.slow_links:
            out.append(Finding("link", (labels[a], labels[b]), (
                f"slow link {labels[a]}-{labels[b]}: {metric} {show(values[(a, b)])}, "
                f"reference {show(j.reference)}")))
    return out


def _network_rules(n: int, pairs: Mapping[Pair, Figure], t: Thresholds
                   ) -> list[tuple[str, dict[Pair, float], PairJudgement]]:
    """(metric, higher-is-better values, judgement) for busbw and latency: the one place
    the thresholds and floors of the network rule are applied."""
    lat_enough = 1.0 / t.latency_floor if t.latency_floor else math.inf
    out = []
    for metric, values, thr, floor, enough in (
            ("busbw", {p: f.busbw for p, f in pairs.items()}, t.bandwidth, t.min_busbw,
             math.inf),
            ("latency", {p: 1.0 / f.latency for p, f in pairs.items()}, t.latency, 0.0,
             lat_enough)):
        out.append((metric, values, judge_pairs(n, values, thr, floor, enough)))
    return out


def remeasure(n: int, pairs: Mapping[Pair, Figure], t: Thresholds) -> list[Pair]:
    """The pairs the rule would call slow (busbw or latency), to be timed again alone
    before anything is flagged: sorted, so every rank agrees on the order."""
    return sorted({p for _, _, j in _network_rules(n, pairs, t) for p in j.slow_pairs})
