"""Staging a checkpoint's tensors in shared memory, for the writer process.

An asynchronous save (:mod:`hpc.checkpoint.writer`) must hand the state to another
process and return before the training loop changes it. :class:`Stage` copies every
tensor of a payload into buffers in ``/dev/shm`` that the writer maps too, and returns
the payload's *skeleton*: the same nesting of dicts, lists and plain values, each tensor
replaced by a :class:`TensorRef` (where its bytes are, its dtype and shape), small
enough to pickle through a pipe. :func:`rebuild` (in the writer) turns the skeleton back
into a payload of tensors that ``torch.save`` writes exactly as it would the original.

Buffers are kept from one save to the next (the second copy into a mapped page costs
a third of the first) and reused while a tensor keeps its dtype and shape. A tensor of
at least :data:`OWN_FILE_BYTES` gets a file of its own, mapped by the writer without a
copy; the smaller ones share one packed file and the writer clones them out. Tensors
that are one in the payload (tied weights) are staged once and come back as one.
CUDA tensors are copied to the host here (the training loop waits for that copy).

The staging directory ``/dev/shm/hpc-stage-<pid>-<n>`` (``HPC_STAGE_DIR``) belongs to one writer; a
directory whose owner process is gone is removed by the next :class:`Stage` created on
the host (a master killed by SIGKILL runs no clean-up).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from hpc.checkpoint.files import pid_alive

__all__ = ["Stage", "TensorRef", "rebuild", "stage_bytes", "stage_root", "OWN_FILE_BYTES",
           "MARGIN_BYTES"]

#: A tensor this large gets a file of its own (the writer maps it, no copy).
OWN_FILE_BYTES = 1 << 20
#: Room left free on the stage's filesystem (others use ``/dev/shm`` too): this much, or
#: an eighth of the filesystem when that is less (a container's 64 MiB ``/dev/shm``).
MARGIN_BYTES = 64 << 20
_PACK_ALIGN = 64
_DIR = re.compile(r"^hpc-stage-(\d+)-\d+$")


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Where a staged tensor's bytes are: ``file`` (a name in the stage directory) at
    ``offset``; its ``dtype`` (``torch.float32`` as ``"float32"``) and ``shape``."""

    file: str
    offset: int
    dtype: str
    shape: tuple[int, ...]
    packed: bool


def stage_bytes(obj: Any) -> int:
    """The bytes of every tensor in ``obj`` (a tensor seen twice counts once)."""
    seen: dict[int, int] = {}
    _walk(obj, "", lambda t, _: seen.setdefault(id(t), t.numel() * t.element_size()))
    return sum(seen.values())


def stage_root() -> Path:
    """Where the buffers live (``HPC_STAGE_DIR``, default ``/dev/shm``): a tmpfs, so a
    copy into them is a copy in memory."""
    from hpc import envvars

    return Path(envvars.value("HPC_STAGE_DIR"))


def remove_orphans(root: Path) -> list[Path]:
    """Remove stage directories whose owning process is gone; return them."""
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for path in entries:
        m = _DIR.match(path.name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class Stage:
    """Reusable shared-memory buffers for the tensors of successive payloads."""

    _made = 0

    def __init__(self, root: Optional[Path] = None) -> None:
        root = stage_root() if root is None else root
        remove_orphans(root)
        Stage._made += 1
        self.dir = root / f"hpc-stage-{os.getpid()}-{Stage._made}"
        self.dir.mkdir(mode=0o700)
        self._own: dict[str, tuple[str, torch.Tensor]] = {}  # slot -> (file, buffer)
        self._pack: Optional[torch.Tensor] = None
        self._pack_file = ""
        self._files = 0
        self._used: set[str] = set()

    def shortfall(self, payload: Any) -> int:
        """Bytes missing on the stage's filesystem to stage ``payload`` (0: it fits).

        A write into a mapped tmpfs page that has no room is a SIGBUS, not an error, so
        this is asked first: the buffers already made are reused, the rest must fit
        with :data:`MARGIN_BYTES` (or an eighth of the filesystem) to spare."""
        made = sum(buf.numel() for _, buf in self._own.values())
        made += self._pack.numel() if self._pack is not None else 0
        st = os.statvfs(self.dir)
        margin = min(MARGIN_BYTES, st.f_blocks * st.f_frsize // 8)
        need = stage_bytes(payload) - made + margin
        return max(0, need - st.f_bavail * st.f_frsize)

    def _new_file(self, nbytes: int) -> tuple[str, torch.Tensor]:
        self._files += 1
        name = f"t{self._files}"
        return name, torch.from_file(str(self.dir / name), shared=True, size=max(nbytes, 1),
                                     dtype=torch.uint8)

    def copy(self, payload: Any) -> Any:
        """Copy ``payload``'s tensors into the buffers; its skeleton (see the module).

        The copies use every CPU this process may run on: the other ranks wait for this
        one meanwhile (``init_torch`` gave each rank its share of the cores)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, len(os.sched_getaffinity(0))))
        try:
            return self._copy(payload)
        finally:
            torch.set_num_threads(threads)

    def _copy(self, payload: Any) -> Any:
        tensors: dict[Any, tuple[str, torch.Tensor]] = {}  # same -> (first slot, tensor)
        _walk(payload, "", lambda t, slot: tensors.setdefault(_same(t), (slot, t)))
        refs: dict[Any, Any] = {}
        small = []
        for key, (slot, t) in tensors.items():
            t = t.detach()
            if t.is_sparse or t.is_quantized or t.is_nested:  # rare: pickled as a copy
                refs[key] = t.to("cpu", copy=True)
            elif t.numel() * t.element_size() < OWN_FILE_BYTES:
                small.append((key, t))
            else:
                refs[key] = self._own_file(slot, t)
        refs.update(self._pack_small(small))
        for slot in set(self._own) - self._used:  # tensors gone from the state
            (self.dir / self._own.pop(slot)[0]).unlink(missing_ok=True)
        self._used = set()
        objects: dict[int, Any] = {}  # one ref object per tensor object, as pickle sees

        def ref_of(t: torch.Tensor) -> Any:
            if id(t) not in objects:
                ref = refs[_same(t)]
                objects[id(t)] = dataclasses.replace(ref) if isinstance(ref, TensorRef) else ref
            return objects[id(t)]

        return _map(payload, ref_of)

    def _own_file(self, slot: str, t: torch.Tensor) -> TensorRef:
        key = f"{slot}|{t.dtype}|{tuple(t.shape)}"
        if key not in self._own:
            self._own[key] = self._new_file(t.numel() * t.element_size())
        self._used.add(key)
        name, buf = self._own[key]
        buf.view(t.dtype).view(t.shape).copy_(t)
        return TensorRef(name, 0, _dtype_name(t.dtype), tuple(t.shape), packed=False)

    def _pack_small(self, small: list[tuple[Any, torch.Tensor]]) -> dict[Any, TensorRef]:
        offsets, total = [], 0
        for _, t in small:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // _PACK_ALIGN) * _PACK_ALIGN
        if self._pack is None or self._pack.numel() < total:
            if self._pack_file:
                (self.dir / self._pack_file).unlink(missing_ok=True)
            self._pack_file, self._pack = self._new_file(max(total, 1) * 2)
        refs = {}
        for (key, t), off in zip(small, offsets):
            nbytes = t.numel() * t.element_size()
            if nbytes:
                self._pack[off:off + nbytes].view(t.dtype).view(t.shape).copy_(t)
            refs[key] = TensorRef(self._pack_file, off, _dtype_name(t.dtype),
                                  tuple(t.shape), packed=True)
        return refs

    def close(self) -> None:
        """Drop the buffers and remove the directory."""
        self._own.clear()
        self._pack = None
        shutil.rmtree(self.dir, ignore_errors=True)


def _same(t: torch.Tensor) -> Any:
    """What makes two tensors one in ``torch.save``'s file: the same view of the same
    storage (``state_dict()`` returns a new tensor object for a tied weight's every name)."""
    ptr = t.untyped_storage().data_ptr() if t.layout == torch.strided else 0
    if not ptr:
        return id(t)
    return (ptr, t.device, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _walk(value: Any, slot: str, seen: Any) -> None:
    """Call ``seen(tensor, slot)`` for every tensor in a payload, in order."""
    if isinstance(value, torch.Tensor):
        seen(value, slot)
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk(v, f"{slot}/{k}", seen)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _walk(v, f"{slot}/{i}", seen)


def _map(value: Any, change: Any, kind: type = torch.Tensor,
         memo: Optional[dict[int, Any]] = None) -> Any:
    """``value`` with every instance of ``kind`` in it replaced by ``change(it)``; a
    container met twice (a scheduler's state shares lists) comes back as one, as pickle
    keeps it."""
    memo = {} if memo is None else memo
    if isinstance(value, kind):
        return change(value)
    if not isinstance(value, (dict, list, tuple)):
        return value
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, dict):
        new: Any = type(value)((k, _map(v, change, kind, memo)) for k, v in value.items())
        if getattr(value, "__dict__", None):  # state_dict()'s _metadata
            new.__dict__.update(value.__dict__)
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        new = type(value)(*(_map(v, change, kind, memo) for v in value))
    else:
        new = type(value)(_map(v, change, kind, memo) for v in value)
    memo[id(value)] = new
    return new


def rebuild(skeleton: Any, directory: Path, cache: dict[str, torch.Tensor]) -> Any:
    """The payload a skeleton stands for, its tensors read from ``directory``'s buffers
    (in the writer). ``cache`` keeps the mapped files from one save to the next."""
    storages: dict[TensorRef, torch.Tensor] = {}  # equal refs: one storage
    objects: dict[int, torch.Tensor] = {}  # one ref object: one tensor object

    def tensor(ref: TensorRef) -> torch.Tensor:
        if id(ref) in objects:
            return objects[id(ref)]
        if ref not in storages:
            storages[ref] = _read(ref, directory, cache)
        objects[id(ref)] = storages[ref].view(ref.shape)  # a view: a tensor of its own
        return objects[id(ref)]

    payload = _map(skeleton, tensor, TensorRef)
    for name in set(cache) - {ref.file for ref in storages}:  # files the master replaced
        del cache[name]
    return payload


def _read(ref: TensorRef, directory: Path, cache: dict[str, torch.Tensor]) -> torch.Tensor:
    """The staged tensor ``ref`` names: the mapped file itself, or a packed one's clone."""
    dtype = getattr(torch, ref.dtype)
    numel = 1
    for n in ref.shape:
        numel *= n
    if ref.file not in cache:
        path = directory / ref.file
        cache[ref.file] = torch.from_file(str(path), shared=True, size=path.stat().st_size,
                                          dtype=torch.uint8)
    raw = cache[ref.file][ref.offset:ref.offset + numel * dtype.itemsize]
    t = raw.view(dtype).view(ref.shape)
    return t.clone() if ref.packed else t
