"""The schema of a submission: :class:`SubmitOptions` and the extra sbatch options.

:class:`SubmitOptions` is what :func:`hpc.submit.submit` takes; :func:`parse_sbatch`
validates extra sbatch options against this cluster's ``sbatch --help`` and refuses the
ones ``hpc submit`` sets itself (:data:`MANAGED`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from hpc.errors import SubmitError
from hpc.submit.preempt import DEFAULT_MAX_REQUEUES, DEFAULT_SIGNAL, parse_signal

__all__ = ["MANAGED", "SubmitOptions", "parse_sbatch", "sbatch_long_options"]

#: sbatch options ``hpc submit`` sets itself, with the option to use instead.
MANAGED = {
    "nodes": "--nodes", "ntasks-per-node": "--tasks-per-node",
    "gpus-per-node": "--gpus-per-node", "cpus-per-task": "--cpus-per-task",
    "partition": "--partition", "time": "--time", "signal": "--signal / --signal-delay",
    "job-name": "--name", "output": "--log-dir", "error": "--log-dir",
    "open-mode": "nothing (always append)", "requeue": "nothing (always on)",
    "no-requeue": "--max-requeues 0", "ntasks": "--nodes and --tasks-per-node",
    "array": "nothing (arrays are not supported)", "wrap": "the command after --",
}
#: sbatch options that make no sense in a submission (they control the sbatch command).
_NOT_JOB_OPTIONS = ("help", "usage", "version", "parsable", "wait", "quiet", "verbose",
                    "test-only")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@functools.lru_cache(maxsize=1)
def sbatch_long_options() -> tuple[str, ...]:
    """The long options this cluster's ``sbatch --help`` lists (without ``--``)."""
    try:
        text = subprocess.run(["sbatch", "--help"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SubmitError(f"cannot run `sbatch --help`: {e}.\n"
                          "HINT: run hpc submit where the Slurm client tools are on PATH "
                          "(a login node).") from e
    found = re.findall(r"^\s+(?:-\w, )?--([a-z][a-z0-9-]*)", text, flags=re.M)
    return tuple(sorted(set(found)))


def parse_sbatch(items: Mapping[str, Any] | Sequence[str]) -> dict[str, Any]:
    """Validate extra sbatch options: ``{"mail-type": "END"}`` or ``["mail-type=END"]``.

    Keys may use ``_`` for ``-``; a key without a value is a flag (``exclusive``).

    Raises:
        SubmitError: a key is unknown to sbatch (the message lists the valid ones and
            close matches) or is one ``hpc submit`` sets itself (it names the option).
    """
    pairs: list[tuple[str, Any]] = []
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        for item in items:
            key, sep, value = str(item).partition("=")
            pairs.append((key, value if sep else True))
    valid = sbatch_long_options()
    out: dict[str, Any] = {}
    for key, value in pairs:
        name = str(key).strip().lstrip("-").replace("_", "-")
        if name in MANAGED:
            raise SubmitError(f"--sbatch {name}=... is set by hpc submit itself.\n"
                              f"HINT: use {MANAGED[name]} instead.")
        if name not in valid or name in _NOT_JOB_OPTIONS:
            close = difflib.get_close_matches(name, [v for v in valid if v not in _NOT_JOB_OPTIONS], n=3)
            raise SubmitError(
                f"--sbatch {name}: sbatch has no option --{name}"
                + (f" (did you mean {', '.join(close)}?)" if close else "") + ".\n"
                "HINT: valid sbatch options: "
                + ", ".join(o for o in valid if o not in MANAGED and o not in _NOT_JOB_OPTIONS)
                + ".")
        out[name] = value
    return out


@dataclasses.dataclass(frozen=True)
class SubmitOptions:
    """How a job is laid out and treated by Slurm (the schema of :func:`~hpc.submit.submit`).

    Attributes:
        nodes: Nodes to allocate.
        gpus_per_node: GPUs per node; one task per GPU. 0 = CPU job (``tasks_per_node``).
        tasks_per_node: Tasks per node; default ``gpus_per_node`` (or 1 without GPUs).
            With GPUs it must equal ``gpus_per_node``.
        cpus_per_task: CPUs of each task.
        partition: Slurm partition (default: the cluster's default).
        time_min: Time limit in minutes.
        sbatch: Extra sbatch options, validated by :func:`parse_sbatch`.
        log_dir: Folder of the logs and submitit's pickles (``<log_dir>/<job id>/``).
        name: Job name.
        signal: Warning signal sent before the time limit (``USR2``; not USR1, which
            NCCL may use).
        signal_delay_s: Seconds before the time limit the signal comes.
        max_requeues: Requeue budget (``HPC_MAX_REQUEUES`` in the job).
        env: Variables exported in the job (``KEY: value``).
        python: Interpreter on the nodes (default: this one).
    """

    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: Optional[int] = None
    cpus_per_task: int = 1
    partition: Optional[str] = None
    time_min: int = 60
    sbatch: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    log_dir: str = "hpc-logs"
    name: str = "hpc"
    signal: str = DEFAULT_SIGNAL
    signal_delay_s: int = 120
    max_requeues: int = DEFAULT_MAX_REQUEUES
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    python: Optional[str] = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "SubmitOptions":
        """Build from keywords; an unknown keyword is rejected listing the valid ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            hints = {u: difflib.get_close_matches(u, names, n=1) for u in unknown}
            maybe = "; ".join(f"{u} -> {h[0]}?" for u, h in hints.items() if h)
            raise SubmitError(f"unknown submit option(s): {', '.join(unknown)}"
                              + (f" ({maybe})" if maybe else "") + ".\n"
                              f"HINT: valid options: {', '.join(names)}.")
        return cls(**kwargs)

    @property
    def ntasks_per_node(self) -> int:
        """Tasks per node: one per GPU, or ``tasks_per_node`` (default 1) without GPUs."""
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return self.gpus_per_node or 1

    def validate(self) -> None:
        """Raise :class:`SubmitError` listing every impossible value with its fix."""
        problems = [f"{k}={getattr(self, k)} (must be >= 1)"
                    for k in ("nodes", "cpus_per_task", "time_min", "ntasks_per_node")
                    if getattr(self, k) < 1]
        problems += [f"{k}={getattr(self, k)} (must be >= 0)"
                     for k in ("gpus_per_node", "signal_delay_s", "max_requeues")
                     if getattr(self, k) < 0]
        if self.gpus_per_node and self.tasks_per_node not in (None, self.gpus_per_node):
            problems.append(f"tasks_per_node={self.tasks_per_node} with gpus_per_node="
                            f"{self.gpus_per_node} (one task per GPU: leave tasks_per_node "
                            "unset, or use gpus_per_node=0 for CPU tasks)")
        if self.signal_delay_s >= self.time_min * 60:
            problems.append(f"signal_delay_s={self.signal_delay_s} >= time limit "
                            f"{self.time_min * 60} s (the signal would come at the start; "
                            f"use a delay below {self.time_min * 60} s)")
        bad_env = [k for k in self.env if not _ENV_NAME.match(k)]
        if bad_env:
            problems.append(f"env names {bad_env} (letters, digits, _; not a digit first)")
        if problems:
            raise SubmitError("invalid submit options: " + "; ".join(problems) + ".\n"
                              "HINT: see `hpc submit --help`.")
        parse_signal(self.signal)
        parse_sbatch(self.sbatch)
