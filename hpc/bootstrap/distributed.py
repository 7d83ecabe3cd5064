"""``init_torch`` / ``teardown``: the launch detected, exported and initialised.

The roles it records (``hpc.get_rank()``, ``hpc.is_master()``, ...) are read through
:mod:`hpc.roles`.

A training script written for torch-hpc looks the same under every launcher::

    import hpc
    info = hpc.init_torch(seed=0)
    model = build_model().to(hpc.device())
    hpc.sync_model(model)
    ...

No explicit teardown is needed: it is registered with :mod:`atexit`.

This module is the one writer of ``os.environ`` in :mod:`hpc.bootstrap`: each phase
returns the variables it wants set and ``init_torch`` applies them, through one export
step, at the point where the next phase reads them:

* the layout as torchrun's variables (:func:`torchrun_env`; it refuses to replace a
  different value), first;
* ``OMP_NUM_THREADS`` (:func:`hpc.bootstrap.threads.plan`), before torch's own count;
* ``CUDA_VISIBLE_DEVICES`` narrowed to the local rank's MIG instance, before CUDA starts;
* the NCCL Flight Recorder settings (:func:`hpc.watchdog.monitor.flight_recorder_env`)
  and ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``
  (:func:`hpc.bootstrap.interfaces.interface_env`), before the pre-flight and
  ``init_process_group``.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from typing import Any, Optional, Union

from hpc import envvars, roles
from hpc.bootstrap import phases, threads
from hpc.environments import DistInfo, detect
from hpc.errors import LaunchEnvironmentError

__all__ = ["init_torch", "teardown", "export_env", "torchrun_env", "seed_everything"]

logger = logging.getLogger(__name__)

_STATE: dict[str, Any] = {"atexit": False}

#: Default collective timeout; torch's own default is 30 minutes (10 for NCCL).
DEFAULT_TIMEOUT = timedelta(minutes=10)
#: Default pre-flight wait for all ranks; override with ``HPC_CONNECT_TIMEOUT`` (s).
DEFAULT_CONNECT_TIMEOUT: float = envvars.VARIABLES["HPC_CONNECT_TIMEOUT"].default


def _torchrun_values(info: DistInfo) -> dict[str, object]:
    """What :func:`export_env` writes: torchrun's variable -> value (None: left alone)."""
    return {
        "MASTER_ADDR": info.master_addr, "MASTER_PORT": info.master_port,
        "RANK": info.rank, "WORLD_SIZE": info.world_size, "LOCAL_RANK": info.local_rank,
        "LOCAL_WORLD_SIZE": info.local_world_size, "GROUP_RANK": info.node_rank,
        "NODE_RANK": info.node_rank, "NNODES": info.num_nodes,
    }


#: The torchrun-style variables :func:`export_env` writes.
EXPORTED: tuple[str, ...] = tuple(_torchrun_values(DistInfo(launcher="local")))


def torchrun_env(info: DistInfo, environ: Mapping[str, str], *,
                 overwrite: bool = False) -> dict[str, str]:
    """The torchrun-style variables of ``info`` to set over ``environ`` (pure).

    ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``NODE_RANK``, ``NNODES``; a field ``info``
    does not know (``None``) is left out.

    Raises:
        LaunchEnvironmentError: a variable of ``environ`` already holds a different
            value and ``overwrite`` is False; the message shows both values.
    """
    values = {k: str(v) for k, v in _torchrun_values(info).items() if v is not None}
    clashes = [f"{k}={environ[k]} (set) vs {v} (detected from {info.launcher})"
               for k, v in values.items() if k in environ and environ[k] != v]
    if clashes and not overwrite:
        raise LaunchEnvironmentError(
            "refusing to overwrite existing variables with different values: "
            + "; ".join(clashes) + ".\n"
            "They were exported by hand or by an outer launcher and contradict the "
            "detected layout.\n"
            "HINT: unset them, or set HPC_LAUNCHER to the launcher that should win."
        )
    return values


def export_env(info: DistInfo, environ: Optional[MutableMapping[str, str]] = None,
               *, overwrite: bool = False) -> None:
    """Write ``info`` as torchrun-style variables (:func:`torchrun_env`).

    Code that reads them (``env://`` init, other libraries) then sees the same layout.

    Args:
        info: The layout to write.
        environ: Where to write (default ``os.environ``).
        overwrite: Replace variables that hold a different value instead of refusing.

    Raises:
        LaunchEnvironmentError: a variable already holds a different value and
            ``overwrite`` is False; the message shows both values, and nothing is
            written.
    """
    env = os.environ if environ is None else environ
    _export(torchrun_env(info, env, overwrite=overwrite), env)


def _export(values: Mapping[str, str],
            environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Set ``values`` in ``environ`` (default ``os.environ``), in their order.

    The one step of :mod:`hpc.bootstrap` that writes the environment: each phase
    returns the variables it wants set, and :func:`init_torch` hands them here at the
    point where the next phase needs them (``tests/unit/bootstrap/test_env_writer.py``
    keeps it the only one).
    """
    (os.environ if environ is None else environ).update(values)


def seed_everything(seed: int) -> None:
    """Seed python's ``random``, numpy (if installed) and torch (CPU and CUDA)."""
    import torch

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    torch.manual_seed(seed)


def _pick_device(info: DistInfo, backend: Optional[str]) -> tuple[str, Any]:
    """(backend, device) of this rank: the local rank's GPU when the backend moves CUDA
    tensors through NCCL and one is visible, else gloo (or ``backend``) on the CPU."""
    import torch

    from hpc.bootstrap.backend import DEFAULT_GPU_BACKEND, uses_cuda

    if not uses_cuda(backend):
        return backend or "gloo", torch.device("cpu")
    _export(_mig_env(info))  # before CUDA is initialised, which reads it once
    if not torch.cuda.is_available():
        return backend or "gloo", torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 0:
        return backend or "gloo", torch.device("cpu")
    from hpc.bootstrap import gpubind

    index = gpubind.choose_index(info.local_rank, info.local_world_size, count, os.environ)
    torch.cuda.set_device(index)
    return backend or DEFAULT_GPU_BACKEND, torch.device("cuda", index)


def _cpu_build(info: DistInfo, requested: Optional[str], dev: Any,
               env: Mapping[str, str]) -> DistInfo:
    """A CPU device for a backend that wanted CUDA, from a CPU-only torch where GPUs were
    granted (:func:`hpc.bootstrap.build.check`): refused, or with ``HPC_ALLOW_CPU=1`` kept
    with a warning in ``info.warnings``. An explicit CPU backend is the user's choice."""
    from hpc.bootstrap.backend import uses_cuda

    if dev.type != "cpu" or not uses_cuda(requested):
        return info
    import torch

    from hpc.bootstrap import build

    warning = build.check(torch.__version__, torch.version.cuda,
                          getattr(torch.version, "hip", None), env)
    if warning is None:
        return info
    logger.warning("%s", warning)
    return info.replace(warnings=(*info.warnings, warning))


def _mig_env(info: DistInfo) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` narrowed to this local rank's own MIG instance when
    every rank got the whole list (CUDA would show each of them only the first); empty
    when there is nothing to narrow or CUDA was initialised already."""
    import torch

    from hpc.bootstrap.gpubind import narrow_mig

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    mine = narrow_mig(visible, info.local_rank, info.local_world_size)
    if mine is None:
        return {}
    if torch.cuda.is_initialized():
        logger.warning("CUDA_VISIBLE_DEVICES lists %s MIG instances but CUDA was "
                       "initialised before hpc.init_torch(): every rank sees the first",
                       len(visible.split(",")) if visible else 0)
        return {}
    logger.info("local rank %d: CUDA_VISIBLE_DEVICES=%s (its MIG instance of %s)",
                info.local_rank, mine, visible)
    return {"CUDA_VISIBLE_DEVICES": mine}


def init_torch(backend: Optional[str] = None, seed: Optional[int] = None,
               timeout: Union[timedelta, float] = DEFAULT_TIMEOUT,
               connect_timeout: Optional[float] = None,
               environ: Optional[Mapping[str, str]] = None) -> DistInfo:
    """Detect the launch, export it, bind the GPU, seed and init torch.distributed.

    Args:
        backend: ``nccl``/``gloo``/``cpu:gloo,cuda:nccl``/...; default
            ``cpu:gloo,cuda:nccl`` when this local rank has a GPU (CUDA tensors over
            NCCL, CPU tensors over gloo in the same group), else ``gloo``. Every rank
            must end up with the same backend: the pre-flight refuses a mix (a rank
            that sees no GPU while the others do) naming the ranks.
        seed: When given, seeds python, numpy and torch with the same value on every
            rank (identical initial weights).
        timeout: Timeout of collectives (``timedelta`` or seconds).
        connect_timeout: How long the pre-flight waits for the master and all ranks
            (seconds); default ``HPC_CONNECT_TIMEOUT`` or 120.
        environ: Variables to detect from (default ``os.environ``).

    Returns:
        The :class:`~hpc.DistInfo` of this process, master resolved.

    Idempotent: a second call returns the first call's result.
    """
    if roles.current() is not None:
        return roles.current()
    from hpc.log import held_until_setup

    with held_until_setup():  # its INFO lines, for a setup_logging called after it
        return _init_torch(backend, seed, timeout, connect_timeout, environ)


def _init_torch(backend: Optional[str], seed: Optional[int],
                timeout: Union[timedelta, float], connect_timeout: Optional[float],
                environ: Optional[Mapping[str, str]]) -> DistInfo:
    """:func:`init_torch`'s phases, in call order."""
    import torch.distributed as dist

    phases.reset()
    env = os.environ if environ is None else environ
    with phases.phase("detect"):
        envvars.check(env)  # every HPC_* variable, on every rank, before anything runs
        info = _resolve(env)
    with phases.phase("threads"):
        count, wanted = threads.plan(info, env)
        _export(wanted)  # OMP_NUM_THREADS, for child processes: before torch's own count
        threads.set_torch_threads(count)
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    if connect_timeout is None:
        connect_timeout = envvars.value("HPC_CONNECT_TIMEOUT", env)
    with phases.phase("device"):
        requested = backend
        backend, dev = _pick_device(info, backend)
        info = _cpu_build(info, requested, dev, env)
    if seed is not None:
        with phases.phase("seed"):
            seed_everything(seed)
    if not dist.is_initialized():
        _init_process_group(info, backend, dev, timeout, connect_timeout, env)
    roles.set_current(info, dev)
    with phases.phase("exit hooks"):
        _register_exit(info.rank, env)
    logger.info("initialised %s, backend %s, device %s", info.describe(), backend, dev)
    return info


def _resolve(env: Mapping[str, str]) -> DistInfo:
    """Detect the launch, resolve the master, log the reader's warnings, export it."""
    from hpc.bootstrap import master

    info = detect(env)
    if info.launcher == "mpi4py":
        info = master.from_mpi4py(env)
    info = master.resolve_master(info, env)
    for warning in info.warnings:
        logger.warning("%s", warning)
    if (info.launcher == "local" and info.world_size == 1
            and not envvars.value("HPC_LAUNCHER", env)):  # HPC_LAUNCHER=local: on purpose
        logger.info("no launcher found: running as a single process (rank 0 of 1); start "
                    "N ranks with hpc run --nproc N <script> or torchrun --nproc-per-node N "
                    "<script>")
    export_env(info)
    return info


def _init_process_group(info: DistInfo, backend: str, dev: Any, timeout: timedelta,
                        connect_timeout: float, env: Mapping[str, str]) -> None:
    """The pre-flight (more than one rank), ``init_process_group`` on its store, and
    the wait until every rank has finished that."""
    import torch
    import torch.distributed as dist

    from hpc.bootstrap import preflight
    from hpc.bootstrap.backend import device_id_supported, uses_cuda

    nccl = uses_cuda(backend) and dev.type == "cuda"
    if info.world_size == 1:
        store = dist.HashStore()
    else:
        if nccl:
            from hpc.watchdog.monitor import flight_recorder_env

            _export(flight_recorder_env(os.environ))
        gpu = None
        # NCCL >= 2.30 runs several ranks on one GPU when asked to: no refusal then
        if nccl and env.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
            from hpc.bootstrap import gpubind

            with phases.phase("gpu claim"):
                gpu = gpubind.local_claim(info.rank, info.local_rank, dev.index)
        from hpc.bootstrap import interfaces

        how, pinned = interfaces.mode(env), {}  # an unknown HPC_NETWORK: refused anywhere
        if info.local_world_size < info.world_size:  # on one node nothing crosses one
            with phases.phase("network"):
                pinned = interfaces.interface_env(info.master_addr, os.environ,
                                                  info.local_rank, how)
        _export(pinned)  # before the pre-flight reports them and gloo/NCCL read them
        store = preflight.preflight(info, connect_timeout, timeout, env, gpu=gpu,
                                    backend=backend, pinned=pinned)
    kwargs: dict[str, Any] = {}
    if nccl and device_id_supported(torch.__version__):
        kwargs["device_id"] = dev  # eager NCCL init; see hpc.bootstrap.backend
    with phases.phase("init_process_group"):
        dist.init_process_group(backend, store=dist.PrefixStore("hpc/pg", store),
                                rank=info.rank, world_size=info.world_size,
                                timeout=timeout, **kwargs)
    if info.world_size > 1:
        with phases.phase("confirm_init"):
            preflight.confirm_init(store, info, connect_timeout)
        from hpc.watchdog import monitor as watchdog

        with phases.phase("watchdog"):
            watchdog.start(info, lambda t: preflight.client(info, env, t),
                           timeout.total_seconds(), env)


def _register_exit(rank: int, env: Mapping[str, str]) -> None:
    """Once per process: teardown at exit, and the failure marks (which run first)."""
    if _STATE["atexit"]:
        return
    atexit.register(teardown)
    _STATE["atexit"] = True
    from hpc.watchdog import marks

    marks.watch()  # teardown aborts, rather than destroys, a failing rank's group
    marks.install(rank, env)  # after teardown's handler: runs before it


def teardown() -> None:
    """Destroy the process group (safe to call twice; also runs at exit).

    A failing process (:func:`hpc.watchdog.marks.failed`) aborts the group instead:
    destroying it flushes pending NCCL work, which hangs when peers are gone, and the
    launcher's kill-on-bad-exit or ``hpc run``'s report would never come. The how is
    :func:`hpc.bootstrap.shutdown.close_group`.
    """
    from hpc.bootstrap import shutdown

    shutdown.close_group()
    roles.set_current(None)
