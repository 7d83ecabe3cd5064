"""``python -m hpc demo`` under any launcher: every rank prints one ``DEMO`` line, and
:func:`check_demo` checks that the ranks agree on the layout they were given."""

from __future__ import annotations

import re
import sys

DEMO = [sys.executable, "-m", "hpc", "demo"]
LINE = re.compile(r"DEMO rank=(\d+) world=(\d+) local=(\d+)/(\d+) node=(\d+)/(\d+) host=(\S+) "
                  r"launcher=(\S+) master=(\S+) device=\S+ allreduce=(\S+) expected=(\S+) "
                  r"roles=(\S+) (OK|WRONG)")


def check_demo(output: str, world: int, launcher_name: str) -> list[re.Match[str]]:
    """Every rank agrees on world and master, sums right, one master, one local master/node."""
    rows = [m for m in (LINE.search(line) for line in output.splitlines()) if m]
    assert sorted(int(m[1]) for m in rows) == list(range(world)), output
    assert {int(m[2]) for m in rows} == {world}
    assert {m[8] for m in rows} == {launcher_name}
    assert len({m[9] for m in rows}) == 1, "ranks disagree on the master"
    assert all(m[13] == "OK" and float(m[10]) == world * (world + 1) / 2 for m in rows)
    assert sum("master" in m[12].split(",") for m in rows) == 1
    hosts = {m[7] for m in rows}
    assert sum("local-master" in m[12].split(",") for m in rows) == len(hosts)
    return rows
