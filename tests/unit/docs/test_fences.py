"""No code block on a docs page (or the README) swallows prose.

A line that starts with backticks but is not a fence (``` ``` `HPC_PYTHON` chooses...```)
turns the rest of the page, up to the next fence, into code: Sphinx builds it without a
warning. Each page's fences must therefore pair up: an opening fence is backticks (or
tildes) followed by at most an info string (``console``, ``{literalinclude} path``), a
closing fence the same character, at least as many of them, and nothing else.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
#: An opening fence: 3+ backticks or tildes, then an info string (a language, or a MyST
#: directive in braces with its argument); backticks cannot occur in a backtick fence's one.
OPENING = re.compile(r"^\s*(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


def fence_problems(text: str) -> list[str]:
    """``line N: what is wrong`` for each fence that does not pair up, in page order."""
    problems: list[str] = []
    open_at: tuple[int, str] | None = None  # (line, fence)
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if not (stripped.startswith("```") or stripped.startswith("~~~")):
            continue
        if open_at is None:
            m = OPENING.match(line)
            if m is None:
                problems.append(f"line {n}: a line starting with a fence has text after "
                                f"backticks in it: {line!r}")
                continue
            info = m["info"].strip()
            if info and not re.fullmatch(r"[\w+-]+|\{[\w:-]+\}.*", info):
                problems.append(f"line {n}: opening fence with an info string that is no "
                                f"language or directive: {line!r}")
            open_at = (n, m["fence"])
            continue
        start, fence = open_at
        run = re.match(r"[`~]+", stripped)
        assert run is not None
        if stripped[0] == fence[0] and len(run.group()) >= len(fence):
            if stripped[len(run.group()):].strip():
                problems.append(f"line {n}: the block opened at line {start} closes on a "
                                f"line with text after the fence: {line!r}")
            open_at = None
    if open_at is not None:
        problems.append(f"line {open_at[0]}: the block opened here is never closed")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_fences_pair_up_and_hold_no_prose(page: Path) -> None:
    assert fence_problems(page.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("text,found", [
    ("```console\n$ ls\n```\nprose\n", []),
    ("```{literalinclude} examples/x.py\n:language: python\n```\n", []),
    ("  ```text\n  nested in a list item\n  ```\n", []),
    ("````md\n```python\ninner\n```\n````\n", []),
    # launching.md's stray fence: closes the block, the prose after it stays code
    ("```console\n$ cat x\n``` `HPC_PYTHON` chooses the\ninterpreter\n```console\n$ y\n```\n",
     ["line 3: the block opened at line 1 closes on a line with text after the fence"]),
    ("```console\n$ ls\n", ["line 1: the block opened here is never closed"]),
    ("```python: x\ncode\n```\n", ["line 1: opening fence with an info string that is no"]),
])
def test_fence_problems_finds_what_swallows_prose(text: str, found: list[str]) -> None:
    problems = fence_problems(text)
    assert len(problems) == len(found), problems
    assert all(p.startswith(f) for p, f in zip(problems, found)), problems
