"""``hpc run``: the embedded local launcher for machines without a scheduler.

Starts N ranks of a command on this host with torchrun-compatible variables, streams
their output with ``[rank r]`` prefixes, and when a rank fails stops the others and
exits with the first failure's code, naming that rank (torchrun's root-cause idea).
It never imports torch, so ranks start without waiting for it.

Signals: the preemption signal (``USR2``, or ``HPC_PREEMPT_SIGNAL``), ``TERM`` and a
first Ctrl-C are relayed to every rank as the preemption signal, so ``hpc pretrain`` and
scripts with a :class:`hpc.preempt.guard.PreemptGuard` stop at an agreed step with a
checkpoint; a second ``TERM`` or Ctrl-C kills the ranks at once. Ranks run in sessions
of their own (a terminal's Ctrl-C reaches ``hpc run`` only) and, on Linux, die with
``hpc run`` (``PR_SET_PDEATHSIG``) even when it is killed with ``SIGKILL``.
"""

from __future__ import annotations

import collections
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from hpc import envvars
from hpc.environments import check_override
from hpc.environments.base import free_port
from hpc.watchdog.failure import first_failure
from hpc.watchdog.marks import GENERIC_MESSAGE, read_mark

__all__ = ["rank_env", "resolve_command", "run"]

#: Seconds between SIGTERM and SIGKILL when stopping surviving ranks; also how long a
#: rank that has begun to exit (it wrote its failure mark) is given to finish.
GRACE = 5.0

#: gloo connections per pair of ranks on loopback (``GLOO_SOCKET_IFNAME=lo,lo``): each
#: one is a gloo "device" with its own socket, I/O thread and two worker threads, and
#: collectives alternate between them. Two let the many collectives of ``sync_model``
#: overlap (ResNet-50 at world size 2: 0.76x -> 0.91x a flat broadcast, median of 5
#: runs; see docs/sync.md); one flat broadcast is as fast as before.
LOOPBACK_GLOO_LANES = 2

#: First words that mean "this Python" (as torchrun runs its script with its own).
PYTHON_WORDS = ("python", "python3")

_MISSING = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def loopback_interface() -> str | None:
    """Name of this host's loopback interface (``lo`` on Linux), or None."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def rank_env(rank: int, nproc: int, port: int, run_id: str,
             base: dict[str, str] | None = None,
             loopback: str | None = None, prefixed: bool = False) -> dict[str, str]:
    """The environment of local rank ``rank`` of ``nproc`` (pure, for tests).

    ``loopback`` names the loopback interface: unless ``GLOO_SOCKET_IFNAME`` is set,
    gloo then talks over it only, on ``LOOPBACK_GLOO_LANES`` connections.
    ``prefixed`` tells the rank (``HPC_RUN_PREFIXED=1``) that ``hpc run`` prefixes its
    lines with ``[rank r]``, so :func:`hpc.setup_logging` does not add a second prefix.
    """
    env = dict(os.environ if base is None else base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "NNODES": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "HPC_RUN_ID": run_id,
        "PYTHONUNBUFFERED": "1", "HPC_RUN_PREFIXED": "1" if prefixed else "0",
    })
    # Like torchrun: share the cores instead of every rank spawning one thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if loopback:  # all ranks are here: never let gloo pick the hostname's interface
        env.setdefault("GLOO_SOCKET_IFNAME", ",".join([loopback] * LOOPBACK_GLOO_LANES))
    return env


def resolve_command(cmd: Sequence[str], environ: Mapping[str, str] | None = None,
                    executable: str | None = None) -> list[str]:
    """The argv ``hpc run`` starts for ``cmd`` (pure, for tests).

    "This Python" is ``HPC_PYTHON`` when set, else the interpreter running ``hpc``
    (``executable``, default ``sys.executable``). A first word ``python``/``python3``
    means this Python, so an unactivated venv's ``hpc run -- python train.py`` runs the
    venv's interpreter; name another one by its path (``/usr/bin/python3``). A first
    word ending in ``.py`` runs with this Python. A bare name found beside this Python
    but not on ``PATH`` (``hpc`` of a venv that is not activated) runs from there.
    """
    env = os.environ if environ is None else environ
    python = envvars.value("HPC_PYTHON", env) or executable or sys.executable
    first = cmd[0]
    if first in PYTHON_WORDS:
        return [python, *cmd[1:]]
    if first.endswith(".py"):
        return [python, *cmd]
    beside = os.path.join(os.path.dirname(executable or sys.executable), first)
    if os.sep not in first and shutil.which(first) is None \
            and os.path.exists(beside):
        return [beside, *cmd[1:]]
    return list(cmd)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGKILL the child when ``hpc run`` dies."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # hpc run died before prctl took effect
            os._exit(1)

    return preexec


def _pump(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock,
          tail: collections.deque[str]) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        tail.append(line)
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


def _signal_group(p: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(p.pid, signum)  # the rank and its children (own session)
    except (ProcessLookupError, PermissionError):
        try:
            p.send_signal(signum)
        except ProcessLookupError:
            pass


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def run(cmd: Sequence[str], nproc: int, *, prefix: bool = True,
        port: int | None = None) -> int:
    """Run ``cmd`` as ``nproc`` local ranks; return the job's exit code.

    See :func:`resolve_command` for which program runs.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if not cmd:
        raise ValueError("no command given; usage: hpc run --nproc N -- CMD ...")
    envvars.check(os.environ)  # a typo fails here once, not in every rank
    if os.environ.get("HPC_LAUNCHER", "").strip():  # the names: the environments' rule
        check_override(os.environ["HPC_LAUNCHER"].strip())
    relay = envvars.value("HPC_PREEMPT_SIGNAL", os.environ)
    job = _Job(resolve_command(cmd), nproc, prefix, relay)
    port = port or int(os.environ.get("MASTER_PORT") or free_port("127.0.0.1"))
    handled = {signal.SIGINT, signal.SIGTERM, relay}
    previous = {s: signal.signal(s, job.on_signal) for s in handled}  # main thread only
    try:
        job.start(port)
    except OSError as e:
        job.stop()
        _say(f"cannot start {job.argv[0]!r}: {e}\nHINT: check the command after '--' "
             "(is it installed in this environment?)")
        return 127
    try:
        return job.monitor()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


Exit = tuple[int, int, float]  # (rank, exit code, when)


class _Job:
    """The ranks of one ``hpc run``: start, relay signals, wait, name the root cause."""

    def __init__(self, argv: list[str], nproc: int, prefix: bool,
                 relay: signal.Signals) -> None:
        self.argv, self.nproc, self.prefix, self.relay = argv, nproc, prefix, relay
        self.run_id = uuid.uuid4().hex[:12]
        self.error_dir = tempfile.mkdtemp(prefix=f"hpc-run-{self.run_id}-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pumps: list[threading.Thread] = []
        self.tails = [collections.deque(maxlen=40) for _ in range(nproc)]
        self.requested: int | None = None  # the signal that asked for a graceful stop
        self.interrupted: int | None = None  # the INT/TERM that asked for it
        self.hard: int | None = None  # a second INT/TERM: stop now
        self.slow: set[int] = set()  # failed first, still exiting when the rest stopped

    # -- start ------------------------------------------------------------------------
    def start(self, port: int) -> None:
        """Start every rank, then the threads streaming their output."""
        loopback, preexec = loopback_interface(), _die_with_parent()
        for rank in range(self.nproc):
            env = rank_env(rank, self.nproc, port, self.run_id, loopback=loopback,
                           prefixed=self.prefix)
            env["HPC_ERROR_DIR"] = self.error_dir
            self.procs.append(subprocess.Popen(
                self.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=preexec))  # noqa: PLW1509 - forked before any thread starts
        lock = threading.Lock()  # threads only now: no fork while they run (preexec_fn)
        for rank, p in enumerate(self.procs):
            tag = f"[rank {rank}] " if self.prefix else ""
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, daemon=True,
                                     args=(stream, out, tag, lock, self.tails[rank]))
                t.start()
                self.pumps.append(t)

    def stop(self) -> None:
        """Stop the ranks still running (TERM, KILL after GRACE); drop the mark dir."""
        _stop(self.procs)
        shutil.rmtree(self.error_dir, ignore_errors=True)

    # -- signals ----------------------------------------------------------------------
    def on_signal(self, signum: int, _frame: object) -> None:
        """Relay a stop request to every rank; a second INT/TERM stops them now."""
        name = signal.Signals(signum).name
        if signum in (signal.SIGINT, signal.SIGTERM) and signum != self.relay:
            if self.interrupted is not None:
                self.hard = signum
                return
            self.interrupted = signum
            _say(f"got {name}: asking all {len(self.procs)} ranks to stop at the next "
                 f"step ({self.relay.name}); {name} again stops them now")
        self.requested = self.requested or signum
        for p in self.procs:
            if p.returncode is None:
                try:
                    p.send_signal(self.relay)
                except ProcessLookupError:
                    pass

    def _failure(self, entry: Exit) -> bool:
        """A non-zero exit that is not a rank killed by a relayed stop request."""
        return entry[1] != 0 and not (self.requested and entry[1] == -self.relay)

    # -- wait -------------------------------------------------------------------------
    def monitor(self) -> int:
        """Wait for all ranks; on the first failure stop the rest and name the root cause."""
        exits: queue.Queue[Exit] = queue.Queue()
        for rank, p in enumerate(self.procs):
            threading.Thread(target=lambda r=rank, p=p: exits.put((r, p.wait(), time.time())),
                             daemon=True).start()
        seen: list[Exit] = []
        while len(seen) < len(self.procs) and self.hard is None:
            try:
                seen.append(exits.get(timeout=0.1))
            except queue.Empty:
                continue
            if self._failure(seen[-1]):
                break
        if self.hard is not None:  # SIGKILL: TERM may itself mean "stop gracefully" now
            for p in self.procs:
                _signal_group(p, signal.SIGKILL)
            self.stop()
            _say(f"got {signal.Signals(self.hard).name} again: stopped all "
                 f"{len(self.procs)} ranks")
            return 128 + self.hard
        if any(self._failure(e) for e in seen):
            return self._report(self._root_cause(exits, seen))
        self._join_pumps()
        shutil.rmtree(self.error_dir, ignore_errors=True)
        return self._stopped_code(seen)

    def _stopped_code(self, seen: list[Exit]) -> int:
        if all(code == 0 for _, code, _ in seen):
            return 0
        asked = self.requested or self.relay  # only relayed stops end without a failure
        _say(f"all {len(self.procs)} ranks stopped on {self.relay.name} "
             f"(asked by {signal.Signals(asked).name})")
        return 128 + asked

    def _root_cause(self, exits: queue.Queue[Exit], seen: list[Exit]) -> tuple[Exit, list[Exit]]:
        """The rank whose failure began first, among exited *and* still exiting ranks.

        Ranks that crashed because a peer died exit moments later; a rank that failed
        first may still be exiting (slow teardown). Every rank's failure mark is read:
        marked ranks get GRACE seconds to exit before the survivors are stopped.
        """
        deadline = time.monotonic() + GRACE
        time.sleep(0.2)
        while True:
            while not exits.empty():
                seen.append(exits.get())
            done = {r for r, _, _ in seen}
            exiting = [r for r in range(len(self.procs))
                       if r not in done and read_mark(self.error_dir, r)]
            if not exiting or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        failed = [e for e in seen if self._failure(e)]
        now = time.time()
        for rank in exiting:  # still alive, but marked: an exception began its end, or
            # the watchdog's report marked it stuck
            mark = read_mark(self.error_dir, rank)
            if mark and mark[1] != GENERIC_MESSAGE:
                failed.append((rank, 1, now))
                self.slow.add(rank)
        first = first_failure(self.error_dir, {r: t for r, _, t in failed}, (),
                              signalled=[r for r, code, _ in failed if code < 0])
        rank = first.rank if first else failed[0][0]  # every failed entry has a time
        return next(e for e in failed if e[0] == rank), failed

    def _report(self, cause: tuple[Exit, list[Exit]]) -> int:
        (rank, code, _), failed = cause
        mark = read_mark(self.error_dir, rank)
        self.stop()
        self._join_pumps()
        if rank in self.slow:
            how = "no exit of its own (still running when the others had failed; stopped)"
        else:
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        others = ", ".join(str(r) for r, _, _ in sorted(failed) if r != rank) or "none"
        _say(f"rank {rank} (pid {self.procs[rank].pid}) failed first with {how}"
             + (f": {mark[1].rstrip('.')}" if mark and mark[1] != GENERIC_MESSAGE else "")
             + f"; ranks failing after it: {others}; stopped all {len(self.procs)} ranks. "
             + self._where_output(rank) + self._missing_module(rank))
        return 128 - code if code < 0 else code

    def _where_output(self, rank: int) -> str:
        """Where to read the failed rank's output (a SIGKILLed rank may have printed none)."""
        if not self.tails[rank]:
            return "It printed nothing."
        return f"Its output above is prefixed [rank {rank}]." if self.prefix else \
            "Its output is above."

    def _missing_module(self, rank: int) -> str:
        """For a rank that died of ModuleNotFoundError: which Python ran, and the fix."""
        names = [m.group(1) for m in map(_MISSING.search, self.tails[rank]) if m]
        if not names:
            return ""
        program = shutil.which(self.argv[0]) or self.argv[0]
        top = names[-1].split(".")[0]
        which = (f"a leading `python` means {sys.executable}, this `hpc`'s own; "
                 "HPC_PYTHON=/path/to/python picks another")
        fix = (f"install torch-hpc (and torch) into it, or run a Python that has them: {which}"
               if top in ("hpc", "torch") else
               f"install {top!r} into that environment, or run a Python that has it: {which}")
        return (f"\nrank {rank} ran {program}, which cannot import {top!r}.\n"
                f"HINT: {fix}.")

    def _join_pumps(self) -> None:
        for t in self.pumps:
            t.join(timeout=2.0)


def _say(message: str) -> None:
    sys.stderr.write(f"hpc run: {message}\n")
    sys.stderr.flush()
