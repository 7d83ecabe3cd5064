"""Checkpoints for any training script: the collective save and restore, their files.

* :mod:`hpc.checkpoint.resume` — :func:`save_checkpoint` / :func:`restore_checkpoint`
  (all ranks call, the global master writes; another world size is refused);
* :mod:`hpc.checkpoint.choose` — which checkpoint a restore uses: the newest complete one
  of either format, the master's choice agreed on every rank, and whether its world size
  fits;
* :mod:`hpc.checkpoint.ranks` — what each rank keeps of its own (RNG states, buffers that
  differ across ranks, ``rank_extra``): gathered on the master, given back per rank;
* :mod:`hpc.checkpoint.asyncsave` — ``save_checkpoint(..., blocking=False)``: the master's
  writer handle and :func:`wait_for_checkpoint`; :mod:`hpc.checkpoint.staging` copies the
  state into shared memory, :mod:`hpc.checkpoint.writer` is the writer process (and the
  file step every save runs);
* :mod:`hpc.checkpoint.sharded` — ``save_checkpoint(..., sharded=True)``: every rank writes
  its share in PyTorch's distributed-checkpoint layout, loadable at any world size;
  :mod:`hpc.checkpoint.shardfiles` is its directory layer (manifest, verification,
  listing, removal);
* :mod:`hpc.checkpoint.storage` — the storage pre-flight: the directory is one directory on
  every node, with room for two checkpoints (run by the first restore or save there);
* :mod:`hpc.checkpoint.files` — the files: atomic write with a ``.sha256`` sidecar,
  keep-last-K, verified ``weights_only`` load with fallback, RNG states (no collectives);
* :mod:`hpc.checkpoint.loadable` — what a checkpoint may hold: the ``weights_only``
  loader's rule, applied to every save before the rename, and the message naming a
  refused value;
* :mod:`hpc.checkpoint.progress` — the progress file: each checkpoint put in place, for
  ``hpc supervise`` (``HPC_PROGRESS_FILE``; read by the batch host with :func:`read_progress`);
* :mod:`hpc.checkpoint.sampler` — :class:`ResumableSampler`, a mid-epoch resumable
  ``DistributedSampler``.

Served lazily: importing :mod:`hpc.checkpoint` does not import torch.
"""

from __future__ import annotations

from hpc._lazy import lazy_attributes

__all__ = ["Restored", "ResumableSampler", "restore_checkpoint", "save_checkpoint",
           "wait_for_checkpoint"]

_LAZY = {"save_checkpoint": "hpc.checkpoint.resume",
         "restore_checkpoint": "hpc.checkpoint.resume", "Restored": "hpc.checkpoint.resume",
         "ResumableSampler": "hpc.checkpoint.sampler",
         "wait_for_checkpoint": "hpc.checkpoint.asyncsave"}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
