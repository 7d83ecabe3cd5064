"""hpc.sync._threads: a sync's copies on this rank's share of the host's CPUs."""

from __future__ import annotations

import logging

import pytest
import torch

from hpc.bootstrap import threads
from hpc.sync import _threads


@pytest.fixture
def host_of_4(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unbound process on a 4-CPU host."""
    monkeypatch.setattr(threads, "usable_cpus", lambda: 4)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(_threads, "_WARNED", [])


def _threads_inside(local_ranks: int, start: int) -> int:
    before = torch.get_num_threads()
    torch.set_num_threads(start)
    try:
        with _threads.share_of_host(local_ranks):
            inside = torch.get_num_threads()
        assert torch.get_num_threads() == start  # restored
        return inside
    finally:
        torch.set_num_threads(before)


def test_a_thread_per_cpu_on_each_of_two_ranks_is_capped_and_warned_once(
        host_of_4: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hpc.sync._threads"):
        assert _threads_inside(2, 4) == 2
        assert _threads_inside(2, 4) == 2
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    assert warned[0].startswith("sync: 2 ranks run on this host, each with 4 torch "
                                "threads, where each has 2 CPU(s) to itself.")
    assert "HINT:" in warned[0] and "OMP_NUM_THREADS=2" in warned[0]


@pytest.mark.parametrize("local_ranks,start", [(2, 2), (2, 1), (1, 4), (4, 1)])
def test_counts_that_fit_are_left_alone(host_of_4: None, local_ranks: int, start: int,
                                        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hpc.sync._threads"):
        assert _threads_inside(local_ranks, start) == start
    assert not caplog.records


def test_the_count_comes_back_when_the_sync_raises(host_of_4: None) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with pytest.raises(RuntimeError, match="peer gone"):
            with _threads.share_of_host(2):
                raise RuntimeError("peer gone")
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
