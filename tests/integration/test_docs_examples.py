"""Every script in docs/examples/ runs under ``hpc run --nproc 2`` and prints what the
docs say it prints (the pages include these files with ``literalinclude``)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import ROOT, hpc_run

EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))


def check_train_minimal(proc: subprocess.CompletedProcess[str], tmp: Path) -> None:
    synced = re.findall(r"rank (\d): init (\w+) -> synced (\w+)", proc.stdout)
    assert sorted(r for r, _, _ in synced) == ["0", "1"], proc.stdout
    inits = {r: i for r, i, _ in synced}
    assert inits["0"] != inits["1"], "the example should start from different weights"
    assert len({s for _, _, s in synced}) == 1, "sync_model left ranks different"
    finals = re.findall(r"rank (\d): final (\w+)", proc.stdout)
    assert len(finals) == 2 and len({d for _, d in finals}) == 1, proc.stdout
    # Logging on local masters only: one node, so each epoch is logged once, by rank 0.
    epochs = [line for line in proc.stderr.splitlines() if "INFO train_minimal: epoch" in line]
    assert len(epochs) == 3 and all(line.startswith("[rank 0]") for line in epochs), epochs
    # IO on the global master only.
    assert (tmp / "model.pt").is_file()
    assert proc.stderr.count("INFO train_minimal: saved") == 1


def check_train_supernet(proc: subprocess.CompletedProcess[str], tmp: Path) -> None:
    rows = re.findall(r"rank (\d): last step blocks with grad (\[[\d, ]*\]) checksum (\S+)",
                      proc.stdout)
    assert sorted(r for r, _, _ in rows) == ["0", "1"], proc.stdout
    assert len({(used, total) for _, used, total in rows}) == 1, "ranks diverged"


#: Expected output of each example; a new example needs an entry here.
CHECKS: dict[str, tuple[list[str], Callable[[subprocess.CompletedProcess[str], Path], None]]] = {
    "train_minimal.py": (["--out", "{tmp}"], check_train_minimal),
    "train_supernet.py": ([], check_train_supernet),
}


def test_every_example_has_a_check() -> None:
    assert EXAMPLES, "docs/examples/ is empty"
    assert sorted(p.name for p in EXAMPLES) == sorted(CHECKS)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_under_hpc_run(path: Path, tmp_path: Path) -> None:
    args, check = CHECKS[path.name]
    argv = [str(path), *(a.format(tmp=tmp_path) for a in args)]
    proc = hpc_run(2, argv, timeout=150)
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    check(proc, tmp_path)
