"""The package's rooms import one way (README, "Where things are"; STYLE.md, Layout).

Read from the source with :mod:`ast`, imports inside functions included: a room that
imports a room which imports it back holds two concerns in the wrong places.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hpc"

#: The dispatcher: its table names every command's module (as text), and the stage
#: commands use its runner; it is the one room allowed both ways.
DISPATCHER = "cli"
#: Rooms that run inside every rank under any launcher: never the submitit client.
IN_RANK = ("preempt", "checkpoint", "watchdog", "sync", "bootstrap", "environments")


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else "hpc"


def _imports() -> dict[str, dict[str, set[str]]]:
    """room -> imported top-level module or hpc room -> the files importing it."""
    found: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        room = _room(".".join(rel.parts))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                target = _room(name) if name.startswith("hpc.") else name.split(".")[0]
                found[room][target].add(str(rel))
    return found


def test_no_two_rooms_import_each_other() -> None:
    imports = _imports()
    rooms = [p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    both = [(a, b, sorted(imports[a][b]), sorted(imports[b][a]))
            for i, a in enumerate(rooms) for b in rooms[i + 1:]
            if DISPATCHER not in (a, b) and imports[a].get(b) and imports[b].get(a)]
    assert not both, both


def test_the_in_rank_rooms_never_import_submitit_or_the_submit_client() -> None:
    imports = _imports()
    bad = {room: sorted(imports[room].get("submitit", set()) | imports[room].get("submit", set()))
           for room in IN_RANK}
    assert not any(bad.values()), bad


def test_pretrain_never_imports_search() -> None:
    """search and tune read pretrain's runs; the pretrain stage knows nothing of them."""
    assert not _imports()["pretrain"].get("search"), _imports()["pretrain"]["search"]
