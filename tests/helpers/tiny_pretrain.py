"""The tiny ``hpc pretrain`` run every requeue test makes, and the checks that a run which
was stopped and resumed ended as its uninterrupted reference did.

Every run is 4 ranks (2 nodes x 2 tasks), 2 epochs x 11 steps, a checkpoint every 3 steps;
:data:`TINY` (for :class:`hpc.pretrain.PretrainConfig`) and :data:`TINY_ARGS` (for the
command line) are the same configuration. torch is imported by the checks that need it.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

STEPS = 22  # 2 epochs x (1437 // (4 ranks x 32)) steps
TINY = dict(epochs=2, batch_size=32, width=8, val_archs=2, recal_samples=64, ckpt_every=3,
            progress=False)
TINY_ARGS = ["--epochs", "2", "--batch-size", "32", "--width", "8", "--val-archs", "2",
             "--recal-samples", "64", "--ckpt-every", "3", "--no-progress"]
# The same in every run: the reference must match bitwise. HPC_ALLOW_CPU: submit() jobs
# ask for the test cluster's fake GPUs and train with the CPU torch on purpose.
ENV = {"OMP_NUM_THREADS": "1", "HPC_ALLOW_CPU": "1"}


def train_steps(run_dir: Path) -> list[int]:
    """The train steps metrics.csv holds, in file order."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r["split"] == "train"]


def final_state(run_dir: Path) -> dict[str, Any]:
    """The newest checkpoint of ``run_dir``, loaded on the CPU."""
    import torch

    newest = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1]
    return torch.load(newest, map_location="cpu", weights_only=True)


def assert_same_final_weights(run_dir: Path, reference: Path) -> None:
    """Both runs ended at :data:`STEPS` with bitwise equal weights, optimizer state and
    validation accuracies."""
    import torch

    a, b = final_state(run_dir), final_state(reference)
    assert a["step"] == b["step"] == STEPS
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"weight {k} differs"
    for k, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][k][name]), f"optimizer {k}.{name}"
    assert a["val_acc"] == b["val_acc"]


def assert_each_step_once(run_dir: Path) -> None:
    """metrics.csv holds every train step exactly once, in order."""
    steps = train_steps(run_dir)
    assert steps == list(range(1, STEPS + 1)), f"duplicates or gaps: {steps}"
