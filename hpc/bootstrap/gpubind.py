"""One GPU per nccl rank: detect ranks that would share a GPU, before NCCL does.

A task that sees exactly one GPU binds ``cuda:0`` (the ``--gpus-per-task=1`` case). When
several tasks of a node all see the *same* single GPU (``hpc run --nproc 2`` on a
one-GPU machine, ``srun --ntasks-per-node=2 --gpus-per-node=1``), each binds it and NCCL
fails later with "Duplicate GPU detected" or stalls, depending on its version. One
process cannot tell the two cases apart from its own variables, so every nccl rank
publishes the UUID of the GPU it bound in the pre-flight store
(:func:`hpc.bootstrap.preflight.preflight`); rank 0 checks for a clash once all ranks joined and
aborts start-up on every rank with :func:`shared_gpu_error`, naming the ranks, the GPU
and the fix.

MIG: CUDA enumerates one MIG instance per process (NVIDIA's MIG user guide), the first
one ``CUDA_VISIBLE_DEVICES`` names. When a node's ranks are all handed the same list of
MIG UUIDs (``MIG-<uuid>``, or the older ``MIG-GPU-<uuid>/<gi>/<ci>``), every rank would
see and bind that first one. :func:`narrow_mig` gives local rank *i* the *i*-th
instance instead; :func:`hpc.init_torch` applies it before CUDA is touched.

Store keys (under the pre-flight's prefix): ``hpc/pf/gpu/<host>/<uuid>`` counts the
ranks on a GPU, ``.../<n>`` holds the n-th one's :class:`GpuClaim` as JSON, and
``hpc/pf/gpu-shared`` names a GPU claimed twice (absent when all is well), so rank 0
reads one key when nothing is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from hpc.errors import LaunchEnvironmentError

__all__ = ["GpuClaim", "VISIBLE_DEVICES", "choose_index", "local_claim", "publish",
           "find_shared", "shared_gpu_error", "visible_devices", "mig_devices", "narrow_mig"]

logger = logging.getLogger(__name__)

_SHARED = "hpc/pf/gpu-shared"
#: The variables that choose the GPUs a process sees: NVIDIA's, and AMD ROCm's two.
VISIBLE_DEVICES = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def visible_devices(environ: Mapping[str, str]) -> str:
    """``CUDA_VISIBLE_DEVICES=0,1`` (and the ROCm variables that are set), for messages;
    ``CUDA_VISIBLE_DEVICES=None`` when none is set."""
    shown = [f"{k}={environ[k]}" for k in VISIBLE_DEVICES if k in environ]
    return " ".join(shown) or "CUDA_VISIBLE_DEVICES=None"


def _visible_value(environ: Mapping[str, str]) -> Optional[str]:
    """``CUDA_VISIBLE_DEVICES``'s value; under ROCm without it, the ROCm variables' text."""
    if "CUDA_VISIBLE_DEVICES" in environ or not any(k in environ for k in VISIBLE_DEVICES):
        return environ.get("CUDA_VISIBLE_DEVICES")
    return visible_devices(environ)


def choose_index(local_rank: int, local_world_size: int, count: int,
                 environ: Mapping[str, str]) -> int:
    """The ``cuda:<index>`` this rank binds, of the ``count`` GPUs it sees (pure).

    One visible GPU, or GPUs of the task's own (``srun --gpus-per-task=k`` sets
    ``SLURM_GPUS_PER_TASK`` and gives each task its k GPUs): the first. Otherwise the
    node's GPUs are shared by its ranks: ``cuda:<local_rank>``.

    Raises:
        LaunchEnvironmentError: more ranks on this node than GPUs.
    """
    if count == 1 or environ.get("SLURM_GPUS_PER_TASK", "").strip():
        return 0
    if local_rank < count:
        return local_rank
    raise LaunchEnvironmentError(
        f"local rank {local_rank} of {local_world_size} has no GPU: only "
        f"{count} visible ({visible_devices(environ)}).\n"
        "More tasks per node were started than GPUs were allocated.\n"
        "HINT: use --ntasks-per-node equal to --gpus-per-node (one task per GPU), "
        "or pass backend='gloo' to run on CPU."
    )


@dataclasses.dataclass(frozen=True)
class GpuClaim:
    """The GPU one rank bound: what the error message shows about it."""

    rank: int
    local_rank: int
    host: str
    index: int                  #: ``cuda:<index>`` as this process sees it
    uuid: str                   #: the physical GPU (``torch.cuda`` device UUID)
    name: str = ""
    #: this process's ``CUDA_VISIBLE_DEVICES`` value, or :func:`visible_devices`'s text
    visible: Optional[str] = None

    @property
    def key(self) -> str:
        return f"hpc/pf/gpu/{self.host}/{self.uuid}"


def local_claim(rank: int, local_rank: int, index: int) -> Optional[GpuClaim]:
    """The claim of this process on ``cuda:<index>``; None when CUDA gives no identity.

    The UUID names the physical GPU whatever ``CUDA_VISIBLE_DEVICES`` renumbered; a
    torch without it falls back to the PCI bus id (unique on one host).
    """
    import torch

    try:
        props = torch.cuda.get_device_properties(index)
        raw = getattr(props, "uuid", None)  # str() is 8-4-4-4-12 hex (torch >= 2.1)
        ident = "" if raw is None else str(raw)
        if " object at " in ident:  # no __str__ in this build: use the raw bytes
            ident = bytes(raw.bytes).hex()
        if not ident and hasattr(props, "pci_bus_id"):
            ident = "pci-" + ":".join(str(getattr(props, f"pci_{k}_id", "?"))
                                      for k in ("domain", "bus", "device"))
        name = str(props.name)
    except Exception as e:  # a broken driver: let NCCL report it
        logger.debug("no identity for cuda:%d: %s", index, e)
        return None
    if not ident:
        return None
    return GpuClaim(rank=rank, local_rank=local_rank, host=socket.gethostname(),
                    index=index, uuid=ident, name=name,
                    visible=_visible_value(os.environ))


def publish(store: Any, claim: GpuClaim) -> None:
    """Record ``claim`` in the pre-flight store; flag its GPU when it is taken already.

    Runs before the rank announces itself, so rank 0 sees every claim once all joined.
    """
    n = store.add(claim.key, 1)
    store.set(f"{claim.key}/{n}", json.dumps(dataclasses.asdict(claim)))
    if n > 1:
        store.set(_SHARED, claim.key)


def find_shared(store: Any) -> Optional[LaunchEnvironmentError]:
    """On rank 0 after all ranks joined: the error for a GPU claimed twice, else None."""
    if not store.check([_SHARED]):
        return None
    key = store.get(_SHARED).decode()
    count = store.add(key, 0)
    claims = [GpuClaim(**json.loads(store.get(f"{key}/{i}").decode()))
              for i in range(1, count + 1)]
    return shared_gpu_error(claims)


def shared_gpu_error(claims: Sequence[GpuClaim]) -> LaunchEnvironmentError:
    """The error for ranks ``claims`` that bound one physical GPU (pure)."""
    claims = sorted(claims, key=lambda c: c.rank)
    ranks = [str(c.rank) for c in claims[:16]] + (["..."] if len(claims) > 16 else [])
    shown = ", ".join(ranks[:-1]) + " and " + ranks[-1]
    first = claims[0]
    each = "; ".join(f"rank {c.rank}: local rank {c.local_rank}, cuda:{c.index}, "
                     + (c.visible if c.visible and "=" in c.visible
                        else f"CUDA_VISIBLE_DEVICES={c.visible}") for c in claims[:16])
    return LaunchEnvironmentError(
        f"ranks {shown} would share one GPU under nccl: {first.name} ({first.uuid}) on "
        f"{first.host} ({each}).\n"
        "NCCL needs a GPU of its own for every rank; more tasks were started on this "
        "node than it has GPUs, or every task was given the same GPU.\n"
        "HINT: start one task per GPU (srun --gpus-per-task=1, or --ntasks-per-node "
        "equal to the GPUs per node; hpc run --nproc at most the GPU count), or pass "
        "backend='gloo' to hpc.init_torch() to run these ranks on CPU."
    )


def mig_devices(visible: str | None) -> list[str]:
    """The MIG instances ``CUDA_VISIBLE_DEVICES`` names, in order; [] unless every entry
    is a MIG UUID (``MIG-<uuid>`` or ``MIG-GPU-<uuid>/<gi>/<ci>``)."""
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    if not entries or not all(e.upper().startswith("MIG-") for e in entries):
        return []
    return entries


def narrow_mig(visible: str | None, local_rank: int, local_world_size: int
               ) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` local rank ``local_rank`` should use (pure).

    The rank's own MIG instance when the variable lists several and there is one for
    each of the node's ``local_world_size`` ranks; None (leave it) otherwise: one entry
    (already bound), not MIG, or too few instances (the pre-flight's shared-GPU check
    then names the ranks).
    """
    migs = mig_devices(visible)
    if len(migs) < 2 or local_rank >= len(migs) or len(migs) < local_world_size:
        return None
    return migs[local_rank]
