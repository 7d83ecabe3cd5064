"""When a collective runs on the GPU: the in-order backlog the tracker keeps for it.

An NCCL collective returns once it is queued on the GPU, so counting at the Python call
says nothing about the device: a rank whose GPU is stuck in a kernel before
``all_reduce #n`` would read "entered and completed #n" while its peers' GPUs wait for
it in #n. For a collective on CUDA tensors :mod:`hpc.watchdog.tracker` therefore asks
two questions later instead of answering them at the call:

* *started?* an event recorded on the tensor's current stream just before the call:
  done once the GPU reached the collective (everything queued before it ran);
* *finished?* an event recorded just after a synchronous call (the stream then waits
  for the collective), or the Work's ``is_completed()`` for ``async_op=True``.

:class:`Backlog` is the pure state machine over those answers, fed by "done?"
callables and polled by the watchdog thread (and by the tracker when the backlog grows
long); it knows nothing of CUDA and is tested with fake events on the CPU.
:func:`cuda_marker` makes the real questions. In-order, because one rank's collectives
on the default group run one after the other:

* ``entered`` is the highest ``n`` such that every collective up to ``n`` started;
* ``completed`` the highest ``n`` such that every collective up to ``n`` finished;
* ``queued`` (the host's own count) may run ahead of both.

So a rank whose GPU never reached #n shows ``entered < n`` and is named by the report,
and a rank whose GPU waits in #n shows ``entered == n > completed``, waiting, and gets
the hang warning. Host-synchronous collectives (gloo on CPU tensors, barriers, object
collectives) that come while a CUDA one is pending join the backlog already started,
and finish when their call returns.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_BACKLOG", "Backlog", "Done", "cuda_marker"]

logger = logging.getLogger(__name__)

#: "Has this happened on the device yet?" (a CUDA event's ``query``).
Done = Callable[[], bool]
#: The tracker polls the backlog itself once it holds this many collectives (the
#: watchdog thread polls every 0.5 s; a fast loop of small collectives queues more).
MAX_BACKLOG = 1024


class _Item:
    __slots__ = ("finished", "op", "seq", "started")

    def __init__(self, seq: int, op: str, started: Done | None) -> None:
        self.seq, self.op = seq, op
        self.started: Done | None = started  # None: known to have started
        self.finished: Done | bool = False  # False: the host call has not returned


def _ask(done: Done) -> bool:
    try:
        return bool(done())
    except Exception as e:  # noqa: BLE001 - a broken CUDA context: never done, logged
        logger.debug("device progress: %r", e)
        return False


class Backlog:
    """The collectives of one rank whose start or finish is known only later.

    Holds ``progress`` (a :class:`~hpc.watchdog.tracker.Progress`) to its in-order
    rules (module docstring). Once a collective waits here every later one joins it
    until the backlog drains, so it holds consecutive numbers: ``#n`` is at
    ``n - items[0].seq``, and each call costs O(1) (plus what it pops). Empty, it costs
    the tracker nothing: collectives then update ``progress`` directly. Not
    thread-safe: the tracker calls it under its lock.
    """

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.items: deque[_Item] = deque()

    def __len__(self) -> int:
        return len(self.items)

    def add(self, seq: int, op: str, started: Done | None, now: float) -> None:
        """Collective ``#seq`` (the next number) was called; ``started`` tells when the
        device reached it (None: it started now, e.g. a host collective behind a
        pending CUDA one)."""
        self.items.append(_Item(seq, op, started))
        if len(self.items) >= MAX_BACKLOG:
            self._advance(now, ask=True)
        elif started is None and self.progress.entered == seq - 1:  # entered now
            self._advance(now)

    def finish(self, seq: int, finished: Done | bool, now: float) -> None:
        """``#seq``'s call returned: it is finished (True), or ``finished`` tells when."""
        items, p = self.items, self.progress
        if items and items[0].seq <= seq <= items[-1].seq:
            items[seq - items[0].seq].finished = finished
            if seq <= p.entered:  # one not entered yet cannot complete
                self._advance(now)
        # Not here: it completed out of order (an async gloo future) before the backlog.
        elif p.completed < seq < (items[0].seq if items else p.entered + 1):
            p.completed, p.since = seq, now

    def poll(self, now: float) -> bool:
        """Ask the pending collectives; True when ``progress`` moved."""
        return self._advance(now, ask=True)

    def _advance(self, now: float, ask: bool = False) -> bool:
        p, items, moved = self.progress, self.items, False
        if not items:
            return False
        i = max(0, p.entered + 1 - items[0].seq)
        while i < len(items):  # starts, in order, from the first not yet entered
            item = items[i]
            if item.started is not None:
                if not (ask and _ask(item.started)):
                    break
                item.started = None
            p.entered, p.op, p.since, moved = item.seq, item.op, now, True
            i += 1
        while items:  # finishes, in order
            item = items[0]
            if item.seq > p.entered or item.finished is False:
                break
            if item.finished is not True and not (ask and _ask(item.finished)):
                break
            items.popleft()
            if item.seq > p.completed:
                p.completed, p.since, moved = item.seq, now, True
        return moved


def cuda_marker() -> Callable[[Any], Done | None] | None:
    """``mark(tensor)``: records a CUDA event on the current stream of ``tensor``'s
    device and returns its ``query`` (None while that stream is being captured into a
    CUDA graph: its events cannot be queried then, so the call counts on the host).
    None when CUDA is unavailable."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    event, current_stream = torch.cuda.Event, torch.cuda.current_stream
    capturing = torch.cuda.is_current_stream_capturing

    def mark(tensor: Any) -> Done | None:
        if capturing():
            return None
        ev = event()
        ev.record(current_stream(tensor.device))
        return ev.query

    return mark
