"""The single-process default: plain ``python train.py`` with no launcher.

Reads ``MASTER_ADDR``/``MASTER_PORT`` if set; otherwise the process rendezvouses with
itself in memory (no port is opened).
"""

from __future__ import annotations

from collections.abc import Mapping

from hpc.environments.base import DistInfo, Environment, master_port

__all__ = ["LocalEnvironment"]


class LocalEnvironment(Environment):
    """One process, rank 0 of 1."""

    name = "local"
    variables = ("MASTER_ADDR", "MASTER_PORT")

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return True

    @staticmethod
    def read(environ: Mapping[str, str]) -> DistInfo:
        return DistInfo(
            launcher="local",
            master_addr=environ.get("MASTER_ADDR") or "127.0.0.1",
            master_port=master_port(environ, "local"),
        )
