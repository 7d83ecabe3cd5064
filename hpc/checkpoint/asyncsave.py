"""Asynchronous checkpoints: the master's writer handle, and the collective wait.

``hpc.save_checkpoint(..., blocking=False)`` returns once the state is staged (copied into
shared memory, :mod:`hpc.checkpoint.staging`); the writer process
(:mod:`hpc.checkpoint.writer`) writes the file meanwhile. At most one save is in flight:
the next save, :func:`wait_for_checkpoint` and the end of the process wait for it, and a
failed write (disk full, I/O error, a killed writer) is raised there on every rank, as a
synchronous save would have raised it.

Every rank keeps the path of the save in flight (each called the same save), so the wait
is one broadcast from the master only when there is something to wait for. The master
alone holds a :class:`Writer`: the stage and the process, started at its first
asynchronous save and kept for the next.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional

from hpc.errors import CheckpointError

__all__ = ["Writer", "start_save", "settle", "wait_for_checkpoint", "WAIT_NOTE_S"]

logger = logging.getLogger(__name__)

#: A wait for the save in flight longer than this (seconds) is logged: saves come faster
#: than the writer writes, or the filesystem stalls.
WAIT_NOTE_S = 1.0
#: The path of the save in flight, on every rank (None: nothing to wait for).
_IN_FLIGHT: Optional[str] = None
#: The master's writer, once it saved asynchronously.
_WRITER: Optional["Writer"] = None


class Writer:
    """The master's end of the writer process: its stage, its pipes, the save in flight."""

    def __init__(self) -> None:
        from hpc.checkpoint.staging import Stage

        self.stage: Optional[Stage] = None
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.requests: Optional[Connection] = None
        self.answers: Optional[Connection] = None
        self.pending: Optional[tuple[str, float]] = None  # (path, submitted at)
        self.written: Any = False  # a synchronous fallback's result: error text or None
        self.warned = False  # about a fallback: once
        self.starting = False  # the save in flight started the writer process

    def _start(self) -> None:
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the directory holding hpc/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hpc.checkpoint.writer", str(os.getpid()),
             str(to_child), str(from_child)], pass_fds=(to_child, from_child), env=env,
            stdin=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self.requests = Connection(from_parent, readable=False)
        self.answers = Connection(to_parent, writable=False)
        logger.debug("checkpoint writer started: pid %d", self.proc.pid)

    def submit(self, payload: dict[str, Any], path: Path, step: int, keep: int) -> float:
        """Stage ``payload`` and hand it to the writer; the seconds the staging took."""
        assert self.pending is None, "one save in flight at most"
        started = time.perf_counter()
        reason = self._unstageable(payload)
        if reason is not None:
            self._write_now(payload, path, step, keep, reason)
            return time.perf_counter() - started
        assert self.stage is not None
        skeleton = self.stage.copy(payload)
        staged = time.perf_counter() - started
        self.starting = self.proc is None or self.proc.poll() is not None
        if self.starting:
            self._start()
        assert self.requests is not None
        self.requests.send((str(self.stage.dir), skeleton, str(path), int(step), int(keep)))
        self.pending = (str(path), time.monotonic())
        return staged

    def _unstageable(self, payload: dict[str, Any]) -> Optional[str]:
        """Why ``payload`` cannot be staged in memory, or None when it can."""
        from hpc.checkpoint.staging import Stage, stage_root

        try:
            if self.stage is None:
                self.stage = Stage()
            short = self.stage.shortfall(payload)
        except OSError as e:
            return f"cannot stage it in {stage_root()}: {e}"
        if short:
            return f"{stage_root()} lacks {short / 2**20:.0f} MiB to stage it in memory"
        return None

    def _write_now(self, payload: dict[str, Any], path: Path, step: int, keep: int,
                   reason: str) -> None:
        """Save synchronously (it cannot be staged); :meth:`wait` returns its result."""
        from hpc.checkpoint.writer import write_checkpoint

        log, self.warned = (logger.debug if self.warned else logger.warning), True
        log(
            "asynchronous checkpoint %s: %s; saved synchronously instead (training "
            "waited for the write).\nHINT: point HPC_STAGE_DIR at a tmpfs with room for "
            "one copy of the state (a container's /dev/shm is often 64 MiB: docker "
            "--shm-size), or save with blocking=True.", path.name, reason)
        self.written = write_checkpoint(payload, path, step, keep)
        self.pending = (str(path), time.monotonic())

    def wait(self) -> Optional[str]:
        """Wait for the save in flight: its error text, or None (also when none is)."""
        if self.pending is None:
            return None
        if self.written is not False:  # saved synchronously by _write_now
            error, self.written, self.pending = self.written, False, None
            return error
        path, since = self.pending
        assert self.answers is not None and self.proc is not None
        started = time.monotonic()
        try:
            while not self.answers.poll(1.0):
                if self.proc.poll() is not None and not self.answers.poll(0):
                    return self._died(path)
            error, seconds = self.answers.recv()
        except (EOFError, OSError):
            return self._died(path)
        finally:
            self.pending = None
        waited = time.monotonic() - started
        log = logger.info if waited > WAIT_NOTE_S else logger.debug
        if self.starting:  # the process start (Python, torch), not the writing, took it
            log("waited %.1f s for checkpoint %s: its writer process was starting (the "
                "file took %.2f s once it ran; the save returned %.1f s before)", waited,
                Path(path).name, seconds, time.monotonic() - since)
        else:
            log("waited %.1f s for checkpoint %s, still being written (written in %.2f s; "
                "the save returned %.1f s before)", waited, Path(path).name, seconds,
                time.monotonic() - since)
        return error

    def _died(self, path: str) -> str:
        assert self.proc is not None
        code, pid = self.proc.wait(), self.proc.pid
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        self.proc = None  # the next save starts a new one
        return (f"rank 0's checkpoint writer (pid {pid}) ended with {how} "
                f"while writing {path}: that checkpoint was not written; the previous "
                "ones are intact (each is renamed into place only once complete).\n"
                "A process killed it (the out-of-memory killer, a user, the job's end).\n"
                "HINT: rerun: it resumes from the newest complete checkpoint; or catch "
                "hpc.CheckpointError around save_checkpoint to train on (the next save "
                "starts a new writer). dmesg names the OOM killer's victims.")

    def close(self) -> None:
        """End the writer (after its save in flight) and remove the stage."""
        if self.requests is not None:
            self.requests.close()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.answers is not None:
            self.answers.close()
        if self.stage is not None:
            self.stage.close()


def start_save(payload: Optional[dict[str, Any]], path: Path, step: int, keep: int,
           rank: int) -> None:
    """Hand the master's ``payload`` to the writer (on the master; every rank calls it,
    after :func:`settle`, to record the save in flight)."""
    global _IN_FLIGHT, _WRITER
    if rank == 0 and payload is not None:
        if _WRITER is None:
            _WRITER = Writer()
            atexit.register(_at_exit)
        staged = _WRITER.submit(payload, path, step, keep)
        logger.debug("staged %s in %.3f s", path.name, staged)
    _IN_FLIGHT = str(path)


def settle() -> None:
    """Wait for the save in flight, if any (collective when one is).

    Raises:
        CheckpointError: on every rank, when that save failed.
    """
    global _IN_FLIGHT
    if _IN_FLIGHT is None:
        return
    from hpc.sync.agree import broadcast_object, world
    from hpc.watchdog import tracker

    error = None
    if world()[0] == 0 and _WRITER is not None:
        with tracker.aside():  # the others wait for it: not a straggler (hpc.health)
            error = _WRITER.wait()
    _IN_FLIGHT = None
    error = broadcast_object(error)
    if error is not None:
        raise CheckpointError(error)


def wait_for_checkpoint() -> None:
    """Wait until the last asynchronous :func:`~hpc.save_checkpoint` is on disk
    (collective: every rank calls it; a no-op when none is in flight).

    Call it before the script ends and before anything reads the newest checkpoint.
    The next save and the end of the process wait too, but only this raises a failed
    write on every rank at a point of your choosing.

    Raises:
        CheckpointError: on every rank, when the write failed (the message says why);
            the previous checkpoints are intact.
    """
    settle()


def _at_exit() -> None:
    """The master's last act: wait for the save in flight, then end the writer; when that
    save failed, end the process with status 1 (the error is logged)."""
    global _WRITER
    if _WRITER is None:
        return
    error = _WRITER.wait()
    _WRITER.close()
    _WRITER = None
    if error is not None:  # a job that lost its last checkpoint must not end with 0
        logger.error("the last asynchronous checkpoint failed (exit status 1): %s\nHINT: "
                     "call hpc.wait_for_checkpoint() on every rank before the script "
                     "ends: it raises this on every rank.", error)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
