"""The sync's transport: the collectives :mod:`hpc.sync.model`, :mod:`hpc.sync.grads`,
the shared-memory lane and :mod:`hpc.sync.agree` issue (private: other rooms use
:mod:`hpc.sync.agree`).

* :func:`active_world` says whether collectives are needed at all (no-op otherwise).
* :func:`check_same_tensors` verifies, with one ``all_reduce(MAX)`` of four int64 (a
  hash and the tensor count, each also negated: all ranks agree exactly when the
  maximum equals the minimum), that every rank holds the same tensor list (names,
  shapes, dtypes); on a mismatch it gathers the lists and raises
  :class:`~hpc.errors.ModelMismatchError` on every rank, naming the first differing
  tensor and the ranks, instead of letting a later collective of mismatched sizes hang.
* :func:`comm_device` picks the device a collective's tensors must live on.
* :data:`BucketKind` names what one bucket's collective does, in both modules, and
  :func:`start_bucket` issues it; :func:`start_max` and :func:`start_all_gather` are the
  small element-wise MAX and gather. At world size 2 on gloo (CPU tensors) all three go
  as ``isend``/``irecv`` (gloo runs those in the calling thread), counted by the
  watchdog's tracker as one collective each.
* The default bucket sizes of both modules live here, side by side, with why they differ.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any, Literal, Optional, get_args

import torch
import torch.distributed as dist

from hpc.errors import ModelMismatchError

__all__ = ["active_world", "check_same_tensors", "start_check", "finish_check",
           "comm_device", "Signature", "describe", "agreement_vector", "all_agree",
           "same_on_all_ranks", "BucketKind", "BUCKET_KINDS", "start_bucket", "start_max",
           "start_all_gather",
           "P2P_TAG_BASE", "MODEL_BUCKET_BYTES",
           "GRAD_BUCKET_BYTES", "GRAD_OVERLAP_BUCKET_BYTES"]

logger = logging.getLogger(__name__)

#: One entry per tensor: (name, shape, dtype as text).
Signature = list[tuple[str, tuple[int, ...], str]]

#: What one bucket's collective makes of it, on every rank, in ``sync_model`` and
#: ``GradSync`` alike: ``"broadcast"``, one rank's values (``dist.broadcast`` from it);
#: ``"mean"``, the mean over ranks, from a summing ``dist.all_reduce`` (``GradSync``
#: scales each gradient by ``1/world_size`` before it, ``sync_model`` divides after).
BucketKind = Literal["broadcast", "mean"]
#: Every :data:`BucketKind`, in a fixed order (per-kind figures).
BUCKET_KINDS: tuple[BucketKind, ...] = get_args(BucketKind)

# Default bucket sizes. They differ on purpose: each was chosen for its own traffic.
#: ``sync_model``: its large tensors go alone, in place, so buckets hold only the small
#: ones, pipelined (6 in flight): measured on gloo, 4 MiB packs, sends and copies out
#: better than 25 MiB with 3 in flight for a 1M-parameter model and equals it for
#: ResNet-50.
MODEL_BUCKET_BYTES = 4 * 1024 * 1024
#: ``GradSync.sync`` after backward: DDP's default ``bucket_cap_mb=25``. ``match_ddp``
#: passes it to DDP's bucket assignment, so only this value reproduces default DDP's
#: layout (and bits); it also caps the arena's flat buffers.
GRAD_BUCKET_BYTES = 25 * 1024 * 1024
#: ``GradSync.backward``, overlapping with the backward pass: smaller, so that the first
#: sends start while backward still runs.
GRAD_OVERLAP_BUCKET_BYTES = 4 * 1024 * 1024


def active_world(group: Optional[Any] = None) -> int:
    """World size of ``group`` when collectives are needed, else 0 (not initialised or 1)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    ws = dist.get_world_size(group)
    return ws if ws > 1 else 0


def _backend(group: Optional[Any]) -> str:
    return str(dist.get_backend(group)).lower()


def comm_device(group: Optional[Any] = None, tensor_device: Optional[torch.device] = None
                ) -> torch.device:
    """Device for a collective's buffers.

    ``tensor_device`` itself when the group's backend moves tensors of its type (gloo:
    CPU and CUDA; nccl: CUDA; mpi: CPU; ``cpu:gloo,cuda:nccl``: both, each on its own
    backend), else the CPU when the backend moves CPU tensors, else the current CUDA
    device (CPU tensors under plain nccl are staged). Without ``tensor_device``: the CPU
    where the backend can (host-side agreement never touches the GPU there).
    """
    from hpc.bootstrap.backend import parse_backend

    devices = parse_backend(_backend(group))
    if tensor_device is not None and tensor_device.type in devices:
        return tensor_device
    if "cpu" in devices:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


#: Tags of the point-to-point sends that stand in for broadcasts (see
#: :func:`start_bucket`): a range user code is unlikely to use at the same moment.
P2P_TAG_BASE = 0x48500000


def start_bucket(kind: BucketKind, flat: torch.Tensor, src: int,
                 group: Optional[Any] = None, seq: int = 0) -> Any:
    """Issue ``kind``'s collective on ``flat`` (``async_op=True``); returns its Work.

    ``src`` is the *global* rank that broadcasts (unused for ``"mean"``); ``seq`` is the
    bucket's position in a plan every rank shares.

    At world size 2 on gloo a broadcast is one message from ``src`` to the other rank,
    so it is sent as ``isend``/``irecv``: gloo runs those in the calling thread, while
    a collective waits for a worker thread. Measured (ws 2, 97.7 MB in 29 pieces, one
    gloo connection): 29 broadcasts 42.3 ms, 29 sends 30.4 ms, one flat broadcast
    37.2 ms. The tag (``P2P_TAG_BASE + seq``) also spreads successive buckets over
    gloo's connections, as its collectives are.
    """
    if kind == "mean":
        return dist.all_reduce(flat, group=group, async_op=True)
    peer = _p2p_peer(flat, group)
    if peer is None:
        return dist.broadcast(flat, src, group=group, async_op=True)
    tag = P2P_TAG_BASE + seq
    if peer == src:
        return _Pairwise("broadcast", group, [dist.irecv(flat, src, group=group, tag=tag)])
    return _Pairwise("broadcast", group, [dist.isend(flat, peer, group=group, tag=tag)])


class _Pairwise:
    """Point-to-point Works that stand in for one collective of a two-rank group.

    ``wait()`` waits for all of them. On the default group the watchdog's tracker
    counts them as one collective (``name``), as it counts the wrapped ones, so a rank
    stuck here is reported like a rank stuck in ``dist.broadcast``.
    """

    def __init__(self, name: str, group: Optional[Any], works: list[Any]) -> None:
        from hpc.watchdog import tracker

        world = group is None or group is dist.group.WORLD
        self._name, self._works = name, works
        self._seq = tracker.begin(name) if world else None

    def wait(self) -> bool:
        from hpc.watchdog import tracker

        try:
            for work in self._works:
                work.wait()
        except Exception as e:
            instead = tracker.end(self._seq, self._name, e)
            if instead is not None:
                raise instead from e
            raise
        tracker.end(self._seq, self._name)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


def start_all_gather(out: torch.Tensor, mine: torch.Tensor,
                     group: Optional[Any] = None) -> Any:
    """Gather every rank's ``mine`` into ``out`` (rank order), asynchronously; a Work.

    At world size 2 on gloo (CPU tensors) the two ranks swap ``mine`` with
    ``isend``/``irecv``, skipping gloo's worker hand-off as :func:`start_bucket` does.
    """
    peer = _p2p_peer(mine, group)
    if peer is None:
        # torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single;
        # looked up per call, so the watchdog's tracker (installed later) sees it.
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(out, mine, group=group, async_op=True)
    n, rank = mine.numel(), dist.get_rank(group)
    out[rank * n:(rank + 1) * n].copy_(mine)
    tag = P2P_TAG_BASE - 2
    theirs = out[(1 - rank) * n:(2 - rank) * n]
    return _Pairwise("all_gather", group, [dist.isend(mine, peer, group=group, tag=tag),
                                           dist.irecv(theirs, peer, group=group, tag=tag)])


class _MaxReduce:
    """An element-wise ``MAX`` over the ranks of a small int64 vector, started now.

    ``wait()`` returns the reduced vector. At world size 2 on gloo the two ranks swap
    their vectors with ``isend``/``irecv`` and take the maximum locally (the same result
    on both), which skips gloo's worker hand-off as :func:`start_bucket` does.
    """

    def __init__(self, mine: torch.Tensor, group: Optional[Any], name: str) -> None:
        self._mine = mine
        peer = _p2p_peer(mine, group)
        if peer is None:
            self._theirs = None
            self._works = [dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group,
                                           async_op=True)]
            return
        self._theirs = torch.empty_like(mine)
        tag = P2P_TAG_BASE - 1
        self._works = [_Pairwise(name, group, [
            dist.isend(mine, peer, group=group, tag=tag),
            dist.irecv(self._theirs, peer, group=group, tag=tag)])]

    def wait(self) -> torch.Tensor:
        from hpc.watchdog import tracker

        for work in self._works:
            tracker.wait(work)
        if self._theirs is None:
            return self._mine
        return torch.maximum(self._mine, self._theirs)


def start_max(mine: torch.Tensor, group: Optional[Any] = None,
              name: str = "all_reduce") -> _MaxReduce:
    """Start an element-wise ``MAX`` of ``mine`` over ``group``; ``.wait()`` returns it.

    Also a barrier: it completes on a rank only once every rank has contributed.
    ``name``: what the watchdog calls it where it is not a wrapped ``all_reduce``.
    """
    return _MaxReduce(mine, group, name)


def _p2p_peer(flat: torch.Tensor, group: Optional[Any]) -> Optional[int]:
    """The other rank's global number when ``flat``'s broadcast can be a send (ws 2, a
    CPU tensor on gloo; gloo's CUDA support is for collectives), else None."""
    if flat.device.type != "cpu" or dist.get_world_size(group) != 2:
        return None
    from hpc.bootstrap.backend import parse_backend

    if parse_backend(_backend(group)).get("cpu") != "gloo":
        return None
    other = 1 - dist.get_rank(group)
    return dist.get_global_rank(group, other) if group is not None else other


def signature(named: Sequence[tuple[str, torch.Tensor]]) -> Signature:
    """The (name, shape, dtype) list that ranks must agree on."""
    return [(n, tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in named]


def _digest(sig: Signature) -> int:
    """62 bits of a hash of ``sig``: non-negative, so that negating it cannot overflow."""
    raw = hashlib.sha256(repr(sig).encode()).digest()[:8]
    return int.from_bytes(raw, "little") & ((1 << 62) - 1)


def agreement_vector(digest: int, count: int) -> list[int]:
    """What each rank contributes to the check's ``all_reduce(MAX)``."""
    return [digest, -digest, count, -count]


def all_agree(reduced: Sequence[int]) -> bool:
    """True when the MAX-reduced :func:`agreement_vector` shows one digest and count."""
    hi, neg_lo, n_hi, neg_n_lo = reduced
    return hi == -neg_lo and n_hi == -neg_n_lo


def same_on_all_ranks(data: bytes, group: Optional[Any] = None) -> bool:
    """True on every rank when every rank of ``group`` passed the same ``data``.

    One ``all_reduce(MAX)`` of a hash and its length (as :func:`start_check`);
    collective. True when not distributed.
    """
    if not active_world(group):
        return True
    digest = int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & ((1 << 62) - 1)
    mine = torch.tensor(agreement_vector(digest, len(data)), dtype=torch.int64,
                        device=comm_device(group))
    return all_agree(start_max(mine, group).wait().tolist())


def describe(entry: Optional[tuple[str, tuple[int, ...], str]]) -> str:
    """``'name' shape (a, b) dtype`` or ``nothing`` for a missing entry."""
    if entry is None:
        return "nothing"
    name, shape, dtype = entry
    return f"{name!r} shape {tuple(shape)} {dtype}"


def mismatch_message(sigs: Sequence[Signature], what: str) -> str:
    """The error text for gathered signatures ``sigs`` (one per rank) that differ."""
    ref = sigs[0]
    first: Optional[int] = None
    bad_ranks: list[int] = []
    for rank, sig in enumerate(sigs[1:], start=1):
        if sig == ref:
            continue
        bad_ranks.append(rank)
        idx = next((i for i, (a, b) in enumerate(zip(ref, sig)) if a != b),
                   min(len(ref), len(sig)))
        if first is None or idx < first:
            first = idx
    first = first or 0
    lines = [f"{what}: ranks disagree on the tensor list; first difference at tensor "
             f"#{first}:"]
    for rank in [0, *bad_ranks]:
        sig = sigs[rank]
        entry = sig[first] if first < len(sig) else None
        lines.append(f"  rank {rank}: {describe(entry)} ({len(sig)} tensors in all)")
    same = [r for r in range(1, len(sigs)) if r not in bad_ranks]
    if same:
        lines.append(f"  ranks {same} agree with rank 0")
    lines.append("The ranks built different models (different arguments, config or "
                 "code), so their buffers cannot be matched element by element.")
    lines.append("HINT: build the model from the same configuration on every rank; "
                 "per-rank choices (e.g. a supernet path) belong in forward(), not in "
                 "which modules exist.")
    return "\n".join(lines)


def start_check(named: Sequence[tuple[str, torch.Tensor]], group: Optional[Any] = None
                ) -> Optional[tuple[Signature, torch.Tensor, Any]]:
    """Issue the check's ``all_reduce`` asynchronously; finish with :func:`finish_check`.

    Lets the caller plan its buckets while the check travels. None when not
    distributed. No other collective may be issued on ``group`` before
    :func:`finish_check`. An ``all_reduce`` rather than an ``all_gather`` of the
    hashes: on gloo at world size 4 (2 cores) it took 2.5 ms against 8 ms.
    """
    if not active_world(group):
        return None
    sig = signature(named)
    mine = torch.tensor(agreement_vector(_digest(sig), len(sig)), dtype=torch.int64,
                        device=comm_device(group))
    return sig, mine, start_max(mine, group)


def finish_check(handle: Optional[tuple[Signature, torch.Tensor, Any]], what: str,
                 group: Optional[Any] = None) -> None:
    """Wait for :func:`start_check`; raise :class:`ModelMismatchError` on a mismatch."""
    if handle is None:
        return
    sig, _, work = handle
    if all_agree(work.wait().tolist()):
        return
    sigs: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(sigs, sig, group=group)
    raise ModelMismatchError(mismatch_message(sigs, what))


def check_same_tensors(named: Sequence[tuple[str, torch.Tensor]], what: str,
                       group: Optional[Any] = None) -> None:
    """Raise :class:`ModelMismatchError` on every rank when the tensor lists differ.

    Costs one ``all_reduce`` of four int64 when they agree; a mismatch adds an
    ``all_gather_object`` of the lists (to name the difference). Collective: every rank
    of ``group`` must call it.
    """
    finish_check(start_check(named, group), what, group)
