"""DistInfo: layout validation, describe, roles."""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import inspect
import re
import sys
from collections import Counter

import pytest

from hpc import environments
from hpc.environments.base import DistInfo
from hpc.errors import LaunchEnvironmentError

INFO = DistInfo(launcher="slurm", rank=3, local_rank=1, world_size=8, local_world_size=4,
                node_rank=0, num_nodes=2, master_addr="node1", master_port=15042)



@pytest.mark.parametrize("fields,bad", [
    (dict(world_size=0, local_world_size=0, num_nodes=0), "world_size"),
    (dict(rank=-1), "rank"),
    (dict(rank=8), "rank"),
    (dict(local_world_size=9), "local_world_size"),
    (dict(local_rank=4), "local_rank"),
    (dict(num_nodes=9), "num_nodes"),
    (dict(node_rank=2), "node_rank"),
])
def test_distinfo_layout_errors(fields: dict[str, int], bad: str) -> None:
    with pytest.raises(LaunchEnvironmentError) as e:
        dataclasses.replace(INFO, **fields)
    text = str(e.value)
    assert f"({bad}" in text or f", {bad}" in text, text
    assert text.startswith("slurm: inconsistent layout") and "HINT" in text


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_distinfo_port_errors(port: int) -> None:
    with pytest.raises(LaunchEnvironmentError, match=f"master port {port} is not a TCP port"):
        INFO.replace(master_port=port)


def test_distinfo_describe_and_roles() -> None:
    assert INFO.describe() == "slurm rank 3/8 local 1/4 node 0/2 master node1:15042"
    assert DistInfo(launcher="mpich").describe() == (
        "mpich rank 0/1 local 0/1 node 0/1 master unresolved")
    assert not INFO.is_master and not INFO.is_local_master
    assert DistInfo(launcher="local").is_master
    with pytest.raises(dataclasses.FrozenInstanceError):
        INFO.rank = 0  # type: ignore[misc]
    assert Counter(INFO.replace(rank=r).is_master for r in range(8)) == {False: 7, True: 1}


def _variable_literals(module: object) -> set[str]:
    """Whole string literals of ``module`` shaped like an environment variable."""
    shape = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Za-z0-9]+)*$")
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and shape.match(n.value)}


@pytest.mark.parametrize("module", sorted({env.__module__ for env in environments.ORDER}))
def test_environments_declare_what_they_read(module: str) -> None:
    """``variables``/``patterns`` (which tests/conftest.py clears) cover every variable
    name in the environment's module, so a new launcher cannot forget one."""
    envs = [e for e in environments.ORDER if e.__module__ == module]
    declared = {v for e in envs for v in e.variables}
    patterns = [p for e in envs for p in e.patterns]
    undeclared = {v for v in _variable_literals(sys.modules[module]) if v not in declared
                  and not any(fnmatch.fnmatchcase(v, p) for p in patterns)}
    assert not undeclared, f"{module} reads {sorted(undeclared)} but does not declare them"
