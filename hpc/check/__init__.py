"""``hpc check``: a health check of the allocation (compute, GPUs, links between nodes).

``measure.py`` times (torch), ``runner.py`` runs the phases on every rank, ``verdict.py``
is the outlier rule (pure), ``report.py`` the table, JSON and PNG, ``cli.py`` the command.
Importing this package imports no torch.
"""

from __future__ import annotations

from hpc.check.verdict import (
    Figure,
    Finding,
    Thresholds,
    algbw,
    busbw,
    judge_compute,
    judge_gpus,
    judge_network,
    judge_pairs,
    round_robin,
    verdict_line,
)

__all__ = ["Figure", "Finding", "Thresholds", "algbw", "busbw", "judge_compute",
           "judge_gpus", "judge_network", "judge_pairs", "round_robin", "verdict_line"]
