"""The trackers a run can report to: TensorBoard, Weights & Biases, MLflow.

Each sink opens the run's one tracker run (by :func:`hpc.run_id`), takes points
``(step, {name: value})`` and closes. Each also says, when it opens, through which step
the tracker already holds points (``held_through``), which is how
:class:`~hpc.track.tracker.Trackers` keeps one point per step after a resume:

* **TensorBoard** writes event files into one directory per run id and opens its writer
  with ``purge_step`` = the resumed step + 1, TensorBoard's own rule for a restarted job:
  its readers drop the earlier attempt's points from that step on, and the resumed
  attempt's replace them. It holds nothing to skip.
* **MLflow** finds the run tagged ``hpc.run_id`` in the experiment (or creates it) and
  reports the highest step of its metric histories: MLflow keeps every value it is
  given, so those steps are not sent again.
* **W&B** opens ``wandb.init(id=run_id, resume="allow")`` in the run directory and keeps
  its own mark of the last step it handed to wandb (``wandb/hpc-step-<id>``), since an
  offline run cannot be asked: steps up to the mark are not sent again.

Each package is imported only when its sink opens; a missing one raises
:class:`TrackerUnavailable` naming the extra to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from hpc.errors import HPCError
from hpc.track.runid import write_text_atomic

__all__ = ["TensorBoardSink", "WandbSink", "MlflowSink", "TrackerUnavailable", "Point",
           "installed", "require"]

logger = logging.getLogger(__name__)

#: One logged step: ``(step, {name: value})``.
Point = tuple[int, dict[str, float]]


class TrackerUnavailable(HPCError):
    """A tracker was asked for but its package is not installed."""


# Each tracker's name is its package, its extra (``torch-hpc[name]``) and its flag
# (``--name``): the rule lives here once.
def _unavailable(tracker: str, cause: object) -> TrackerUnavailable:
    return TrackerUnavailable(
        f"--{tracker} needs the {tracker!r} package, which is not installed ({cause}).\n"
        f"HINT: pip install 'torch-hpc[{tracker}]', or drop --{tracker}.")


def installed(tracker: str) -> bool:
    """Whether ``tracker``'s package is importable (found, not imported)."""
    return importlib.util.find_spec(tracker) is not None


def require(tracker: str) -> None:
    """Raise :class:`TrackerUnavailable` unless ``tracker``'s package is installed."""
    if not installed(tracker):
        raise _unavailable(tracker, f"no module named {tracker!r}")


def _need(tracker: str, module: Optional[str] = None) -> Any:
    """Import ``module`` (default: the tracker's package) when its sink opens."""
    try:
        return importlib.import_module(module or tracker)
    except ImportError as e:
        raise _unavailable(tracker, e) from e


class TensorBoardSink:
    """Event files in ``<directory>/<run_id>/``, one directory per run."""

    name = "tensorboard"

    def __init__(self, directory: Path, run_id: str, resume_step: Optional[int]) -> None:
        _need("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(directory) / run_id
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(str(self.log_dir), purge_step=purge, flush_secs=30)
        self.held_through: Optional[int] = None

    def send(self, points: Sequence[Point]) -> None:
        for step, values in points:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run with id ``run_id``, resumed by every attempt.

    wandb logs through a service process of its own, and a Slurm preemption's SIGTERM
    reaches every process of the step: the service shuts down at once, long before the
    ranks' agreed stop, and what it had not yet written is lost (measured: all of the
    attempt's points, with wandb 0.31 offline). A send that finds it gone reopens the run
    (a new service, the same id) once and sends again every point the dead service was
    given (the newest :data:`RESEND` of them), so no point is lost.
    """

    #: Points kept for a resend after the service died (older ones are on disk: the
    #: service writes its log in 32 KiB blocks as they fill).
    RESEND = 100_000

    name = "wandb"

    def __init__(self, project: str, directory: Path, run_id: str,
                 config: dict[str, Any]) -> None:
        self._wandb = _need("wandb")
        directory.mkdir(parents=True, exist_ok=True)
        self._init = dict(project=project, id=run_id, name=run_id, resume="allow",
                          dir=str(directory), config=config)
        self.run = self._wandb.init(**self._init)
        self._given: deque[Point] = deque(maxlen=self.RESEND)  # to this service
        self.mark = directory / "wandb" / f"hpc-step-{run_id}"
        self.held_through = int(self.mark.read_text()) if self.mark.is_file() else None

    def _recover(self, error: BaseException, unsent: Sequence[Point]) -> None:
        """The service died: reopen the run, then send what it was given and ``unsent``."""
        self._reopen(error)
        lost = [*self._given, *unsent]
        self._given.clear()
        for point in lost:
            self._give(point)

    def _reopen(self, error: BaseException) -> None:
        logger.warning("wandb's service is gone (%s: %s; a preemption's SIGTERM reaches "
                       "every process of the step): reopening run %s", type(error).__name__,
                       error, self._init["id"])
        try:
            self._wandb.teardown()
        except Exception:  # noqa: BLE001 - the broken connection says so again
            pass
        self.run = self._wandb.init(**self._init)

    def _give(self, point: Point) -> None:
        """Hand one point to the service, and keep it for a resend."""
        self.run.log(point[1], step=point[0])
        self._given.append(point)

    def send(self, points: Sequence[Point]) -> None:
        for i, point in enumerate(points):
            try:
                self._give(point)
            except OSError as e:  # ConnectionResetError, BrokenPipeError: the service died
                self._recover(e, points[i:])
                break
        if points:
            write_text_atomic(self.mark, f"{points[-1][0]}\n")

    def close(self, status: str) -> None:
        """Finish the run, then end wandb's service: ``finish`` returns before the
        service has written the run's last records (seen under load), and an attempt
        that exits for a requeue must leave them on disk."""
        code = 0 if status in ("completed", "stopped") else 1
        try:
            self.run.finish(exit_code=code)
        except OSError as e:  # the service died since the last send: its points with it
            self._recover(e, [])
            self.run.finish(exit_code=code)
        self._wandb.teardown()


class MlflowSink:
    """The MLflow run tagged ``hpc.run_id=<run_id>`` in ``experiment`` (created once).

    The tracking store is MLflow's own setting (``MLFLOW_TRACKING_URI``)."""

    name = "mlflow"
    TAG = "hpc.run_id"

    def __init__(self, experiment: str, run_id: str, params: dict[str, Any]) -> None:
        tracking = _need("mlflow", "mlflow.tracking")
        self.client = client = tracking.MlflowClient()
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
        found = client.search_runs([exp_id], filter_string=f"tags.`{self.TAG}` = '{run_id}'",
                                   max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            keys = found[0].data.metrics
            steps = [m.step for k in keys for m in client.get_metric_history(self.run_id, k)]
            self.held_through = max(steps) if steps else None
            client.update_run(self.run_id, status="RUNNING")
        else:
            run = client.create_run(exp_id, run_name=run_id, tags={self.TAG: run_id})
            self.run_id, self.held_through = run.info.run_id, None
            client.log_batch(self.run_id, params=[
                _param(k, v) for k, v in sorted(params.items())][:100])

    def send(self, points: Sequence[Point]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for step, values in points
                   for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, status: str) -> None:
        # "stopped" is a preemption: the next attempt sets the run RUNNING again.
        final = {"completed": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, status=final)


def _param(key: str, value: Any) -> Any:
    from mlflow.entities import Param

    return Param(key, str(value)[:500])
