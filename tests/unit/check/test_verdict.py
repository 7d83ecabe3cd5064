"""The outlier rule of ``hpc check`` on synthetic matrices (pure functions, no torch)."""

from __future__ import annotations

import itertools
import math

import pytest

from hpc.check.verdict import (
    Figure,
    Thresholds,
    algbw,
    busbw,
    judge_compute,
    judge_gpus,
    judge_network,
    judge_pairs,
    judge_ranks,
    round_robin,
    verdict_line,
)

HOSTS = ["n0", "n1", "n2", "n3", "n4", "n5"]


def matrix(n: int, fast: float = 10.0, slow_units: tuple[int, ...] = (),
           slow_links: tuple[tuple[int, int], ...] = (), noise: float = 0.0,
           slow: float = 0.1) -> dict[tuple[int, int], float]:
    """All pairs of n units at ``fast`` (+- noise, deterministic), slow ones at ``slow``."""
    out = {}
    for k, (a, b) in enumerate(itertools.combinations(range(n), 2)):
        v = fast * (1 + noise * math.sin(7 * k + 1))
        out[(a, b)] = slow if a in slow_units or b in slow_units or (a, b) in slow_links else v
    return out


def test_nccl_tests_definitions() -> None:
    assert algbw(8e9, 2.0) == 4e9
    assert busbw(4e9, 2) == 4e9                 # a pair: busbw = algbw
    assert busbw(4e9, 8) == pytest.approx(7e9)  # 2 (n-1)/n = 1.75
    assert busbw(4e9, 1) == 0
    with pytest.raises(ValueError, match="positive"):
        algbw(1, 0)


@pytest.mark.parametrize("n", range(1, 10))
def test_round_robin_covers_every_pair_once_in_disjoint_rounds(n: int) -> None:
    rounds = round_robin(n)
    flat = [p for r in rounds for p in r]
    assert sorted(flat) == list(itertools.combinations(range(n), 2))
    for r in rounds:
        units = [u for p in r for u in p]
        assert len(units) == len(set(units))
    assert len(rounds) == (0 if n < 2 else n - 1 if n % 2 == 0 else n)


def test_healthy_noisy_matrix_flags_nothing() -> None:
    j = judge_pairs(6, matrix(6, noise=0.3), 0.5)
    assert j.slow_pairs == () and j.slow_units == () and j.slow_links == ()
    assert 9 < j.reference < 13


@pytest.mark.parametrize("n", [3, 4, 6])
def test_one_slow_node_is_a_node_not_links(n: int) -> None:
    # With 3 units, 2 of the 3 pairs are slow: a median over all pairs would call the
    # slow ones normal; the median of each unit's best pair does not.
    j = judge_pairs(n, matrix(n, slow_units=(2,), noise=0.2), 0.5)
    assert j.slow_units == (2,)
    assert j.slow_links == ()
    assert all(2 in p for p in j.slow_pairs) and len(j.slow_pairs) == n - 1


@pytest.mark.parametrize("n", [3, 4, 6])
def test_one_slow_link_is_a_link_not_nodes(n: int) -> None:
    j = judge_pairs(n, matrix(n, slow_links=((0, 2),), noise=0.2), 0.5)
    assert j.slow_units == () and j.slow_links == ((0, 2),)


def test_slow_node_and_separate_slow_link() -> None:
    j = judge_pairs(6, matrix(6, slow_units=(4,), slow_links=((0, 1),)), 0.5)
    assert j.slow_units == (4,) and j.slow_links == ((0, 1),)


def test_two_units_only_the_floor_can_flag() -> None:
    assert judge_pairs(2, {(0, 1): 0.001}, 0.5).slow_pairs == ()
    j = judge_pairs(2, {(0, 1): 0.001}, 0.5, floor=1.0)
    assert j.slow_links == ((0, 1),) and j.slow_units == ()


def test_threshold_is_the_boundary_and_is_validated() -> None:
    values = {(0, 1): 10.0, (0, 2): 10.0, (1, 2): 4.9}
    assert judge_pairs(3, values, 0.5).slow_links == ((1, 2),)
    assert judge_pairs(3, {**values, (1, 2): 5.0}, 0.5).slow_links == ()
    with pytest.raises(ValueError, match="threshold"):
        judge_pairs(3, values, 1.5)


def test_judge_ranks_is_median_relative() -> None:
    ref, slow = judge_ranks([100, 98, 103, 30, 101], 0.5)
    assert ref == 100 and slow == [3]
    assert judge_ranks([], 0.5)[1] == []


def fig(bw_gbs: float, lat_us: float = 100.0) -> Figure:
    return Figure(2, 1 << 20, (1 << 20) / (bw_gbs * 1e9), lat_us * 1e-6)


def test_network_findings_name_only_the_outlier_hosts() -> None:
    labels = HOSTS[:4]
    pairs = {p: fig(0.006 if 2 in p else 0.5 + 0.05 * p[0]) for p in
             itertools.combinations(range(4), 2)}
    found = judge_network(labels, pairs, Thresholds())
    assert [(f.kind, f.names) for f in found] == [("node", ("n2",))]
    line = verdict_line(found, "unused")
    assert line.startswith("VERDICT: FLAGGED n2: slow node n2: busbw of all its 3 pairs")
    assert not any(h in line for h in ("n0", "n1", "n3"))


def test_latency_outlier_link() -> None:
    pairs = {p: fig(1.0, 900.0 if p == (1, 3) else 100.0)
             for p in itertools.combinations(range(4), 2)}
    found = judge_network(HOSTS[:4], pairs, Thresholds())
    assert [(f.kind, f.names) for f in found] == [("link", ("n1", "n3"))]
    assert "latency 900 us" in found[0].text


def rows(n: int, **overrides: dict[str, object]) -> list[dict[str, object]]:
    out = [{"rank": r, "host": HOSTS[r], "gemm": 40e9, "copy": 8e9, "gpus": 0,
            "torch_cuda": None, "gpu_uuid": None} for r in range(n)]
    for r, extra in overrides.items():
        out[int(r[1:])].update(extra)
    return out


def test_compute_outlier_names_its_host() -> None:
    found = judge_compute(rows(4, r1={"gemm": 10e9}), Thresholds())
    assert [(f.kind, f.names) for f in found] == [("compute", ("n1",))]
    assert "GEMM 10 GFLOP/s < 0.5x the median 40" in found[0].text
    assert judge_compute(rows(4, r1={"gemm": 30e9}), Thresholds()) == []


def test_gpu_visibility_findings() -> None:
    assert judge_gpus(rows(2)) == []
    found = judge_gpus(rows(2, r0={"CUDA_VISIBLE_DEVICES": "0,1"}))
    assert found[0].names == ("n0",) and "built without CUDA" in found[0].text
    assert judge_gpus(rows(2, r0={"CUDA_VISIBLE_DEVICES": ""})) == []
    two = rows(3, r0={"gpus": 4, "torch_cuda": "12.4"}, r1={"gpus": 4, "torch_cuda": "12.4"},
               r2={"gpus": 2, "torch_cuda": "12.4"})
    assert [f.names for f in judge_gpus(two)] == [("n2",)]
    shared = rows(2, r0={"gpus": 1, "gpu_uuid": "GPU-a"}, r1={"gpus": 1, "gpu_uuid": "GPU-a"})
    shared[1]["host"] = "n0"
    assert "share one GPU" in judge_gpus(shared)[0].text


def test_ok_line_carries_the_summary() -> None:
    assert verdict_line([], "4 nodes") == "VERDICT: OK: 4 nodes"
