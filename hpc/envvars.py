"""The ``HPC_*`` variables torch-hpc reads: one table, one reader, checked at init.

:data:`VARIABLES` holds, for each variable, its parser, the accepted form, the default and
a one-line meaning. Code that reads one calls :func:`value` (the parsed value, or the
default when unset or empty); nothing else parses them. :func:`check` parses every one
that is set and is the first thing :func:`hpc.init_torch` does on every rank (and
``hpc run`` before it starts any), so a typo such as ``HPC_MAX_REQUEUES=three`` fails at
start-up naming the variable, the value and the accepted form, not at the preemption
hours later. ``docs/envvars.rst`` renders this table (``.. hpc-envvars::``) and
``tests/unit/docs/test_envvars.py`` keeps it and the code's reads the same set.

This module imports nothing of the package but :mod:`hpc.errors`: every room may read
through it. Which launcher names ``HPC_LAUNCHER`` may take is the environments' own
rule (:func:`hpc.environments.by_name`, with :func:`refusal`'s message): here its value
is only checked to be a launcher's name in form.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
from collections.abc import Mapping
from typing import Any, Callable, Optional

from hpc.errors import HPCError, LaunchEnvironmentError, PreemptError

__all__ = ["Variable", "VARIABLES", "DEFAULT_SIGNAL", "VALID_SIGNALS", "check", "value",
           "parse", "refusal", "signal_of", "rst_table"]

DEFAULT_SIGNAL = "USR2"
#: Signals a job may ask for as its warning or stop signal: catchable, and not the ones
#: Slurm uses for job control itself (STOP/CONT/KILL).
VALID_SIGNALS = ("USR2", "USR1", "TERM", "INT", "HUP", "QUIT", "ALRM", "URG", "XCPU")

_SWITCH = {"1": True, "on": True, "true": True, "yes": True,
           "0": False, "off": False, "false": False, "no": False}
_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclasses.dataclass(frozen=True)
class Variable:
    """One ``HPC_*`` variable.

    Attributes:
        name: The variable.
        parse: Text (stripped, not empty) -> value; raises ``ValueError`` saying why not.
        accepted: The accepted form, as the error's HINT and the docs show it.
        default: The value when unset or empty (``None``: no default, the feature is off).
        default_text: How the docs and errors show the default.
        meaning: One line: what it does.
        error: The :class:`~hpc.errors.HPCError` a malformed value raises.
        choices: The accepted words, for variables that take one of a few.
    """

    name: str
    parse: Callable[[str], Any]
    accepted: str
    default: Any
    default_text: str
    meaning: str
    error: type[HPCError] = LaunchEnvironmentError
    choices: tuple[str, ...] = ()


def signal_of(text: str) -> signal.Signals:
    """``USR2``, ``SIGUSR2``, ``usr2`` or ``12`` -> ``signal.SIGUSR2``.

    Raises:
        ValueError: (``is not one of ...``) not one of :data:`VALID_SIGNALS` (by name or number).
    """
    name = str(text).strip().upper()
    short = name[3:] if name.startswith("SIG") else name
    if name.isdigit():
        try:
            short = signal.Signals(int(name)).name[3:]
        except ValueError:
            short = name
    if short not in VALID_SIGNALS:
        raise ValueError(f"is not one of {', '.join(VALID_SIGNALS)}")
    return signal.Signals[f"SIG{short}"]


def _signals(text: str) -> tuple[signal.Signals, ...]:
    names = [n for n in text.replace(" ", ",").split(",") if n.strip()]
    if not names:
        raise ValueError("names no signal")
    found: list[signal.Signals] = []
    for name in names:
        try:
            found.append(signal_of(name))
        except ValueError as e:
            raise ValueError(f"names {name.strip()!r}, which {e}") from None
    return tuple(dict.fromkeys(found))


def _seconds(minimum_exclusive: bool) -> Callable[[str], float]:
    def parse_seconds(text: str) -> float:
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError("is not a number of seconds") from None
        if not math.isfinite(seconds) or seconds < 0 or (minimum_exclusive and seconds == 0):
            raise ValueError("is not a positive number of seconds" if minimum_exclusive
                             else "is not a number of seconds >= 0")
        return seconds
    return parse_seconds


def _count(text: str) -> int:
    if not text.isdigit():
        raise ValueError("is not a non-negative integer")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError("is not a whole number >= 1")
    return int(text)


def _choice(*choices: str) -> Callable[[str], str]:
    def parse_choice(text: str) -> str:
        if text not in choices:
            raise ValueError(f"is not one of {', '.join(choices)}")
        return text
    return parse_choice


def _switch(text: str) -> bool:
    try:
        return _SWITCH[text.lower()]
    except KeyError:
        raise ValueError("is not 1 or 0 (on/off, true/false, yes/no)") from None


def _text(text: str) -> str:
    return text


def _reference(text: str) -> str:
    if not _REFERENCE.match(text):
        raise ValueError("is not module:function")
    return text


_LAUNCHER_NAME = re.compile(r"^[a-z][a-z0-9-]*$")


def _launcher(text: str) -> str:
    """A launcher's name in form; which names exist is :mod:`hpc.environments`' rule."""
    if not _LAUNCHER_NAME.match(text):
        raise ValueError("is not a launcher name (lowercase letters, digits, dashes)")
    return text


#: ``HPC_FAULT`` kinds: those that take an argument after a colon, and those that do not.
FAULT_KINDS = ("kill", "hang", "exit", "exc", "slow", "bitflip")


def _faults(text: str) -> tuple[tuple[int, int, str, Optional[float]], ...]:
    """``rank:step:kind[:arg],...`` -> ``((rank, step, kind, arg), ...)``."""
    found = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) < 3 or not parts[0].isdigit() or not parts[1].isdigit():
            raise ValueError(f"names {item!r}, which is not rank:step:kind")
        rank, step, kind, rest = int(parts[0]), int(parts[1]), parts[2], parts[3:]
        if kind not in FAULT_KINDS:
            raise ValueError(f"names the kind {kind!r}, not one of {', '.join(FAULT_KINDS)}")
        arg: Optional[float] = None
        if kind == "slow":
            try:
                arg = float(rest[0]) if len(rest) == 1 else math.nan
            except ValueError:
                arg = math.nan
            if not math.isfinite(arg) or arg <= 1:
                raise ValueError(f"names {item!r}: slow takes a factor > 1 (slow:2)")
        elif rest:
            raise ValueError(f"names {item!r}: {kind} takes no argument")
        found.append((rank, step, kind, arg))
    if not found:
        raise ValueError("names no fault")
    return tuple(found)


_NETWORK_MODES = ("set", "print", "off")
_CONSOLES = ("local", "global")


def _table(*rows: Variable) -> dict[str, Variable]:
    return {row.name: row for row in rows}


#: Every ``HPC_*`` variable the package reads, in the order the docs show them.
VARIABLES: dict[str, Variable] = _table(
    Variable("HPC_LAUNCHER", _launcher, "the name of the launcher that started the job "
             "(torchrun, slurm, openmpi, ...)", None, "detected",
             "force a launcher instead of detecting one"),
    Variable("HPC_CONNECT_TIMEOUT", _seconds(True), "a number of seconds > 0, e.g. 120",
             120.0, "120", "seconds the pre-flight of hpc.init_torch waits for the master "
             "and for all ranks; then it fails naming host:port or the missing ranks"),
    Variable("HPC_NETWORK", _choice(*_NETWORK_MODES), " | ".join(_NETWORK_MODES), "set",
             "set", "what the pre-flight does about the network between nodes: set "
             "checks it and sets GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME when unset and one "
             "interface reaches the master; print only prints the export line; off does "
             "neither", choices=_NETWORK_MODES),
    Variable("HPC_HANG_TIMEOUT", _seconds(False), "a number of seconds >= 0, e.g. 300",
             300.0, "300", "seconds a rank may wait in one collective before the watchdog "
             "logs the stuck-rank report of every rank as a warning (0: never; the job is "
             "not ended)"),
    Variable("HPC_WATCHDOG", _switch, "1 or 0 (also on/off, true/false, yes/no)", True, "1",
             "0 turns the post-init watchdog off: no collective tracking, no stuck-rank "
             "report, no ending of the job when one rank fails"),
    Variable("HPC_ALLOW_CPU", _choice("0", "1"), "1 or 0", "0", "0",
             "1: a CPU-only torch may train where GPUs were granted (with a warning in "
             "info.warnings); 0 or unset: hpc.init_torch refuses, naming the torch build "
             "and the fix", error=LaunchEnvironmentError, choices=("0", "1")),
    Variable("HPC_SYNC_SHM", _switch, "1 or 0 (also on/off, true/false, yes/no)", True, "1",
             "0 turns off the shared-memory exchange of hpc.sync_gradients, used when "
             "every rank of the group is on one host with CPU parameters"),
    Variable("HPC_LOG_DIR", _text, "a directory", None, "none",
             "run directory: hpc.setup_logging writes rank<r>.log there, the watchdog "
             "hang-report.txt and, under nccl, PyTorch's Flight Recorder dumps; "
             "slurm/pretrain.sbatch sets hpc-logs/<job id>"),
    Variable("HPC_LOG_CONSOLE", _choice(*_CONSOLES), " | ".join(_CONSOLES), "local",
             "local", "hpc.setup_logging: INFO on the console from each node's local rank 0 "
             "(local) or from global rank 0 only (global); every rank logs warnings",
             error=LaunchEnvironmentError, choices=_CONSOLES),
    Variable("HPC_ERROR_DIR", _text, "a directory", None, "none",
             "set by hpc run, slurm/pretrain.sbatch and hpc submit: each rank records there "
             "when and why it began to fail, so the first failing rank can be named"),
    Variable("HPC_TRACEBACK", _switch, "1 or 0", False, "0",
             "1: an hpc command that fails with a torch-hpc error shows the traceback "
             "after the message (by default the message alone, in one write)"),
    Variable("HPC_PROGRESS_FILE", _text, "a file", None, "none",
             "set by hpc supervise: hpc.save_checkpoint records the step and path of each "
             "checkpoint there (global master), so the supervisor knows where a restart "
             "resumes and whether an attempt made progress"),
    Variable("HPC_STAGE_DIR", _text, "a directory on a tmpfs", "/dev/shm", "/dev/shm",
             "where hpc.save_checkpoint(blocking=False) stages the state in memory for its "
             "writer process (needs room for one copy of the checkpoint; a save that does "
             "not fit is written synchronously, with a warning)"),
    Variable("HPC_SUPERVISE", _choice("0", "1"), "1 or 0", "0", "0",
             "slurm/pretrain.sbatch, slurm/torchrun.sbatch: 1 runs the step under hpc supervise, which restarts it "
             "inside the allocation without a host that failed (HPC_SPARE_NODES > 0 implies "
             "it); submit with --no-kill"),
    Variable("HPC_SPARE_NODES", _count, "a count of nodes", 0, "0",
             "hpc supervise (the sbatch templates): nodes of the allocation held back as spares; "
             "the step runs on the others and a restart takes a spare in place of a host "
             "that failed"),
    Variable("HPC_MAX_RESTARTS", _count, "a count", 3, "3",
             "hpc supervise: restarts inside the allocation after infrastructure failures "
             "(an attempt that wrote no new checkpoint counts twice)"),
    Variable("HPC_SUPERVISE_ELASTIC", _choice("0", "1"), "1 or 0", "0", "0",
             "hpc supervise (the sbatch templates): 1 is --elastic: with no spare left, the "
             "step goes on on fewer hosts instead of requeueing the job (the command must "
             "allow a world-size change, e.g. hpc pretrain --elastic)"),
    Variable("HPC_ATTEMPT", _count, "a count", 0, "0",
             "set by hpc supervise: 0 for the first attempt of the step in this allocation, "
             "n for its n-th restart (HPC_FAULT reaches attempt 0 only)"),
    Variable("HPC_RUN_ID", _text, "any text", None, "none",
             "set by hpc run: the launcher is reported as hpc-run and the variables are "
             "trusted as the launcher's own"),
    Variable("HPC_RUN_PREFIXED", _switch, "1 or 0", False, "0",
             "set by hpc run (1, or 0 under --no-prefix): hpc run already prefixes each "
             "line, so hpc.setup_logging leaves its rank prefix out on the console"),
    Variable("HPC_PYTHON", _text, "a Python executable", None, "the running Python",
             "the Python hpc run starts for a leading python/python3 or a .py script; in "
             "the slurm/ templates the Python of hpc and of a leading python/python3 (python3)"),
    Variable("HPC_PREEMPT_SIGNAL", signal_of, f"a signal name: {', '.join(VALID_SIGNALS)}",
             signal.SIGUSR2, DEFAULT_SIGNAL, "the warning signal (USR1 is avoided because "
             "NCCL may use it); hpc submit sets it, hpc run relays it to the ranks",
             error=PreemptError),
    Variable("HPC_PREEMPT_SIGNALS", _signals,
             f"comma-separated signal names of: {', '.join(VALID_SIGNALS)}", None,
             "HPC_PREEMPT_SIGNAL,TERM", "every signal that asks for the agreed stop "
             "(default: the warning signal and TERM, which real preemption sends)",
             error=PreemptError),
    Variable("HPC_MAX_REQUEUES", _count, "a whole number >= 0, e.g. 3", 3, "3",
             "requeue budget: no requeue once SLURM_RESTART_COUNT reaches it",
             error=PreemptError),
    Variable("HPC_STOP_FILE", _text, "a file path", None, "none",
             "a file the guard looks for (at most every 0.5 s): slurm/torchrun.sbatch and "
             "slurm/mpirun.sbatch write the signal they got there, for ranks the signal "
             "does not reach (mpirun)", error=PreemptError),
    Variable("HPC_REQUEUE_MARKER", _text, "a file path", None, "none",
             "a file the batch shell watches: where scontrol is missing the master writes "
             "the job to requeue there (set by slurm/lib/preempt.sh)", error=PreemptError),
    Variable("HPC_STRAGGLER", _switch, "1 or 0 (also on/off, true/false, yes/no)", True, "1",
             "name a rank (and its host) that computes slower than the others, or than "
             "itself earlier, while training runs (hpc.AgreedStop, hpc pretrain)"),
    Variable("HPC_STRAGGLER_EVERY", _positive, "a whole number >= 1, e.g. 20", 20, "20",
             "steps per straggler window: the ranks' step times are compared once per "
             "window, in a collective the loop makes anyway"),
    Variable("HPC_SDC", _choice("stop", "warn", "off"), "stop | warn | off", "stop", "stop",
             "what a rank whose replicated state (parameters, optimizer state) differs "
             "from the majority's does: stop the job naming it, or warn"),
    Variable("HPC_SDC_EVERY", _count, "a whole number >= 0, e.g. 100 (0: never)", 100, "100",
             "steps between two checks of the replicated state across ranks"),
    Variable("HPC_FAULT", _faults,
             "rank:step:kind[,...]; kind: kill, hang, exit, exc, slow:<factor>, bitflip",
             None, "none", "inject a fault into rank at step (prove the job recovers, or "
             "that a straggler or a corrupt rank is named)"),
    Variable("HPC_STATE_DIR", _text, "a directory every node of the cluster sees", None,
             "~/.local/state/torch-hpc", "where torch-hpc keeps state across jobs: the "
             "bad-node ledger (bad-nodes/, one file per strike; hpc nodes lists it)"),
    Variable("HPC_LEDGER_TTL", _seconds(False), "a number of seconds >= 0, e.g. 86400",
             86400.0, "86400 (24 h)", "seconds a strike against a node counts (hpc check's "
             "FLAGGED verdict, a persisting straggler, a corrupt replica); hosts with 2 "
             "live strikes are excluded by hpc submit (0: no ledger)"),
    Variable("HPC_STEP_HOOK", _reference, "module:function, e.g. mypkg.hooks:on_step", None,
             "none", "a function called (no arguments) at every poll of the preemption "
             "guard, i.e. once per step: fault injection", error=PreemptError),
)


def _failure(var: Variable, raw: str, reason: str) -> str:
    """The fact: the variable, its value and why it is refused."""
    return f"{var.name}={raw!r} {reason}"


def _hint(var: Variable) -> str:
    return f"{var.name} to {var.accepted} (default {var.default_text})"


def parse(name: str, raw: str) -> Any:
    """``raw`` as variable ``name`` would be read (stripped; empty: the default).

    Raises:
        HPCError: (the variable's ``error`` type) malformed; the message names the
            variable, the value and the accepted form.
        KeyError: ``name`` is not in :data:`VARIABLES`.
    """
    var = VARIABLES[name]
    text = raw.strip()
    if not text:
        return var.default
    try:
        return var.parse(text)
    except ValueError as e:
        raise refusal(name, raw, str(e)) from e


def refusal(name: str, raw: str, reason: str) -> HPCError:
    """The error refusing ``raw`` for variable ``name``: fact (``reason``), meaning, HINT.

    :func:`parse` raises it for a malformed value; a room whose rule decides more than
    the form (:func:`hpc.environments.by_name`: which launchers exist) raises the same.
    """
    var = VARIABLES[name]
    return var.error(f"{_failure(var, raw, reason)}.\n{name}: {var.meaning}.\n"
                     f"HINT: set {_hint(var)}, or unset it.")


def value(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of ``name`` in ``environ`` (default ``os.environ``), or its default.

    Raises:
        HPCError: malformed (see :func:`parse`).
    """
    env = os.environ if environ is None else environ
    return parse(name, env.get(name, ""))


def check(environ: Optional[Mapping[str, str]] = None) -> None:
    """Parse every variable of :data:`VARIABLES` that ``environ`` sets.

    Raises:
        HPCError: one or more are malformed; one error lists all of them (its type is the
            first one's), each with its value and accepted form.
    """
    env = os.environ if environ is None else environ
    bad: list[tuple[Variable, str, str]] = []
    for name, var in VARIABLES.items():
        raw = env.get(name, "")
        if raw.strip():
            try:
                var.parse(raw.strip())
            except ValueError as e:
                bad.append((var, raw, str(e)))
    if not bad:
        return
    if len(bad) == 1:
        var, raw, reason = bad[0]
        parse(var.name, raw)  # raises the one error
    facts = "; ".join(_failure(var, raw, reason) for var, raw, reason in bad)
    hints = "; ".join(_hint(var) for var, _, _ in bad)
    raise bad[0][0].error(f"{len(bad)} torch-hpc variables are malformed: {facts}.\n"
                          "Each is read at start-up so that none fails the job later.\n"
                          f"HINT: set {hints}; or unset them.")


def rst_table() -> str:
    """:data:`VARIABLES` as a reStructuredText list-table (``docs/envvars.rst``)."""
    rows = [".. list-table::", "   :header-rows: 1", "   :widths: 22 26 12 40", "",
            "   * - variable", "     - accepted", "     - default", "     - meaning"]
    for var in VARIABLES.values():
        rows += [f"   * - ``{var.name}``", f"     - {var.accepted}",
                 f"     - {var.default_text}", f"     - {var.meaning}"]
    return "\n".join(rows)
