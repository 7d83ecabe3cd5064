"""hpc.submit's import arrows point one way: no two of its modules import each other."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import ROOT

PACKAGE = ROOT / "hpc" / "submit"


def _imports(path: Path) -> set[str]:
    """The hpc.submit modules ``path`` imports anywhere: at the top, in a function, under
    TYPE_CHECKING (``from hpc.submit import watch`` is the module ``watch``)."""
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            head, _, rest = name.partition("hpc.submit.")
            if not head and rest.split(".")[0] in modules:
                out.add(rest.split(".")[0])
    return out - {path.stem}


def test_no_import_circle_in_hpc_submit() -> None:
    graph = {p.stem: _imports(p) for p in sorted(PACKAGE.glob("*.py"))}
    assert graph["cli"] >= {"options", "executor"}  # executor: inside cli._run

    def circle(start: str, at: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph.get(at, ())):
            if nxt == start:
                return [*path, nxt]
            if nxt not in path:
                found = circle(start, nxt, [*path, nxt])
                if found:
                    return found
        return None

    for module in graph:
        found = circle(module, module, [module])
        assert found is None, (
            f"hpc.submit imports go in a circle: {' -> '.join(found)}.\n"
            "HINT: move what both need into the module lower down (options for the "
            "schema's readers), or pass it in.")
