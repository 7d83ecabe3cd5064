"""The loop's own collectives: one fused all_reduce per step, and the sync checks.

BatchNorm statistics. Every rank trains a different sub-network, so each rank updates
the running statistics of different BatchNorm layers, and they drift apart. Training
itself does not read them (BN normalises with batch statistics in train mode); only
validation and checkpoints do. The loop therefore averages every BatchNorm running
mean/variance across ranks after every step, packed into the same small all_reduce that
already carries the step's loss/accuracy and the stop-request flag (see
:class:`StepReducer`). This keeps parameters *and* buffers identical on every rank after
every step, which is what makes a checkpoint taken at any step (including an
unscheduled one after a stop request) resume bitwise-exactly, at the cost of a few
kilobytes per step in a collective the loop makes anyway. Averaging running variances
ignores the spread of per-rank means, as timm's ``distribute_bn(reduce=True)`` does.
These shared statistics mix every sub-network's activations, so validation recalibrates
them per sub-network first (:mod:`hpc.pretrain.evaluate`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hpc.errors import ModelMismatchError
from hpc.sync.agree import gather_objects, world

__all__ = ["StepReducer", "StepStats", "model_digest", "check_identical"]


@dataclass
class StepStats:
    """One step's metrics over all ranks."""

    loss: float        #: mean training loss over the global batch
    acc: float         #: training accuracy over the global batch
    samples: int       #: global batch size
    stop: bool         #: some rank asked to stop at this step boundary
    rows: Optional[list[list[float]]] = None  #: every rank's ``row`` when one was given


class StepReducer:
    """Reduces step metrics, the stop flag and BN running statistics in one all_reduce.

    Args:
        module: The supernet; the running statistics of its BatchNorm layers (any
            ``nn.modules.batchnorm._BatchNorm``) are averaged across ranks. Other
            buffers are left alone.
        device: Device of the model (the flat buffer lives there).
        ranks: How many ranks' statistics the buffers hold summed after the all_reduce:
            the world size, or :attr:`PretrainConfig.virtual_ranks` when each process
            hands in the sum of its virtual ranks' statistics.
    """

    def __init__(self, module: nn.Module, device: torch.device,
                 ranks: Optional[int] = None) -> None:
        floats: list[Tensor] = []
        ints: list[Tensor] = []
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                for b in (m.running_mean, m.running_var, m.num_batches_tracked):
                    if b is not None:
                        (floats if b.is_floating_point() else ints).append(b)
        #: Floating buffers first, then the integer counters (rounded after the mean).
        self.buffers: list[Tensor] = floats + ints
        self._n_float = len(floats)
        self._sizes = [b.numel() for b in self.buffers]
        self.device = device
        self.world = world()[1]
        self.ranks = ranks or self.world

    @torch.no_grad()
    def __call__(self, loss_sum: Tensor, correct: Tensor, count: int,
                 stop: bool, row: Optional[list[float]] = None) -> StepStats:
        """The step's stats; ``row`` (the straggler detector's, on its window steps)
        travels in the same all_reduce, each rank's in its own slot: a gather."""
        if self.world == 1:  # one device-to-host copy, nothing else
            if self.ranks > 1 and self.buffers:  # virtual ranks' summed statistics
                self._copy_back(torch.cat([b.reshape(-1) for b in self.buffers]).float())
            loss_total, corr = torch.stack([loss_sum.detach().float(), correct.float()]).tolist()
            return StepStats(loss=loss_total / max(count, 1), acc=corr / max(count, 1),
                             samples=count, stop=stop, rows=None if row is None else [row])
        slots = [float(count), float(stop)]
        if row is not None:
            slots += [0.0] * (len(row) * self.world)
            at = 2 + len(row) * world()[0]
            slots[at:at + len(row)] = row
        extra = torch.tensor(slots, device=self.device)
        # One cat (it promotes the int64 counters) and, after the all_reduce, one div,
        # one round and two multi-tensor copies: a fixed handful of kernels per step,
        # not three per buffer.
        flat = torch.cat([loss_sum.detach().float().reshape(1).to(self.device),
                          correct.float().reshape(1).to(self.device), extra]
                         + [b.reshape(-1) for b in self.buffers]).float()
        dist.all_reduce(flat)
        head = 2 + len(slots)
        values = flat[:head].tolist()
        if self.buffers:
            self._copy_back(flat[head:])
        loss, corr, n, flag = values[:4]
        rows = None
        if row is not None:
            k = len(row)
            rows = [values[4 + r * k:4 + (r + 1) * k] for r in range(self.world)]
        return StepStats(loss=loss / max(n, 1.0), acc=corr / max(n, 1.0), samples=int(n),
                         stop=flag > 0, rows=rows)

    def _copy_back(self, summed: Tensor) -> None:
        """Buffers := the mean of ``summed`` (integer counters rounded), fused."""
        summed.div_(self.ranks)
        n_float_elems = sum(self._sizes[:self._n_float])
        summed[n_float_elems:].round_()
        views = [v.view(b.shape) for v, b in zip(summed.split(self._sizes), self.buffers)]
        k = self._n_float
        for dst, src in ((self.buffers[:k], views[:k]), (self.buffers[k:], views[k:])):
            if dst:
                torch._foreach_copy_(dst, src)


def model_digest(module: nn.Module) -> int:
    """A 63-bit BLAKE2b digest of every parameter's and buffer's bytes (and names)."""
    h = hashlib.blake2b(digest_size=8)
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def check_identical(module: nn.Module, step: int) -> None:
    """Debug check: raise on every rank when ranks hold different weights or buffers.

    Raises:
        ModelMismatchError: the digests differ; the message lists each rank's.
    """
    digests = gather_objects(model_digest(module))
    if len(set(digests)) > 1:
        table = ", ".join(f"rank {r}: {d:016x}" for r, d in enumerate(digests))
        raise ModelMismatchError(
            f"after step {step} the ranks hold different models ({table}).\n"
            "A rank skipped sync_gradients, stepped a different optimizer, or the "
            "search space has state outside its parameters and BatchNorm buffers.\n"
            "HINT: call hpc.sync_gradients(model) after backward on every rank, and keep "
            "randomness in sample(generator).")
