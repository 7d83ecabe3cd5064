"""The straggler rules (:mod:`hpc.health.straggler`): pure functions of the ranks' rows."""

from __future__ import annotations

import pytest

from hpc.health.straggler import Baselines, Rules, StepClock, judge, ranks_text, slow_roots


def _row(compute: float, wait: float, steps: int = 20) -> list[float]:
    return [compute, wait, compute + wait, float(steps)]


def _baselines(rows: list[list[float]], n: int = 3) -> Baselines:
    b = Baselines()
    for _ in range(n):
        b.add(rows, n)
    return b


def test_a_rank_computing_longer_than_the_median_is_named_with_the_others_wait() -> None:
    rows = [_row(0.010, 0.010), _row(0.010, 0.010), _row(0.018, 0.002), _row(0.011, 0.009)]
    (f,) = judge(rows, Baselines())
    assert (f.kind, f.ranks) == ("relative", (2,))
    assert f.factor == pytest.approx(0.018 / 0.0105)
    assert f.others_waited == pytest.approx(0.5, abs=0.05)


def test_just_under_the_threshold_is_not_a_verdict() -> None:
    rows = [_row(0.010, 0.01), _row(0.010, 0.01), _row(0.0129, 0.007)]
    assert judge(rows, Baselines()) == []
    rows[2] = _row(0.0131, 0.007)
    assert [f.kind for f in judge(rows, Baselines())] == ["relative"]


def test_differences_below_the_floor_are_noise_whatever_the_ratio() -> None:
    rows = [_row(0.0002, 0.0), _row(0.0002, 0.0), _row(0.0011, 0.0)]
    assert judge(rows, Baselines(), Rules(floor_s=0.001)) == []
    assert judge(rows, Baselines(), Rules(floor_s=0.0005))[0].ranks == (2,)


def test_two_ranks_have_no_median_to_beat_but_each_has_its_own_past() -> None:
    healthy = [_row(0.010, 0.002), _row(0.010, 0.002)]
    base = _baselines(healthy)
    slow = [_row(0.010, 0.012), _row(0.022, 0.0)]
    assert judge(slow, Baselines()) == []  # no baseline yet, no relative rule at 2 ranks
    (f,) = judge(slow, base)
    assert (f.kind, f.ranks, round(f.factor, 1)) == ("individual", (1,), 2.2)


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


def test_slow_roots_names_the_host_whose_broadcast_is_slow() -> None:
    assert slow_roots([0.002, 0.002, 0.041, 0.0021]) == [2]
    assert slow_roots([0.002, 0.0021, 0.0022, 0.002]) == []
    assert slow_roots([0.002, 0.040]) == [1]
    assert slow_roots([0.04, 0.04, 0.002, 0.002]) == []  # half the hosts: not "one host"


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
