"""How long each phase of :func:`hpc.init_torch` took in this process.

``init_torch`` wraps each of its phases in :func:`phase`; :func:`times` returns them in
the order they ran, for ``bench/startup.py`` and for anyone asking why start-up is slow::

    hpc.init_torch()
    from hpc.bootstrap import phases
    print(phases.times())   # {'detect': 0.0004, 'threads': 0.0001, ...} in seconds

A phase that waits for other ranks (``preflight.wait``, ``confirm_init``) holds that
wait too. Nothing is recorded outside ``init_torch``; a second ``init_torch`` (which
returns at once) leaves the first one's times alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["phase", "reset", "times"]

_TIMES: dict[str, float] = {}


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the wall time of the ``with`` block to phase ``name``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _TIMES[name] = _TIMES.get(name, 0.0) + time.perf_counter() - start


def times() -> dict[str, float]:
    """Phase -> seconds of the last ``init_torch`` in this process, in the order run."""
    return dict(_TIMES)


def reset() -> None:
    """Forget the recorded phases (``init_torch`` calls it as it starts)."""
    _TIMES.clear()
