"""A run's trackers on the global master, and the one-point-per-step rule.

:func:`open_trackers` (``hpc.open_trackers``, for any script; :func:`for_stage` for
``hpc pretrain``, ``search`` and ``tune``) settles the run's id on every rank and opens
the sinks asked for (:mod:`hpc.track.sinks`) on the master. :class:`Trackers` sends
points, dropping for each sink the steps it already holds (its ``held_through``, read
when it opened). The stages send their rows when ``metrics.csv`` gets them (before every
checkpoint, at epoch ends, at the end), so an attempt that resumes from step ``s``
replays at most the steps between ``s`` and the last flush, and those are the steps the
rule drops.

A sink that fails while the run goes on is reported once and dropped: a tracker never
stops the training.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from hpc.track.runid import establish
from hpc.track.sinks import MlflowSink, Point, TensorBoardSink, WandbSink, installed, require

__all__ = ["Trackers", "open_trackers", "for_stage", "points_from_rows", "check_available",
           "wanted"]

logger = logging.getLogger(__name__)

#: Row columns that are positions or counters, not curves.
_NOT_CURVES = ("step", "epoch", "split", "samples", "elapsed_s")


def points_from_rows(rows: Iterable[dict[str, Any]]) -> list[Point]:
    """Metric rows (``metrics.csv``'s) as points: ``<split>/<column>`` per number."""
    points: list[Point] = []
    for row in rows:
        values = {f"{row.get('split', 'train')}/{k}": float(v) for k, v in row.items()
                  if k not in _NOT_CURVES and isinstance(v, (int, float))
                  and not isinstance(v, bool)}
        if values:
            points.append((int(row["step"]), values))
    return points


def wanted(tensorboard: Optional[bool], wandb: Optional[str],
           mlflow: Optional[str]) -> list[str]:
    """The sinks a stage's settings ask for: TensorBoard when ``tensorboard`` is True,
    or ``None`` (auto) and the package is installed; W&B and MLflow when named."""
    names = []
    if tensorboard or (tensorboard is None and installed("tensorboard")):
        names.append("tensorboard")
    if wandb:
        names.append("wandb")
    if mlflow:
        names.append("mlflow")
    return names


def check_available(tensorboard: Optional[bool], wandb: Optional[str],
                    mlflow: Optional[str]) -> None:
    """Raise :class:`~hpc.track.sinks.TrackerUnavailable` on every rank when a tracker
    that was asked for is not installed (before any rank starts the run; nothing is
    imported)."""
    for tracker, asked in (("tensorboard", tensorboard), ("wandb", wandb),
                           ("mlflow", mlflow)):
        if asked:
            require(tracker)


class Trackers:
    """The run's open trackers (none on ranks other than the global master).

    Attributes:
        run_id: The run's :func:`hpc.run_id`, on every rank.
        sinks: The open sinks (empty off the master, or when none was asked for).
    """

    def __init__(self, run_id: str, sinks: Sequence[Any] = ()) -> None:
        self.run_id = run_id
        self.sinks = list(sinks)
        for sink in self.sinks:
            if sink.held_through is not None:
                logger.info("%s already holds steps up to %d of run %s: those are not "
                            "sent again", sink.name, sink.held_through, run_id)

    def log(self, step: int, values: dict[str, float]) -> None:
        """Send ``values`` (name -> number) as the point of ``step``; a no-op off the
        master, so every rank may call it."""
        self.send([(int(step), {k: float(v) for k, v in values.items()})])

    def send_rows(self, rows: Iterable[dict[str, Any]]) -> None:
        """Send metric rows (``metrics.csv``'s, see :func:`points_from_rows`)."""
        self.send(points_from_rows(rows))

    def send(self, points: Sequence[Point]) -> None:
        """Send ``points`` to every sink, without the steps it already holds."""
        for sink in list(self.sinks):
            held = sink.held_through
            fresh = [p for p in points if held is None or p[0] > held]
            if not fresh:
                continue
            try:
                sink.send(fresh)
            except Exception as e:  # noqa: BLE001 - a tracker never stops the training
                logger.warning("%s failed (%s: %s): the run goes on without it", sink.name,
                               type(e).__name__, e)
                self.sinks.remove(sink)

    def close(self, status: str = "completed") -> None:
        """Close every sink. ``status``: ``completed``, ``stopped`` (a preemption: the
        next attempt reopens the same run) or ``failed``."""
        for sink in self.sinks:
            try:
                sink.close(status)
            except Exception as e:  # noqa: BLE001
                logger.warning("%s did not close cleanly (%s: %s)", sink.name,
                               type(e).__name__, e)
        self.sinks = []


def _open_sinks(run_dir: Path, run_id: str, resume_step: Optional[int],
                tensorboard: Optional[bool], wandb: Optional[str], mlflow: Optional[str],
                config: dict[str, Any]) -> list[Any]:
    sinks: list[Any] = []
    for name in wanted(tensorboard, wandb, mlflow):
        try:
            if name == "tensorboard":
                sinks.append(TensorBoardSink(run_dir / "tensorboard", run_id, resume_step))
            elif name == "wandb":
                sinks.append(WandbSink(str(wandb), run_dir, run_id, config))
            else:
                sinks.append(MlflowSink(str(mlflow), run_id, config))
        except Exception as e:  # noqa: BLE001 - a tracker never stops the training
            logger.warning("%s could not open run %s (%s: %s): the run goes on without "
                           "it", name, run_id, type(e).__name__, e)
    if sinks:
        logger.info("run %s reports to %s", run_id, ", ".join(s.name for s in sinks))
    return sinks


def open_trackers(directory: Union[str, Path], *, restored: Optional[Any] = None,
                  resume_step: Optional[int] = None, new: bool = False,
                  tensorboard: Optional[bool] = None, wandb: Optional[str] = None,
                  mlflow: Optional[str] = None, config: Optional[dict[str, Any]] = None,
                  known_id: Optional[str] = None) -> Trackers:
    """Settle the run's id and open its trackers on the global master (collective).

    Call it on every rank after :func:`hpc.init_torch` and after restoring your
    checkpoint; log through the result on every rank (only the master sends).

    Args:
        directory: The run directory, shared by every node: ``run_id`` is kept there,
            TensorBoard writes ``tensorboard/<run id>/`` and W&B its ``wandb/`` folder.
        restored: What :func:`hpc.restore_checkpoint` returned (``None``: a fresh
            start): its step is the resume step and its run id (stored by
            :func:`hpc.save_checkpoint`) wins over the directory's.
        resume_step: The step your checkpoint resumed from, for checkpoints that are
            not hpc's (Lightning, Fabric); ``None`` on a fresh start.
        new: A fresh start is a new run (a new id) rather than the directory's run
            again; ignored when resuming.
        tensorboard: ``True``/``False``; ``None`` = when the package is installed.
        wandb: The W&B project, or ``None``.
        mlflow: The MLflow experiment (at ``MLFLOW_TRACKING_URI``), or ``None``.
        config: The run's settings (W&B config, MLflow params).
        known_id: The id a resumed checkpoint holds; it wins over the directory's.

    Raises:
        TrackerUnavailable: a tracker that was asked for is not installed (every rank).
    """
    check_available(tensorboard, wandb, mlflow)
    if restored is not None:
        resume_step = restored.step
        known_id = known_id or restored.run_id
    fresh = resume_step is None and known_id is None
    rid = establish(directory, new=new and fresh, known=known_id)
    from hpc.sync.agree import world

    if world(None)[0] != 0:
        return Trackers(rid)
    return Trackers(rid, _open_sinks(Path(directory), rid, resume_step, tensorboard, wandb,
                                     mlflow, config or {}))


def for_stage(run_dir: Path, settings: Any, *, resume_step: Optional[int],
              known_id: Optional[str], config: dict[str, Any]) -> Trackers:
    """:func:`open_trackers` for ``hpc pretrain``, ``search`` and ``tune``: their
    settings' ``tensorboard``, ``wandb``, ``mlflow``; ``resume="never"`` is a new run."""
    return open_trackers(run_dir, resume_step=resume_step, new=settings.resume == "never",
                         tensorboard=settings.tensorboard, wandb=settings.wandb,
                         mlflow=settings.mlflow, config=config, known_id=known_id)
