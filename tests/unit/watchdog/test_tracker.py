"""The collective tracker: which world collectives a rank entered and completed."""

from __future__ import annotations

import sys
import threading
import time
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


@pytest.fixture
def gloo_world() -> Any:
    """A one-rank gloo group with the tracker installed on ``torch.distributed``."""
    dist = pytest.importorskip("torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    failures: list[tuple[int, str, BaseException, bool]] = []
    progress = tracker.Progress()
    tracker.install(progress, lambda *a: failures.append(a) or ValueError("the report"))
    try:
        yield types.SimpleNamespace(dist=dist, progress=progress, failures=failures)
    finally:
        tracker.uninstall()
        dist.destroy_process_group()


def test_a_local_error_reaches_the_caller_as_itself_and_completes_its_number(
        gloo_world: Any) -> None:
    """Issue #25 item 2: an object that cannot be pickled, or arguments the backend
    refuses before sending anything, are the caller's errors, not a job failure: no
    failure published (every rank would exit), the caller's ``except TypeError`` works,
    and the collective's number completes, so the next one is not blamed for a wait."""
    import torch

    dist, progress = gloo_world.dist, gloo_world.progress
    with pytest.raises(TypeError, match="pickle"):
        dist.all_gather_object([None], {"lock": threading.Lock()})
    with pytest.raises(RuntimeError, match="invalid output tensor list"):
        dist.all_gather([torch.ones(2), torch.ones(2)], torch.ones(2))
    assert gloo_world.failures == []
    assert (progress.entered, progress.completed) == (2, 2) and not progress.waiting()
    dist.all_reduce(torch.ones(1))
    assert (progress.entered, progress.completed, progress.op) == (3, 3, "all_reduce")


def test_backend_failures_still_fail_the_job() -> None:
    """What a backend raises while the collective waits for its peers (gloo: a plain
    RuntimeError out of ``work.wait()``), torch's ``DistError`` family, and timeouts of
    calls that block in C++ (``monitored_barrier``) stay job failures."""
    dist = pytest.importorskip("torch.distributed")

    def waits_then_fails(t: Any, group: Any = None) -> None:
        # a Work whose C++ wait() raises (here: a builtin raising RuntimeError, words
        # that name no timeout), as gloo's does on a transport error
        work = types.SimpleNamespace(wait=threading.Lock().release)
        work.wait()

    def refused(t: Any, group: Any = None) -> None:
        raise dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp, unhandled system error")

    def blocked(group: Any = None) -> None:
        raise RuntimeError("[Rank 0]: Rank 1 failed to pass monitoredBarrier in 2000 ms\n "
                           "Original exception: \n[../gloo/transport/tcp/unbound_buffer.cc:78] "
                           "Timed out waiting 2000ms for recv operation to complete")

    module = types.SimpleNamespace(all_reduce=waits_then_fails, broadcast=refused,
                                   monitored_barrier=blocked,
                                   DistError=dist.DistError)
    seen: list[str] = []
    tracker.install(tracker.Progress(), lambda seq, op, e, r: seen.append(op) or None, module)
    try:
        for call in (lambda: module.all_reduce(1), lambda: module.broadcast(1),
                     module.monitored_barrier):
            with pytest.raises(RuntimeError):
                call()
    finally:
        tracker.uninstall(module)
    assert seen == ["all_reduce", "broadcast", "monitored_barrier"]


def test_a_subgroup_passed_by_position_is_not_a_world_collective(gloo_world: Any) -> None:
    """Issue #25 item 3: ``all_reduce(t, op, group)``, ``broadcast(t, src, group)``,
    ``reduce(t, dst, op, group)``, ``monitored_barrier(group)`` on a subgroup used to
    count as world collectives, so one rank's numbers ran ahead of its peers' and the
    report blamed a rank that only waited. ``async_op`` by position counts too."""
    import torch

    dist, progress = gloo_world.dist, gloo_world.progress
    solo, t, total = dist.new_group([0]), torch.ones(2), dist.ReduceOp.SUM
    dist.all_reduce(t, total, solo)
    dist.broadcast(t, 0, solo)
    dist.reduce(t, 0, total, solo)
    dist.all_gather([t], t, solo)
    dist.monitored_barrier(solo)
    dist.barrier(solo)
    assert progress.entered == 0
    dist.all_reduce(t, total, None)
    dist.broadcast(t, 0, dist.group.WORLD)
    work = dist.all_reduce(t, total, None, True)  # async_op by position
    assert work is not None
    work.wait()
    assert progress.entered == 3
    # the async one completes through its future
    for _ in range(100):
        if progress.completed == 3:
            break
        time.sleep(0.01)
    assert progress.completed == 3


def test_torch_compile_traces_a_tracked_collective_without_a_break(gloo_world: Any) -> None:
    """Issue #25 item 4: once init_torch ran, dynamo met the wrapper's lock at every
    collective (a graph break, 'Unsupported context manager'; ``fullgraph=True``
    raised). Under compilation the wrapper hands over to torch's function at once:
    dynamo traces it as it would untracked, and the compiled call is not counted."""
    import torch

    dist, progress = gloo_world.dist, gloo_world.progress

    def step(t: Any) -> Any:
        dist.all_reduce(t)
        return t * 2

    from torch._dynamo.utils import counters

    counters.clear()
    try:
        torch.compile(step, backend="eager")(torch.ones(4))
        assert dict(counters["graph_break"]) == {}
        torch._dynamo.reset()
        out = torch.compile(step, fullgraph=True, backend="eager")(torch.ones(4))
    finally:
        torch._dynamo.reset()
    assert out.tolist() == [2.0] * 4
    assert progress.entered == 0  # inside a compiled graph: not counted
    step(torch.ones(4))  # eager again: counted
    assert (progress.entered, progress.completed) == (1, 1)
