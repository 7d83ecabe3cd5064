"""The package's rooms import one way, down the floors README declares ("Where things are";
STYLE.md, Layout).

Read from the source with :mod:`ast`, imports inside functions included (a lazy import is
still an arrow). A room may import its own floor's rooms (one way: no circle) and the
floors below; an arrow up, a circle, a private name taken from another room or a module
that only stands for another (an alias at an old path) fails here.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from tests.helpers.paths import ROOT

PACKAGE = ROOT / "hpc"

#: The floors, bottom first: a room imports rooms of its floor or below. A room is a
#: folder of hpc/ or a top-level module; ``hpc`` is the package's facade (``import hpc``
#: then ``hpc.init_torch``: its lazy names reach every floor, so only the features use it).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors", "_lazy", "envvars", "ledger"),  # the kit every room reads: no room above
    ("environments",),                         # pure detection of the launch
    ("roles", "log"),                          # who this process is; logging setup
    ("watchdog",),                             # after init, every rank: marks, stuck ranks
    ("bootstrap",),                            # init_torch, in call order
    ("sync",),                                 # sync_model, GradSync, the agreed collectives
    ("health", "track"),                       # per step; the run's id and trackers
    ("checkpoint",),                           # save/restore for any script
    ("preempt",),                              # stop -> the one ending -> requeue; the stage life
    ("launch", "_command"),                    # hpc run's engine; the commands' kit
    ("hpc",),                                  # the facade (import hpc)
    ("pretrain", "supervise", "check", "integrations"),  # features
    ("search", "submit"),                      # read pretrain's runs; submit its jobs
    ("cli", "__main__"),                       # the dispatcher: imported by none
)
FLOOR = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
#: Rooms that run inside every rank under any launcher: never the submitit client.
IN_RANK = ("preempt", "checkpoint", "watchdog", "sync", "bootstrap", "environments")


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its own name)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def room(module: str) -> str:
    """The room of a dotted module name: its folder of hpc/, or its top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hpc"


def arrows(sources: dict[str, str] | None = None) -> list[tuple[str, str, list[str], int]]:
    """(importing module, imported module, the names taken, line) for every import of the
    package's own modules in ``sources`` (module -> text; default: the package's files);
    ``from a import b`` names module ``a.b`` when that exists."""
    if sources is None:
        sources = {name: path.read_text(encoding="utf-8") for name, path in MODULES.items()}
    known = set(MODULES) | set(sources)
    found = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                found += [(name, a.name, [], node.lineno) for a in node.names
                          if a.name == "hpc" or a.name.startswith("hpc.")]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if node.module != "hpc" and not node.module.startswith("hpc."):
                    continue
                plain = []
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in known:
                        found.append((name, sub, [], node.lineno))
                    else:
                        plain.append(a.name)
                if plain:
                    found.append((name, node.module, plain, node.lineno))
    return found


def floor(module: str) -> int:
    """The floor of ``module``'s room (a room FLOORS does not name: below all)."""
    return FLOOR.get(room(module), -1)


def upward(found: list[tuple[str, str, list[str], int]]) -> list[str]:
    """The arrows of ``found`` that point up the floors."""
    return sorted(f"{a}:{line} imports {b} ({room(a)} floor {floor(a)} -> {room(b)} "
                  f"floor {floor(b)})" for a, b, _, line in found if floor(b) > floor(a))


def private(found: list[tuple[str, str, list[str], int]]) -> list[str]:
    """The private names (and modules) of ``found`` taken across a room; ``hpc._lazy``
    and ``hpc._command`` are the package's kit (private to the package, not to a room)."""
    crossing = sorted(f"{a}:{line} takes {b}.{n}" for a, b, names, line in found
                      for n in names if n.startswith("_") and room(a) != room(b))
    return crossing + sorted(f"{a}:{line} imports {b}" for a, b, _, line in found
                             if room(a) != room(b) and room(b) not in ("_lazy", "_command")
                             and any(p.startswith("_") for p in b.split(".")[1:]))


def test_every_room_has_a_floor() -> None:
    rooms = {room(m) for m in MODULES}
    assert rooms - set(FLOOR) == set(), f"rooms with no floor in FLOORS: {rooms - set(FLOOR)}"
    assert set(FLOOR) - rooms == set(), f"floors name no such room: {set(FLOOR) - rooms}"


def test_no_arrow_points_up_the_floors() -> None:
    up = upward(arrows())
    assert not up, "\n".join(up)


def test_no_two_rooms_import_each_other() -> None:
    pairs: dict[tuple[str, str], list[str]] = defaultdict(list)
    for a, b, _, line in arrows():
        if room(a) != room(b):
            pairs[room(a), room(b)].append(f"{a}:{line}")
    both = sorted((x, y, pairs[x, y], pairs[y, x]) for x, y in pairs if x < y and (y, x) in pairs)
    assert not both, both


def test_no_private_name_crosses_a_room() -> None:
    """Data passed between rooms is read through public names."""
    crossing = private(arrows())
    assert not crossing, "\n".join(crossing)


_ALIAS_CALL = re.compile(r"^(moved|alias|sys\.modules)")


def hollow(source: str) -> bool:
    """True for a module that defines nothing of its own: only imports, a docstring,
    ``__all__`` and calls that alias it to another (``moved(__name__, ...)``)."""
    own = [s for s in ast.parse(source).body if not isinstance(s, (ast.Import, ast.ImportFrom))
           and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
           and not (isinstance(s, ast.Assign)
                    and [getattr(t, "id", "") for t in s.targets] == ["__all__"])
           and not (isinstance(s, ast.Expr) and _ALIAS_CALL.match(ast.unparse(s.value)))]
    return not own


def test_no_module_only_stands_for_another() -> None:
    """No alias left at an old path: every module other than a package's ``__init__`` or
    a ``__main__`` defines something of its own (a function, a class, a value)."""
    found = [name for name, path in MODULES.items()
             if path.name not in ("__init__.py", "__main__.py")
             and hollow(path.read_text(encoding="utf-8"))]
    assert not found, f"modules that only import or alias another: {found}"


def test_the_in_rank_rooms_never_import_submitit_or_the_submit_client() -> None:
    bad = []
    for name, path in MODULES.items():
        if room(name) not in IN_RANK:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{name}: {m}" for m in mods
                    if m.split(".")[0] == "submitit" or m.startswith("hpc.submit")]
    assert not bad, bad


def test_the_checks_here_see_an_arrow_up_a_private_name_and_a_shim() -> None:
    """The rules on made-up modules: a rule that cannot fail passes for ever."""
    probe = {"hpc.sync.probe": "from hpc.pretrain.cli import add_flags\n"
                               "from hpc.watchdog.marks import _write\n"}
    assert upward(arrows(probe)) == ["hpc.sync.probe:1 imports hpc.pretrain.cli (sync floor "
                                     f"{FLOOR['sync']} -> pretrain floor {FLOOR['pretrain']})"]
    assert private(arrows(probe)) == ["hpc.sync.probe:2 takes hpc.watchdog.marks._write"]
    assert hollow('"""Moved."""\nfrom hpc._moved import moved\nmoved(__name__, "hpc.x")\n')
    assert hollow('"""Re-exported."""\nfrom hpc.sync.agree import world\n__all__ = ["world"]\n')
    assert not hollow('"""Own."""\nfrom hpc import envvars\nLIMIT = 3\n')
