"""The straggler rules (:mod:`hpc.health.straggler`): pure functions of the ranks' rows."""

from __future__ import annotations

import random
import statistics

import pytest

from hpc.health.straggler import (
    Baselines,
    Rules,
    StepClock,
    judge,
    probe_shifts,
    ranks_text,
    references,
    slow_links,
)


def _row(compute: float, wait: float, steps: int = 20) -> list[float]:
    return [compute, wait, compute + wait, float(steps)]


def _baselines(rows: list[list[float]], n: int = 3) -> Baselines:
    b = Baselines()
    for _ in range(n):
        b.add(rows, n)
    return b


def test_a_rank_computing_longer_than_the_others_is_named_with_the_others_wait() -> None:
    rows = [_row(0.010, 0.010), _row(0.010, 0.010), _row(0.018, 0.002), _row(0.011, 0.009)]
    (f,) = judge(rows, Baselines())
    assert (f.kind, f.ranks) == ("relative", (2,))
    assert f.factor == pytest.approx(1.8) and f.reference_s == pytest.approx(0.010)
    assert f.others_waited == pytest.approx(0.5, abs=0.05)


def test_just_under_the_threshold_is_not_a_verdict() -> None:
    rows = [_row(0.020, 0.01), _row(0.020, 0.01), _row(0.0259, 0.004)]  # 1.295x
    assert judge(rows, Baselines()) == []
    rows[2] = _row(0.0261, 0.004)  # 1.305x
    assert [f.kind for f in judge(rows, Baselines())] == ["relative"]


def test_differences_below_the_floor_are_noise_whatever_the_ratio() -> None:
    rows = [_row(0.0002, 0.0), _row(0.0002, 0.0), _row(0.0011, 0.0)]
    assert judge(rows, Baselines(), Rules(floor_s=0.001)) == []
    assert judge(rows, Baselines(), Rules(floor_s=0.0005))[0].ranks == (2,)


def test_an_excess_too_small_to_cost_the_job_is_not_named() -> None:
    """The wire slowed every step to 130 ms; a rank computing 20 ms against 12 ms is not
    what the others wait for (6 % of the step)."""
    rows = [_row(0.020, 0.110)] + [_row(0.012, 0.118)] * 7
    assert judge(rows, Baselines()) == []
    assert judge(rows, Baselines(), Rules(share=0.05))[0].ranks == (0,)


def test_named_only_over_the_thresholds_two_windows_in_a_row() -> None:
    rows = [_row(0.012, 0.068)] * 3 + [_row(0.026, 0.054)]  # 14 ms of an 80 ms step: 17 %
    suspects: set[int] = set()
    assert judge(rows, Baselines(), suspects=suspects) == [] and suspects == {3}
    (f,) = judge(rows, Baselines(), suspects=suspects)
    assert f.ranks == (3,) and suspects == {3}
    healthy = [_row(0.012, 0.068)] * 4
    assert judge(healthy, Baselines(), suspects=suspects) == [] and suspects == set()
    assert judge(rows, Baselines(), suspects=suspects) == []  # a new episode: twice again
    other = [_row(0.012, 0.068)] * 2 + [_row(0.026, 0.054), _row(0.012, 0.068)]
    assert judge(other, Baselines(), suspects=suspects) == []  # rank 2 now, not rank 3
    assert suspects == {2}


def test_a_whole_slow_node_is_measured_against_the_other_nodes() -> None:
    rows = [_row(0.010, 0.012)] * 4 + [_row(0.022, 0.0)] * 2
    hosts = ["node1", "node1", "node2", "node2", "node3", "node3"]
    (f,) = judge(rows, Baselines(), hosts=hosts)
    assert (f.ranks, f.factor) == ((4, 5), pytest.approx(2.2))
    rows = [_row(0.010, 0.012)] * 2 + [_row(0.022, 0.0)] * 3  # more than half: the job
    assert judge(rows, Baselines(), hosts=["a", "a", "b", "b", "b"]) == []


def test_two_ranks_each_other_s_reference_and_their_own_past() -> None:
    slow = [_row(0.010, 0.012), _row(0.022, 0.0)]
    (f,) = judge(slow, Baselines())
    assert (f.kind, f.ranks) == ("relative", (1,))
    base = _baselines([_row(0.010, 0.002), _row(0.016, 0.0)])  # rank 1 always slower
    later = [_row(0.010, 0.014), _row(0.026, 0.0)]  # 1.63x its own past, 2.6x rank 0
    kinds = {f.kind: f.ranks for f in judge(later, base)}
    assert kinds == {"relative": (1,)}


def test_a_rank_slower_than_its_own_past_but_not_than_the_others() -> None:
    base = _baselines([_row(0.006, 0.006)] + [_row(0.010, 0.002)] * 3)
    rows = [_row(0.0125, 0.0)] + [_row(0.010, 0.0025)] * 3  # 2.1x itself, 1.25x the others
    (f,) = judge(rows, base)
    assert (f.kind, f.ranks, round(f.factor, 2)) == ("individual", (0,), 2.08)


def test_the_whole_job_slowing_is_not_one_rank() -> None:
    base = _baselines([_row(0.010, 0.002)] * 4)
    everyone = [_row(0.020, 0.002)] * 4
    assert judge(everyone, base) == []


def test_a_slow_job_that_mostly_waits_is_a_link_suspicion() -> None:
    base = _baselines([_row(0.010, 0.002)] * 4)
    waiting = [_row(0.010, 0.030)] * 4
    (f,) = judge(waiting, base)
    assert f.kind == "link" and f.ranks == () and f.factor == pytest.approx(40 / 12)
    computing = [_row(0.010, 0.004)] * 4  # slower, but not by 1.5x
    assert judge(computing, base) == []


def test_a_rank_without_steps_in_the_window_is_left_out() -> None:
    rows = [_row(0.010, 0.01), [0.0, 0.0, 0.0, 0.0], _row(0.010, 0.01), _row(0.03, 0.0)]
    (f,) = judge(rows, Baselines())
    assert f.ranks == (3,)


def test_slow_links_tell_a_slow_sender_from_a_slow_receiver() -> None:
    fast, slow = 0.002, 0.5
    # host 2 sends slowly: 2 -> 3 (shift 1) and 2 -> 1 (shift -1) are slow
    sending = [[fast, fast, slow, fast], [fast, fast, slow, fast]]
    assert slow_links(sending, (1, -1)) == [(2, "sending", pytest.approx(250), fast)]
    # host 2 receives slowly: 1 -> 2 (shift 1) and 3 -> 2 (shift -1) are slow
    receiving = [[fast, slow, fast, fast], [fast, fast, fast, slow]]
    assert slow_links(receiving, (1, -1)) == [(2, "receiving", pytest.approx(250), fast)]
    assert slow_links([[fast] * 4, [fast] * 4], (1, -1)) == []
    assert slow_links([[fast, slow, slow, fast], [fast] * 4], (1, -1)) == []  # no host in both
    assert slow_links([[fast, slow]], probe_shifts(2)) == [(1, "sending", 250.0, fast)]
    noisy = [[0.0009, 0.0027, 0.0009, 0.0009], [0.0009, 0.0009, 0.0027, 0.0009]]
    assert slow_links(noisy, (1, -1)) == []  # 3x of a millisecond: a probe's noise
    assert probe_shifts(2) == (1,) and probe_shifts(4) == (1, -1)


def test_step_clock_splits_wall_into_compute_and_wait_and_trims_outliers() -> None:
    now, waited = [0.0], [0.0]
    clock = StepClock(lambda: waited[0], lambda: now[0])
    assert clock.mark() is None  # the first boundary starts the first step
    for compute, wait in [(0.01, 0.002)] * 8 + [(0.5, 0.0), (0.5, 0.0)]:
        now[0] += compute + wait
        waited[0] += wait
        assert clock.mark() == pytest.approx(compute)
    c, w, wall, n = clock.window(trim=0.2)
    assert c == pytest.approx(0.01) and n == 10  # the two 0.5 s steps trimmed
    assert w == pytest.approx(0.0016) and wall == pytest.approx((8 * 0.012 + 1.0) / 10)
    assert clock.window(0.2) == [0.0, 0.0, 0.0, 0.0]


def test_step_clock_skip_and_shift_leave_time_out() -> None:
    now = [0.0]
    clock = StepClock(lambda: 0.0, lambda: now[0])
    clock.mark()
    now[0] += 5.0
    clock.skip()  # a validation pass
    now[0] += 1.0
    assert clock.mark() is None
    now[0] += 0.3
    clock.shift(0.2)  # 0.2 s spent in the detector itself
    assert clock.mark() == pytest.approx(0.1)
    assert StepClock(lambda: None, lambda: now[0]).mark() is None


def test_ranks_text() -> None:
    assert ranks_text((5, 4)) == "ranks 4-5"
    assert ranks_text((2,)) == "rank 2"
    assert ranks_text((1, 3)) == "ranks 1,3"


def test_window_steps_are_a_function_of_the_step_alone() -> None:
    """A resumed run carries the rows at the same steps as an uninterrupted one: pretrain
    sums them in its metrics all_reduce, whose length (and rounding) must not depend on
    where the run started."""
    from hpc.health.step import StepHealth

    def due_steps(start: int, agreed_every: int) -> list[int]:
        h = StepHealth(0, 1, environ={})
        h.stragglers = True  # as with a tracker installed and several ranks
        return [s for s in range(start, 101) if h.due(s, agreed_every)]

    assert due_steps(1, 1) == [20, 40, 60, 80, 100]
    assert due_steps(57, 1) == [60, 80, 100]  # resumed after step 56
    assert due_steps(1, 3) == [21, 42, 60, 81]  # the first agreed step of each window
    assert due_steps(50, 3) == [60, 81]


def _references_by_definition(compute: dict[int, float], hosts) -> dict[int, float]:
    """The rule as the docstring states it, rank by rank (O(N^2))."""
    out = {}
    for r in compute:
        others = [c for q, c in compute.items() if q != r and (
            hosts is None or hosts[q] != hosts[r])]
        others = others or [c for q, c in compute.items() if q != r]
        out[r] = statistics.median(others) if others else compute[r]
    return out


def test_references_are_the_median_of_the_other_hosts_ranks_exactly() -> None:
    """Ties, one host, ranks missing from the table, hosts of uneven size, no hosts."""
    rng = random.Random(7)
    for _ in range(500):
        n, per = rng.randint(1, 40), rng.randint(1, 9)
        live = sorted(rng.sample(range(n + 3), n))
        compute = {r: round(rng.uniform(0, 3), rng.choice([0, 1, 3])) for r in live}
        hosts = None if rng.random() < 0.3 else [
            f"h{i // per}" if rng.random() < 0.9 else "h0" for i in range(n + 3)]
        assert references(compute, hosts) == _references_by_definition(compute, hosts)


class _Counted(dict):
    """A table that counts how often it is read whole."""

    reads = 0

    def items(self):  # type: ignore[override]
        _Counted.reads += 1
        return super().items()

    def __iter__(self):
        _Counted.reads += 1
        return super().__iter__()


def test_references_read_the_table_a_few_times_not_once_per_rank() -> None:
    """At 8,192 ranks the rank-by-rank rule cost 59 s a window on every rank
    (bench/straggler_scale.py times today's)."""
    _Counted.reads = 0
    compute = _Counted({r: 0.1 + 1e-4 * (r % 13) for r in range(512)})
    references(compute, [f"node{r // 8}" for r in range(512)])
    assert _Counted.reads <= 3
