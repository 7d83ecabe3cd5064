"""The schema of a submission: :class:`SubmitOptions`, whose fields drive everything else.

Each field is declared with :func:`option`: its ``hpc submit`` flag (type, default and
help come from the field), the sbatch options it sets (refused in ``--sbatch``, see
:data:`MANAGED`) and the submitit parameter it becomes (:func:`field_parameters`, which
:func:`hpc.submit.make_executor` passes on). A new ``hpc submit`` flag is one new field.
:func:`parse_sbatch` validates extra sbatch options against this cluster's ``sbatch
--help``; :func:`job_dir` and :func:`marks_dir` are where a job's files and a run's
failure marks go under ``log_dir``, for the executor that writes them there and the
:class:`~hpc.submit.SubmittedJob` that reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import re
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from hpc.envvars import DEFAULT_SIGNAL, VALID_SIGNALS
from hpc.errors import PreemptError, SubmitError
from hpc.preempt.guard import parse_signal
from hpc.preempt.requeue import DEFAULT_MAX_REQUEUES

__all__ = ["MANAGED", "SubmitOptions", "field_parameters", "job_dir", "marks_dir", "option",
           "parse_sbatch", "parse_time", "sbatch_long_options"]

#: sbatch options that make no sense in a submission (they control the sbatch command).
_NOT_JOB_OPTIONS = ("help", "usage", "version", "parsable", "wait", "quiet", "verbose",
                    "test-only")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_time(text: str) -> int:
    """Slurm time (``MIN``, ``MIN:SS``, ``H:MM:SS``, ``D-H[:MM[:SS]]``) -> whole minutes.

    Raises:
        argparse.ArgumentTypeError: not a Slurm time, or not positive.
    """
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Slurm time: use minutes (90), H:MM:SS (1:30:00) or "
            "D-HH:MM (1-12:00)")
    d, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if d is not None:  # days-hours[:minutes[:seconds]]
        seconds = ((d * 24 + a) * 60 + (b or 0)) * 60 + (c or 0)
    elif c is not None:  # hours:minutes:seconds
        seconds = (a * 60 + b) * 60 + c
    elif b is not None:  # minutes:seconds
        seconds = a * 60 + b
    else:  # minutes
        seconds = a * 60
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"time {text!r} must be positive")
    return math.ceil(seconds / 60)


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    """``["KEY=VALUE", ...]`` -> a dict; ``what`` (the flag) names the culprit."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SubmitError(f"{what} {item!r} is not KEY=VALUE.\nHINT: e.g. {what} "
                              "OMP_NUM_THREADS=4")
        out[key] = value
    return out


def option(*flags: str, help: str, default: Any = dataclasses.MISSING,
           factory: Any = dataclasses.MISSING, sbatch: Sequence[str] = (),
           submitit: str | None = None, submitit_from: str | None = None,
           omit_unset: bool = False, parse: Callable[[Any], Any] | None = None,
           cli_default: Any = dataclasses.MISSING, **argparse_kw: Any) -> Any:
    """A :class:`SubmitOptions` field with what the CLI and the executor derive from it.

    Args:
        *flags: Its ``hpc submit`` flags, the long one first (``"--nodes", "-N"``).
        help: The flag's help; ``{default}`` becomes the flag's default.
        default: The field's default.
        factory: The field's default factory (instead of ``default``).
        sbatch: The sbatch options it sets: ``--sbatch`` refuses them, naming this flag.
        submitit: The submitit parameter it becomes; None when :func:`make_executor
            <hpc.submit.make_executor>` composes it with others.
        submitit_from: The attribute whose value is passed (default: the field).
        omit_unset: Do not pass a 0/None value (submitit's default applies).
        parse: Turns the flag's value into the field's (``--env`` pairs -> a dict).
        cli_default: The flag's default when it differs from the field's.
        **argparse_kw: Further ``add_argument`` keywords (``type``, ``metavar``,
            ``choices``, ``action``); ``type`` defaults to the field's int/float type.

    Returns:
        A :func:`dataclasses.field` whose ``metadata`` holds all of this.
    """
    meta = {"flags": flags, "help": help, "sbatch": tuple(sbatch), "submitit": submitit,
            "submitit_from": submitit_from, "omit_unset": omit_unset, "parse": parse,
            "cli_default": cli_default, "argparse": argparse_kw}
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)


@functools.lru_cache(maxsize=1)
def sbatch_long_options() -> tuple[str, ...]:
    """The long options this cluster's ``sbatch --help`` lists (without ``--``)."""
    try:
        text = subprocess.run(["sbatch", "--help"], check=False, capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SubmitError(f"cannot run `sbatch --help`: {e}.\n"
                          "HINT: run hpc submit where the Slurm client tools are on PATH "
                          "(a login node).") from e
    found = re.findall(r"^\s+(?:-\w, )?--([a-z][a-z0-9-]*)", text, flags=re.MULTILINE)
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
    job_options = [v for v in valid if v not in _NOT_JOB_OPTIONS]
    out: dict[str, Any] = {}
    for key, value in pairs:
        name = str(key).strip().lstrip("-").replace("_", "-")
        if name in MANAGED:
            raise SubmitError(f"--sbatch {name}=... is set by hpc submit itself.\n"
                              f"HINT: use {MANAGED[name]} instead.")
        if name not in valid or name in _NOT_JOB_OPTIONS:
            close = difflib.get_close_matches(name, job_options, n=3)
            raise SubmitError(
                f"--sbatch {name}: sbatch has no option --{name}"
                + (f" (did you mean {', '.join(close)}?)" if close else "") + ".\n"
                "HINT: valid sbatch options: "
                + ", ".join(o for o in job_options if o not in MANAGED)
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
        env: Variables exported in the job (``KEY: value``).
        log_dir: Folder of the logs and submitit's pickles (``<log_dir>/<job id>/``).
        name: Job name.
        signal: Warning signal sent before the time limit (``USR2``; not USR1, which
            NCCL may use).
        signal_delay_s: Seconds before the time limit the signal comes.
        max_requeues: Requeue budget (``HPC_MAX_REQUEUES`` in the job).
        python: Interpreter on the nodes (default: this one).
        spare_nodes: Nodes allocated beyond ``nodes`` as spares; > 0 runs the tasks under
            ``hpc supervise`` (:mod:`hpc.supervise`), which restarts them inside the
            allocation without a failed host (``--no-kill``).
        array: Tasks of a job array (0 = one plain job): one Slurm job per index
            ``0..array-1``, each with its own run directory (``{task}`` in the target's
            arguments, e.g. ``--out runs/sweep/{task}``), each preempted and requeued on
            its own (``<array job>_<task>``).
    """

    nodes: int = option(
        "--nodes", "-N", default=1, help="nodes (default {default})",
        sbatch=("nodes", "ntasks"), submitit="nodes")
    gpus_per_node: int = option(
        "--gpus-per-node", "-G", default=0,
        help="GPUs per node, one task per GPU (default {default}: CPU tasks, see "
        "--tasks-per-node)", sbatch=("gpus-per-node",), submitit="gpus_per_node",
        omit_unset=True)
    tasks_per_node: Optional[int] = option(  # noqa: UP045 (get_type_hints, Python 3.9)
        "--tasks-per-node", default=None,
        help="tasks per node (default: --gpus-per-node, or 1 without GPUs)",
        sbatch=("ntasks-per-node", "ntasks"), submitit="tasks_per_node",
        submitit_from="ntasks_per_node")
    cpus_per_task: int = option(
        "--cpus-per-task", "-c", default=1, help="CPUs per task (default {default})",
        sbatch=("cpus-per-task",), submitit="cpus_per_task")
    partition: Optional[str] = option(  # noqa: UP045 (get_type_hints, Python 3.9)
        "--partition", "-p", default=None, help="partition (default: the cluster's)",
        sbatch=("partition",), submitit="slurm_partition", omit_unset=True)
    time_min: int = option(
        "--time", "-t", default=60, type=parse_time, metavar="TIME",
        help="time limit: minutes, H:MM:SS or D-HH:MM (default {default} min)",
        sbatch=("time",), submitit="timeout_min")
    sbatch: Mapping[str, Any] = option(
        "--sbatch", factory=dict, action="append", metavar="KEY=VALUE",
        help="extra sbatch option, repeatable (e.g. account=proj, mail-type=END, exclusive)",
        parse=parse_sbatch)
    env: Mapping[str, str] = option(
        "--env", factory=dict, action="append", metavar="KEY=VALUE",
        help="variable exported in the job, repeatable",
        parse=functools.partial(_pairs, what="--env"))
    log_dir: str = option(
        "--log-dir", default="hpc-logs", metavar="DIR",
        help="logs and submitit files go to DIR/<job id>/ (default {default})",
        sbatch=("output", "error"))
    name: str = option(
        "--name", "-J", default="hpc", cli_default=None,
        help="job name (default hpc-<target>)", sbatch=("job-name",), submitit="name")
    signal: str = option(
        "--signal", default=DEFAULT_SIGNAL, choices=VALID_SIGNALS,
        help="warning signal before the time limit (default {default}; USR1 may clash "
        "with NCCL)", sbatch=("signal",))
    signal_delay_s: int = option(
        "--signal-delay", default=120, metavar="S",
        help="seconds before the time limit the signal comes (default {default})",
        sbatch=("signal",), submitit="slurm_signal_delay_s")
    max_requeues: int = option(
        "--max-requeues", default=DEFAULT_MAX_REQUEUES, metavar="N",
        help="requeue budget (HPC_MAX_REQUEUES; default {default})",
        submitit="slurm_max_num_timeout")
    python: Optional[str] = option(  # noqa: UP045 (get_type_hints, Python 3.9)
        "--python", default=None, help="interpreter on the nodes (default: this one)",
        submitit="slurm_python")
    spare_nodes: int = option(
        "--spare-nodes", default=0, metavar="K",
        help="allocate K nodes more than --nodes and keep them as spares: the tasks run "
        "under hpc supervise, which restarts them without a host that fails, a spare in "
        "its place, from the newest checkpoint (default {default}: no supervisor)")
    array: int = option(
        "--array", default=0, metavar="N",
        help="a job array of N tasks (index 0..N-1), each its own job, requeued on its "
        "own; {{task}} in the target's arguments becomes the index, e.g. -- --out "
        "runs/sweep/{{task}} (default: one job)", sbatch=("array",))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SubmitOptions:
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

    @property
    def is_array(self) -> bool:
        """True for a job array (``array`` >= 1), False for one plain job (``array`` 0).

        The one place that decides: ``hpc submit`` picks :func:`~hpc.submit.submit` or
        :func:`~hpc.submit.executor.submit_array` by it, and each refuses the other kind
        by it. A negative ``array`` is no array; :meth:`validate` refuses it.
        """
        return self.array >= 1

    def validate(self) -> None:
        """Raise :class:`SubmitError` listing every impossible value with its fix."""
        problems = [f"{k}={getattr(self, k)} (must be >= 1)"
                    for k in ("nodes", "cpus_per_task", "time_min", "ntasks_per_node")
                    if getattr(self, k) < 1]
        problems += [f"{k}={getattr(self, k)} (must be >= 0)"
                     for k in ("gpus_per_node", "signal_delay_s", "max_requeues", "array",
                               "spare_nodes")
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
        try:
            parse_signal(self.signal)
        except PreemptError as e:
            raise SubmitError(f"--signal: {e}") from e
        parse_sbatch(self.sbatch)


#: sbatch options ``hpc submit`` sets without a field of its own, with what to use instead.
_SET_ALWAYS = {
    "open-mode": "nothing (always append)", "requeue": "nothing (always on)",
    "no-requeue": "--max-requeues 0",
    "wrap": "the command after --",
}


def _managed() -> dict[str, str]:
    flags: dict[str, list[str]] = {}
    for f in dataclasses.fields(SubmitOptions):
        for name in f.metadata["sbatch"]:
            flags.setdefault(name, []).append(f.metadata["flags"][0])
    return {**{name: " and ".join(fl) for name, fl in flags.items()}, **_SET_ALWAYS}


#: sbatch options ``hpc submit`` sets itself, with the option to use instead (from the
#: fields' ``sbatch`` metadata, plus the ones it always sets).
MANAGED = _managed()


def field_parameters(options: SubmitOptions) -> dict[str, Any]:
    """Each field's submitit parameter (its ``submitit`` metadata) with the field's value.

    A field marked ``omit_unset`` is left out when 0 or None (submitit's default applies).
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        param = f.metadata["submitit"]
        if param is None:
            continue
        value = getattr(options, f.metadata["submitit_from"] or f.name)
        if not (f.metadata["omit_unset"] and not value):
            out[param] = value
    return out


def job_dir(log_dir: str | Path, job_id: str) -> Path:
    """The job's folder, absolute: ``LOG_DIR/ID`` (its logs, submitit's pickles and
    failure marks); ``job_id`` ``"%j"`` is the pattern submitit and sbatch fill in."""
    return Path(log_dir).resolve() / str(job_id)


def marks_dir(log_dir: str | Path, job_id: str, restart: int | str) -> Path:
    """The job's ``HPC_ERROR_DIR`` (failure marks) for one run: ``LOG_DIR/ID/failures-N``,
    absolute; the directory :class:`~hpc.submit.SubmittedJob` reads."""
    return job_dir(log_dir, job_id) / f"failures-{restart}"
