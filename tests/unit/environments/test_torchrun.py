"""parse_local_rank: torchrun's --local-rank argument."""

from __future__ import annotations

from typing import Any

import pytest

from hpc.environments import parse_local_rank
from hpc.environments.base import DistInfo

INFO = DistInfo(launcher="slurm", rank=3, local_rank=1, world_size=8, local_world_size=4,
                node_rank=0, num_nodes=2, master_addr="node1", master_port=15042)



@pytest.mark.parametrize("argv,expected", [
    (["--local_rank=3", "--lr", "0.1"], (3, ["--lr", "0.1"])),
    (["--epochs", "2", "--local-rank", "2", "data/"], (2, ["--epochs", "2", "data/"])),
    (["--local-rank=0"], (0, [])),
    (["--local_rank", "5", "--x=1", "y"], (5, ["--x=1", "y"])),
    (["train.py", "--lr", "1"], (None, ["train.py", "--lr", "1"])),
    ([], (None, [])),
])
def test_parse_local_rank(argv: list[str], expected: tuple[Any, list[str]]) -> None:
    before = list(argv)
    assert parse_local_rank(tuple(argv)) == expected
    assert parse_local_rank(argv) == expected
    assert argv == before  # the caller's list is not modified
