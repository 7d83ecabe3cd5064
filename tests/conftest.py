"""Shared fixtures and hooks.

* Launcher variables and ``HPC_*`` knobs are cleared for every test; a test that leaks
  launcher variables fails.
* Under ``HPC_CI=1`` (``.ci/run``) a skipped test FAILS unless it carries the ``cuda``
  marker: CI must not pass because a dependency (MPI, Slurm, submitit, sklearn...) is
  missing. Module-level skips at collection fail the same way.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Generator
from typing import Any

import pytest

from hpc.bootstrap.distributed import EXPORTED
from hpc.environments import ORDER, OVERRIDE_VARIABLE
from tests.helpers.processes import timeout_scale


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


#: HPC_* variables that configure the test run itself, not the code under test.
KEPT_KNOBS = frozenset({"HPC_CI", "HPC_TORCH_SPEC", "HPC_TESTCLUSTER_DIR",
                        "HPC_WRITE_ENV_FIXTURES", "HPC_DOCS_INTERSPHINX",
                        "HPC_TEST_TIMEOUT_SCALE"})


def _knob(name: str) -> bool:
    """An ``HPC_*`` setting a developer may have exported (``HPC_CONNECT_TIMEOUT``,
    ``HPC_PREEMPT_SIGNAL``, ``HPC_LOG_CONSOLE``...): tests start without it."""
    return name.startswith("HPC_") and name not in KEPT_KNOBS


@pytest.fixture(scope="session", autouse=True)
def session_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Generator[None, None, None]:
    """``HPC_STATE_DIR`` for module fixtures too: no test reads or writes the user's
    bad-node ledger (a strike there would exclude a test node from every submission)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HPC_STATE_DIR", str(tmp_path_factory.mktemp("hpc-state")))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def clean_launcher_env(monkeypatch: pytest.MonkeyPatch,
                       tmp_path_factory: pytest.TempPathFactory):
    """Clear launcher variables and HPC_* knobs; fail the test if it leaks launcher ones.
    Each test gets an empty ``HPC_STATE_DIR`` (an empty bad-node ledger)."""
    for key in [k for k in os.environ if LAUNCHER_VARS.match(k) or _knob(k)]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HPC_STATE_DIR", str(tmp_path_factory.mktemp("state")))
    yield
    leaked = sorted(k for k in os.environ if LAUNCHER_VARS.match(k))
    if leaked:
        for key in leaked:
            del os.environ[key]
        pytest.fail(f"test leaked launcher variables into os.environ: {leaked}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's pytest-timeout (its marker's, else setup.cfg's) times
    ``HPC_TEST_TIMEOUT_SCALE`` (:func:`tests.helpers.processes.timeout_scale`)."""
    scale = timeout_scale()
    if scale == 1:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        seconds = float(marker.args[0]) if marker and marker.args else default
        if seconds:
            item.add_marker(pytest.mark.timeout(seconds * scale), append=False)


def _ci_failure(report: Any, where: str) -> None:
    """Turn a skip into a failure that says why (HPC_CI=1)."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"{where} skipped under HPC_CI=1: {reason}\n"
                       "CI must run every test but the `cuda` ones; install what is missing "
                       "in .ci/run (or bin/hpc-test's extras) instead of skipping.")


def _in_ci() -> bool:
    return os.environ.get("HPC_CI") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Generator[None, Any, None]:
    """Under HPC_CI=1 a skipped test fails, unless it is marked ``cuda``."""
    outcome = yield
    report = outcome.get_result()
    if (_in_ci() and report.skipped and not hasattr(report, "wasxfail")
            and item.get_closest_marker("cuda") is None):
        _ci_failure(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    """Under HPC_CI=1 a module that skips itself (importorskip) fails collection."""
    outcome = yield
    report = outcome.get_result()
    if _in_ci() and report.skipped:
        _ci_failure(report, collector.nodeid)
