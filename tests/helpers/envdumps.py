"""Parse the real launch-environment dumps in ``tests/fixtures/env/`` (see its README).

Two formats, one block per task or rank:

* Slurm dumps: a header ``### task R on NODE`` (or ``### batch-step env on NODE``)
  followed by ``KEY=VALUE`` lines;
* MPI dumps: a header ``--- rank R/S host=H allreduce=X`` followed by indented
  ``KEY=VALUE`` lines; lines before the first header (``lib: ...``) are ignored.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple, Optional

__all__ = ["FIXTURES", "Header", "dump_files", "parse_dump", "load", "parse_header"]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "env"

_SLURM_HEADER = re.compile(r"^### (?:task (?P<rank>\d+)|(?P<what>[\w-]+) env) on (?P<host>\S+)$")
_MPI_HEADER = re.compile(r"^--- rank (?P<rank>\d+)/(?P<size>\d+) host=(?P<host>\S+)")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Header(NamedTuple):
    """What a block's header says about the process, independently of its variables."""

    rank: Optional[int]
    size: Optional[int]
    host: str


def parse_header(label: str) -> Header:
    """Rank, world size (MPI dumps only) and host named by a block's header line."""
    m = _SLURM_HEADER.match(label) or _MPI_HEADER.match(label)
    if m is None:
        raise ValueError(f"not a dump header: {label!r}")
    groups = m.groupdict()
    return Header(
        rank=int(groups["rank"]) if groups.get("rank") else None,
        size=int(groups["size"]) if groups.get("size") else None,
        host=groups["host"],
    )


def parse_dump(text: str) -> list[tuple[str, dict[str, str]]]:
    """``[(header line, environ), ...]`` in file order.

    Raises:
        ValueError: a ``KEY=VALUE`` line before any header, or a line that is neither.
    """
    blocks: list[tuple[str, dict[str, str]]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\n")
        if _SLURM_HEADER.match(line) or _MPI_HEADER.match(line):
            blocks.append((line, {}))
            continue
        if not line.strip():
            continue
        if not blocks:
            if line.startswith("lib:"):
                continue
            raise ValueError(f"line {lineno}: variable before any header: {line!r}")
        key, sep, value = line.strip().partition("=")
        if not sep or not _KEY.match(key):
            raise ValueError(f"line {lineno}: not KEY=VALUE: {line!r}")
        env = blocks[-1][1]
        if key in env:
            raise ValueError(f"line {lineno}: {key} twice in one block")
        env[key] = value
    return blocks


def dump_files() -> list[Path]:
    """Every dump in the fixture folder, sorted by name."""
    return sorted(FIXTURES.glob("*.txt"))


def load(name: str) -> list[tuple[str, dict[str, str]]]:
    """Parse the fixture ``name`` (e.g. ``"srun_from_login_env.txt"``)."""
    return parse_dump((FIXTURES / name).read_text(encoding="utf-8"))
