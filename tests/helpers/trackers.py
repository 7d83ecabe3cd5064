"""Read back what each tracker holds, with the trackers' own readers where they have one.

* TensorBoard: ``EventAccumulator``, the reader TensorBoard's UI uses (it applies
  ``purge_step``);
* MLflow: ``MlflowClient.get_metric_history``;
* W&B offline: the ``run-<id>.wandb`` files, read as the W&B CLI's ``sync`` reads them.
  wandb ships no Python reader any more (its core is a Go binary), so :func:`wandb_history`
  parses the file's documented framing: a 7-byte header (``:W&B``, magic, version),
  then 32 KiB blocks of records, each ``crc32 (4) | length (2) | type (1) | data``
  (LevelDB's log format: full=1, first=2, middle=3, last=4), each record a
  ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.requires import in_ci

_BLOCK = 32768


def require_package(name: str) -> None:
    """Skip without the tracker package (fail under .ci/run, whose extras install it)."""
    if importlib.util.find_spec(name) is None:
        msg = f"{name} is not installed (pip install 'torch-hpc[track]')"
        if in_ci():
            pytest.fail(f"{msg}; .ci/run installs the test extras")
        pytest.skip(msg)


def tensorboard_steps(log_dir: Path, tag: str) -> list[int]:
    """Every step of ``tag``'s series in ``log_dir`` as TensorBoard shows it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def tensorboard_values(log_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


@contextlib.contextmanager
def _file_store_allowed() -> Any:
    """MLflow 3 refuses its file store unless ``MLFLOW_ALLOW_FILE_STORE`` is set (the
    runs under test had it in their environment; this process may not)."""
    old = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if old is None:
            del os.environ["MLFLOW_ALLOW_FILE_STORE"]
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = old


def mlflow_runs(experiment: str, tag_value: str, uri: str | None = None) -> list[Any]:
    from mlflow.tracking import MlflowClient

    with _file_store_allowed():
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name(experiment)
        assert exp is not None, f"no MLflow experiment {experiment!r}"
        return client.search_runs([exp.experiment_id],
                                  filter_string=f"tags.`hpc.run_id` = '{tag_value}'")


def mlflow_steps(run_id: str, key: str, uri: str | None = None) -> list[int]:
    from mlflow.tracking import MlflowClient

    with _file_store_allowed():
        return [m.step for m in MlflowClient(uri).get_metric_history(run_id, key)]


def _records(path: Path) -> Any:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left - 7
            continue
        buf += data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            yield buf
            buf = b""


def wandb_history(run_dir: Path) -> dict[str, Any]:
    """Every offline W&B run under ``run_dir/wandb``: ids, and each key's logged steps."""
    from wandb.proto import wandb_internal_pb2 as pb

    ids: set[str] = set()
    steps: dict[str, list[int]] = {}
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    for path in files:
        for data in _records(path):
            record = pb.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        steps.setdefault(key, []).append(record.history.step.num)
    return {"ids": ids, "files": len(files), "steps": steps}


def duplicates(steps: list[int]) -> list[int]:
    """Steps that appear more than once."""
    return sorted(s for s, n in Counter(steps).items() if n > 1)


#: Flags of a run that reports to every tracker (``hpc pretrain`` and the example).
TRACKER_ARGS = ["--wandb", "hpc-test", "--mlflow", "hpc-test"]


def tracker_env(tmp: Path) -> dict[str, str]:
    """Environment of a run with :data:`TRACKER_ARGS`: W&B offline (nothing leaves the
    machine), MLflow's file store in ``tmp/mlruns`` (MLflow 3 keeps it in maintenance
    mode: allowed explicitly)."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
            "MLFLOW_TRACKING_URI": (tmp / "mlruns").as_uri(),
            "MLFLOW_ALLOW_FILE_STORE": "true"}


def assert_one_tracked_run(run_dir: Path, tmp: Path, *, steps: int, attempts: int,
                           tag: str = "train/loss") -> str:
    """``run_dir``'s run has one id, and each tracker one run with one point per step
    ``1..steps`` of ``tag``, written by ``attempts`` attempts. Returns the id."""
    for name in ("tensorboard", "wandb", "mlflow"):
        require_package(name)
    rid = (run_dir / "run_id").read_text().strip()
    assert [p.name for p in (run_dir / "tensorboard").iterdir()] == [rid]
    tb = tensorboard_steps(run_dir / "tensorboard" / rid, tag)
    assert tb == list(range(1, steps + 1)), f"TensorBoard {tag}: {tb}"
    held = wandb_history(run_dir)
    # one offline file per attempt, and one more per reopened service (a preemption)
    assert held["ids"] == {rid} and held["files"] >= attempts, held
    assert sorted(held["steps"][tag]) == list(range(1, steps + 1)), \
        f"W&B {tag} duplicates {duplicates(held['steps'][tag])}: {held['steps'][tag]}"
    uri = (tmp / "mlruns").as_uri()
    runs = mlflow_runs("hpc-test", rid, uri)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", runs
    ml = mlflow_steps(runs[0].info.run_id, tag, uri)
    assert sorted(ml) == list(range(1, steps + 1)), f"MLflow {tag}: {sorted(ml)}"
    return rid
