"""Slurm hostlist and tasks-per-node expansion, checked against ``scontrol`` when present.

The fixed expectations keep the tests meaningful without Slurm; with ``scontrol``
installed each case is also compared with ``scontrol show hostnames`` (offline, through a
throw-away slurm.conf). In CI (HPC_CI=1) a missing scontrol fails instead of skipping.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from hpc.environments.slurm import expand_hostnames, expand_tasks_per_node
from hpc.errors import LaunchEnvironmentError
from tests.helpers.requires import require

HOSTLISTS: dict[str, list[str]] = {
    "node[1-2]": ["node1", "node2"],
    "node7": ["node7"],
    "a,b": ["a", "b"],
    "a[1-2]-b[3-4]": ["a1-b3", "a1-b4", "a2-b3", "a2-b4"],
    "rack[1-2]n[01-02]": ["rack1n01", "rack1n02", "rack2n01", "rack2n02"],
    "c[1-2]-[1-2]": ["c1-1", "c1-2", "c2-1", "c2-2"],
    "n[008-011]": ["n008", "n009", "n010", "n011"],
    "n[098-101]": ["n098", "n099", "n100", "n101"],
    "x[1,3-4],y,z[001-002]": ["x1", "x3", "x4", "y", "z001", "z002"],
    # duplicates and order are kept, never sorted
    "node1,node1,node[1-2]": ["node1", "node1", "node1", "node2"],
    "n[1-2],n[1-2]": ["n1", "n2", "n1", "n2"],
    "n[1-3,2]": ["n1", "n2", "n3", "n2"],
    "n[3,1,2]": ["n3", "n1", "n2"],
    # mixed padding: the width comes from the range's start
    "n[8-011]": ["n8", "n9", "n10", "n11"],
    "n[008-11]": ["n008", "n009", "n010", "n011"],
    "n[01-2]": ["n01", "n02"],
    "n[9-10]": ["n9", "n10"],
    "n[09-10]": ["n09", "n10"],
    # blanks separate names like commas (issue 13: "a, b" gave " b")
    "a, b": ["a", "b"],
    " node001 ": ["node001"],
    "n[1-2] m3": ["n1", "n2", "m3"],
    "a ,b,  c": ["a", "b", "c"],
}

#: Rejected by both python-hostlist and scontrol ("Invalid hostlist").
BAD_HOSTLISTS = ["n[2-1]", "n[a-b]", "n[010-8]"]
#: Rejected here; scontrol 22.05 prints a mangled name for it ("n]") instead.
BAD_HERE_ONLY = ["n[1-2", "]"]


@pytest.fixture(scope="module")
def scontrol_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for ``scontrol show hostnames`` with a throw-away slurm.conf."""
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=n1\n"
                    "PartitionName=p Nodes=n1\n", encoding="utf-8")
    return dict(os.environ, SLURM_CONF=str(conf))


def scontrol_hostnames(nodelist: str, env: dict[str, str]) -> list[str]:
    scontrol = require("scontrol", "Slurm client tools")
    proc = subprocess.run([scontrol, "show", "hostnames", nodelist], env=env,
                          capture_output=True, text=True, timeout=20)
    assert "fatal" not in proc.stderr, proc.stderr  # e.g. slurm.conf not read
    return proc.stdout.split()


@pytest.mark.parametrize("nodelist", sorted(HOSTLISTS))
def test_expand_hostnames(nodelist: str) -> None:
    assert expand_hostnames(nodelist) == HOSTLISTS[nodelist]


@pytest.mark.parametrize("nodelist", sorted(HOSTLISTS))
def test_expand_hostnames_like_scontrol(nodelist: str, scontrol_env: dict[str, str]) -> None:
    assert scontrol_hostnames(nodelist, scontrol_env) == HOSTLISTS[nodelist]


@pytest.mark.parametrize("nodelist", BAD_HOSTLISTS + BAD_HERE_ONLY)
def test_expand_hostnames_rejects(nodelist: str) -> None:
    with pytest.raises(LaunchEnvironmentError) as e:
        expand_hostnames(nodelist)
    assert repr(nodelist) in str(e.value) and "HINT" in str(e.value)


@pytest.mark.parametrize("nodelist", BAD_HOSTLISTS)
def test_scontrol_rejects_too(nodelist: str, scontrol_env: dict[str, str]) -> None:
    assert scontrol_hostnames(nodelist, scontrol_env) == []


def test_scontrol_needs_no_cluster(scontrol_env: dict[str, str]) -> None:
    """The comparison above really ran offline against our slurm.conf."""
    assert scontrol_hostnames("node[1-2]", scontrol_env) == ["node1", "node2"]


@pytest.mark.parametrize("spec,expected", [
    ("2(x3),1", [2, 2, 2, 1]),
    ("4", [4]),
    ("1,2(x2)", [1, 2, 2]),
    ("2(x2)", [2, 2]),
    (" 3 , 1(x2) ", [3, 1, 1]),
    ("16(x128)", [16] * 128),
])
def test_expand_tasks_per_node(spec: str, expected: list[int]) -> None:
    assert expand_tasks_per_node(spec) == expected


@pytest.mark.parametrize("spec", ["", "x", "2(x)", "2(x3", "2x3", "-1", "2(x3),", "2,,1", "2(3)"])
def test_expand_tasks_per_node_rejects(spec: str) -> None:
    with pytest.raises(LaunchEnvironmentError) as e:
        expand_tasks_per_node(spec)
    assert repr(spec) in str(e.value) and "HINT" in str(e.value)
