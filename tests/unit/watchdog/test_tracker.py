"""The collective tracker: which world collectives a rank entered and completed."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

import pytest

from hpc.watchdog import tracker


class _Work:
    def __init__(self, fut: Any) -> None:
        self.fut = fut

    def get_future(self) -> Any:
        return self.fut


def _fake_dist(fail: Exception | None = None) -> types.SimpleNamespace:
    torch_fut = pytest.importorskip("torch.futures")

    def all_reduce(t: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        if fail is not None:
            raise fail
        if async_op:
            return _Work(torch_fut.Future())
        return None

    return types.SimpleNamespace(all_reduce=all_reduce, barrier=lambda group=None: None)


def test_tracker_counts_world_collectives_only() -> None:
    module = _fake_dist()
    progress = tracker.Progress()
    tracker.install(progress, lambda *a: None, module)
    try:
        module.all_reduce(1)
        module.barrier()
        assert (progress.entered, progress.completed, progress.op) == (2, 2, "barrier")
        module.all_reduce(1, group=object())  # a subgroup: not counted
        assert progress.entered == 2
        work = module.all_reduce(1, async_op=True)
        assert progress.waiting() and progress.op == "all_reduce"
        work.fut.set_result(None)
        assert not progress.waiting() and progress.completed == 3
    finally:
        tracker.uninstall(module)
    assert not hasattr(module.all_reduce, "__hpc_tracked__")


def test_tracker_reads_world_from_the_module_it_wraps(monkeypatch: pytest.MonkeyPatch) -> None:
    """No import of torch.distributed per collective; WORLD is read at each call (init
    replaces it after install)."""
    module = _fake_dist()
    module.GroupMember = types.SimpleNamespace(WORLD=None)
    progress = tracker.Progress()
    tracker.install(progress, lambda *a: None, module)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)  # importing it now fails
    try:
        module.GroupMember.WORLD = world = object()
        module.all_reduce(1, group=world)
        module.barrier(world)
        module.all_reduce(1, group=object())
        assert (progress.entered, progress.completed) == (2, 2)
    finally:
        tracker.uninstall(module)


def test_tracker_raises_what_the_failure_callback_returns() -> None:
    module = _fake_dist(fail=RuntimeError("Timed out waiting 10000ms for recv"))
    calls: list[tuple[int, str, bool]] = []

    def on_failure(seq: int, op: str, error: BaseException, raising: bool) -> Exception:
        calls.append((seq, op, raising))
        return ValueError("report")

    tracker.install(tracker.Progress(), on_failure, module)
    try:
        with pytest.raises(ValueError, match="report") as caught:
            module.all_reduce(1)
    finally:
        tracker.uninstall(module)
    assert calls == [(1, "all_reduce", True)]
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_tracker_reports_a_failed_async_collective_off_thread() -> None:
    torch_fut = pytest.importorskip("torch.futures")
    fut = torch_fut.Future()
    module = types.SimpleNamespace(all_reduce=lambda t, async_op=False, group=None: _Work(fut))
    got = threading.Event()
    tracker.install(tracker.Progress(), lambda seq, op, e, raising: got.set() if not raising else None,
                    module)
    try:
        module.all_reduce(1, async_op=True)
        fut.set_exception(RuntimeError("Connection closed by peer"))
        assert got.wait(5)
    finally:
        tracker.uninstall(module)
