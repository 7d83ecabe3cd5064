"""The pretraining configuration: one dataclass shared by the API, the CLI and checkpoints.

Torch-free on purpose: ``hpc --help`` builds the ``pretrain`` parser from these defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

__all__ = ["PretrainConfig", "EXACTNESS_FIELDS", "SPACE_FIELDS", "SAMPLINGS", "OPS",
           "check_ops"]

#: The sampling recipes (:mod:`hpc.pretrain.sampling`).
SAMPLINGS = ("uniform", "sandwich")

#: The candidate operations the default supernet knows (:class:`~hpc.pretrain.space.Supernet`).
OPS = ("conv3x3", "conv5x5", "sepconv3x3", "identity")

#: Fields that must not change between a run and its resume for the resume to be exact.
EXACTNESS_FIELDS = ("seed", "epochs", "batch_size", "lr", "optimizer", "momentum",
                    "weight_decay", "label_smoothing", "data", "val_fraction",
                    "sampling", "distill", "distill_temperature", "distill_weight")

#: Fields that define the supernet itself: a checkpoint's weights belong to one value.
SPACE_FIELDS = ("width", "ops")


def ops_problem(ops: Sequence[str]) -> Optional[str]:
    """What is wrong with ``ops`` (unknown or repeated names, none), or None."""
    ops = tuple(ops)
    unknown = [n for n in ops if n not in OPS]
    repeated = sorted({n for n in ops if ops.count(n) > 1})
    if not ops:
        return "no operation"
    if unknown:
        return f"unknown: {', '.join(unknown)}"
    return f"repeated: {', '.join(repeated)}" if repeated else None


def check_ops(ops: Sequence[str]) -> tuple[str, ...]:
    """``ops`` as a tuple; ``ValueError`` unless each is one of :data:`OPS`, once."""
    problem = ops_problem(ops)
    if problem is not None:
        raise ValueError(f"supernet ops {list(ops)} are not distinct names of known "
                         f"operations ({problem}).\n"
                         f"HINT: choose each at most once from {', '.join(OPS)}.")
    return tuple(ops)


@dataclasses.dataclass
class PretrainConfig:
    """Everything that defines a pretraining run.

    Attributes:
        epochs: Passes over the training split.
        batch_size: Samples per rank per step (the global batch is ``batch_size * world``,
            or ``batch_size * virtual_ranks``).
        lr: Peak learning rate; cosine-annealed to 0 over all steps, per step.
        optimizer: ``sgd`` (Nesterov momentum) or ``adamw``.
        momentum: SGD momentum.
        weight_decay: Weight decay of either optimizer.
        label_smoothing: Cross-entropy label smoothing.
        seed: Seeds the initial weights, the train/val split, the sampler's shuffle and
            every architecture draw (from ``(seed, rank, step)``).
        data: ``None`` for scikit-learn's digits, or an ``.npz``/``.pt`` file (see
            :func:`hpc.pretrain.data.load_file`).
        val_fraction: Share of digits held out for validation (ignored for ``data``).
        width: Channels of the default supernet.
        ops: The default supernet's candidate operations of every block, comma-separated,
            from :data:`OPS` (default all four: 256 sub-networks). Without ``identity``
            the smallest sub-network has a convolution in every block (81 with three).
            Like ``width`` it defines the supernet: a resume with other ops or another
            width is refused.
        val_archs: Sub-networks evaluated at each epoch end (the same on every rank).
        recal_samples: Training images (over all ranks) used to recalibrate each
            validated sub-network's BatchNorm statistics; 0 evaluates with the shared
            statistics (see :mod:`hpc.pretrain.evaluate`).
        val_every: Validate every N epochs (the last epoch always validates); 0 = only
            at the end.
        out: Run directory, written by the global master only; ``None`` writes nothing
            (no checkpoints, no metrics) — handy for benchmarks.
        resume: ``auto`` resumes when ``out`` holds checkpoints, ``never`` starts over
            (refusing a run directory that holds checkpoints), or the path of a
            checkpoint file or directory to resume from.
        ckpt_every: Also checkpoint every N steps (0 = only at epoch ends and at stops).
        keep: How many checkpoints to keep (the newest).
        ckpt_async: Write the checkpoints taken while training goes on (every
            ``ckpt_every`` steps, at epoch ends) in a writer process
            (``save_checkpoint(blocking=False)``); the stop's and the last one are
            written before the run returns.
        ckpt_sharded: Save each checkpoint as ``ckpt-<step>.dcp/`` in PyTorch's
            distributed-checkpoint layout, every rank writing its share (synchronous;
            it takes precedence over ``ckpt_async``).
        elastic: Allow resuming with a different world size: weights, optimizer and
            schedule continue, the epoch resumes near the same sample count, RNG
            streams are reseeded. Not exact; without it such a resume is refused.
        sampling: Which sub-network each rank trains each step: ``uniform`` (each its own
            random draw) or ``sandwich`` (the largest and the smallest beside random
            ones, four positions rotating over the ranks and steps); see
            :mod:`hpc.pretrain.sampling`.
        distill: In-place distillation: ranks that do not train the largest sub-network
            learn from its soft labels on their own batch. Needs ``sampling="sandwich"``
            (the teacher must be trained every step); refused otherwise.
        distill_temperature: Softmax temperature of the distillation.
        distill_weight: Share of the distillation loss (1 = teacher only, 0 = labels only).
        virtual_ranks: Train as this many ranks would, whatever the number of processes:
            each step has ``virtual_ranks`` sub-networks on ``virtual_ranks`` batches of
            ``batch_size``, each process running ``virtual_ranks / world`` of them one after
            the other and summing their gradients before the sync. ``None``: one per process
            (the world size). Must be a multiple of the world size. The same value on 1 or
            2 processes gives bitwise the same run, and a run resumes exactly on any
            process count that divides it (see :mod:`hpc.pretrain.learn`).
        max_steps: Stop (with a checkpoint) once this global step is reached, even
            mid-epoch; ``None`` = run all epochs. The schedule still spans ``epochs``.
        progress: Show a tqdm bar on local masters.
        overlap: Send each step's gradients while backward still runs
            (:meth:`hpc.GradSync.backward`) instead of after it (``sync``); the same
            bits either way.
        check_sync: Debug: after every step all-gather a digest of parameters and
            buffers and raise :class:`~hpc.ModelMismatchError` when ranks differ.
        setup_logging: Call :func:`hpc.setup_logging` with the run directory's log file.
        tensorboard: Write TensorBoard event files into ``out/tensorboard/<run id>``;
            ``None`` (default): when the ``tensorboard`` package is installed.
        wandb: Report to this W&B project (one W&B run per :func:`hpc.run_id`, resumed
            by every attempt); ``None``: no W&B.
        mlflow: Report to this MLflow experiment (``MLFLOW_TRACKING_URI`` says where);
            ``None``: no MLflow.
        deterministic: cuDNN uses deterministic algorithms and no autotuning
            (``torch.backends.cudnn.deterministic = True``, ``benchmark = False``), so
            a resumed GPU run repeats the bits of an uninterrupted one. The cost is
            cuDNN's autotuned speed-up for the convolutions (not measured here: no GPU);
            ``--no-deterministic`` lets cuDNN autotune. No effect on CPU.
    """

    epochs: int = 15
    batch_size: int = 32
    lr: float = 0.1
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 5e-4
    label_smoothing: float = 0.0
    seed: int = 0
    data: Optional[str] = None
    val_fraction: float = 0.2
    width: int = 32
    ops: str = ",".join(OPS)
    val_archs: int = 4
    val_every: int = 1
    recal_samples: int = 512
    out: Optional[str] = "runs/pretrain"
    resume: str = "auto"
    ckpt_every: int = 0
    keep: int = 3
    ckpt_async: bool = False
    ckpt_sharded: bool = False
    elastic: bool = False
    sampling: str = "uniform"
    distill: bool = False
    distill_temperature: float = 1.0
    distill_weight: float = 1.0
    virtual_ranks: Optional[int] = None
    max_steps: Optional[int] = None
    progress: bool = True
    overlap: bool = False
    check_sync: bool = False
    setup_logging: bool = True
    tensorboard: Optional[bool] = None
    wandb: Optional[str] = None
    mlflow: Optional[str] = None
    deterministic: bool = True

    def validate(self) -> None:
        """Raise ``ValueError`` (house format) on an impossible value."""
        problems = []
        for name in ("epochs", "batch_size", "keep", "val_archs", "width"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} (must be >= 1)")
        for name in ("ckpt_every", "val_every", "recal_samples"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} (must be >= 0)")
        if self.lr <= 0:
            problems.append(f"lr={self.lr} (must be > 0)")
        if self.optimizer not in ("sgd", "adamw"):
            problems.append(f"optimizer={self.optimizer!r} (valid: 'sgd', 'adamw')")
        if not 0.0 < self.val_fraction < 1.0:
            problems.append(f"val_fraction={self.val_fraction} (must be in (0, 1))")
        problem = ops_problem(self.op_names())
        if problem is not None:
            problems.append(f"ops={self.ops!r} ({problem}; comma-separated, each once, "
                            f"from {', '.join(OPS)})")
        if self.sampling not in SAMPLINGS:
            problems.append(f"sampling={self.sampling!r} (valid: {', '.join(SAMPLINGS)})")
        if self.distill_temperature <= 0:
            problems.append(f"distill_temperature={self.distill_temperature} (must be > 0)")
        if not 0.0 <= self.distill_weight <= 1.0:
            problems.append(f"distill_weight={self.distill_weight} (must be in [0, 1])")
        if self.distill and self.sampling != "sandwich":
            # Under uniform sampling the largest sub-network (the teacher) is almost never
            # trained: every rank would copy an untrained teacher (a helper's run: val
            # accuracy at chance for all 10 epochs).
            problems.append(f"distill=True with sampling={self.sampling!r} (distillation "
                            "needs sampling='sandwich': only then is the teacher, the "
                            "largest sub-network, trained at every step)")
        if self.virtual_ranks is not None and self.virtual_ranks < 1:
            problems.append(f"virtual_ranks={self.virtual_ranks} (must be >= 1 or None)")
        if not self.distill:
            default = PretrainConfig.__dataclass_fields__
            for name in ("distill_temperature", "distill_weight"):
                if getattr(self, name) != default[name].default:
                    problems.append(f"{name}={getattr(self, name)} without distill (it "
                                    "only shapes the distillation loss: add --distill, or "
                                    "drop it)")
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"max_steps={self.max_steps} (must be >= 1 or None)")
        if self.resume != "auto" and self.resume != "never" and not Path(self.resume).exists():
            problems.append(f"resume={self.resume!r} (no such file or directory)")
        if problems:
            distill = any(p.startswith("distill=True") for p in problems)
            raise ValueError(
                "invalid pretrain configuration: " + "; ".join(problems) + ".\n"
                "HINT: change each value named above as its parenthesis says"
                + (" (for --distill: add --sampling sandwich)." if distill else "."))

    def __post_init__(self) -> None:
        # One spelling per space: "conv3x3, conv5x5," is "conv3x3,conv5x5" (config.json,
        # and the resume's comparison of the spaces).
        self.ops = ",".join(self.op_names())

    def op_names(self) -> tuple[str, ...]:
        """:attr:`ops` as a tuple of names."""
        return tuple(n.strip() for n in self.ops.split(",") if n.strip())

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (stored in ``config.json`` and in checkpoints)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "PretrainConfig":
        """Inverse of :meth:`to_dict`; unknown keys are ignored (older/newer runs)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})
