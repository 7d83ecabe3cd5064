"""An attempt id every rank of one torchrun attempt shares, agreed through its store.

Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) every worker joins the agent's
TCPStore, which torch keeps across restarts, so the pre-flight keys of an earlier attempt
are still there and must be scoped per attempt. ``TORCHELASTIC_RESTART_COUNT`` cannot be
that scope: it counts *this agent's* restarts, and after a worker fails on one node only
that node's agent counts one more while the others restart their workers for the new
rendezvous round at their old count (pytorch/pytorch#108158, #135712: counts 1 vs 0, the
ranks meet under different prefixes and every rank waits for the others).

The agreement needs nothing from torch's internals. Every worker of an attempt is
running before any of them reaches the pre-flight, and the agents stop every worker of
the previous attempt before the next rendezvous round, so:

1. rank 0 takes the next generation number ``g`` (``add`` on ``hpc/attempt/gen``) and
   notes how many questions were asked so far (``hpc/attempt/asks``);
2. every other rank asks: ``n = add("hpc/attempt/asks", 1)`` is a number no other
   process ever got, and it waits for the answer under ``hpc/attempt/answer/<n>``;
3. rank 0 answers ``g`` to every question from the last ``world_size - 1`` before its
   own start on, until every rank joined attempt ``g`` (an answer to a dead process of
   an earlier attempt is harmless: nobody waits for it).

Each rank then uses ``PrefixStore("attempt<g>", store)`` for the pre-flight, the
watchdog and ``init_process_group``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from hpc.environments import DistInfo
from hpc.errors import RendezvousError

__all__ = ["Answerer", "ask", "prefix", "remember", "remembered", "take"]

_GEN, _ASKS, _ANSWER = "hpc/attempt/gen", "hpc/attempt/asks", "hpc/attempt/answer/"
#: The attempt each (master address, port) got in this process, for later store clients.
_AGREED: dict[tuple[str, int], int] = {}


def prefix(attempt: int) -> str:
    """The store prefix of ``attempt`` (``attempt3``)."""
    return f"attempt{attempt}"


def remember(info: DistInfo, attempt: int) -> None:
    """Note ``attempt`` for :func:`hpc.bootstrap.preflight.client` (same process)."""
    _AGREED[(str(info.master_addr), int(info.master_port or 0))] = attempt


def remembered(info: DistInfo) -> int | None:
    """The attempt :func:`remember` noted for this master, or None."""
    return _AGREED.get((str(info.master_addr), int(info.master_port or 0)))


class Answerer:
    """Rank 0's side: answers the other ranks' questions with its generation.

    Args:
        store: The agent's (unscoped) store.
        attempt: The generation rank 0 took.
        first: Questions up to this number are answered already (or are older).
    """

    def __init__(self, store: Any, attempt: int, first: int) -> None:
        self.store, self.attempt, self.answered = store, attempt, first

    def answer(self) -> None:
        """Answer every question asked since the last call (one round trip if none)."""
        asked = self.store.add(_ASKS, 0)
        if asked > self.answered:
            keys = [f"{_ANSWER}{n}" for n in range(self.answered + 1, asked + 1)]
            self.store.multi_set(keys, [str(self.attempt)] * len(keys))
            self.answered = asked

    def until(self, done: Callable[[], bool], deadline: float, poll: float = 0.005) -> None:
        """Answer until ``done()`` or the ``time.monotonic()`` deadline.

        ``poll`` bounds how late the last question is answered, and how late rank 0
        notices that all joined; one look costs two store round trips.
        """
        while True:
            self.answer()
            if done() or time.monotonic() >= deadline:
                return
            time.sleep(poll)


def take(store: Any, info: DistInfo) -> Answerer:
    """Rank 0: the next generation, and the answerer that hands it out."""
    attempt = store.add(_GEN, 1)
    asked = store.add(_ASKS, 0)
    answerer = Answerer(store, attempt, max(0, asked - (info.world_size - 1)))
    answerer.answer()
    return answerer


def ask(store: Any, info: DistInfo, deadline: float) -> int:
    """Every other rank: the generation rank 0 of this attempt took.

    Raises:
        RendezvousError: rank 0 did not answer before the ``time.monotonic()`` deadline.
    """
    key = f"{_ANSWER}{store.add(_ASKS, 1)}"
    try:
        store.wait([key], timedelta(seconds=max(0.01, deadline - time.monotonic())))
        return int(store.get(key).decode())
    except Exception as e:
        raise RendezvousError(
            f"rank {info.rank}: joined torchrun's store at {info.master_addr}:"
            f"{info.master_port}, but rank 0 of this attempt never gave it the attempt id.\n"
            "Rank 0 did not start, crashed before its pre-flight, or runs another hpc "
            "version.\nHINT: check rank 0's log (torchrun names the failed worker)."
        ) from e
