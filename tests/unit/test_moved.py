"""Old deep import paths of moved modules keep working for one release, with a warning."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.processes import clean_env

#: old path -> new path (the restructuring of issue 24).
MOVED = {
    "hpc.submit.guard": "hpc.preempt.guard",
    "hpc.submit.preempt": "hpc.preempt.requeue",
    "hpc.submit.stop": "hpc.preempt.stop",
    "hpc.submit.checkpoint": "hpc.checkpoint.files",
    "hpc.submit.resume": "hpc.checkpoint.resume",
    "hpc.submit.sampler": "hpc.checkpoint.sampler",
    "hpc.bootstrap.watchdog": "hpc.watchdog.monitor",
    "hpc.bootstrap.failure": "hpc.watchdog.failure",
    "hpc.pretrain.search": "hpc.search.search",
    "hpc.pretrain.search_config": "hpc.search.config",
    "hpc.pretrain.export": "hpc.search.export",
}

_PROBE = """
import importlib, sys, warnings
old, new = sys.argv[1:3]
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    module = importlib.import_module(old)
assert module is importlib.import_module(new), (module, new)
assert sys.modules[old] is module
parent, _, leaf = old.rpartition(".")
assert getattr(importlib.import_module(parent), leaf) is module
(w,) = [w for w in seen if issubclass(w.category, DeprecationWarning)]
assert new in str(w.message), w.message
assert w.filename == "<string>", w.filename  # points at the importing line
print("ok")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_new_module_with_a_deprecation_warning(old: str) -> None:
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-c", _PROBE, old, MOVED[old]], cwd=ROOT,
                          env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.timeout(60)
def test_old_shield_path_still_runs_as_a_script() -> None:
    """Copied batch templates call ``python -m hpc.submit.shield``."""
    proc = subprocess.run([sys.executable, "-m", "hpc.submit.shield", sys.executable, "-c",
                           "print('shielded')"], cwd=ROOT,
                          env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "shielded"
    assert "python -m hpc.preempt.shield" in proc.stderr
