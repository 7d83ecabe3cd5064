"""Distributed supernet pretraining without DDP, with checkpoints and exact resume.

Public API (importing this package does not import torch; names load on first use)::

    from hpc.pretrain import PretrainConfig, pretrain
    result = pretrain(PretrainConfig(epochs=5, out="runs/x"))

See ``docs/pretrain.md`` for the search-space protocol, the run directory and resume.
"""

from __future__ import annotations

from hpc._lazy import lazy_attributes

__all__ = [
    "pretrain", "PretrainConfig", "PretrainResult", "StopFlag",
    "SearchSpace", "Supernet", "derive_seed", "arch_generator",
    "PretrainData", "load_data", "load_digits", "load_file",
]

_LAZY = {
    "pretrain": "hpc.pretrain.loop", "PretrainResult": "hpc.pretrain.loop",
    "StopFlag": "hpc.preempt.guard", "PretrainConfig": "hpc.pretrain.config",
    "SearchSpace": "hpc.pretrain.space", "Supernet": "hpc.pretrain.space",
    "derive_seed": "hpc.pretrain.space", "arch_generator": "hpc.pretrain.space",
    "PretrainData": "hpc.pretrain.data", "load_data": "hpc.pretrain.data",
    "load_digits": "hpc.pretrain.data", "load_file": "hpc.pretrain.data",
}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
