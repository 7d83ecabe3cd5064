"""hpc env --all: mismatches between the ranks' views."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hpc.cli.env import find_mismatches
from hpc.environments import detect
from hpc.environments.base import DistInfo
from tests.helpers.envdumps import load, parse_header

EXPORTED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "NNODES")
INFO = DistInfo(launcher="slurm", rank=3, local_rank=1, world_size=8, local_world_size=4,
                node_rank=0, num_nodes=2, master_addr="node1", master_port=15042)



def rows_of(name: str) -> list[dict[str, Any]]:
    """``hpc env --all`` rows for a real dump: detected layout plus the header's host."""
    rows = []
    for label, env in load(name):
        row = dataclasses.asdict(detect(env))
        row["host"] = parse_header(label).host
        rows.append(row)
    return rows


@pytest.mark.parametrize("name", ["sbatch_srun_tasks_env.txt", "srun_from_login_env.txt",
                                  "openmpi_mpirun_local.txt", "mpich_mpiexec_local.txt",
                                  "pals_mpiexec_env.txt", "flux_run_env.txt",
                                  "lsf_jsrun_env.txt"])
def test_find_mismatches_clean(name: str) -> None:
    assert find_mismatches(rows_of(name)) == []


def test_find_mismatches_duplicate_local_rank() -> None:
    rows = rows_of("srun_from_login_env.txt")
    rows[1]["local_rank"] = 0
    assert find_mismatches(rows) == ["node1: local ranks [0, 0], expected 0..1"]


def test_find_mismatches_different_master() -> None:
    rows = rows_of("srun_from_login_env.txt")
    rows[3]["master_addr"] = "node2"
    rows[2]["master_port"] = 29500
    problems = find_mismatches(rows)
    assert "master_addr differs between ranks: ['node1', 'node2']" in problems
    assert any(p.startswith("master_port differs") and "29500" in p for p in problems)
    assert len(problems) == 2


def test_find_mismatches_wrong_local_world_size() -> None:
    rows = rows_of("srun_from_login_env.txt")
    rows[2]["local_world_size"] = 4
    assert find_mismatches(rows) == ["node2: local_world_size [2, 4] but 2 ranks"]


def test_find_mismatches_ranks_and_nodes() -> None:
    rows = rows_of("srun_from_login_env.txt")
    rows[3]["rank"] = 1
    rows[2]["node_rank"] = 0
    problems = find_mismatches(rows)
    assert "ranks are not 0..3: [0, 1, 1, 2]" in problems
    assert "node2: several node ranks [0, 1]" in problems
