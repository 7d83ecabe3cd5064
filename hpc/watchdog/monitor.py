"""After init: name the stuck rank, and end the whole job when one rank fails.

:func:`start` (called by :func:`hpc.init_torch` on every rank of a job with more than
one) counts the world collectives (:mod:`hpc.watchdog.tracker`) and starts one daemon
thread per rank. Through the pre-flight store it:

* publishes this rank's progress (last collective's sequence number and op) when it
  changes, and answers report requests with that, where its main thread is and its
  Python stacks (:mod:`faulthandler`, all threads); for collectives on CUDA tensors it
  first asks the GPU which of them it reached and finished (:func:`tracker.poll
  <hpc.watchdog.tracker.poll>`, :mod:`hpc.watchdog.device`), since NCCL returns once
  a collective is queued;
* when this rank has waited in a collective for ``HPC_HANG_TIMEOUT`` seconds, asks every
  rank for a report and logs it as a warning (once per collective; nothing is killed);
* when a collective fails on a rank (its timeout, a dead peer), that rank gathers the
  report, publishes the failure and raises :class:`~hpc.errors.CollectiveError` naming
  the rank(s) that never entered the collective, with host, pid and stack. Every rank's
  watchdog then ends its own process (exit code :data:`EXIT_CODE`) within
  :data:`EXIT_GRACE` seconds, so the job ends under every launcher, bare ``srun``
  without ``--kill-on-bad-exit`` included. A culprit whose watchdog cannot answer (a
  stopped or wedged process) is killed by the reporter when it runs on its host, and
  under Slurm the reporter cancels the step (``scancel JOB.STEP``). Rank 0 serves the
  store until every rank read the failure; a rank that has not read it within
  :data:`EXIT_GRACE` seconds and two polls (starved on a loaded host, outside any
  collective) would never learn it once the store is gone, so under Slurm rank 0
  cancels the step too.

Environment variables:

* ``HPC_HANG_TIMEOUT`` — seconds in one collective before the warning report (default
  300; ``0`` turns the warning off).
* ``HPC_WATCHDOG`` — ``0`` disables the watchdog and the collective tracking.
* ``HPC_LOG_DIR`` — where the report (``hang-report.txt``) and, under nccl, PyTorch's
  Flight Recorder dumps (``nccl_trace_rank_<r>``) are written.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from hpc import envvars
from hpc.environments import DistInfo
from hpc.errors import CollectiveError
from hpc.watchdog import marks, report, tracker

__all__ = ["DEFAULT_HANG_TIMEOUT", "EXIT_CODE", "EXIT_GRACE", "Watchdog",
           "flight_recorder_env", "start", "stop"]

logger = logging.getLogger(__name__)

#: Seconds in one collective before the warning report (``HPC_HANG_TIMEOUT``).
DEFAULT_HANG_TIMEOUT: float = envvars.VARIABLES["HPC_HANG_TIMEOUT"].default
#: Exit code of a rank its watchdog ends because the job failed.
EXIT_CODE = 1
#: Seconds a rank gets to exit on its own once the job failed, before its watchdog ends it.
EXIT_GRACE = 3.0
#: Seconds between two looks of the watchdog at the store.
POLL = 0.5
#: Seconds the reporter waits for the other ranks' answers.
ANSWER_WAIT = 3.0
#: Timeout of the watchdog's store operations (a stopped master cannot block longer).
STORE_TIMEOUT = 5.0

StoreFactory = Callable[[float], Any]
_CURRENT: dict[str, Watchdog | None] = {"dog": None}


def flight_recorder_env(environ: Mapping[str, str]) -> dict[str, str]:
    """PyTorch's NCCL Flight Recorder settings to add to ``environ`` (pure).

    A trace buffer, a dump on timeout, and the dump file in ``HPC_LOG_DIR`` when set;
    nothing the user set is replaced.
    """
    wanted = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if environ.get("HPC_LOG_DIR"):
        wanted["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(
            Path(environ["HPC_LOG_DIR"]) / "nccl_trace_rank_")
    return {k: v for k, v in wanted.items() if k not in environ}


def _stacks() -> str:
    """Every thread's Python stack, as :func:`faulthandler.dump_traceback` prints it."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()


def main_thread_stack(dump: str) -> str:
    """The main thread's block of a :func:`_stacks` dump (all of it if not found)."""
    ident = threading.main_thread().ident or 0
    for block in dump.split("\n\n"):
        if block.lstrip().startswith((f"Thread 0x{ident:016x}", f"Current thread 0x{ident:016x}")):
            return block.strip()
    return dump.strip()


def _process_state(pid: int) -> str:
    """``stopped``/``gone``/``running`` for a pid on this host (Linux ``/proc``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return "gone"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(fields[0], "running")


class Watchdog:
    """One rank's watchdog; see the module docstring.

    Args:
        info: This rank's layout.
        connect: Opens a new client of the pre-flight store, given its op timeout.
        pg_timeout: The collective timeout (seconds), for messages.
        environ: Where ``HPC_HANG_TIMEOUT``, ``HPC_LOG_DIR``, ``HPC_ERROR_DIR`` and
            ``SLURM_JOB_ID``/``SLURM_STEP_ID`` are read.
    """

    def __init__(self, info: DistInfo, connect: StoreFactory, pg_timeout: float,
                 environ: Mapping[str, str]) -> None:
        self.info, self.connect, self.pg_timeout = info, connect, pg_timeout
        self.hang_timeout: float = envvars.value("HPC_HANG_TIMEOUT", environ)
        self.log_dir: str | None = envvars.value("HPC_LOG_DIR", environ)
        self.error_dir: str | None = envvars.value("HPC_ERROR_DIR", environ)
        self.slurm_step = (f"{environ['SLURM_JOB_ID']}.{environ['SLURM_STEP_ID']}"
                           if environ.get("SLURM_JOB_ID") and environ.get("SLURM_STEP_ID")
                           else None)
        # Rank 0 serves the store unless the torchrun agent does: it must outlive the
        # others' reading of a failure (see finish()).
        self.serves_store = info.rank == 0 and \
            environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
        self._cancel: threading.Thread | None = None
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.progress = tracker.Progress()
        self.failure: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._published: tuple[int, int, str, int] = (-1, -1, "", -1)
        self._answered = 0
        self._warned = 0
        self._thread: threading.Thread | None = None

    # -- the thread ---------------------------------------------------------------

    def start(self) -> None:
        """Open the thread's store client, track collectives, start the thread."""
        self._store = self.connect(STORE_TIMEOUT)
        self._answered = int(self._store.add("hpc/wd/req", 0))
        self._publish()
        tracker.install(self.progress, self.collective_failed)
        self._thread = threading.Thread(target=self._loop, name="hpc-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the tracking and the thread, and join it (at teardown): a daemon thread
        in a store call at finalization dies by ``pthread_exit`` in C++ frames, which
        calls ``std::terminate`` (SIGABRT after a clean run)."""
        self._stop.set()
        tracker.uninstall()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(STORE_TIMEOUT + POLL)

    def _loop(self) -> None:
        lost_since: float | None = None
        while not self._stop.wait(POLL):
            try:
                self._tick()
                lost_since = None
            except Exception as e:  # noqa: BLE001 - the store went away: rank 0 ended or died
                lost_since = lost_since or time.monotonic()
                if self._stop.is_set():
                    return
                if (self.progress.waiting() or self.progress.failed) and \
                        time.monotonic() - lost_since > 2 * STORE_TIMEOUT:
                    self._exit(f"the store at {self.info.master_addr}:{self.info.master_port} "
                               f"(rank 0) stopped answering ({e}) while this rank was in "
                               f"{self.progress.op} #{self.progress.entered}: rank 0 died "
                               "or is stopped")

    def _tick(self) -> None:
        tracker.poll()  # what the GPU finished of the CUDA collectives queued on it
        self._publish()
        self._answer()
        if self._store.check(["hpc/wd/failed"]):
            failed = json.loads(self._store.get("hpc/wd/failed"))
            self._ack(self._store)
            self._exit(f"rank {failed['rank']} reported that {failed['op']} "
                       f"#{failed['seq']} failed: {failed['summary']}")
        p = self.progress
        if (self.hang_timeout > 0 and p.waiting() and p.entered > self._warned
                and time.time() - p.since > self.hang_timeout):
            self._warned = p.entered
            if int(self._store.add(f"hpc/wd/warn/{p.entered}", 1)) == 1:
                text = report.compose("warning", self.info.rank, self.gather(self._store))
                logger.warning("possible hang (HPC_HANG_TIMEOUT=%gs; not ending the job):\n%s",
                               self.hang_timeout, text)

    def _ack(self, store: Any) -> None:
        """Note that this rank read the failure (rank 0 waits for the others): one key
        per rank, so that the main thread raising and the watchdog thread reading the
        failure too count once (a count of calls reached ``world_size - 1`` while a rank
        had not read it yet, and rank 0 took the store away from it)."""
        if self.info.rank != 0:
            store.set(f"hpc/wd/seen-failed/{self.info.rank}", "1")

    def _exit(self, why: str) -> None:
        """Give the process :data:`EXIT_GRACE` seconds to exit by itself, then end it."""
        self._stop.set()
        logger.error("rank %d: %s; ending this rank (exit code %d).", self.info.rank, why,
                     EXIT_CODE)
        time.sleep(EXIT_GRACE)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_CODE)

    # -- what this rank contributes --------------------------------------------------

    def _mine(self, with_stack: bool) -> dict[str, Any]:
        entry = {**self.progress.as_dict(), "host": self.host, "pid": self.pid}
        if with_stack:
            dump = _stacks()
            entry.update(answered=True, where=report.where(report.main_stack()),
                         stack=main_thread_stack(dump), threads=dump)
        return entry

    def _publish(self) -> None:
        p = self.progress
        now = (p.entered, p.completed, p.failed, p.queued)
        if now != self._published:
            self._store.set(f"hpc/wd/state/{self.info.rank}", json.dumps(self._mine(False)))
            self._published = now

    def _answer(self) -> None:
        wanted = int(self._store.add("hpc/wd/req", 0))
        if wanted > self._answered:
            mine = json.dumps(self._mine(True))
            for k in range(self._answered + 1, wanted + 1):
                self._store.set(f"hpc/wd/ans/{k}/{self.info.rank}", mine)
            self._answered = wanted

    # -- the report -----------------------------------------------------------------

    def gather(self, store: Any) -> dict[int, dict[str, Any]]:
        """Ask every rank for its entry; wait ``ANSWER_WAIT`` s; fill in the silent."""
        tracker.poll()
        k = int(store.add("hpc/wd/req", 1))
        entries: dict[int, dict[str, Any]] = {self.info.rank: self._mine(True)}
        pending = [r for r in range(self.info.world_size) if r != self.info.rank]
        deadline = time.monotonic() + ANSWER_WAIT
        while pending and time.monotonic() < deadline:
            for r in list(pending):
                if store.check([f"hpc/wd/ans/{k}/{r}"]):
                    entries[r] = json.loads(store.get(f"hpc/wd/ans/{k}/{r}"))
                    pending.remove(r)
            time.sleep(0.05)
        for r in pending:
            entries[r] = self._silent(store, r)
        return entries

    def _silent(self, store: Any, rank: int) -> dict[str, Any]:
        """What is known of a rank that did not answer: its last state, host, pid."""
        entry: dict[str, Any] = {"answered": False}
        for key in (f"hpc/pf/{rank}", f"hpc/wd/state/{rank}"):
            if store.check([key]):
                entry.update(json.loads(store.get(key)))
        if entry.get("host") == self.host and entry.get("pid"):
            entry["process"] = _process_state(int(entry["pid"]))
        return entry

    def collective_failed(self, seq: int, op: str, error: BaseException,
                          raising: bool = True) -> Exception | None:
        """Tracker callback: collective ``op #seq`` failed on this rank with ``error``, a
        job failure (:func:`~hpc.watchdog.tracker.is_job_failure`: a timeout or a lost
        peer; the tracker passes other errors, raised before sending, to the caller).

        The first failing rank gathers the report and publishes the failure; the others
        wait for it. Returns the :class:`CollectiveError` to raise instead; when nobody
        raises it (``raising`` False: an ``async_op`` collective) it is logged.
        """
        if self.failure is not None:
            return None
        self.progress.failed = f"{op} #{seq}: {str(error).splitlines()[0] if str(error) else error!r}"
        kind = "timeout" if "timed out" in str(error).lower() else "failure"
        try:
            store = self.connect(STORE_TIMEOUT)
            if int(store.add("hpc/wd/reporter", 1)) == 1:
                text = self._report(store, kind, error)
            else:
                text = self._await_report(store, seq, op)
        except Exception as e:  # noqa: BLE001 - the store is gone: rank 0 died or is stopped
            text = (f"{op} #{seq} {'timed out' if kind == 'timeout' else 'failed'} on rank "
                    f"{self.info.rank} ({self.host}, pid {self.pid}): "
                    f"{str(error).splitlines()[0] if str(error) else error!r}\n"
                    f"The pre-flight store at {self.info.master_addr}:{self.info.master_port} "
                    f"does not answer ({e}): rank 0 died or is stopped, so no rank's state "
                    "is known.\nHINT: look at rank 0's log and host first.")
        self.failure = {"seq": seq, "op": op, "text": text}
        if not raising:
            logger.error("rank %d: %s", self.info.rank, text)
        return CollectiveError(text)

    def _report(self, store: Any, kind: str, error: BaseException) -> str:
        entries = self.gather(store)
        text = report.compose(kind, self.info.rank, entries, str(error))
        seq, op = report.target(entries)
        stuck = report.culprits(entries)
        self._mark(stuck, entries, text)
        summary = text.splitlines()[0]
        store.set("hpc/wd/failed", json.dumps({"rank": self.info.rank, "seq": seq, "op": op,
                                                "summary": summary}))
        self._ack(store)
        if self.log_dir:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            full = "\n\n".join(f"rank {r}:\n{e.get('threads', '(no answer)')}"
                               for r, e in sorted(entries.items()))
            (Path(self.log_dir) / "hang-report.txt").write_text(
                f"{text}\n\nAll threads of every rank that answered:\n\n{full}\n")
        self._end_silent([r for r in stuck if not entries[r].get("answered")], entries)
        return text

    def _await_report(self, store: Any, seq: int, op: str) -> str:
        store.wait(["hpc/wd/failed"], timedelta(seconds=ANSWER_WAIT + STORE_TIMEOUT))
        failed = json.loads(store.get("hpc/wd/failed"))
        self._ack(store)
        return (f"{op} #{seq} failed on rank {self.info.rank} ({self.host}, pid {self.pid}); "
                f"rank {failed['rank']} reported: {failed['summary']}\n"
                f"The full report with the stuck ranks' stacks is in rank {failed['rank']}'s "
                "output.\nHINT: fix the rank(s) it names; this rank only waited.")

    def _mark(self, stuck: list[int], entries: Mapping[int, Mapping[str, Any]],
              text: str) -> None:
        """Failure marks for the culprits, dated when they stopped making progress."""
        if not self.error_dir:
            return
        for r in stuck:
            origin = (str(entries[r].get("host") or ""), int(entries[r].get("pid") or 0))
            marks.write_mark(self.error_dir, r, text.splitlines()[0],
                             float(entries[r].get("since") or time.time()), origin)

    def _end_silent(self, silent: list[int], entries: Mapping[int, Mapping[str, Any]]) -> None:
        """Kill culprits that cannot end themselves: on this host, or the Slurm step."""
        remote = False
        for r in silent:
            pid = int(entries[r].get("pid") or 0)
            if entries[r].get("host") == self.host and pid and entries[r].get("process") != "gone":
                logger.error("rank %d: killing rank %d (pid %d, %s): it cannot end itself",
                             self.info.rank, r, pid, entries[r].get("process"))
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            elif entries[r].get("host") != self.host:
                remote = True
        if remote and self.slurm_step:
            self._cancel = threading.Thread(target=self._scancel, daemon=True)
            self._cancel.start()

    def finish(self) -> None:
        """Before a failed rank exits: run the pending step cancel, and, on the rank
        serving the store, wait until every other rank read the failure (or
        :data:`EXIT_GRACE` + 2 polls), so no rank loses the store before it learns
        that the job failed.

        A rank that has not read it by then is stopped, dead, or was starved of CPU
        outside any collective: once the store is gone it would never learn of the
        failure, and a live one would never end (its watchdog ends a rank that lost the
        store only while it waits in a collective; outside one, rank 0 may have ended
        cleanly). Under Slurm the step is cancelled, as for a culprit that cannot end
        itself; other launchers end the remaining ranks at the first failure."""
        cancelled = self._cancel is not None
        if self._cancel is not None:
            self._cancel.join(EXIT_GRACE + 40)
        if not self.serves_store:
            return
        deadline = time.monotonic() + EXIT_GRACE + 2 * POLL
        seen = [f"hpc/wd/seen-failed/{r}" for r in range(1, self.info.world_size)]
        try:
            store = self.connect(STORE_TIMEOUT)
            while time.monotonic() < deadline:
                if store.check(seen):
                    return
                time.sleep(0.05)
            unread = [r for r, key in enumerate(seen, 1) if not store.check([key])]
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            logger.debug("finish: %s", e)
            return
        why = (f"rank(s) {report._ranks(unread)} did not read the job's failure within "
               f"{EXIT_GRACE + 2 * POLL:g} s (stopped, dead, or starved outside a "
               "collective) and would outlive the store")
        if self.slurm_step and not cancelled:
            self._scancel(0.0, why)
        else:
            logger.error("rank %d: %s; the launcher must end them", self.info.rank, why)

    def _scancel(self, wait: float = EXIT_GRACE + 2 * POLL,
                 why: str = "a rank on another node cannot end itself") -> None:
        time.sleep(wait)  # let the live ranks print and exit first
        logger.error("rank %d: cancelling Slurm step %s: %s", self.info.rank,
                     self.slurm_step, why)
        subprocess.run(["scancel", str(self.slurm_step)], timeout=30, check=False)


def start(info: DistInfo, connect: StoreFactory, pg_timeout: float,
          environ: MutableMapping[str, str]) -> Watchdog | None:
    """Start this rank's watchdog unless ``HPC_WATCHDOG=0`` or a single process."""
    if info.world_size <= 1 or not envvars.value("HPC_WATCHDOG", environ):
        return None
    dog = Watchdog(info, connect, pg_timeout, environ)
    dog.start()
    _CURRENT["dog"] = dog
    return dog


def stop() -> Watchdog | None:
    """Stop the running watchdog (teardown); returns it."""
    dog = _CURRENT["dog"]
    if dog is not None:
        dog.stop()
        _CURRENT["dog"] = None
    return dog
