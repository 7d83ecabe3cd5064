"""The one shape of a stage command (``hpc pretrain``, ``hpc search``, ``hpc tune``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.helpers.paths import ROOT  # noqa: E402
from tests.helpers.processes import clean_env  # noqa: E402

_PROBE = """
import sys
from importlib import import_module
from hpc.watchdog import marks
code = import_module(sys.argv[1]).main(sys.argv[2:])
print("exit", code, "failing", marks.failed())
"""

#: A command line of each stage that fails inside the stage (not in its argument parsing).
#: ``{tmp}/run`` is an empty directory, ``{tmp}/search`` holds an empty ``search.json``.
_FAILING = {
    "hpc.pretrain.cli": ["--data", "{tmp}/missing.npz", "--out", "{tmp}/p"],
    "hpc.search.search_cli": ["--run", "{tmp}/run"],
    "hpc.search.tune_cli": ["--search", "{tmp}/search"],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", sorted(_FAILING))
def test_a_failing_stage_marks_the_failure_so_the_exit_aborts_the_group(
        module: str, tmp_path: Path) -> None:
    """After an error every stage exits 1 *and* marks the process as failing: the
    teardown then aborts the process group instead of destroying it (a destroy can hang
    a rank whose peers are gone, see hpc.watchdog.marks)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "search.json").write_text("{}")
    argv = [a.format(tmp=tmp_path) for a in _FAILING[module]]
    proc = subprocess.run([sys.executable, "-c", _PROBE, module, *argv], cwd=ROOT,
                          env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "exit 1 failing True", (proc.stdout,
                                                                          proc.stderr)
