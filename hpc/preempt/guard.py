"""The stop request of a preemption: signals -> :class:`PreemptGuard`, polled every step.

The handler only assigns a flag (signal-safe); the training loop polls the guard once per
step and agrees across ranks. A second source is the stop file (``HPC_STOP_FILE``): where
the signal never reaches the ranks (``mpirun`` under Slurm does not forward it,
openpmix/prrte#2136) the batch shell traps it and writes the signal's name into that
file; the guard looks for it at most every :data:`STOP_FILE_POLL_S` seconds (one
``stat``), so polling the guard every step stays cheap. :mod:`hpc.preempt.requeue` has
the rest of the flow (the requeue budget, ``scontrol requeue``, the exit codes) and the
table of the variables it reads.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any, Callable, Optional

from hpc import envvars
from hpc._lazy import resolve_callable
from hpc.envvars import DEFAULT_SIGNAL, VALID_SIGNALS
from hpc.errors import PreemptError

__all__ = ["STOP_FILE_POLL_S", "PreemptGuard", "StopFlag",
           "load_step_hook", "parse_signal", "parse_signals", "preempt_signals"]

#: Seconds between two looks at the stop file (``HPC_STOP_FILE``).
STOP_FILE_POLL_S = 0.5


def parse_signal(name: str) -> signal.Signals:
    """``USR2``, ``SIGUSR2``, ``usr2`` or ``12`` -> ``signal.SIGUSR2``: a warning signal
    asked for by name (``hpc submit --signal``, the stop file's content).

    Raises:
        PreemptError: the name is not one of :data:`hpc.envvars.VALID_SIGNALS` (listed
            in the message).
    """
    try:
        return envvars.signal_of(name)
    except ValueError as e:
        raise PreemptError(
            f"warning signal {name!r} is not supported.\n"
            "The job must be able to catch it, and Slurm uses STOP/CONT/KILL itself.\n"
            f"HINT: use one of: {', '.join(VALID_SIGNALS)} (default {DEFAULT_SIGNAL}; "
            "USR1 may clash with NCCL).") from e


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """``"USR2,TERM"`` -> ``(SIGUSR2, SIGTERM)`` (duplicates dropped, order kept), read as
    ``HPC_PREEMPT_SIGNALS``.

    Raises:
        PreemptError: the list is empty or names a signal outside
            :data:`hpc.envvars.VALID_SIGNALS`; the message names ``HPC_PREEMPT_SIGNALS``.
    """
    if not text.strip():
        text = ","  # nothing at all is "names no signal" too, not the default
    signals: tuple[signal.Signals, ...] = envvars.parse("HPC_PREEMPT_SIGNALS", text)
    return signals


def preempt_signals(environ: Optional[Mapping[str, str]] = None) -> tuple[signal.Signals, ...]:
    """The signals that ask for the agreed stop: ``HPC_PREEMPT_SIGNALS``, else the warning
    signal (``HPC_PREEMPT_SIGNAL``, default USR2) and SIGTERM (what preemption sends).

    Raises:
        PreemptError: either variable is malformed (the message names it).
    """
    env = os.environ if environ is None else environ
    listed: Optional[tuple[signal.Signals, ...]] = envvars.value("HPC_PREEMPT_SIGNALS", env)
    if listed:
        return listed
    return tuple(dict.fromkeys((envvars.value("HPC_PREEMPT_SIGNAL", env), signal.SIGTERM)))


def load_step_hook(environ: Optional[Mapping[str, str]] = None) -> Optional[Callable[[], None]]:
    """The ``HPC_STEP_HOOK`` function (``module:function``), or None when unset.

    Raises:
        PreemptError: the value is not ``module:function`` or does not import (the message
            says which part failed).
    """
    env = os.environ if environ is None else environ
    spec: Optional[str] = envvars.value("HPC_STEP_HOOK", env)
    if not spec:
        return None
    return resolve_callable(spec, label=f"HPC_STEP_HOOK={spec!r}",
                            example="HPC_STEP_HOOK=mypkg.hooks:on_step, or unset it",
                            where="of the job, or unset HPC_STEP_HOOK", error=PreemptError)


class PreemptGuard:
    """A stop request raised by a preemption signal, polled by the training loop.

    Pass the guard as ``stop_requested`` (it is callable) after :meth:`install`::

        guard = PreemptGuard().install()
        result = pretrain(cfg, stop_requested=guard)

    Installing replaces any previous handler of the signal, submitit's included (it would
    requeue at once from inside the handler, without the agreed stop), and unblocks the
    signals (``python -m hpc.preempt.shield`` starts a launcher with SIGTERM blocked, so a
    preemption's SIGTERM waits, pending, until here).

    The guard also asks for the stop when the stop file exists (``stop_file``, default
    ``HPC_STOP_FILE``; ``slurm/torchrun.sbatch`` and ``slurm/mpirun.sbatch`` set it and
    write it when their batch shell gets the signal); its text may name the signal
    (``TERM``).

    Args:
        signame: The signal, or a comma-separated list (default
            :func:`preempt_signals`: ``HPC_PREEMPT_SIGNALS``, else the warning signal
            ``HPC_PREEMPT_SIGNAL``/USR2 and TERM).
        environ: Variables to read (default ``os.environ``).
        step_hook: Called at every poll, before the answer (default: the
            ``HPC_STEP_HOOK`` function, see :func:`load_step_hook`).
        stop_file: The stop file (default ``HPC_STOP_FILE``; empty: none).
    """

    def __init__(self, signame: Optional[str] = None,
                 environ: Optional[Mapping[str, str]] = None,
                 step_hook: Optional[Callable[[], None]] = None,
                 stop_file: Optional[str] = None) -> None:
        env = os.environ if environ is None else environ
        self.signums = parse_signals(signame) if signame else preempt_signals(env)
        self.signum = self.signums[0]
        self.requested = False
        self.received_at: Optional[float] = None
        self.received: Optional[signal.Signals] = None
        self._previous: dict[signal.Signals, Any] = {}
        self._announce = env.get("SLURM_LOCALID", env.get("LOCAL_RANK", "0")) == "0"
        self._rank = env.get("SLURM_PROCID", env.get("RANK", "0"))
        self.step_hook = step_hook if step_hook is not None else load_step_hook(env)
        self.stop_file = (envvars.value("HPC_STOP_FILE", env) if stop_file is None
                          else stop_file.strip()) or None
        self._next_look = 0.0

    @property
    def signal_name(self) -> str:
        """The signal that asked for the stop (else the first handled), e.g. ``SIGTERM``."""
        return (self.received or self.signum).name

    def install(self) -> "PreemptGuard":
        """Handle the signals from now on (main thread only); returns ``self``."""
        for signum in self.signums:
            self._previous[signum] = signal.signal(signum, self.request)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signums)  # a pending one: now
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were there before :meth:`install`."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def request(self, signum: Optional[int] = None, frame: Any = None) -> None:
        """Ask for a stop; fits ``signal.signal`` (only assignments and one ``write``)."""
        first = not self.requested
        self.requested = True
        if first:
            self.received_at = time.time()
            if signum is not None:
                self.received = signal.Signals(signum)
            if self._announce and signum is not None:
                try:
                    os.write(2, f"hpc: rank {self._rank} got {signal.Signals(signum).name}: "
                                "stopping at the next step boundary\n".encode())
                except OSError:
                    pass

    def _look_at_stop_file(self) -> None:
        """Request the stop when the stop file exists (at most every STOP_FILE_POLL_S)."""
        now = time.monotonic()
        if self.stop_file is None or self.requested or now < self._next_look:
            return
        self._next_look = now + STOP_FILE_POLL_S
        try:
            with open(self.stop_file) as f:
                text = f.read(64).strip()
        except OSError:  # not there (the usual case), or not readable yet
            return
        try:
            received: Optional[signal.Signals] = parse_signal(text) if text else None
        except PreemptError:
            received = None
        self.request()
        self.received = received
        if self._announce:
            print(f"hpc: rank {self._rank}: stop file {self.stop_file} says "
                  f"{text or 'stop'}: stopping at the next step boundary", file=sys.stderr,
                  flush=True)

    def __call__(self) -> bool:
        if self.step_hook is not None:
            self.step_hook()
        self._look_at_stop_file()
        return self.requested


class StopFlag:
    """A "checkpoint now and stop at the next step boundary" request.

    Pass it as ``stop_requested``; call :meth:`request` from anywhere (a signal handler,
    another thread). Only assignment happens in :meth:`request`, so it is safe in a
    signal handler: ``signal.signal(signal.SIGUSR1, flag.request)``. The loop checks it
    once per step and agrees across ranks, so a request on any single rank stops all.
    """

    def __init__(self) -> None:
        self.requested = False

    def request(self, *_: Any) -> None:
        """Ask the loop to stop (signature fits ``signal.signal`` handlers)."""
        self.requested = True

    def __call__(self) -> bool:
        return self.requested
