"""Settings of ``hpc search`` and ``hpc tune``: dataclasses shared by the API and the CLIs.

Torch-free on purpose: ``hpc --help`` builds both parsers from these defaults. As with
:class:`~hpc.pretrain.config.PretrainConfig`, each dataclass is the schema: the CLI flags
and the validation derive from its fields.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

__all__ = ["SEARCH_EXACTNESS_FIELDS", "SearchConfig", "TuneConfig"]

#: Search settings that must not change between a search and its resume.
SEARCH_EXACTNESS_FIELDS = ("run", "budget", "max_params", "max_latency_ms", "seed",
                           "population", "top_k", "mutation_prob", "recal_samples")


def _problems_to_error(what: str, problems: list[str], command: str) -> None:
    if problems:
        raise ValueError(f"invalid {what} configuration: " + "; ".join(problems) + ".\n"
                         "HINT: change each value named above as its parenthesis says.")


@dataclasses.dataclass
class SearchConfig:
    """Everything that defines an architecture search over a pretrained supernet.

    Attributes:
        run: The pretrain run directory (its newest loadable checkpoint is searched).
        budget: Sub-networks evaluated. A space with at most ``budget`` sub-networks is
            searched exhaustively; otherwise evolution evaluates exactly ``budget``.
        max_params: Keep only sub-networks with at most this many parameters (counted
            exactly on the standalone sub-network); ``None`` = no limit.
        max_latency_ms: Keep only sub-networks whose measured latency (median, rank 0's
            device) is at most this; ``None`` = no limit.
        seed: Seeds every evolutionary draw (a pure function of ``(seed, generation)``).
        population: Candidates per generation (also the checkpoint interval).
        top_k: Parents: the best ``top_k`` sub-networks evaluated so far.
        mutation_prob: Chance that mutation redraws each choice of a parent.
        recal_samples: Training images recalibrating each candidate's BatchNorm
            statistics (the same images for every candidate, on every rank).
        latency_batch: Batch size of the latency measurement.
        latency_repeats: Timed forward passes (the median is kept), after 3 warm-ups.
        out: Output directory (``search.json``, ``pareto.png``, checkpoints); default
            ``RUN/search``.
        resume: ``auto`` continues a search whose checkpoints are in ``out``, ``never``
            refuses such a directory.
        max_generations: Stop (with a checkpoint) after this generation; ``None`` = run
            to the end. For tests and time-boxed jobs.
        progress: Show a tqdm bar on local masters.
        tensorboard, wandb, mlflow: Trackers, as in
            :class:`~hpc.pretrain.config.PretrainConfig` (one point per generation).
    """

    run: str = "runs/pretrain"
    budget: int = 64
    max_params: Optional[int] = None
    max_latency_ms: Optional[float] = None
    seed: int = 0
    population: int = 16
    top_k: int = 5
    mutation_prob: float = 0.25
    recal_samples: int = 512
    latency_batch: int = 1
    latency_repeats: int = 10
    out: Optional[str] = None
    resume: str = "auto"
    max_generations: Optional[int] = None
    progress: bool = True
    tensorboard: Optional[bool] = None
    wandb: Optional[str] = None
    mlflow: Optional[str] = None

    @property
    def out_dir(self) -> Path:
        """``out``, or ``RUN/search`` when unset."""
        return Path(self.out) if self.out else Path(self.run) / "search"

    def validate(self) -> None:
        """Raise ``ValueError`` (house format) on an impossible value."""
        problems = [f"{n}={getattr(self, n)} (must be >= 1)"
                    for n in ("budget", "population", "top_k", "latency_batch",
                              "latency_repeats") if getattr(self, n) < 1]
        if self.recal_samples < 0:
            problems.append(f"recal_samples={self.recal_samples} (must be >= 0)")
        if not 0.0 <= self.mutation_prob <= 1.0:
            problems.append(f"mutation_prob={self.mutation_prob} (must be in [0, 1])")
        if self.max_params is not None and self.max_params < 1:
            problems.append(f"max_params={self.max_params} (must be >= 1 or unset)")
        if self.max_latency_ms is not None and self.max_latency_ms <= 0:
            problems.append(f"max_latency_ms={self.max_latency_ms} (must be > 0 or unset)")
        if self.max_generations is not None and self.max_generations < 1:
            problems.append(f"max_generations={self.max_generations} (must be >= 1)")
        if self.resume not in ("auto", "never"):
            problems.append(f"resume={self.resume!r} (valid: 'auto', 'never')")
        if not Path(self.run).is_dir():
            problems.append(f"run={self.run!r} (no such directory; pass the --out of "
                            "an hpc pretrain run)")
        _problems_to_error("search", problems, "search")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (stored in ``search.json`` and in checkpoints)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class TuneConfig:
    """Fine-tuning the searched sub-network as a plain model with DDP.

    Field names follow :class:`~hpc.pretrain.config.PretrainConfig` where they mean the
    same (the checkpoint and resume code of pretrain serves both).

    Attributes:
        search: The ``hpc search`` output directory (its ``search.json`` names the run,
            the checkpoint and the best sub-network).
        epochs: Passes over the training split.
        batch_size: Samples per rank per step.
        lr: Peak learning rate, cosine-annealed to 0 per step.
        momentum: SGD (Nesterov) momentum.
        weight_decay: SGD weight decay.
        label_smoothing: Cross-entropy label smoothing.
        seed: Seeds the data order (and the weights with ``from_scratch``).
        from_scratch: Ignore the supernet's weights: train the same architecture from a
            fresh initialisation (the baseline fine-tuning is compared against).
        recal_samples: Training images recalibrating the sub-network's BatchNorm
            statistics before export.
        out: Output directory (default ``SEARCH/tune``, or ``SEARCH/scratch``).
        resume: ``auto``, ``never`` or a checkpoint file/directory, as in pretrain.
        ckpt_every: Also checkpoint every N steps (0 = epoch ends and stops only).
        keep: Checkpoints kept.
        elastic: Allow resuming with another world size (not exact).
        max_steps: Stop with a checkpoint after this global step.
        tensorboard, wandb, mlflow: Trackers, as in
            :class:`~hpc.pretrain.config.PretrainConfig`.
    """

    search: str = "runs/pretrain/search"
    epochs: int = 5
    batch_size: int = 32
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 5e-4
    label_smoothing: float = 0.0
    seed: int = 0
    from_scratch: bool = False
    recal_samples: int = 512
    out: Optional[str] = None
    resume: str = "auto"
    ckpt_every: int = 0
    keep: int = 2
    elastic: bool = False
    max_steps: Optional[int] = None
    tensorboard: Optional[bool] = None
    wandb: Optional[str] = None
    mlflow: Optional[str] = None

    @property
    def out_dir(self) -> Path:
        """``out``, or ``SEARCH/tune`` (``SEARCH/scratch`` with ``from_scratch``)."""
        if self.out:
            return Path(self.out)
        return Path(self.search) / ("scratch" if self.from_scratch else "tune")

    def validate(self) -> None:
        """Raise ``ValueError`` (house format) on an impossible value."""
        problems = [f"{n}={getattr(self, n)} (must be >= 1)"
                    for n in ("epochs", "batch_size", "keep") if getattr(self, n) < 1]
        for name in ("ckpt_every", "recal_samples"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} (must be >= 0)")
        if self.lr <= 0:
            problems.append(f"lr={self.lr} (must be > 0)")
        if self.max_steps is not None and self.max_steps < 1:
            problems.append(f"max_steps={self.max_steps} (must be >= 1 or unset)")
        if self.resume not in ("auto", "never") and not Path(self.resume).exists():
            problems.append(f"resume={self.resume!r} (no such file or directory)")
        if not Path(self.search).is_dir():
            problems.append(f"search={self.search!r} (no such directory; pass the --out "
                            "of an hpc search)")
        elif not (Path(self.search) / "search.json").is_file():
            problems.append(f"search={self.search!r} (holds no search.json; pass the "
                            "--out of an hpc search)")
        _problems_to_error("tune", problems, "tune")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (stored in ``tune.json`` and in checkpoints)."""
        return dataclasses.asdict(self)
