"""sync_model / sync_gradients with the options the other scripts leave at their
defaults: ``src != 0``, ``group=`` (a subgroup, ``src`` counted in it), a parameter list
instead of a module, and gradients of mixed dtypes. Run with 3 ranks.

Every rank seeds differently; the originals are all_gathered first and each result is
checked bitwise:

1. ``sync_model(model, src=1)``: every rank holds rank 1's tensors (float32, float64,
   float16, bfloat16 parameters, int64 and bool buffers).
2. ``sync_model(model, src=1, group=ranks [1, 2])``: ranks 1 and 2 hold global rank 2's
   tensors, rank 0 keeps its own.
3. ``sync_gradients(params)`` with float32/float64/bfloat16/float16 parameters, one
   without a gradient: each gradient is the mean over the ranks (integer multiples of
   the world size, so the mean is exact whatever the order of the sums), dtypes kept.
4. ``sync_gradients(params, group=ranks [0, 2])``: ranks 0 and 2 hold the mean of their
   two, rank 1 keeps its own.

Prints ``RESULT ok rank=R`` or ``RESULT FAIL rank=R: ...``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import hpc

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 5).to(d) for d in DTYPES)
        self.register_buffer("count", torch.randint(0, 1000, (4,)))
        self.register_buffer("flags", torch.rand(7) > 0.5)


def gathered(tensors: list[torch.Tensor], ws: int) -> list[list[torch.Tensor]]:
    """Every rank's copy of each tensor: result[r][i] is rank r's tensors[i]."""
    out: list[list[torch.Tensor]] = [[] for _ in range(ws)]
    for t in tensors:
        copies = [torch.empty_like(t) for _ in range(ws)]
        dist.all_gather(copies, t.contiguous())
        for r in range(ws):
            out[r].append(copies[r])
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach() for t in [*model.parameters(), *model.buffers()]]


def check_sync_model(rank: int, ws: int, sub12: object) -> list[str]:
    errors = []
    model = Mixed()
    before = gathered(state(model), ws)
    hpc.sync_model(model, src=1)
    if not same(state(model), before[1]):
        errors.append("sync_model(src=1): not rank 1's tensors")
    model = Mixed()
    before = gathered(state(model), ws)
    hpc.sync_model(model, src=1, group=sub12)  # group rank 1 = global rank 2
    want = before[2] if rank in (1, 2) else before[rank]
    if not same(state(model), want):
        errors.append("sync_model(src=1, group=[1, 2]): not global rank 2's tensors "
                      "on 1 and 2, or rank 0 changed")
    return errors


def params_with_grads(rank: int, scale: int) -> list[torch.Tensor]:
    """Parameters of every dtype with integer gradients ``scale * (rank + 1) * k``."""
    params = []
    for i, d in enumerate(DTYPES):
        p = torch.zeros(3, 4, dtype=d, requires_grad=True)
        k = torch.arange(12, dtype=torch.float64).reshape(3, 4) + i
        p.grad = (scale * (rank + 1) * k).to(d)
        params.append(p)
    params.append(torch.zeros(2, requires_grad=True))  # no gradient: left alone
    return params


def check_sync_gradients(rank: int, ws: int, sub02: object) -> list[str]:
    errors = []
    params = params_with_grads(rank, ws)
    hpc.sync_gradients(params)
    mean = params_with_grads(0, sum(range(1, ws + 1)))  # ws * sum(r+1) / ws
    if params[-1].grad is not None:
        errors.append("sync_gradients(list): a parameter without grad got one")
    if not same([p.grad for p in params[:-1]], [p.grad for p in mean[:-1]]):
        errors.append("sync_gradients(list): not the exact mean, or a dtype changed")
    params = params_with_grads(rank, 2)
    hpc.sync_gradients(params, group=sub02)
    if rank in (0, 2):  # mean of 2*(0+1)k and 2*(2+1)k = 4k = params_with_grads(0, 4)
        want = params_with_grads(0, 4)
    else:
        want = params_with_grads(rank, 2)
    if not same([p.grad for p in params[:-1]], [p.grad for p in want[:-1]]):
        errors.append("sync_gradients(list, group=[0, 2]): not the pair's mean on 0 and 2, "
                      "or rank 1 changed")
    return errors


def main() -> int:
    info = hpc.init_torch(seed=0, backend="gloo")
    rank, ws = info.rank, info.world_size
    if ws != 3:
        print(f"RESULT FAIL rank={rank}: run with 3 ranks, not {ws}", flush=True)
        return 1
    torch.manual_seed(1000 + rank)  # every rank different
    sub12 = dist.new_group([1, 2])
    sub02 = dist.new_group([0, 2])
    errors = check_sync_model(rank, ws, sub12) + check_sync_gradients(rank, ws, sub02)
    dist.barrier()
    print(f"RESULT {'FAIL' if errors else 'ok'} rank={rank}" +
          (": " + "; ".join(errors) if errors else ""), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
