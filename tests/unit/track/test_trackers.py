"""The trackers with the real packages: one run per id, one point per step after a resume.

Each test plays two attempts of one run in one directory: the first logs steps 1-10 and
stops (as a crash after a checkpoint at step 6 leaves it), the second resumes from step 6
and logs 7-14, as the replayed steps of a real resume are. What each tracker then holds
is read back with its own reader (tests/helpers/trackers.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.track import runid
from hpc.track.sinks import TrackerUnavailable
from hpc.track.tracker import check_available, open_trackers, points_from_rows, wanted
from tests.helpers import trackers as read


def _rows(steps: range, shift: float = 0.0) -> list[dict]:
    return [{"step": s, "epoch": 1, "split": "train", "loss": 1.0 / s + shift, "acc": 0.5,
             "lr": 0.1, "samples": 64, "elapsed_s": 0.1} for s in steps]


def _two_attempts(run_dir: Path, **which: object) -> str:
    """The run's id, after two attempts of it in ``run_dir``."""
    first = open_trackers(run_dir, config={"lr": 0.1}, **which)
    assert len(first.sinks) == 1
    first.send_rows(_rows(range(1, 11)))
    first.close("failed")
    runid._current = None  # the next attempt is a new process
    second = open_trackers(run_dir, resume_step=6, config={"lr": 0.1}, **which)
    assert len(second.sinks) == 1 and second.run_id == first.run_id
    second.send_rows(_rows(range(7, 15), shift=1.0))
    second.close("completed")
    return first.run_id


def test_rows_become_split_prefixed_curves_without_counters() -> None:
    assert points_from_rows(_rows(range(2, 3))) == [
        (2, {"train/loss": 0.5, "train/acc": 0.5, "train/lr": 0.1})]
    assert points_from_rows([{"step": 3, "split": "val", "acc_best": 0.9, "loss": None}]) \
        == [(3, {"val/acc_best": 0.9})]


def test_tensorboard_replaces_the_replayed_steps_one_point_per_step(tmp_path: Path) -> None:
    read.require_package("tensorboard")
    rid = _two_attempts(tmp_path, tensorboard=True, wandb=None, mlflow=None)
    log_dir = tmp_path / "tensorboard" / rid
    assert read.tensorboard_steps(log_dir, "train/loss") == list(range(1, 15))
    values = read.tensorboard_values(log_dir, "train/loss")
    assert values[6] == pytest.approx(1 / 6) and values[7] == pytest.approx(1 / 7 + 1)


def test_mlflow_keeps_one_run_and_does_not_take_a_step_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read.require_package("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    rid = _two_attempts(tmp_path, tensorboard=False, wandb=None, mlflow="exp")
    runs = read.mlflow_runs("exp", rid)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    steps = read.mlflow_steps(runs[0].info.run_id, "train/loss")
    assert sorted(steps) == list(range(1, 15)), steps


def test_wandb_offline_resumes_the_same_id_without_a_step_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read.require_package("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rid = _two_attempts(tmp_path, tensorboard=False, wandb="proj", mlflow=None)
    held = read.wandb_history(tmp_path)
    assert held["ids"] == {rid} and held["files"] == 2
    assert sorted(held["steps"]["train/loss"]) == list(range(1, 15)), held["steps"]


def test_a_tracker_asked_for_but_not_installed_names_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(TrackerUnavailable, match=r"(?s)--wandb needs the 'wandb' package.*"
                       r"HINT: pip install 'torch-hpc\[wandb\]'"):
        check_available(None, "proj", None)
    check_available(None, None, None)  # nothing asked, nothing checked


def test_tensorboard_is_on_by_default_only_when_installed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert wanted(None, None, "e") == ["mlflow"]
    assert wanted(True, "p", None) == ["tensorboard", "wandb"]


def test_a_failing_tracker_is_dropped_and_the_others_go_on(tmp_path: Path) -> None:
    read.require_package("tensorboard")
    trackers = open_trackers(tmp_path, tensorboard=True)
    tb = trackers.sinks[0]
    tb.writer.close()
    tb.writer.add_scalar = None  # a sink whose send raises (TypeError)
    trackers.send_rows(_rows(range(1, 3)))
    assert trackers.sinks == []
    trackers.log(3, {"train/loss": 0.1})  # nothing left to send to: a no-op


def test_log_sends_one_point_and_a_resumed_run_keeps_its_id(tmp_path: Path) -> None:
    read.require_package("tensorboard")
    first = open_trackers(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        first.log(step, {"loss": 1.0 / step})
    first.close("stopped")
    runid._current = None
    fresh = open_trackers(tmp_path, new=True, tensorboard=True)  # --no-resume: a new run
    assert fresh.run_id != first.run_id
    fresh.close()
    assert read.tensorboard_steps(tmp_path / "tensorboard" / first.run_id, "loss") == \
        [1, 2, 3]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runid, "_current", None)


def test_wandb_reopens_its_run_when_a_sigterm_ended_its_service(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Slurm preemption's SIGTERM reaches wandb's service process too (found on the
    test cluster: the attempt's last points were lost). The real service is SIGTERMed
    here; the next send reopens the run and no step is lost or doubled."""
    import os
    import signal
    import subprocess
    import time

    read.require_package("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = open_trackers(tmp_path, tensorboard=False, wandb="proj")
    trackers.send_rows(_rows(range(1, 4)))
    services = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "wandb-core"],
                              capture_output=True, text=True, timeout=10).stdout.split()
    assert services, "wandb's service process was not found"
    for pid in services:
        os.kill(int(pid), signal.SIGTERM)
    time.sleep(1)
    trackers.send_rows(_rows(range(4, 7)))
    assert [s.name for s in trackers.sinks] == ["wandb"]  # not dropped
    trackers.close("completed")
    held = read.wandb_history(tmp_path)
    assert held["ids"] == {trackers.run_id} and held["files"] == 2
    assert sorted(held["steps"]["train/loss"]) == list(range(1, 7)), held["steps"]


def test_wandb_resends_at_close_what_a_dead_service_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's case on the cluster: the points were given to the service, then the
    SIGTERM ended it, and the next call was the stop's close (steps 1-22 were lost)."""
    import os
    import signal
    import subprocess
    import time

    read.require_package("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = open_trackers(tmp_path, tensorboard=False, wandb="proj")
    for step in range(1, 5):
        trackers.log(step, {"loss": 1.0 / step})
    for pid in subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "wandb-core"],
                              capture_output=True, text=True, timeout=10).stdout.split():
        os.kill(int(pid), signal.SIGTERM)
    time.sleep(1)
    trackers.close("stopped")
    held = read.wandb_history(tmp_path)
    assert sorted(held["steps"]["loss"]) == [1, 2, 3, 4], held
