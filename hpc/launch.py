"""``hpc run``: the embedded local launcher for machines without a scheduler.

Starts N ranks of a command on this host with torchrun-compatible variables, streams
their output with ``[rank r]`` prefixes, and when a rank fails stops the others and
exits with the first failure's code, naming that rank (torchrun's root-cause idea).
It never imports torch, so ranks start without waiting for it.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from typing import IO, Optional

from hpc.bootstrap.failure import read_mark
from hpc.environments.base import free_port

__all__ = ["run", "rank_env"]

#: Seconds between SIGTERM and SIGKILL when stopping surviving ranks.
GRACE = 5.0

#: gloo connections per pair of ranks on loopback (``GLOO_SOCKET_IFNAME=lo,lo``): each
#: one is a gloo "device" with its own socket, I/O thread and two worker threads, and
#: collectives alternate between them. Two let the many collectives of ``sync_model``
#: overlap (ResNet-50 at world size 2: 0.76x -> 0.91x a flat broadcast, median of 5
#: runs; see docs/sync.md); one flat broadcast is as fast as before.
LOOPBACK_GLOO_LANES = 2


def loopback_interface() -> Optional[str]:
    """Name of this host's loopback interface (``lo`` on Linux), or None."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def rank_env(rank: int, nproc: int, port: int, run_id: str,
             base: Optional[dict[str, str]] = None,
             loopback: Optional[str] = None) -> dict[str, str]:
    """The environment of local rank ``rank`` of ``nproc`` (pure, for tests).

    ``loopback`` names the loopback interface: unless ``GLOO_SOCKET_IFNAME`` is set,
    gloo then talks over it only, on ``LOOPBACK_GLOO_LANES`` connections.
    """
    env = dict(os.environ if base is None else base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "NNODES": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "HPC_RUN_ID": run_id,
        "PYTHONUNBUFFERED": "1",
    })
    # Like torchrun: share the cores instead of every rank spawning one thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if loopback:  # all ranks are here: never let gloo pick the hostname's interface
        env.setdefault("GLOO_SOCKET_IFNAME", ",".join([loopback] * LOOPBACK_GLOO_LANES))
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
    error_dir = tempfile.mkdtemp(prefix=f"hpc-run-{run_id}-")
    loopback = loopback_interface()
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    try:
        for rank in range(nproc):
            env = rank_env(rank, nproc, port, run_id, loopback=loopback)
            env["HPC_ERROR_DIR"] = error_dir
            p = subprocess.Popen(argv, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(p)
            tag = f"[rank {rank}] " if prefix else ""
            for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(stream, out, tag, lock), daemon=True)
                t.start()
                pumps.append(t)
    except OSError as e:
        _stop(procs)
        shutil.rmtree(error_dir, ignore_errors=True)
        print(f"hpc run: cannot start {argv[0]!r}: {e}\nHINT: check the command after "
              "'--' (is it installed in this environment?)", file=sys.stderr)
        return 127
    return _monitor(procs, pumps, error_dir)


def _monitor(procs: Sequence[subprocess.Popen[bytes]], pumps: Sequence[threading.Thread],
             error_dir: str) -> int:
    """Wait for all ranks; on the first failure stop the rest and name the root cause."""
    exits: queue.Queue[tuple[int, int, float]] = queue.Queue()
    for rank, p in enumerate(procs):
        threading.Thread(target=lambda r=rank, p=p: exits.put((r, p.wait(), time.time())),
                         daemon=True).start()
    seen: list[tuple[int, int, float]] = []

    def terminated(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, terminated)  # scancel, timeouts: stop ranks too
    try:
        while len(seen) < len(procs):
            seen.append(exits.get())
            if seen[-1][1] != 0:
                break
    except KeyboardInterrupt as e:
        _stop(procs)
        print(f"hpc run: interrupted ({e or 'SIGINT'}); stopped all ranks", file=sys.stderr)
        return 143 if str(e) == "SIGTERM" else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = [entry for entry in seen if entry[1] != 0]
    if failed:
        # Ranks that crashed because a peer died exit moments later; collect them too
        # (not the ones we stop), then pick the earliest failure mark as the root cause.
        time.sleep(0.2)
        while not exits.empty():
            failed.append(exits.get())
        failed = [entry for entry in failed if entry[1] != 0]
        _stop(procs)
    for t in pumps:
        t.join(timeout=2.0)
    if not failed:
        shutil.rmtree(error_dir, ignore_errors=True)
        return 0

    def began(entry: tuple[int, int, float]) -> float:
        mark = read_mark(error_dir, entry[0])
        return min(mark[0], entry[2]) if mark else entry[2]

    first_code = failed[0][1]
    # A rank the watchdog's report marked as stuck failed first, even if we stopped it.
    gone = {r for r, _, _ in failed}
    stuck = [(r, p.returncode, time.time()) for r, p in enumerate(procs)
             if r not in gone and read_mark(error_dir, r)]
    rank, code, _ = min(failed + stuck, key=began)
    mark = read_mark(error_dir, rank)
    shutil.rmtree(error_dir, ignore_errors=True)
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    if rank not in gone:
        how, code = "no exit of its own (stopped by hpc run)", first_code
    others = ", ".join(str(r) for r, _, _ in sorted(failed) if r != rank) or "none"
    print(f"hpc run: rank {rank} (pid {procs[rank].pid}) failed first with {how}"
          + (f": {mark[1]}" if mark and mark[1] != "exited with a non-zero code" else "")
          + f"; ranks failing after it: {others}; stopped all {len(procs)} ranks. "
          f"Its output above is prefixed [rank {rank}].", file=sys.stderr)
    return 128 - code if code < 0 else code
