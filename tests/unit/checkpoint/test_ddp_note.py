"""Which DDP wrappers still rebuild their gradient buckets, so that a resume over 3+ ranks
is not bitwise (restore_checkpoint says so), on a real one-rank gloo group."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from hpc.checkpoint.resume import _note_ddp_rebuild, _rebuilding_ddp  # noqa: E402


class Compiled(nn.Module):
    """Stands in for torch.compile's OptimizedModule: the module in ``_orig_mod``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner


def test_only_a_ddp_that_has_not_rebuilt_yet_is_named(one_rank: None) -> None:
    plain = DDP(nn.Linear(4, 2))
    assert _rebuilding_ddp(plain) is plain
    assert _rebuilding_ddp(Compiled(plain)) is plain  # through torch.compile's wrapper
    assert _rebuilding_ddp(DDP(nn.Linear(4, 2), find_unused_parameters=True)) is None
    assert _rebuilding_ddp(nn.Linear(4, 2)) is None
    for _ in range(2):  # the rebuild happens at the second forward
        plain(torch.randn(3, 4)).sum().backward()
    assert _rebuilding_ddp(plain) is None  # already in its final layout


def test_the_note_needs_three_ranks(one_rank: None, caplog: pytest.LogCaptureFixture) -> None:
    net = DDP(nn.Linear(4, 2))
    with caplog.at_level(logging.INFO, "hpc.checkpoint.resume"):
        _note_ddp_rebuild(net, 2, "run/ckpt-00000008.pt")  # a 2-rank sum is exact
        assert not caplog.records
        _note_ddp_rebuild(net, 4, "run/ckpt-00000008.pt")
    (record,) = caplog.records
    text = record.getMessage()
    assert "first step after ckpt-00000008.pt" in text and "over 4 ranks" in text
    assert text.splitlines()[-1].startswith("HINT: construct it with "
                                            "DistributedDataParallel(..., "
                                            "find_unused_parameters=True)")
