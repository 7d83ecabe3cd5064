"""Where the repository and the integration tests' scripts are."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "integration" / "scripts"


def script(name: str) -> str:
    """Path of a script in tests/integration/scripts."""
    return str(SCRIPTS / name)
