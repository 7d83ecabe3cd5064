"""The fast pre-flight that runs before torch.distributed init.

The pre-flight turns the two classic silent hangs into errors within seconds:

* an unreachable master (wrong ``MASTER_ADDR``, rank 0 never started, a firewall):
  every other rank probes ``host:port`` with plain sockets and fails at the deadline
  naming both, instead of waiting out the 30-minute default timeout;
* a missing rank (``--ntasks`` vs ``--ntasks-per-node``, a dead process): rank 0 waits
  for every rank's key in its store and reports exactly which ranks never came.

It also refuses ranks that picked different backends (a rank that sees no GPU falls
back to gloo while its peers start NCCL, and both would hang in init), and stops nccl
ranks that would share one GPU (see :mod:`hpc.bootstrap.gpubind`) before NCCL
fails on them with "Duplicate GPU detected" or stalls.

Non-master ranks only open the torch store once rank 0's port accepts connections, so
no client falls into the store's reconnect back-off. The master address itself comes
from :mod:`hpc.bootstrap.master`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from hpc.bootstrap import interfaces, network
from hpc.bootstrap.backend import parse_backend
from hpc.bootstrap.phases import phase
from hpc.environments import DistInfo
from hpc.errors import LaunchEnvironmentError, RendezvousError

if TYPE_CHECKING:  # attempt (torchrun) and gpubind (nccl) are imported where they apply
    from hpc.bootstrap import attempt, gpubind

__all__ = ["client", "confirm_init", "mixed_backend_error", "preflight"]

logger = logging.getLogger(__name__)


#: Seconds between two connection attempts to a port that does not accept yet. A rank
#: that is ready before rank 0 learns of rank 0's store half of this late on average (at
#: 20 ms that was most of the start-up when rank 0 came last); a refused local connect
#: costs some 50 us.
PROBE_POLL = 0.005
#: Seconds a node's local rank 0 waits for the master's network report, and at most
#: probes one of the master's addresses (only where nothing shows it reachable).
NET_WAIT = 3.0
_NET_MASTER = "hpc/pf/net/master"


def _connect_once(infos: list[Any], deadline: float) -> tuple[str | None, OSError | None]:
    """One TCP connection attempt to each of ``infos`` (``getaddrinfo`` results): the
    address that accepted it, or None and the last error."""
    last: OSError | None = None
    for family, stype, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, stype, proto) as s:
                s.settimeout(max(0.05, min(1.0, deadline - time.monotonic())))
                s.connect(sockaddr)
                return str(sockaddr[0]), None
        except OSError as e:
            last = e
    return None, last


def _reach(addr: str, port: int, deadline: float) -> str | None:
    """Connect to ``addr:port`` (a numeric address) until it accepts or the
    ``time.monotonic()`` deadline: None when it did, else the last error as text."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_NUMERICHOST)
    except socket.gaierror as e:
        return str(e)
    while True:
        reached, last = _connect_once(infos, deadline)
        if reached is not None:
            return None
        if time.monotonic() >= deadline:
            return str(last)
        time.sleep(PROBE_POLL)


def _probe(addr: str, port: int, rank: int, start: float, deadline: float) -> str:
    """Wait until ``addr:port`` accepts TCP connections, or fail at ``deadline``; the
    address that accepted.

    ``start`` is when the pre-flight began (``time.monotonic()``), for the message.
    """
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise RendezvousError(
            f"rank {rank}: cannot resolve master address {addr!r} ({e}).\n"
            "MASTER_ADDR (or the first host of the nodelist) is not a known host name "
            "on this node.\n"
            "HINT: export MASTER_ADDR=<an address of rank 0's node that every node can "
            "reach>, e.g. $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)."
        ) from e
    while True:
        reached, last = _connect_once(infos, deadline)
        if reached is not None:
            return reached
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"rank {rank}: master {addr}:{port} is unreachable ({last}) after "
                f"waiting {deadline - start:.1f}s.\n"
                "Rank 0 never opened its store there: it did not start, crashed before "
                "init, runs on another host than MASTER_ADDR names, or a firewall blocks "
                "the port.\n"
                "HINT: check rank 0's log first; make sure MASTER_ADDR/MASTER_PORT are the "
                "same on every rank and reachable (HPC_CONNECT_TIMEOUT sets this wait)."
            ) from last
        time.sleep(PROBE_POLL)


def preflight(info: DistInfo, connect_timeout: float, pg_timeout: timedelta,
              environ: Mapping[str, str] | None = None,
              gpu: gpubind.GpuClaim | None = None,
              backend: str | None = None,
              pinned: Mapping[str, str] | None = None) -> Any:
    """Bring every rank together on rank 0's TCPStore and return the store.

    ``gpu`` is the GPU this rank bound for nccl; rank 0 refuses a GPU claimed twice.
    ``backend`` is the backend this rank picked; rank 0 refuses a mix (None: unchecked).
    Rank 0 and each other node's local rank 0 publish their network
    (:mod:`hpc.bootstrap.interfaces`; ``pinned``: the interface variables
    :func:`~hpc.bootstrap.interfaces.interface_env` returned and init set), the latter
    after probing the master's addresses nothing shows reachable, and rank 0 refuses a
    multi-node run whose network is known to break (:mod:`hpc.bootstrap.network`),
    unless ``HPC_NETWORK=off``; with every rank on one node
    (``local_world_size == world_size``) nothing is published.
    The returned store's timeout is ``pg_timeout`` on every rank: NCCL fetches its
    unique id through it, so what was left of the pre-flight window must not apply.

    Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent already serves the
    store at ``MASTER_PORT``; every rank, rank 0 included, joins it as a client, and keys
    are scoped by an attempt id all ranks agree on (:mod:`hpc.bootstrap.attempt`), so a
    restarted attempt starts clean even where the nodes' restart counts differ.

    Raises:
        RendezvousError: the master is unreachable, its port is taken, a rank is
            missing at the deadline, or two processes claim the same rank.
        LaunchEnvironmentError: two ranks would share one GPU under nccl, ranks
            picked different backends, or the nodes' network is broken (every rank).
    """
    addr, port = info.master_addr, info.master_port
    assert addr and port, "resolve_master() runs first"
    start = time.monotonic()
    deadline = start + connect_timeout
    env = os.environ if environ is None else environ
    with phase("preflight.store"):
        store, answerer, reached = _open_store(info, addr, port, env, pg_timeout,
                                               (start, deadline))
    # on one node the network is never refused: no reports to publish or read
    checked = interfaces.mode(env) != "off" and info.local_world_size < info.world_size
    if checked:
        with phase("preflight.network"):
            _publish_network(store, info, pinned, reached, backend, deadline)
    with phase("preflight.join"):
        _join(store, info, gpu, backend)
    with phase("preflight.wait"):  # for the others (rank 0), or for rank 0's verdict
        if info.rank == 0:
            if answerer is not None:  # until every rank learnt the attempt and joined it
                keys = [f"hpc/pf/{r}" for r in range(info.world_size)]
                answerer.until(lambda: bool(store.check(keys)), deadline)
            _master_wait(store, info, addr, port, deadline, start)
        else:
            _worker_wait(store, info, addr, port, deadline + 10.0)
    if info.rank == 0:
        with phase("preflight.checks"):
            _verdict(store, info, backend, checked)
    store.set_timeout(pg_timeout)  # torch resets it only for stores it makes itself
    logger.debug("pre-flight done in %.3fs", time.monotonic() - start)
    return store


def _open_store(info: DistInfo, addr: str, port: int, env: Mapping[str, str],
                pg_timeout: timedelta, window: tuple[float, float]
                ) -> tuple[Any, attempt.Answerer | None, str | None]:
    """Rank 0's TCPStore: served by rank 0, or by the torchrun agent; the others join.

    ``window`` is the pre-flight's ``(start, deadline)`` in ``time.monotonic()`` time.
    Under torchrun the store is scoped to the attempt all ranks agreed on; rank 0 also
    gets the :class:`~hpc.bootstrap.attempt.Answerer` that tells the others (else None).
    Last, the address the master's port answered at (None on rank 0 serving it).
    """
    import torch.distributed as dist

    start, deadline = window
    if _agent_store(env):
        from hpc.bootstrap import attempt

        reached = _probe(addr, port, info.rank, start, deadline)
        store = dist.TCPStore(addr, port, None, False, timeout=pg_timeout)
        answerer = attempt.take(store, info) if info.rank == 0 else None
        agreed = answerer.attempt if answerer else attempt.ask(store, info, deadline)
        attempt.remember(info, agreed)
        logger.debug("torchrun attempt %d (local restart count %s)", agreed,
                     env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return dist.PrefixStore(attempt.prefix(agreed), store), answerer, reached
    if info.rank == 0:
        try:
            return dist.TCPStore(addr, port, None, True, timeout=pg_timeout,
                                 wait_for_workers=False), None, None
        except Exception as e:  # DistNetworkError: bind failed
            raise RendezvousError(
                f"rank 0: cannot listen on {addr}:{port}: {e}.\n"
                "Another job or step on this node already uses the port.\n"
                "HINT: export MASTER_PORT=<a free port> (the derived port is documented "
                "under 'Master address and port' in the launching guide)."
            ) from e
    reached = _probe(addr, port, info.rank, start, deadline)
    return dist.TCPStore(addr, port, None, False,
                         timeout=timedelta(seconds=max(1.0, deadline - time.monotonic()))
                         ), None, reached


def _publish_network(store: Any, info: DistInfo, pinned: Mapping[str, str] | None,
                     reached: str | None, backend: str | None, deadline: float) -> None:
    """Rank 0 publishes the master's :func:`~hpc.bootstrap.interfaces.local_report`; the
    local rank 0 of every other node probes the master's addresses that nothing shows
    reachable (:func:`~hpc.bootstrap.network.probe_targets`) and publishes its own report
    with the outcome, for rank 0's :func:`~hpc.bootstrap.network.check`."""
    if info.rank == 0:
        store.set(_NET_MASTER, json.dumps(interfaces.local_report(os.environ, pinned)))
        return
    if info.local_rank != 0:  # one report per node
        return
    report = interfaces.local_report(os.environ, pinned)
    until = min(deadline, time.monotonic() + NET_WAIT)
    try:  # rank 0 sets it as soon as its store exists
        store.wait([_NET_MASTER], timedelta(seconds=max(0.01, until - time.monotonic())))
        master = json.loads(store.get(_NET_MASTER).decode())
    except Exception as e:  # noqa: BLE001 - rank 0 runs HPC_NETWORK=off, or is late
        logger.debug("no network report of the master (%s): nothing probed", e)
        master = None
    if master is not None:
        probes, errors = network.probe_targets(report, master, reached, backend), {}
        for p in probes:
            if p["addr"] not in errors:
                errors[p["addr"]] = _reach(p["addr"], info.master_port or 0,
                                          min(deadline, time.monotonic() + NET_WAIT))
            p.update(port=info.master_port, reached=reached, error=errors[p["addr"]])
            if p["error"] is None:
                logger.info("network: probed the master's %s address %s (%s on %s): it "
                            "answers", p["for"], p["addr"], p["iface"] or "its hostname",
                            master["host"])
        report["probes"] = probes
    slot = store.add("hpc/pf/net/n", 1)
    store.set(f"hpc/pf/net/{slot}", json.dumps(report))


def client(info: DistInfo, environ: Mapping[str, str], timeout: float) -> Any:
    """A new client of the pre-flight store (same keys as :func:`preflight`'s).

    For threads that must not share the main thread's connection (the watchdog); every
    operation gives up after ``timeout`` seconds, so a stopped or dead master cannot
    block its caller for longer.
    """
    import torch.distributed as dist

    store = dist.TCPStore(info.master_addr, info.master_port, None, False,
                          timeout=timedelta(seconds=timeout))
    if _agent_store(environ):
        from hpc.bootstrap import attempt

        agreed = attempt.remembered(info)
        if agreed is not None:
            return dist.PrefixStore(attempt.prefix(agreed), store)
    return store


def _agent_store(environ: Mapping[str, str]) -> bool:
    """True when torchrun's agent serves the store (kept across restarts)."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _join(store: Any, info: DistInfo, gpu: gpubind.GpuClaim | None,
          backend: str | None = None) -> None:
    """Claim this rank's slot (refusing a second claimant), publish the GPU, report in."""
    if store.add(f"hpc/pf/claim/{info.rank}", 1) != 1:
        raise RendezvousError(
            f"rank {info.rank}: another process already joined "
            f"{info.master_addr}:{info.master_port} as rank {info.rank}.\nTwo launches "
            "share the master port, or RANK was exported by hand so several processes "
            "carry the same rank.\n"
            "HINT: unset RANK/LOCAL_RANK in the job script; give concurrent jobs distinct "
            "MASTER_PORTs."
        )
    if gpu is not None:
        from hpc.bootstrap import gpubind

        gpubind.publish(store, gpu)  # before joining: rank 0 then sees every claim
    me = {"host": socket.gethostname(), "pid": os.getpid(), "local_rank": info.local_rank,
          "world_size": info.world_size, "backend": backend,
          "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if backend is not None:
        store.add(f"hpc/pf/backend/{backend}", 1)
    store.set(f"hpc/pf/{info.rank}", json.dumps(me))


def _master_wait(store: Any, info: DistInfo, addr: str, port: int,
                 deadline: float, start: float) -> None:
    """Rank 0: wait until every rank joined; at the deadline abort, naming the missing."""
    keys = [f"hpc/pf/{r}" for r in range(info.world_size)]
    try:
        store.wait(keys, timedelta(seconds=max(0.01, deadline - time.monotonic())))
    except Exception as e:
        missing = [r for r in range(info.world_size) if not store.check([keys[r]])]
        shown = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        msg = (
            f"rank 0: {len(missing)} of {info.world_size} ranks did not join "
            f"{addr}:{port} within {time.monotonic() - start:.1f}s: missing rank(s) {shown}.\n"
            "They were never started, crashed before init, or run with another world "
            "size or master (e.g. --ntasks=N with --ntasks-per-node, or different "
            "MASTER_PORT per node).\n"
            "HINT: check the missing ranks' logs; under Slurm compare SLURM_NTASKS with "
            "what srun started (`hpc env` on each node shows the detected layout)."
        )
        _abort(store, "abort:" + msg, info.world_size - 1 - len(missing))
        raise RendezvousError(msg) from e


def _verdict(store: Any, info: DistInfo, backend: str | None, checked: bool) -> None:
    """Rank 0 once all joined: refuse mixed backends, a GPU claimed twice and (when
    ``checked``) a network known to break, on every rank; else let them go."""
    mixed = _mixed_backends(store, info, backend)
    if mixed is not None:
        _abort(store, "abort-launch:" + str(mixed), info.world_size - 1)
        raise mixed
    shared = None
    if backend is None or "nccl" in parse_backend(backend).values():  # GPUs claimed
        from hpc.bootstrap import gpubind

        shared = gpubind.find_shared(store)
    if shared is None and checked:
        nodes = int(store.add("hpc/pf/net/n", 0))
        reports = [json.loads(store.get(key).decode()) for key in
                   [_NET_MASTER, *(f"hpc/pf/net/{i}" for i in range(1, nodes + 1))]]
        shared = network.check(reports, backend)
        if shared is None and (line := network.note(reports)):
            logger.info("%s", line)
    if shared is not None:
        _abort(store, "abort-launch:" + str(shared), info.world_size - 1)
        raise shared
    store.set("hpc/pf/go", "ok")


def _mixed_backends(store: Any, info: DistInfo, backend: str | None
                    ) -> LaunchEnvironmentError | None:
    """On rank 0 after all joined: the error when ranks picked different backends.

    One counter read when all agree; the ranks' reports only on the error path.
    """
    if backend is None or store.add(f"hpc/pf/backend/{backend}", 0) == info.world_size:
        return None
    reports = [json.loads(store.get(f"hpc/pf/{r}").decode()) for r in range(info.world_size)]
    return mixed_backend_error([(r, m.get("backend"), m.get("host", "?"), m.get("visible"))
                                for r, m in enumerate(reports)])


def mixed_backend_error(ranks: list[tuple[int, str | None, str, str | None]]
                        ) -> LaunchEnvironmentError:
    """The error for ranks ``(rank, backend, host, CUDA_VISIBLE_DEVICES)`` that disagree."""
    by: dict[str, list[tuple[int, str, str | None]]] = {}
    for rank, name, host, visible in ranks:
        by.setdefault(str(name), []).append((rank, host, visible))
    parts = []
    for name, members in sorted(by.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(f"{r} ({h}, CUDA_VISIBLE_DEVICES={v})" for r, h, v in members[:8])
        more = f" and {len(members) - 8} more" if len(members) > 8 else ""
        parts.append(f"{name}: rank(s) {shown}{more}")
    return LaunchEnvironmentError(
        "ranks picked different torch.distributed backends: " + "; ".join(parts) + ".\n"
        "With the default backend a rank that sees no GPU falls back to gloo while its "
        "peers start NCCL; the two cannot form one group and init_process_group would "
        "hang.\n"
        "HINT: check the GPU allocation of the listed node(s) (nvidia-smi, "
        "--gpus-per-task / --gpus-per-node, CUDA_VISIBLE_DEVICES), or pass the same "
        "backend to hpc.init_torch() on every rank (backend='gloo' to run on CPU).")


def _abort(store: Any, verdict: str, readers: int, linger: float = 3.0) -> None:
    """Publish an abort verdict; wait (briefly) until ``readers`` ranks have read it.

    Rank 0 serves the store: exiting at once could close it before the other ranks
    fetched the reason, and they would report a vanished master instead.
    """
    store.set("hpc/pf/go", verdict)
    end = time.monotonic() + linger
    while readers > 0 and time.monotonic() < end:
        if store.add("hpc/pf/verdict-read", 0) >= readers:
            return
        time.sleep(0.01)


def _worker_wait(store: Any, info: DistInfo, addr: str, port: int, deadline: float) -> None:
    try:
        store.wait(["hpc/pf/go"], timedelta(seconds=max(0.01, deadline - time.monotonic())))
        verdict = store.get("hpc/pf/go").decode()
        if verdict != "ok":
            store.add("hpc/pf/verdict-read", 1)  # rank 0 may leave now
    except Exception as e:
        raise RendezvousError(
            f"rank {info.rank}: connected to {addr}:{port} but rank 0 never confirmed "
            "that all ranks joined.\nRank 0 died or stalled during start-up.\n"
            "HINT: check rank 0's log."
        ) from e
    if verdict.startswith("abort"):
        kind, reason = verdict.split(":", 1)
        error = LaunchEnvironmentError if kind == "abort-launch" else RendezvousError
        raise error(f"rank {info.rank}: rank 0 aborted start-up: {reason}")


def confirm_init(store: Any, info: DistInfo, timeout: float) -> None:
    """Return only once every rank has finished ``init_process_group``.

    Without it a rank that returns from init and fails at once (a bad argument, a
    missing file) closes its sockets while peers are still connecting their gloo mesh,
    and they die with "Connection closed by peer", hiding the real cause. One counter
    in the store; the last rank to arrive releases the others.
    """
    if store.add("hpc/pf/initialised", 1) == info.world_size:
        store.set("hpc/pf/all-initialised", "1")
    try:
        store.wait(["hpc/pf/all-initialised"], timedelta(seconds=max(1.0, timeout)))
    except Exception as e:
        raise RendezvousError(
            f"rank {info.rank}: initialised, but not every rank of {info.world_size} "
            f"finished init_process_group within {timeout:.0f}s.\n"
            "A rank crashed or stalled while connecting to its peers.\n"
            "HINT: check the other ranks' logs for the first error."
        ) from e
