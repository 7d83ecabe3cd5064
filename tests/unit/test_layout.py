"""The test tree's layout: what test modules share lives in ``tests/helpers/`` (fixtures
in a ``conftest.py``), so no module under ``tests/`` imports a test module.

Importing a test module runs its module-level skips and collects its fixtures into the
importer, and a helper kept there is found by nobody looking for helpers.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import ROOT

TESTS = ROOT / "tests"


def dotted(path: Path) -> str:
    """``tests/integration/test_slurm.py`` -> ``tests.integration.test_slurm``."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imported(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) for every module an import in ``source`` may name, function-local
    imports included; ``package`` (the file's own) resolves relative imports.

    ``from a.b import c`` yields ``a.b`` and ``a.b.c``: ``c`` may be a submodule.
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def imports_of_tests(source: str, package: str, test_modules: set[str]) -> list[tuple[int, str]]:
    """The imports in ``source`` that name one of ``test_modules``."""
    return [(line, name) for line, name in imported(source, package) if name in test_modules]


def test_no_module_under_tests_imports_a_test_module() -> None:
    test_modules = {dotted(p) for p in TESTS.rglob("test_*.py")}
    assert "tests.integration.test_slurm" in test_modules, sorted(test_modules)
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        package = dotted(path.parent)
        for line, name in imports_of_tests(path.read_text(), package, test_modules):
            found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not found, (
        "test modules are imported by other modules:\n  " + "\n  ".join(found) + "\n"
        "HINT: move what they share to tests/helpers/<concern>.py (a fixture to the "
        "conftest.py beside the tests that use it) and import it from there.")


def test_the_check_sees_every_form_of_importing_a_test_module() -> None:
    source = "\n".join([
        "from tests.integration.test_slurm import run",  # 1
        "from tests.integration import test_slurm",  # 2
        "import tests.integration.test_slurm",  # 3
        "from .test_slurm import sbatch",  # 4
        "from . import test_slurm as slurm_tests",  # 5
        "def f():",
        "    from tests.integration.test_slurm import job",  # 7
        "from tests.helpers.slurm import run",  # allowed from here on
        "from tests.integration import submit_target",
        "from tests.helpers.demo import check_demo",
        "from ..helpers import slurm",
    ])
    found = imports_of_tests(source, "tests.integration", {"tests.integration.test_slurm"})
    assert sorted({line for line, _ in found}) == [1, 2, 3, 4, 5, 7], found
