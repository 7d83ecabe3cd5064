"""The run directory's human-facing files, written by the global master only.

``metrics.csv`` holds one ``train`` row per global step and one ``val`` row per
validation, both keyed by ``step``. Rows are appended in chunks when the loop flushes
(before every checkpoint, at epoch ends and at the end), and on resume from step ``S``
every row with ``step > S`` is dropped first, so after any sequence of crashes and
resumes each step appears exactly once. The same rows go to the run's trackers
(:mod:`hpc.track`) when they reach the file.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["MetricsWriter", "COLUMNS", "write_json", "plot_metrics", "read_metrics"]

logger = logging.getLogger(__name__)

#: Columns of ``metrics.csv``. ``acc_best``/``acc_mean`` are over the validated
#: sub-networks; train rows leave them empty (and val rows leave ``lr`` empty).
COLUMNS = ("step", "epoch", "split", "loss", "acc", "acc_best", "acc_mean", "lr",
           "samples", "elapsed_s")


def write_json(path: Union[str, Path], data: Any) -> None:
    """Write ``data`` as indented JSON through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def read_metrics(path: Union[str, Path]) -> list[dict[str, str]]:
    """Rows of a ``metrics.csv`` as dicts of strings (empty list when absent)."""
    path = Path(path)
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class MetricsWriter:
    """Append-only ``metrics.csv`` that tolerates resumes.

    Args:
        path: The CSV file.
        resume_step: When resuming from a checkpoint taken after this step, rows with a
            larger step (written after that checkpoint by the interrupted run) are
            dropped before appending. ``None`` starts a fresh file.
        trackers: Where the rows also go at each :meth:`flush`
            (:class:`hpc.track.tracker.Trackers`); :meth:`close` closes them.
    """

    def __init__(self, path: Union[str, Path], resume_step: Optional[int] = None,
                 trackers: Optional[Any] = None) -> None:
        self.path = Path(path)
        self.trackers = trackers
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._pending: list[dict[str, Any]] = []
        kept: list[dict[str, Any]] = []
        if resume_step is not None:
            rows = read_metrics(self.path)
            kept = [r for r in rows if r.get("step", "").isdigit()
                    and int(r["step"]) <= resume_step]
            if len(rows) > len(kept):
                logger.info("metrics.csv: dropped %d rows after step %d (written after the "
                            "checkpoint resumed from)", len(rows) - len(kept), resume_step)
        self._rewrite(kept)

    def _rewrite(self, rows: Sequence[dict[str, Any]]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        """Queue rows; they reach the file at the next :meth:`flush`."""
        self._pending.extend(rows)

    def flush(self) -> None:
        """Append the queued rows and fsync, so a following checkpoint never outruns them;
        then send them to the trackers."""
        if not self._pending:
            return
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writerows(_fmt(r) for r in self._pending)
            f.flush()
            os.fsync(f.fileno())
        if self.trackers is not None:
            self.trackers.send_rows(self._pending)
        self._pending.clear()

    def close(self, status: str) -> None:
        """Flush, then close the trackers (``status``: completed, stopped or failed)."""
        self.flush()
        if self.trackers is not None:
            self.trackers.close(status)
            self.trackers = None


def _fmt(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()}


def plot_metrics(csv_path: Union[str, Path], png_path: Union[str, Path]) -> Optional[Path]:
    """Plot train loss per step and validation accuracy per epoch into ``png_path``.

    Uses matplotlib's Agg backend, imported here (not at import time). Returns ``None``
    and logs a warning when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written. HINT: pip install "
                       "'torch-hpc[pretrain]'")
        return None
    rows = read_metrics(csv_path)
    train = [(int(r["step"]), float(r["loss"]), float(r["acc"]))
             for r in rows if r["split"] == "train"]
    val = [(int(r["step"]), float(r["acc_best"]), float(r["acc_mean"]))
           for r in rows if r["split"] == "val"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    if train:
        steps, losses, accs = zip(*train)
        ax_loss.plot(steps, losses, lw=0.8, label="train loss (sampled sub-nets)")
        ax_acc.plot(steps, accs, lw=0.5, alpha=0.5, label="train acc")
    if val:
        steps, best, mean = zip(*val)
        ax_acc.plot(steps, best, "o-", label="val acc, best sub-net")
        ax_acc.plot(steps, mean, "s--", label="val acc, mean of sub-nets")
    ax_loss.set(xlabel="step", ylabel="loss", title="training loss")
    ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1), title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    png_path = Path(png_path)
    tmp = png_path.with_name(f".{png_path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)
    return png_path
