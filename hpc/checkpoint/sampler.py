"""A ``DistributedSampler`` that can resume in the middle of an epoch.

``torch.utils.data.DistributedSampler`` derives each epoch's order from ``(seed,
epoch)`` but always starts the epoch at its first sample, so a run stopped after batch
``b`` of an epoch could only resume at an epoch boundary. :class:`ResumableSampler` is
the same sampler (same order, same partition) that skips the batches already done,
once, in the epoch :func:`~hpc.checkpoint.resume.restore_checkpoint` put it in::

    sampler = hpc.ResumableSampler(dataset, batch_size=32, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    restored = hpc.restore_checkpoint("ckpt", model=model, sampler=sampler)
    for epoch in range(restored.epoch if restored else 0, epochs):
        sampler.set_epoch(epoch)        # keeps the skip of the resumed epoch
        for i, (x, y) in enumerate(loader, start=sampler.start_batch): ...
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

from torch.utils.data import DistributedSampler

from hpc.errors import CheckpointError

__all__ = ["ResumableSampler", "position_sampler"]


class ResumableSampler(DistributedSampler):
    """:class:`~torch.utils.data.DistributedSampler` plus a one-shot mid-epoch skip.

    Args:
        dataset: As for ``DistributedSampler``.
        batch_size: The ``DataLoader``'s batch size (a resumed epoch skips
            ``batch * batch_size`` of this rank's samples).
        **kwargs: ``num_replicas``, ``rank``, ``shuffle``, ``seed``, ``drop_last``;
            ``num_replicas``/``rank`` default to the process group's.
    """

    def __init__(self, dataset: Any, *, batch_size: int, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        if batch_size < 1:
            raise ValueError(f"ResumableSampler: batch_size={batch_size} must be >= 1.")
        self.batch_size = batch_size
        self._skip_epoch: Optional[int] = None
        self.start_batch = 0

    def set_epoch(self, epoch: int) -> None:
        """As ``DistributedSampler.set_epoch``; the resumed epoch keeps its skip."""
        super().set_epoch(epoch)
        if epoch != self._skip_epoch:
            self._skip_epoch, self.start_batch = None, 0

    def resume_at(self, epoch: int, batch: int) -> None:
        """The next iteration is epoch ``epoch`` from its batch ``batch`` on (once)."""
        super().set_epoch(epoch)
        self._skip_epoch, self.start_batch = epoch, int(batch)

    def state_dict(self) -> dict[str, Any]:
        """Plain values describing the layout (stored by ``save_checkpoint``)."""
        return {"batch_size": self.batch_size, "shuffle": bool(self.shuffle),
                "drop_last": bool(self.drop_last), "num_samples": int(self.num_samples)}

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip = self.start_batch * self.batch_size
        self._skip_epoch, self.start_batch = None, 0  # one-shot: later epochs are whole
        return iter(indices[skip:])

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start_batch * self.batch_size)


def position_sampler(sampler: Any, epoch: int, batch: int, saved: Optional[dict[str, Any]],
                     path: str) -> None:
    """Move ``sampler`` to ``(epoch, batch)`` after a restore (used by restore_checkpoint).

    Raises:
        CheckpointError: mid-epoch (``batch > 0``) with a sampler that cannot skip, or a
            batch size different from the saved one.
    """
    if saved is not None and "batch_size" in saved and hasattr(sampler, "batch_size") \
            and int(saved["batch_size"]) != int(sampler.batch_size):
        raise CheckpointError(
            f"checkpoint {path} was written with batch_size={saved['batch_size']} but the "
            f"sampler has batch_size={sampler.batch_size}: the resumed epoch would skip "
            "the wrong samples.\nHINT: resume with the same batch size.")
    if hasattr(sampler, "resume_at"):
        sampler.resume_at(epoch, batch)
        return
    if batch:
        raise CheckpointError(
            f"checkpoint {path} was taken after batch {batch} of epoch {epoch}, but a "
            f"{type(sampler).__name__} always starts an epoch at its first sample, so "
            "those batches would run twice.\n"
            "HINT: use hpc.ResumableSampler(dataset, batch_size=...) instead of "
            "DistributedSampler, or checkpoint only at epoch ends.")
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
