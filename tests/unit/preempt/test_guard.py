"""The stop file (HPC_STOP_FILE) as a source of the agreed stop, and the SIGTERM shield."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.preempt import guard


def test_stop_file_requests_the_stop_and_names_the_signal(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    stop = tmp_path / ".hpc-stop-7"
    g = guard.PreemptGuard(environ={"HPC_STOP_FILE": str(stop)})
    assert g() is False  # no file yet
    stop.write_text("TERM\n")
    assert g() is False  # looked 0 s ago: the next look waits STOP_FILE_POLL_S
    monkeypatch.setattr(guard, "STOP_FILE_POLL_S", 0.0)
    g._next_look = 0.0
    assert g() is True
    assert g.signal_name == "SIGTERM"
    assert f"hpc: rank 0: stop file {stop} says TERM: stopping" in capsys.readouterr().err


def test_stop_file_without_a_signal_name_still_stops(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    stop.write_text("please\n")
    g = guard.PreemptGuard(environ={"HPC_PREEMPT_SIGNAL": "USR2"}, stop_file=str(stop))
    assert g() is True
    assert g.signal_name == "SIGUSR2"  # unknown text: the warning signal is named


def test_no_stop_file_configured_never_looks(tmp_path: Path) -> None:
    g = guard.PreemptGuard(environ={})
    assert g.stop_file is None and g() is False


def test_install_unblocks_a_pending_sigterm() -> None:
    """Under ``hpc.preempt.shield`` SIGTERM is blocked; the guard gets it once installed."""
    code = ("import os, signal\n"
            "from hpc.preempt.guard import PreemptGuard\n"
            "os.kill(os.getpid(), signal.SIGTERM)  # blocked: stays pending\n"
            "g = PreemptGuard(environ={}).install()\n"
            "print(g(), g.signal_name)\n")
    proc = subprocess.run([sys.executable, "-m", "hpc.preempt.shield", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "SIGTERM"]
    assert "got SIGTERM: stopping at the next step boundary" in proc.stderr


def test_shield_without_a_command_says_how() -> None:
    proc = subprocess.run([sys.executable, "-m", "hpc.preempt.shield"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "usage: python -m hpc.preempt.shield CMD" in proc.stderr
    missing = subprocess.run([sys.executable, "-m", "hpc.preempt.shield", "no-such-launcher"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 127 and "cannot run 'no-such-launcher'" in missing.stderr


def _mask(status: str, field: str) -> set[int]:
    """The signals of a ``/proc/<pid>/status`` mask line (``SigBlk``, ``SigIgn``)."""
    bits = int(re.search(rf"^{field}:\s*([0-9a-f]+)$", status, re.MULTILINE)[1], 16)
    return {n for n in range(1, 65) if bits >> (n - 1) & 1}


def test_shield_blocks_sigterm_in_the_launcher_and_what_it_forks() -> None:
    """What the shield exec's (a launcher) and a process that one forks and exec's in
    turn (orted, a rank) have SIGTERM blocked (pending, not lost) and not ignored, read
    from their own /proc/<pid>/status; without the shield neither is blocked.

    The launcher here is Python, not ``sh -c``: dash clears the blocked mask when it
    starts, so a launcher that is a /bin/sh script would lose the shield."""
    launcher = ("import subprocess, sys\n"
                "print(open('/proc/self/status').read(), '---', flush=True)\n"
                "sys.exit(subprocess.run(['cat', '/proc/self/status']).returncode)\n")
    shielded = subprocess.run([sys.executable, "-m", "hpc.preempt.shield", sys.executable,
                               "-c", launcher], capture_output=True, text=True, timeout=60)
    plain = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True,
                           timeout=60)
    assert shielded.returncode == 0 == plain.returncode, shielded.stderr + plain.stderr
    statuses = shielded.stdout.split("---")
    assert len(statuses) == 2 and all("SigBlk" in x for x in statuses), shielded.stdout
    for status in statuses:
        assert signal.SIGTERM in _mask(status, "SigBlk"), status
        assert signal.SIGTERM not in _mask(status, "SigIgn"), status
    for status in plain.stdout.split("---"):
        assert signal.SIGTERM not in _mask(status, "SigBlk"), status
