"""Keeping ranks equal without DDP: :func:`sync_model` and :func:`sync_gradients`.

* :mod:`hpc.sync.model` — ``sync_model``: parameters and buffers, bucketed;
* :mod:`hpc.sync.grads` — ``sync_gradients``/``GradSync`` for supernets;
* :mod:`hpc.sync._plan`, :mod:`hpc.sync._pack`, :mod:`hpc.sync._collective`,
  :mod:`hpc.sync._shm` (same-host exchange through ``/dev/shm``),
  :mod:`hpc.sync._shm_region` (its regions: naming, opening, sweeping) and
  :mod:`hpc.sync._users` — their internals.

Served lazily: importing :mod:`hpc.sync` does not import torch.
"""

from __future__ import annotations

from hpc._lazy import lazy_attributes

__all__ = ["sync_model", "sync_gradients", "GradSync"]

_LAZY = {"sync_model": "hpc.sync.model", "sync_gradients": "hpc.sync.grads",
         "GradSync": "hpc.sync.grads"}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
