"""What ``hpc search`` leaves for humans: ``search.json`` and ``pareto.png`` (master only).

``search.json`` holds ``best`` (``arch``, ``arch_name``, ``val_acc``, ``val_loss``,
``params``, ``latency_ms``), ``evaluated`` (every scored sub-network in evaluation
order, with its generation), the Pareto fronts (indices into ``evaluated``), the
settings and where the supernet came from. ``pareto.png`` plots accuracy against
parameters and against latency, draws each front and marks the best sub-network.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

from hpc.pretrain.runlog import write_json
from hpc.search.evolution import pareto_front

__all__ = ["DETERMINISTIC", "plot_pareto", "write_outputs"]

logger = logging.getLogger(__name__)

#: What the search guarantees, written into every ``search.json``.
DETERMINISTIC = ("arch choice, val_acc, val_loss, params and the evaluation order are "
                 "identical for any number of ranks with the same seed and settings "
                 "(without max_latency_ms); latency_ms varies between runs and, without "
                 "max_latency_ms, between the ranks that measured it")


def write_outputs(result: Any, cfg: Any, run: Any) -> None:
    """Write ``search.json`` and ``pareto.png`` into ``cfg.out_dir``."""
    out = Path(cfg.out_dir)
    records = result.records
    fronts = {
        "params": pareto_front([(r["params"], r["val_acc"]) for r in records]),
        "latency_ms": pareto_front([(r["latency_ms"], r["val_acc"]) for r in records]),
    }
    write_json(out / "search.json", {
        "status": result.status, "mode": result.mode, "best": result.best,
        "evaluated": records, "evaluations": len(records),
        "generations": result.generations, "space_size": result.space_size,
        "world_size": result.world_size, "wall_s": round(result.wall_s, 3),
        "pareto": fronts, "settings": cfg.to_dict(), "deterministic": DETERMINISTIC,
        "pretrain": {"run": str(Path(cfg.run).resolve()), "checkpoint": run.checkpoint,
                     "step": run.step}})
    plot_pareto(records, result.best, fronts, out / "pareto.png")


def plot_pareto(records: list[dict[str, Any]], best: Optional[dict[str, Any]],
                fronts: dict[str, list[int]], png_path: Path) -> Optional[Path]:
    """Accuracy against params and against latency, fronts drawn, best marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no pareto.png written. HINT: pip "
                       "install 'torch-hpc[pretrain]'")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "params", "parameters"),
                           (axes[1], "latency_ms", "latency (ms)")):
        xs = [r[key] for r in records]
        ys = [r["val_acc"] for r in records]
        ax.scatter(xs, ys, s=12, alpha=0.5, label="evaluated")
        front = fronts[key]
        ax.step([xs[i] for i in front], [ys[i] for i in front], where="post", color="C1",
                label="Pareto front")
        if best is not None:
            ax.scatter([best[key]], [best["val_acc"]], marker="*", s=200, color="C3",
                       label=f"best: {best['arch_name']}")
        ax.set(xlabel=label, ylabel="val accuracy")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=7)
    fig.suptitle(f"{len(records)} sub-networks")
    fig.tight_layout()
    tmp = png_path.with_name(f".{png_path.stem}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)
    return png_path
