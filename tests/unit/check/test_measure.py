"""``hpc check``'s timing loops on the CPU, and the CUDA branch's order of events."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hpc.check import measure


def test_timed_grows_the_batch_until_it_fills_the_budget() -> None:
    calls: list[int] = []
    per_call = measure.timed(lambda: calls.append(1), torch.device("cpu"), budget=0.02)
    assert 0 < per_call < 0.001 and len(calls) > 10


def test_gemm_and_copy_on_the_cpu_are_plausible() -> None:
    assert 1e7 < measure.time_gemm(256, torch.float32, torch.device("cpu"), 0.01) < 1e13
    assert 1e7 < measure.time_copy(1 << 20, torch.device("cpu"), 0.01) < 1e12


def test_cuda_timing_brackets_work_with_events_and_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA: synchronize, record start, launch, record end, synchronize, then read
    the events (a read before the final synchronize would time only the launches)."""
    log: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self) -> None:
            log.append("record")

        def elapsed_time(self, end: Any) -> float:
            log.append("elapsed")
            return 0.5  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    seconds = measure.timed(lambda: log.append("op"), torch.device("cuda", 0), budget=1e-4)
    assert seconds == pytest.approx(0.0005)
    assert log[:6] == ["sync", "record", "op", "record", "sync", "elapsed"], log


def test_visibility_without_a_gpu() -> None:
    row = measure.gpu_visibility(torch.device("cpu"), {"CUDA_VISIBLE_DEVICES": "0"})
    assert row["CUDA_VISIBLE_DEVICES"] == "0" and row["gpu_name"] is None
    assert row["gpus"] == torch.cuda.device_count()
