"""Every error the bootstrap raises is on the troubleshooting page.

For each ``raise SomeHPCError(<message>)`` (or ``return SomeHPCError(<message>)``, an
error built for the caller to raise) in ``hpc/environments/`` and
``hpc/bootstrap/``, the longest literal piece of the message's
first line (the text between ``{placeholders}``) must appear in
``docs/troubleshooting.md``. Rewording an error, or adding one, therefore means updating
that page.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hpc.errors

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "troubleshooting.md"
BOOTSTRAP = [*sorted((ROOT / "hpc" / "environments").glob("*.py")),
             *sorted((ROOT / "hpc" / "bootstrap").glob("*.py"))]
ERRORS = set(hpc.errors.__all__)


def _pieces(node: ast.AST) -> list[str | None]:
    """The message as literal text pieces, None for each placeholder."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        out: list[str | None] = []
        for value in node.values:
            out += _pieces(value) if isinstance(value, ast.Constant) else [None]
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _pieces(node.left) + _pieces(node.right)
    return [None]


def key_fragment(message: ast.AST) -> str | None:
    """Longest literal piece of the first line, or None for a non-literal message."""
    first_line: list[str | None] = []
    for piece in _pieces(message):
        if piece is not None and "\n" in piece:
            first_line.append(piece.split("\n", 1)[0])
            break
        first_line.append(piece)
    literal = [p.strip() for p in first_line if p and p.strip()]
    return max(literal, key=len) if literal else None


def raised_messages() -> list[tuple[str, int, str]]:
    """(file, line, fragment) per typed error raised (or returned) with a literal message."""
    out = []
    for path in BOOTSTRAP:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            exc = (node.exc if isinstance(node, ast.Raise)
                   else node.value if isinstance(node, ast.Return) else None)
            if not isinstance(exc, ast.Call):
                continue
            name = getattr(exc.func, "id", getattr(exc.func, "attr", ""))
            if name in ERRORS and exc.args:
                fragment = key_fragment(exc.args[0])
                if fragment:
                    out.append((str(path.relative_to(ROOT)), node.lineno, fragment))
    return out


def test_bootstrap_errors_are_documented() -> None:
    found = raised_messages()
    assert len(found) >= 15, "the scanner found too few raise sites; is it still working?"
    page = PAGE.read_text(encoding="utf-8")
    missing = [f"{f}:{line}: {frag!r}" for f, line, frag in found if frag not in page]
    assert not missing, (
        "errors raised by the bootstrap but not shown in docs/troubleshooting.md "
        "(add the real message with its cause and fix):\n" + "\n".join(missing))


def test_the_page_lists_the_launcher_names_of_the_code() -> None:
    """Every "one of: ..." list of HPC_LAUNCHER names on the page is
    :func:`hpc.environments.launcher_names`, in its order: one list, one place."""
    from hpc.environments import launcher_names

    page = PAGE.read_text(encoding="utf-8")
    lists = re.findall(r"HPC_LAUNCHER\S*[^\n]*?\(one of: ([^)]*)\)", page)
    assert len(lists) >= 2, "the page lost its HPC_LAUNCHER lists"
    assert {tuple(x.split(", ")) for x in lists} == {launcher_names()}


def test_fragment_of_fstring() -> None:
    msg = ast.parse('f"rank {r}: master {a}:{p} is unreachable ({e}) after ...\\nHINT"',
                    mode="eval").body
    assert key_fragment(msg) == "is unreachable ("
