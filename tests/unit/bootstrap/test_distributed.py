"""torchrun_env: the torchrun-style variables of a layout (pure); export_env: writing
them."""

from __future__ import annotations

import dataclasses

import pytest

from hpc.bootstrap.distributed import EXPORTED, export_env, torchrun_env
from hpc.environments import detect
from hpc.environments.base import DistInfo
from hpc.errors import LaunchEnvironmentError

INFO = DistInfo(launcher="slurm", rank=3, local_rank=1, world_size=8, local_world_size=4,
                node_rank=0, num_nodes=2, master_addr="node1", master_port=15042)
LAYOUT = {"MASTER_ADDR": "node1", "MASTER_PORT": "15042", "RANK": "3", "WORLD_SIZE": "8",
          "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0", "NODE_RANK": "0",
          "NNODES": "2"}


def test_torchrun_env_returns_the_layout_and_writes_nothing() -> None:
    env = {"PATH": "/bin", "RANK": "3"}  # an equal value is no clash
    assert torchrun_env(INFO, env) == LAYOUT
    assert list(torchrun_env(INFO, {})) == list(EXPORTED)  # in torchrun's order
    assert env == {"PATH": "/bin", "RANK": "3"}


def test_torchrun_env_refuses_a_different_value_unless_overwrite() -> None:
    with pytest.raises(LaunchEnvironmentError, match=r"WORLD_SIZE=4 \(set\) vs 8"):
        torchrun_env(INFO, {"WORLD_SIZE": "4"})
    assert torchrun_env(INFO, {"WORLD_SIZE": "4"}, overwrite=True) == LAYOUT


def test_torchrun_env_leaves_out_what_the_layout_does_not_know() -> None:
    values = torchrun_env(DistInfo(launcher="mpich", rank=1, world_size=2, local_rank=1,
                                   local_world_size=2), {"MASTER_ADDR": "elsewhere"})
    assert "MASTER_ADDR" not in values and "MASTER_PORT" not in values
    assert values["RANK"] == "1"


def test_export_env_sets_every_key() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    export_env(INFO, env)
    assert env == {"PATH": "/bin", **LAYOUT}
    assert set(EXPORTED) <= set(env)
    # what was exported reads back as the same layout
    again = detect(dict(env, TORCHELASTIC_RUN_ID="x"))
    assert dataclasses.replace(again, launcher="slurm", job_id=None) == INFO


def test_export_env_refuses_a_different_value() -> None:
    env = {"RANK": "0", "MASTER_PORT": "29500"}
    with pytest.raises(LaunchEnvironmentError) as e:
        export_env(INFO, env)
    text = str(e.value)
    assert "RANK=0 (set) vs 3" in text and "MASTER_PORT=29500 (set) vs 15042" in text
    assert "slurm" in text and "HINT" in text
    assert env == {"RANK": "0", "MASTER_PORT": "29500"}  # nothing written on refusal


def test_export_env_equal_values_and_overwrite() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "node1"}
    export_env(INFO, env)
    assert env["LOCAL_RANK"] == "1"
    env["RANK"] = "0"
    export_env(INFO, env, overwrite=True)
    assert env["RANK"] == "3"


def test_export_env_skips_unknown_master() -> None:
    env = {"MASTER_ADDR": "elsewhere"}
    export_env(DistInfo(launcher="mpich", rank=1, world_size=2, local_rank=1,
                        local_world_size=2), env)
    assert env["MASTER_ADDR"] == "elsewhere" and "MASTER_PORT" not in env
    assert env["RANK"] == "1"


def test_plain_python_says_once_that_it_runs_as_a_single_process() -> None:
    """``python train.py`` with no launcher (when two ranks were meant): one INFO line
    says it is a single process and how to start N."""
    import sys

    from tests.helpers.processes import clean_env, run_group

    code = ("import logging, hpc; logging.basicConfig(level=logging.INFO); "
            "hpc.init_torch(); hpc.init_torch()")
    proc = run_group([sys.executable, "-c", code], timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "single process" in ln]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("INFO:") and "hpc run --nproc N" in lines[0], lines
    assert "torchrun --nproc-per-node N" in lines[0]
