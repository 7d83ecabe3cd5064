"""Backend strings and the torch version gates of the NCCL path (pure, no torch import).

* :func:`parse_backend` reads a backend string as torch does: ``"nccl"``, ``"gloo"`` or a
  per-device list such as ``"cpu:gloo,cuda:nccl"``, into ``{device type: backend}``.
* :func:`device_id_supported` says whether ``init_process_group(device_id=...)`` may be
  passed for this torch version: the argument exists from torch 2.3, and torch
  2.6.0-2.7.0 can hang at random when it is given (pytorch/pytorch#153960; DeepSpeed
  and NeMo leave it out on those versions too).
* :data:`DEFAULT_GPU_BACKEND` is what :func:`hpc.init_torch` starts on a GPU: NCCL for
  CUDA tensors plus gloo for CPU tensors in the same group, so that small host-side
  agreement (which rank used which parameter, stop flags) never travels through the GPU.
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_GPU_BACKEND", "device_id_supported", "parse_backend", "uses_cuda"]

#: The backend :func:`hpc.init_torch` picks when the rank has a GPU.
DEFAULT_GPU_BACKEND = "cpu:gloo,cuda:nccl"

#: Backends that move tensors of each device type when named alone (torch's table).
_DEVICES = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "mpi": ("cpu",),
            "ucc": ("cpu", "cuda"), "xccl": ("xpu",)}


def parse_backend(backend: str) -> dict[str, str]:
    """``{device type: backend}`` of a backend string, as ``init_process_group`` reads it.

    ``"nccl"`` -> ``{"cuda": "nccl"}``; ``"gloo"`` -> ``{"cpu": "gloo", "cuda": "gloo"}``;
    ``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``. An unknown single
    name (a third-party backend) maps ``cpu`` and ``cuda`` to itself.

    Raises:
        ValueError: a malformed per-device list (``"cpu:"``, ``"cuda:nccl,gloo"``).
    """
    text = str(backend).strip().lower()
    if ":" not in text:
        return {d: text for d in _DEVICES.get(text, ("cpu", "cuda"))}
    out: dict[str, str] = {}
    for part in text.split(","):
        device, sep, name = (s.strip() for s in part.partition(":"))
        if not sep or not device or not name:
            raise ValueError(
                f"backend {backend!r}: {part.strip()!r} is not DEVICE:BACKEND.\n"
                "A per-device backend string lists every device type with its backend.\n"
                "HINT: write it as torch does, e.g. 'cpu:gloo,cuda:nccl', or name one "
                "backend ('nccl', 'gloo').")
        out[device] = name
    return out


def uses_cuda(backend: str | None) -> bool:
    """True when ``backend`` (None: the default) sends CUDA tensors through NCCL."""
    return backend is None or parse_backend(backend).get("cuda") == "nccl"


def _version(text: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of ``"2.6.0+cu124"``, ``"2.7.0a0+git..."``, ``"2.13"``."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ValueError(f"not a torch version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def device_id_supported(torch_version: str) -> bool:
    """Whether to pass ``device_id`` to ``init_process_group`` on this torch (pure).

    False before 2.3 (no such argument: TypeError) and for 2.6.0-2.7.0 inclusive
    (random hangs, pytorch/pytorch#153960); True otherwise. Pre-releases count as their
    release (``2.7.0a0`` is 2.7.0).
    """
    v = _version(torch_version)
    if v < (2, 3, 0):
        return False
    return not (2, 6, 0) <= v <= (2, 7, 0)
