"""StepReducer on a real one-rank gloo group: the fused copy-back of BN statistics."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist
from torch import nn

from hpc.pretrain.reduce import StepReducer


@pytest.fixture()
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fused_copy_back_is_the_per_buffer_mean(one_rank: None) -> None:
    """Pretend the world is 3 (the one-rank all_reduce is the identity, so the sum is
    this rank's values): every float buffer becomes value/3, counters round(value/3)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4, momentum=None))
    model(torch.randn(8, 1, 9, 9)).sum().backward()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.num_batches_tracked.fill_(7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reducer = StepReducer(model, torch.device("cpu"), ranks=3)
    reducer.world = 3
    stats = reducer(torch.tensor(6.0), torch.tensor(4), 8, True)
    assert (stats.loss, stats.acc, stats.samples, stats.stop) == (0.75, 0.5, 8, True)
    for k, v in model.state_dict().items():
        if "running" in k:
            assert torch.equal(v, before[k] / 3), k
        elif "num_batches_tracked" in k:
            assert v.dtype == torch.int64 and int(v) == 2, k   # round(7 / 3)
        else:
            assert torch.equal(v, before[k]), k  # parameters are not touched
    assert len(reducer.buffers) == 6 and reducer._n_float == 4


def test_one_process_playing_two_ranks_halves_the_summed_statistics(one_rank: None) -> None:
    """``virtual_ranks=2`` on one process: the loop hands in the two virtual ranks'
    statistics summed, and the reducer (no all_reduce at world 1) divides by 2."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
    model(torch.randn(8, 1, 9, 9))
    model[1].num_batches_tracked.fill_(4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = StepReducer(model, torch.device("cpu"), ranks=2)(
        torch.tensor(3.0), torch.tensor(2), 4, False)
    assert (stats.loss, stats.acc, stats.samples) == (0.75, 0.5, 4)
    assert torch.equal(model[1].running_mean, before["1.running_mean"] / 2)
    assert torch.equal(model[1].running_var, before["1.running_var"] / 2)
    assert int(model[1].num_batches_tracked) == 2
    assert torch.equal(model[0].weight, before["0.weight"])
