"""The stuck-rank report and the watchdog's pure parts."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import types
from typing import Any

import pytest

from hpc.environments import DistInfo
from hpc.watchdog import failure, marks, report
from hpc.watchdog import monitor as watchdog


def _entry(entered: int, completed: int, *, host: str = "node1", pid: int = 10,
           answered: bool = True, where: str = "train.py:14 in <module>",
           op: str = "all_reduce", **extra: Any) -> dict[str, Any]:
    return {"entered": entered, "completed": completed, "op": op, "since": 100.0,
            "host": host, "pid": pid, "answered": answered, "where": where, **extra}


def test_report_names_the_rank_that_never_entered() -> None:
    entries = {0: _entry(4, 3), 1: _entry(3, 3, host="node2", pid=1234,
                                          stack='File "train.py", line 14 in <module>'),
               2: _entry(4, 3), 3: _entry(4, 3)}
    assert report.target(entries) == (4, "all_reduce")
    assert report.culprits(entries) == [1]
    text = report.compose("timeout", 0, entries, "Timed out waiting 20000ms for recv",
                          now=112.5)
    first = text.splitlines()[0]
    assert first == ("all_reduce #4 timed out (reported by rank 0): rank 1 (node2, pid 1234) "
                     "never entered it.")
    assert ("rank 1 (node2, pid 1234) never entered all_reduce #4: its last collective was "
            "all_reduce #3 (completed, 12.5s ago); it is at train.py:14 in <module>") in text
    assert "stack of rank 1:\n    File \"train.py\", line 14" in text
    assert "waiting in all_reduce #4: rank(s) 0, 2, 3." in text
    assert "error on rank 0: Timed out waiting 20000ms for recv" in text
    assert "\nHINT: " in text


def test_report_on_a_silent_rank_says_what_is_known() -> None:
    entries = {0: _entry(7, 6), 1: _entry(5, 5, answered=False, process="stopped")}
    text = report.compose("failure", 0, entries, now=101.0)
    assert ("rank 1 (node1, pid 10) never entered all_reduce #7: the last collective it "
            "published was all_reduce #5 (completed, 1.0s ago)") in text
    assert "its watchdog did not answer (stopped)" in text


def test_report_when_every_rank_entered_blames_the_network() -> None:
    entries = {0: _entry(2, 1), 1: _entry(2, 1)}
    assert report.culprits(entries) == []
    text = report.compose("timeout", 1, entries)
    assert text.splitlines()[0] == "all_reduce #2 timed out (reported by rank 1)."
    assert "network" in text


def test_where_skips_library_frames() -> None:
    import traceback

    frames = [traceback.FrameSummary("/home/u/train.py", 14, "<module>"),
              traceback.FrameSummary(report.__file__, 50, "tracked"),
              traceback.FrameSummary("/x/site-packages/torch/distributed/c10d.py", 9, "all_reduce")]
    assert report.where(frames) == "train.py:14 in <module>"


def test_main_stack_is_the_main_threads(tmp_path: Any) -> None:
    seen: list[str] = []
    t = threading.Thread(target=lambda: seen.append(report.where(report.main_stack())))
    t.start()
    t.join()
    assert seen and seen[0].startswith("test_monitor.py:"), seen


def test_main_thread_stack_picks_the_main_block() -> None:
    ident = threading.main_thread().ident
    dump = (f"Current thread 0x{1:016x} (most recent call first):\n  File \"w.py\", line 1 in run\n\n"
            f"Thread 0x{ident:016x} (most recent call first):\n  File \"train.py\", line 14 in <module>\n")
    assert watchdog.main_thread_stack(dump) == (
        f"Thread 0x{ident:016x} (most recent call first):\n  File \"train.py\", line 14 in <module>")
    assert "test_main_thread_stack_picks_the_main_block" in watchdog.main_thread_stack(
        watchdog._stacks())


def test_flight_recorder_env_keeps_what_the_user_set() -> None:
    assert watchdog.flight_recorder_env({}) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    env = {"HPC_LOG_DIR": "/runs/x", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    assert watchdog.flight_recorder_env(env) == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/x/nccl_trace_rank_"}


def test_write_mark_keeps_an_earlier_mark(tmp_path: Any) -> None:
    marks.write_mark(str(tmp_path), 1, "stuck since step 3", when=50.0)
    marks.write_mark(str(tmp_path), 1, "exited with a non-zero code")
    assert marks.read_mark(str(tmp_path), 1) == (50.0, "stuck since step 3")


def test_reporter_marks_the_culprit_with_its_own_host_and_pid(tmp_path: Any) -> None:
    """The reporter (rank 0 on node1) marks stuck rank 3 (node2, pid 4242): the mark, and
    so "first failure: rank 3 on ...", names node2, not the reporter's host (a CI run of
    test_sigkilled_rank_fails_the_job_fast_naming_it read "rank 3 on node1")."""
    entries = {3: {"host": "node2", "pid": 4242, "since": 50.0}}
    dog = types.SimpleNamespace(error_dir=str(tmp_path))
    watchdog.Watchdog._mark(dog, [3], entries, "all_reduce #48 failed\nstacks")
    assert marks.read_mark(str(tmp_path), 3) == (50.0, "all_reduce #48 failed")
    first = failure.first_failure(str(tmp_path), {})
    assert first is not None and (first.rank, first.host, first.pid) == (3, "node2", 4242)


def test_watchdog_is_off_for_one_process_and_on_request() -> None:
    one = DistInfo(launcher="local")
    assert watchdog.start(one, lambda t: None, 10.0, {}) is None
    two = DistInfo(launcher="local", rank=0, world_size=2)
    assert watchdog.start(two, lambda t: None, 10.0, {"HPC_WATCHDOG": "0"}) is None


def test_process_state_of_this_and_a_dead_pid() -> None:
    import os
    import subprocess

    assert watchdog._process_state(os.getpid()) == "running"
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert watchdog._process_state(p.pid) == "gone"


def test_gather_fills_in_silent_ranks_from_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    store.set("hpc/pf/1", json.dumps({"host": "elsewhere", "pid": 77}))
    store.set("hpc/wd/state/1", json.dumps({"entered": 3, "completed": 3, "op": "all_reduce",
                                            "since": time.time() - 5}))
    # The wait for answers ends when rank 2's answer was read (rank 1 never answers), not
    # after a fixed 0.2 s that a loaded machine can spend before the helper thread runs:
    # gather's clock stands still until then, and ANSWER_WAIT bounds a test that hangs.
    read = threading.Event()
    start = time.monotonic()

    def clock() -> float:
        return time.monotonic() - start + (1e6 if read.is_set() else 0.0)

    monkeypatch.setattr(watchdog, "time", types.SimpleNamespace(
        monotonic=clock, sleep=time.sleep, time=time.time))
    monkeypatch.setattr(watchdog, "ANSWER_WAIT", 30.0)

    class Reading:  # the store, telling when gather has read rank 2's answer
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def get(self, key: str) -> bytes:
            value = store.get(key)
            if key == "hpc/wd/ans/1/2":
                read.set()
            return value

    dog = watchdog.Watchdog(DistInfo(launcher="local", rank=0, world_size=3),
                            lambda t: store, 10.0, {})
    dog.progress.entered = 4
    dog.progress.op = "all_reduce"

    def answer() -> None:  # rank 2's watchdog answers the request
        while not store.check(["hpc/wd/req"]) or int(store.add("hpc/wd/req", 0)) < 1:
            time.sleep(0.01)
        store.set("hpc/wd/ans/1/2", json.dumps(_entry(4, 3, host="node3")))

    t = threading.Thread(target=answer)
    t.start()
    entries = dog.gather(Reading())
    t.join()
    assert read.is_set() and time.monotonic() - start < 30
    assert entries[1] == {"answered": False, "host": "elsewhere", "pid": 77, "entered": 3,
                          "completed": 3, "op": "all_reduce", "since": entries[1]["since"]}
    assert entries[2]["host"] == "node3" and entries[0]["answered"]
    assert report.culprits(entries) == [1]


def test_stop_waits_for_a_thread_inside_a_store_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A watchdog thread left inside a store call at interpreter exit dies by pthread_exit
    in C++ frames (std::terminate, SIGABRT after a clean run): stop() must join it."""
    dist = pytest.importorskip("torch.distributed")
    inner = dist.HashStore()
    in_call = threading.Event()

    class SlowStore:  # every add() of the thread's ticks takes 0.4 s
        slow = False

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def add(self, key: str, n: int) -> int:
            if self.slow:
                in_call.set()
                time.sleep(0.4)
            return int(inner.add(key, n))

    store = SlowStore()
    monkeypatch.setattr(watchdog, "POLL", 0.01)
    dog = watchdog.Watchdog(DistInfo(launcher="local", rank=1, world_size=2),
                            lambda t: store, 10.0, {})
    dog.start()
    try:
        store.slow = True
        assert in_call.wait(5)
    finally:
        t0 = time.monotonic()
        dog.stop()
    assert dog._thread is not None and not dog._thread.is_alive()
    assert time.monotonic() - t0 > 0.1  # it did wait for the call in progress


def test_a_rank_that_did_not_read_the_failure_gets_its_step_cancelled(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0 serves the store; rank 1 read the failure twice (its main thread raising,
    its watchdog thread on its next look), rank 2 (asleep in its own code, starved on a
    loaded host) not yet. Rank 0 waits for rank 2, not for a count of two reads (which
    once let it take the store away while rank 2 slept on, holding a bare srun's step
    until its time limit); when its wait ends, it cancels the step, naming rank 2. A
    rank that read it in time costs no cancel."""
    dist = pytest.importorskip("torch.distributed")
    scancel = tmp_path / "scancel"
    scancel.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "cancelled"}\n')
    scancel.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(watchdog, "EXIT_GRACE", 0.2)
    monkeypatch.setattr(watchdog, "POLL", 0.05)
    store = dist.HashStore()
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}

    def dog(rank: int) -> watchdog.Watchdog:
        return watchdog.Watchdog(DistInfo(launcher="srun", rank=rank, world_size=3),
                                 lambda t: store, 10.0, slurm)

    dog(1)._ack(store)
    dog(1)._ack(store)
    with caplog.at_level(logging.ERROR, logger=watchdog.__name__):
        dog(0).finish()
    assert (tmp_path / "cancelled").read_text() == "7.0\n"
    assert "cancelling Slurm step 7.0: rank(s) 2 did not read the job's failure" in caplog.text
    dog(2)._ack(store)
    (tmp_path / "cancelled").unlink()
    dog(0).finish()
    assert not (tmp_path / "cancelled").exists()
