"""CUDA collectives counted by the device: the backlog, fed by fake events on the CPU.

Issue #25 item 10: an NCCL collective returns once queued, so the tracker used to
count it completed at the call; a rank whose GPU was stuck before ``all_reduce #n``
read ``entered == completed == n`` like its waiting peers, and no warning or report
came. Here a fake GPU stands in for CUDA events: a mark is done once the fake GPU ran
past it. The real events are checked by ``bench/nccl_hang_check.py`` (in
``bench/device_check.sh``), on a GPU only.
"""

from __future__ import annotations

import json
import logging
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from hpc.environments import DistInfo
from hpc.watchdog import device, report, tracker
from hpc.watchdog import monitor as watchdog


class FakeGPU:
    """One stream: marks are numbered as recorded; those up to ``reached`` are done."""

    def __init__(self) -> None:
        self.marks = 0
        self.reached = 0

    def mark(self, tensor: Any) -> device.Done:
        assert tensor.is_cuda
        self.marks += 1
        n = self.marks
        return lambda: n <= self.reached


class FakeWork:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


CUDA = types.SimpleNamespace(is_cuda=True, device="cuda:0")
CPU = types.SimpleNamespace(is_cuda=False, device="cpu")


def _module() -> types.SimpleNamespace:
    def all_reduce(tensor: Any, op: Any = None, group: Any = None,
                   async_op: bool = False) -> Any:
        return FakeWork() if async_op else None  # NCCL: returns once queued

    def barrier(group: Any = None) -> None:
        return None

    return types.SimpleNamespace(all_reduce=all_reduce, barrier=barrier)


@pytest.fixture
def gpu() -> Iterator[types.SimpleNamespace]:
    fake, module, progress = FakeGPU(), _module(), tracker.Progress()
    tracker.install(progress, lambda *a: None, module, mark=fake.mark)
    try:
        yield types.SimpleNamespace(gpu=fake, dist=module, progress=progress)
    finally:
        tracker.uninstall(module)


def _state(p: tracker.Progress) -> tuple[int, int, int]:
    return p.entered, p.completed, p.queued


def test_a_gpu_stuck_before_the_collective_never_entered_it(gpu: Any) -> None:
    """Rank 1's GPU sleeps in a kernel between all_reduce #1 and #2 (4 marks: start
    and end of each); rank 0's GPU reached #2 and waits there. The report names rank 1;
    rank 0 is waiting, so its hang warning fires."""
    gpu.dist.all_reduce(CUDA)
    gpu.dist.all_reduce(CUDA)  # the host returns at once: both queued
    assert _state(gpu.progress) == (0, 0, 2)
    gpu.gpu.reached = 2  # ran #1, then stuck in its kernel
    assert tracker.poll()
    rank1 = dict(gpu.progress.as_dict(), host="node2", pid=7, answered=True, where="x.py:3")
    assert _state(gpu.progress) == (1, 1, 2) and not gpu.progress.waiting()
    gpu.gpu.reached = 3  # the other rank: reached #2, waits for its peers in it
    tracker.poll()
    assert _state(gpu.progress) == (2, 1, 2) and gpu.progress.waiting()
    assert gpu.progress.op == "all_reduce"
    rank0 = dict(gpu.progress.as_dict(), host="node1", pid=6, answered=True, where="x.py:5")
    entries = {0: rank0, 1: rank1}
    assert report.culprits(entries) == [1]
    text = report.compose("warning", 0, entries)
    assert ("rank 1 (node2, pid 7) never entered all_reduce #2: its last collective was "
            "all_reduce #1 (completed, ") in text
    assert "its host queued up to #2, which its GPU has not reached" in text
    gpu.gpu.reached = 4
    tracker.poll()
    assert _state(gpu.progress) == (2, 2, 2) and not gpu.progress.waiting()


def test_host_collectives_behind_a_pending_gpu_one_keep_their_order(gpu: Any) -> None:
    """A barrier (host) after a queued CUDA all_reduce cannot be entered before the GPU
    reached the all_reduce; once the backlog drains the host path counts directly."""
    gpu.dist.all_reduce(CUDA)
    gpu.dist.barrier()
    assert _state(gpu.progress) == (0, 0, 2)
    gpu.gpu.reached = 1  # the all_reduce started: the barrier (returned) counts entered
    tracker.poll()
    assert _state(gpu.progress) == (2, 0, 2) and gpu.progress.op == "barrier"
    gpu.gpu.reached = 2
    tracker.poll()
    assert _state(gpu.progress) == (2, 2, 2)
    gpu.dist.all_reduce(CPU)  # nothing pending: counted at the call, as before
    assert _state(gpu.progress) == (3, 3, 3)


def test_an_async_gpu_collective_finishes_with_its_work(gpu: Any) -> None:
    work = gpu.dist.all_reduce(CUDA, async_op=True)
    gpu.gpu.reached = gpu.gpu.marks  # one mark only: its start
    assert gpu.gpu.marks == 1
    tracker.poll()
    assert _state(gpu.progress) == (1, 0, 1)
    work.done = True
    tracker.poll()
    assert _state(gpu.progress) == (1, 1, 1)


def test_a_long_backlog_is_polled_by_the_tracker_itself(gpu: Any) -> None:
    gpu.gpu.reached = 10 ** 9  # a GPU that keeps up; nobody calls poll()
    for _ in range(device.MAX_BACKLOG + 1):
        gpu.dist.all_reduce(CUDA)
    assert len(tracker._ACTIVE[0][0]) < device.MAX_BACKLOG
    assert gpu.progress.completed >= device.MAX_BACKLOG - 1


def test_a_failing_device_query_is_not_done() -> None:
    progress = tracker.Progress()
    backlog = device.Backlog(progress)

    def broken() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    backlog.add(1, "all_reduce", broken, 1.0)
    backlog.finish(1, True, 1.0)
    assert not backlog.poll(2.0) and (progress.entered, progress.completed) == (0, 0)


def test_an_out_of_order_host_completion_stays_behind_the_backlog() -> None:
    """An async gloo future (#1) completing while a CUDA collective (#2) is pending."""
    progress = tracker.Progress(entered=1, queued=1)
    backlog = device.Backlog(progress)
    progress.queued = 2
    backlog.add(2, "all_reduce", lambda: False, 1.0)
    backlog.finish(1, True, 2.0)
    assert (progress.entered, progress.completed) == (1, 1)


def test_no_cuda_no_marker() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert device.cuda_marker() is None


def test_the_warning_names_the_rank_whose_gpu_is_behind(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The watchdog thread's tick polls the device: rank 0's GPU waits in all_reduce #2
    (queued and returned long ago on the host), rank 1 published that its GPU finished
    only #1; after HPC_HANG_TIMEOUT the warning names rank 1."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    store.set("hpc/pf/1", json.dumps({"host": "node2", "pid": 77}))
    store.set("hpc/wd/state/1", json.dumps({"entered": 1, "completed": 1, "queued": 2,
                                            "op": "all_reduce", "since": time.time()}))
    monkeypatch.setattr(watchdog, "ANSWER_WAIT", 0.1)
    dog = watchdog.Watchdog(DistInfo(launcher="local", rank=0, world_size=2),
                            lambda t: store, 10.0, {"HPC_HANG_TIMEOUT": "0.2"})
    dog._store = store
    fake, module = FakeGPU(), _module()
    tracker.install(dog.progress, dog.collective_failed, module, mark=fake.mark)
    try:
        module.all_reduce(CUDA)
        module.all_reduce(CUDA)
        fake.reached = 3
        dog._tick()
        assert json.loads(store.get("hpc/wd/state/0"))["entered"] == 2
        time.sleep(0.3)
        with caplog.at_level(logging.WARNING, logger=watchdog.__name__):
            dog._tick()
    finally:
        tracker.uninstall(module)
    assert "possible hang" in caplog.text, caplog.text
    assert "rank 1 (node2, pid 77) never entered all_reduce #2" in caplog.text, caplog.text


def _hang_check() -> Any:
    import importlib.util

    from tests.helpers.paths import ROOT

    spec = importlib.util.spec_from_file_location("nccl_hang_check",
                                                  ROOT / "bench" / "nccl_hang_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_checks_verdict_on_the_report_it_expects() -> None:
    """bench/nccl_hang_check.py's verdict, on the warning this module's fake GPU makes
    the watchdog write (the GPU run itself only happens in bench/device_check.sh)."""
    check = _hang_check()
    entries = {0: {"entered": check.STUCK, "completed": check.STUCK - 1, "queued": check.STUCK,
                   "op": "all_reduce", "since": 1.0, "host": "gpu1", "pid": 5,
                   "answered": True, "where": "nccl_hang_check.py:80 in worker"},
               1: {"entered": check.STUCK - 1, "completed": check.STUCK - 1,
                   "queued": check.STUCK, "op": "barrier", "since": 1.0, "host": "gpu1",
                   "pid": 6, "answered": True, "where": "nccl_hang_check.py:82 in worker"}}
    text = report.compose("warning", 0, entries, now=5.0)
    done = "WORKER done rank=0\nWORKER done rank=1\n"
    assert check.verdict("possible hang (HPC_HANG_TIMEOUT=3s)\n" + text + done) is None
    assert "no hang warning" in check.verdict(done)
    blamed = {0: dict(entries[0], entered=check.STUCK - 1, queued=check.STUCK - 1),
              1: dict(entries[1], entered=check.STUCK)}
    assert "name rank 1" in check.verdict(
        "possible hang\n" + report.compose("warning", 1, blamed) + done)


def test_the_gpu_check_fails_without_cuda() -> None:
    import os
    import subprocess
    import sys

    from tests.helpers.paths import ROOT

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: bench/device_check.sh runs it for real")
    proc = subprocess.run([sys.executable, "bench/nccl_hang_check.py"], capture_output=True,
                          text=True, timeout=120, check=False, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 3, proc
    assert "nccl_hang_check: FAIL: no CUDA device" in proc.stderr and "HINT" in proc.stderr
