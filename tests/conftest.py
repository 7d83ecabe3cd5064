"""Shared fixtures: launcher variables are cleared for every test and leaks fail it."""

from __future__ import annotations

import fnmatch
import os
import re

import pytest

from hpc.bootstrap.distributed import EXPORTED
from hpc.environments import ORDER, OVERRIDE_VARIABLE


def _launcher_vars() -> re.Pattern[str]:
    """What the environments in ORDER declare they read, what export_env writes, and
    HPC_LAUNCHER: a new launcher extends this by declaring its own variables."""
    names = {v for env in ORDER for v in env.variables} | set(EXPORTED) | {OVERRIDE_VARIABLE}
    patterns = {p for env in ORDER for p in env.patterns}
    names = {n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    alternatives = [re.escape(p).replace(r"\*", r"\w+") for p in sorted(patterns)]
    alternatives += [re.escape(n) for n in sorted(names)]
    return re.compile("^(" + "|".join(alternatives) + ")$")


#: Variables any launcher reads; tests must not inherit them nor leave them behind.
LAUNCHER_VARS = _launcher_vars()


@pytest.fixture(autouse=True)
def clean_launcher_env(monkeypatch: pytest.MonkeyPatch):
    """Clear launcher variables before the test; fail it if it leaks new ones."""
    for key in [k for k in os.environ if LAUNCHER_VARS.match(k)]:
        monkeypatch.delenv(key)
    yield
    leaked = sorted(k for k in os.environ if LAUNCHER_VARS.match(k))
    if leaked:
        for key in leaked:
            del os.environ[key]
        pytest.fail(f"test leaked launcher variables into os.environ: {leaked}")
