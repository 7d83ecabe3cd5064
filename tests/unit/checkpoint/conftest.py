"""Fixtures of the checkpoint tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture()
def one_rank() -> Iterator[None]:
    """A process group of this one process (gloo): what DDP and DCP need to run."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
