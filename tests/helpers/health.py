"""``hpc pretrain`` on the 4-node test cluster with a fault started at a chosen step, and
the straggler verdicts it logged: shared by tests/integration/test_health_cluster.py and
bench/stragglers.py.

The run logs at DEBUG, so the master prints each straggler window
(``straggler window 41-60 ...``) as it closes; :func:`pretrain_on_four` reads the output
as it comes and calls ``trigger()`` once the window ending at ``at`` closed: the fault
starts at a known step, not after a guessed sleep.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

#: ``straggler: node3 (ranks 4-5) ... over steps 61-80`` / ``... after steps 61-80``.
VERDICT = re.compile(r"WARNING hpc\.health\.step: straggler: (?P<hosts>[\w, .-]+?) "
                     r"\((?P<ranks>ranks? [\d,-]+)\)(?P<what>.*?)(?:over|after) steps "
                     r"(?P<start>\d+)-(?P<end>\d+)")
WINDOW = re.compile(r"straggler window (\d+)-(\d+) ")
#: The shaping of a "slow link": 20 Mbit/s out of node3, a deep queue (no drops). With a
#: /dev/shm per node the gradients cross the links: a 61 ms step takes ~410 ms, and the
#: probe's 64 KiB (32 KiB of burst) take ~16 ms against ~0.8 ms, 20x (the rule: 5x).
TBF = ["tbf", "rate", "20mbit", "burst", "32kb", "latency", "2s"]


@dataclass
class Verdict:
    hosts: list[str]
    ranks: str
    what: str
    start: int
    end: int
    at: float  #: time.monotonic() when the line was read


@dataclass
class Run:
    returncode: int
    lines: list[str]
    verdicts: list[Verdict] = field(default_factory=list)
    triggered_at: Optional[float] = None  #: time.monotonic() of trigger()
    wall: float = 0.0

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def verdicts_of(lines: Sequence[tuple[float, str]]) -> list[Verdict]:
    out = []
    for t, line in lines:
        m = VERDICT.search(line)
        if m:
            out.append(Verdict([h.strip() for h in m["hosts"].split(",")], m["ranks"],
                               m["what"], int(m["start"]), int(m["end"]), t))
    return out


def pretrain_on_four(out: Path, job: str, env: dict[str, str], *, epochs: int,
                     at: Optional[int] = None, trigger: Optional[Callable[[], None]] = None,
                     extra: Sequence[str] = (), timeout: float = 240) -> Run:
    """``srun -p four -N4 --ntasks-per-node=2 hpc pretrain`` (8 ranks, batch 16: 11 steps
    an epoch); ``trigger()`` once the straggler window ending at step ``at`` closed."""
    argv = ["srun", f"--job-name={job}", "--time=4", "-p", "four", "-N4",
            "--ntasks-per-node=2", sys.executable, "-m", "hpc", "pretrain", "--no-progress",
            "--out", str(out), "--no-resume", "--batch-size", "16", "--epochs", str(epochs),
            "--val-every", "10", "--log-level", "DEBUG", *extra]
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=out.parent, start_new_session=True)
    lines: list[tuple[float, str]] = []
    run = Run(returncode=-1, lines=[])
    killer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    killer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            m = WINDOW.search(line)
            if trigger is not None and run.triggered_at is None and m and int(m[2]) == at:
                trigger()
                run.triggered_at = time.monotonic()
        run.returncode = proc.wait()
    finally:
        killer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run.wall = time.monotonic() - start
    run.lines = [line for _, line in lines]
    run.verdicts = verdicts_of(lines)
    return run


def tc_node3(action: str, *qdisc: str) -> subprocess.CompletedProcess[str]:
    """``tc qdisc ACTION dev eth0 root ...`` inside node3's namespace."""
    return subprocess.run(["ip", "netns", "exec", "hpc-node3", "tc", "qdisc", action, "dev",
                           "eth0", "root", *qdisc], check=False, capture_output=True,
                          text=True, timeout=20)


def rank_pid(marker: str, procid: int) -> Optional[int]:
    """The pid of the process whose command line holds ``marker`` and whose environment
    says ``SLURM_PROCID=procid`` (a rank of the job, in whichever namespace)."""
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            env = Path(path).read_bytes().split(b"\0")
            cmd = Path(path).with_name("cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmd and b"pretrain" in cmd \
                and f"SLURM_PROCID={procid}".encode() in env:
            return int(path.split("/")[2])
    return None


@contextmanager
def duty_cycle(pid_of: Callable[[], Optional[int]], stopped: float = 0.06,
               running: float = 0.14) -> Iterator[Callable[[], None]]:
    """A thread that, once started (call the yielded function), SIGSTOPs the process
    ``pid_of()`` finds for ``stopped`` seconds in every ``stopped + running`` (30 % by
    default) until the block ends or the process is gone; it is left running."""
    done = threading.Event()

    def cycle() -> None:
        pid = pid_of()
        try:
            while pid is not None and not done.is_set():
                os.kill(pid, signal.SIGSTOP)
                time.sleep(stopped)
                os.kill(pid, signal.SIGCONT)
                time.sleep(running)
        except ProcessLookupError:
            return
        finally:
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    thread = threading.Thread(target=cycle, daemon=True)
    try:
        yield thread.start
    finally:
        done.set()
        if thread.is_alive():
            thread.join(timeout=5)
