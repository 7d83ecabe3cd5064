"""``hpc run``: the embedded local launcher for machines without a scheduler.

Starts N ranks of a command on this host with torchrun-compatible variables, streams
their output with ``[rank r]`` prefixes, and when a rank fails stops the others and
exits with the first failure's code, naming that rank (torchrun's root-cause idea).
It never imports torch, so ranks start without waiting for it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import IO, Optional

from hpc.rendezvous import free_port

__all__ = ["run", "rank_env"]

#: Seconds between SIGTERM and SIGKILL when stopping surviving ranks.
GRACE = 5.0


def rank_env(rank: int, nproc: int, port: int, run_id: str,
             base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of local rank ``rank`` of ``nproc`` (pure, for tests)."""
    env = dict(os.environ if base is None else base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "NNODES": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "HPC_RUN_ID": run_id,
        "PYTHONUNBUFFERED": "1",
    })
    # Like torchrun: share the cores instead of every rank spawning one thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def _pump(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run(cmd: Sequence[str], nproc: int, *, prefix: bool = True,
        port: Optional[int] = None) -> int:
    """Run ``cmd`` as ``nproc`` local ranks; return the job's exit code.

    A command whose first word ends in ``.py`` runs with this Python interpreter.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if not cmd:
        raise ValueError("no command given; usage: hpc run --nproc N -- CMD ...")
    argv = [sys.executable, *cmd] if cmd[0].endswith(".py") else list(cmd)
    beside = os.path.join(os.path.dirname(sys.executable), argv[0])
    if os.sep not in argv[0] and shutil.which(argv[0]) is None and os.path.exists(beside):
        argv[0] = beside  # e.g. `hpc` from a venv that is not on PATH
    port = port or int(os.environ.get("MASTER_PORT") or free_port("127.0.0.1"))
    run_id = uuid.uuid4().hex[:12]
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    try:
        for rank in range(nproc):
            p = subprocess.Popen(argv, env=rank_env(rank, nproc, port, run_id),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(p)
            tag = f"[rank {rank}] " if prefix else ""
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, out, tag, lock), daemon=True)
                t.start()
                pumps.append(t)
    except OSError as e:
        _stop(procs)
        print(f"hpc run: cannot start {argv[0]!r}: {e}\nHINT: check the command after "
              "'--' (is it installed in this environment?)", file=sys.stderr)
        return 127
    first: Optional[tuple[int, int]] = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                first = failed[0]
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        first = (-1, 130)
    if first is not None:
        _stop(procs)
    for t in pumps:
        t.join(timeout=2.0)
    if first is None:
        return 0
    rank, code = first
    if rank < 0:
        print("hpc run: interrupted; stopped all ranks", file=sys.stderr)
        return code
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    print(f"hpc run: rank {rank} (pid {procs[rank].pid}) failed first with {how}; "
          f"stopped the other {nproc - 1} rank(s). Its output above is prefixed "
          f"[rank {rank}].", file=sys.stderr)
    return 128 - code if code < 0 else code
