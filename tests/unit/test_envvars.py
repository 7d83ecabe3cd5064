"""The table of ``HPC_*`` variables (:mod:`hpc.envvars`): a typo in each one fails at
init, naming the variable, its value and the accepted form; the documented forms pass."""

from __future__ import annotations

import json
import signal
import sys

import pytest

from hpc import envvars
from hpc.errors import HPCError, LaunchEnvironmentError, PreemptError
from tests.helpers.processes import clean_env, run_group

#: One typo per variable that has a form, the way users make them.
TYPOS = {
    "HPC_LAUNCHER": "PBS Pro",  # the form; an unknown name: test_detect
    "HPC_CONNECT_TIMEOUT": "2m",
    "HPC_NETWORK": "auto",
    "HPC_HANG_TIMEOUT": "5min",
    "HPC_WATCHDOG": "disabled",
    "HPC_SYNC_SHM": "nope",
    "HPC_LOG_CONSOLE": "node",
    "HPC_RUN_PREFIXED": "2",
    "HPC_PREEMPT_SIGNAL": "USR3",
    "HPC_PREEMPT_SIGNALS": "USR3",
    "HPC_MAX_REQUEUES": "three",
    "HPC_STEP_HOOK": "mypkg.hooks.on_step",
    "HPC_ALLOW_CPU": "yes",
    "HPC_STRAGGLER": "auto",
    "HPC_STRAGGLER_EVERY": "0",
    "HPC_SDC": "raise",
    "HPC_SDC_EVERY": "1e2",
    "HPC_FAULT": "3:kill",
    "HPC_LEDGER_TTL": "24h",
    "HPC_TRACEBACK": "verbose",
    "HPC_SUPERVISE": "yes",
    "HPC_SUPERVISE_ELASTIC": "true",
    "HPC_SPARE_NODES": "one",
    "HPC_MAX_RESTARTS": "-1",
    "HPC_ATTEMPT": "first",
}
#: Variables whose value is any text (a path, an id): nothing to get wrong in the form.
FREE_TEXT = {"HPC_LOG_DIR", "HPC_ERROR_DIR", "HPC_RUN_ID", "HPC_PYTHON", "HPC_STOP_FILE",
             "HPC_REQUEUE_MARKER", "HPC_STATE_DIR", "HPC_PROGRESS_FILE",
             "HPC_STAGE_DIR"}
#: The documented forms, and what they read as.
ACCEPTED = [
    ("HPC_LAUNCHER", "slurm", "slurm"), ("HPC_LAUNCHER", "mpi4py", "mpi4py"),
    ("HPC_CONNECT_TIMEOUT", "120", 120.0), ("HPC_CONNECT_TIMEOUT", " 0.5 ", 0.5),
    ("HPC_NETWORK", "print", "print"), ("HPC_HANG_TIMEOUT", "0", 0.0),
    ("HPC_WATCHDOG", "0", False), ("HPC_SYNC_SHM", "off", False),
    ("HPC_SYNC_SHM", "1", True), ("HPC_LOG_CONSOLE", "global", "global"),
    ("HPC_RUN_PREFIXED", "1", True), ("HPC_PREEMPT_SIGNAL", "SIGXCPU", signal.SIGXCPU),
    ("HPC_PREEMPT_SIGNAL", "12", signal.SIGUSR2),
    ("HPC_PREEMPT_SIGNALS", "usr1, SIGHUP,USR1", (signal.SIGUSR1, signal.SIGHUP)),
    ("HPC_MAX_REQUEUES", "0", 0), ("HPC_MAX_REQUEUES", "3", 3),
    ("HPC_STEP_HOOK", "mypkg.hooks:on_step", "mypkg.hooks:on_step"),
    ("HPC_LOG_DIR", "/tmp/x", "/tmp/x"), ("HPC_ALLOW_CPU", "1", "1"),
    ("HPC_STRAGGLER", "off", False), ("HPC_STRAGGLER_EVERY", "5", 5),
    ("HPC_SDC", "warn", "warn"), ("HPC_SDC_EVERY", "0", 0),
    ("HPC_FAULT", "3:50:kill", ((3, 50, "kill", None),)),
    ("HPC_TRACEBACK", "1", True), ("HPC_LEDGER_TTL", "3600", 3600.0), ("HPC_LEDGER_TTL", "0", 0.0),
    ("HPC_FAULT", "1:20:slow:1.5, 0:7:bitflip",
     ((1, 20, "slow", 1.5), (0, 7, "bitflip", None))),
]


def test_every_variable_has_a_typo_case_or_takes_any_text() -> None:
    """A new row must say which: a form to test, or free text."""
    assert set(TYPOS) | FREE_TEXT == set(envvars.VARIABLES)
    assert not set(TYPOS) & FREE_TEXT


@pytest.mark.parametrize("name", sorted(TYPOS))
def test_a_typo_names_the_variable_the_value_and_the_accepted_form(name: str) -> None:
    var = envvars.VARIABLES[name]
    with pytest.raises(var.error) as raised:
        envvars.check({name: TYPOS[name]})
    text = str(raised.value)
    assert text.startswith(f"{name}={TYPOS[name]!r} ")
    assert f"HINT: set {name} to {var.accepted}" in text
    assert "\n" in text and "Slurm uses" not in text


@pytest.mark.parametrize("name, raw, expected", ACCEPTED)
def test_the_documented_forms_are_accepted(name: str, raw: str, expected: object) -> None:
    envvars.check({name: raw})
    assert envvars.value(name, {name: raw}) == expected


@pytest.mark.parametrize("name", sorted(envvars.VARIABLES))
def test_unset_or_empty_is_the_default(name: str) -> None:
    default = envvars.VARIABLES[name].default
    assert envvars.value(name, {}) == default
    assert envvars.value(name, {name: "  "}) == default


def test_several_typos_are_reported_together() -> None:
    with pytest.raises(LaunchEnvironmentError) as raised:
        envvars.check({"HPC_CONNECT_TIMEOUT": "2m", "HPC_MAX_REQUEUES": "three"})
    text = str(raised.value)
    assert text.startswith("2 torch-hpc variables are malformed: HPC_CONNECT_TIMEOUT='2m'")
    assert "HPC_MAX_REQUEUES='three'" in text and "HINT: set HPC_CONNECT_TIMEOUT to" in text


def test_preempt_variables_raise_preempt_errors() -> None:
    for name in ("HPC_PREEMPT_SIGNALS", "HPC_MAX_REQUEUES", "HPC_STEP_HOOK"):
        with pytest.raises(PreemptError):
            envvars.check({name: TYPOS[name]})


_INIT_EACH = """
import json, sys
import hpc
from hpc.errors import HPCError
out = {}
for name, raw in json.loads(sys.argv[1]).items():
    try:
        hpc.init_torch(environ={name: raw})
        out[name] = "accepted"
    except HPCError as e:
        out[name] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""


def test_init_torch_refuses_every_typo_before_anything_runs() -> None:
    """A real process calls ``hpc.init_torch`` with each typo: it must fail there, on the
    rank that reads it, not at the preemption (``HPC_MAX_REQUEUES=three`` was accepted)."""
    proc = run_group([sys.executable, "-c", _INIT_EACH, json.dumps(TYPOS)], timeout=120,
                     env=clean_env())
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    for name, raw in TYPOS.items():
        error = envvars.VARIABLES[name].error.__name__
        assert result[name].startswith(f"{error}: {name}={raw!r} "), (name, result[name])


def test_errors_are_hpc_errors_and_value_errors() -> None:
    for var in envvars.VARIABLES.values():
        assert issubclass(var.error, HPCError) and issubclass(var.error, ValueError)


def test_the_rendered_table_has_a_row_per_variable() -> None:
    table = envvars.rst_table()
    assert [f"``{n}``" for n in envvars.VARIABLES] == [
        line.split("- ", 1)[1] for line in table.splitlines() if line.startswith("   * - ``")]
