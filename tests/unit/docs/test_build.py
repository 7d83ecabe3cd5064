"""The documentation builds without a single warning, and its doctests pass.

The same commands as CI and ``docs/conf.py`` document::

    sphinx-build -W --keep-going -n -b html    docs docs/_build/html
    sphinx-build -W --keep-going -n -b doctest docs docs/_build/doctest

Skipped with the reason when Sphinx or myst-parser is not installed
(``pip install -e '.[docs]'``); with ``HPC_CI=1`` a missing tool fails instead.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.requires import in_ci

pytestmark = pytest.mark.background  # see setup.cfg

DOCS = ROOT / "docs"


def _require_docs_tools() -> None:
    missing = [m for m in ("sphinx", "myst_parser") if importlib.util.find_spec(m) is None]
    if missing:
        msg = (f"documentation tools not installed ({', '.join(missing)}); "
               "pip install -e '.[docs]'")
        if in_ci():
            pytest.fail(f"{msg}: CI must install them")
        pytest.skip(msg)


def _build(builder: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("HPC_DOCS_INTERSPHINX", None)  # offline build: no network in tests
    argv = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q",
            "-b", builder, "-d", str(out / "doctrees"), str(DOCS), str(out / builder)]
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=240, env=env,
                          cwd=ROOT)


@pytest.mark.timeout(300)
def test_html_builds_without_warnings(tmp_path: Path) -> None:
    _require_docs_tools()
    proc = _build("html", tmp_path)
    assert proc.returncode == 0, f"sphinx-build html failed:\n{proc.stderr}\n{proc.stdout}"
    assert "WARNING" not in proc.stderr, proc.stderr
    for page in ("index", "quickstart", "launching", "script", "envvars",
                 "troubleshooting", "benchmarks", "api/index"):
        assert (tmp_path / "html" / f"{page}.html").is_file(), page


@pytest.mark.timeout(300)
def test_doctests_pass(tmp_path: Path) -> None:
    _require_docs_tools()
    proc = _build("doctest", tmp_path)
    assert proc.returncode == 0, f"sphinx doctest failed:\n{proc.stderr}\n{proc.stdout}"
    report = (tmp_path / "doctest" / "output.txt").read_text()
    assert " 0 failures in tests" in report, report
    # Zero doctests run would also report 0 failures: every {doctest} block must count.
    blocks = sum(page.read_text().count("```{doctest}") for page in DOCS.rglob("*.md"))
    ran = re.search(r"^\s*(\d+) tests?$", report, re.MULTILINE)
    assert blocks >= 3 and ran and int(ran.group(1)) >= blocks, (blocks, report)
