"""Links land on the section they name, and HINTs name headings that exist.

A MyST label ``(master-port)=`` belongs to the heading right below it; moved away from
it, every ``[Master address and port](launching.md#master-port)`` still builds and lands
on whatever heading follows the label instead.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.paths import ROOT

DOCS = ROOT / "docs"
LABEL = re.compile(r"^\(([\w-]+)\)=$")
HEADING = re.compile(r"^#{1,6} (.+)$")
SECTION = re.compile(r"^#{2,6} (.+)$")  # not the page title
LINK = re.compile(r"\[([^\]]+)\]\(([\w-]*\.md)?#([\w-]+)\)")


def _plain(title: str) -> str:
    return re.sub(r"[`*]", "", title).strip().lower()


def labels(page: Path) -> dict[str, str]:
    """label -> the title of the heading it sits on ('' for a label on a paragraph)."""
    found: dict[str, str] = {}
    lines = page.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines):
        m = LABEL.match(line)
        if m:
            nxt = next((x for x in lines[n + 1:] if x.strip()), "")
            h = HEADING.match(nxt)
            found[m.group(1)] = _plain(h.group(1)) if h else ""
    return found


def headings(page: Path) -> set[str]:
    """The titles of the page's sections (its own title left out)."""
    return {_plain(m.group(1)) for m in map(SECTION.match,
                                            page.read_text(encoding="utf-8").splitlines()) if m}


def test_a_link_titled_like_a_section_lands_on_that_section() -> None:
    """``[Master address and port](launching.md#master-port)`` must reach that heading."""
    wrong = []
    for page in DOCS.glob("*.md"):
        for text, target, label in LINK.findall(page.read_text(encoding="utf-8")):
            dest = DOCS / target if target else page
            where = labels(dest)
            if label in where and _plain(text) in headings(dest) and \
                    where[label] != _plain(text):
                wrong.append(f"{page.name}: [{text}]({target}#{label}) lands on "
                             f"'{where[label]}'")
    assert not wrong, wrong


def test_headings_that_messages_name_exist() -> None:
    """A HINT saying "under 'X' in the launching guide" names a real heading there."""
    named = []
    for path in (ROOT / "hpc").rglob("*.py"):
        text = re.sub(r'"\s*\n\s*"', "", path.read_text(encoding="utf-8"))  # join literals
        named += [(path.name, title) for title in
                  re.findall(r"under '([^']+)' in the launching guide", text)]
    assert named, "no message names a launching guide section any more: drop this test"
    missing = [(f, t) for f, t in named if _plain(t) not in headings(DOCS / "launching.md")]
    assert not missing, missing
