"""Which collective is this rank in: sequence numbers and ops of world collectives.

:func:`install` wraps the collectives of ``torch.distributed`` (``dist.all_reduce``,
``dist.broadcast``, ``dist.barrier``, ...) so that every call on the default group
counts: the n-th world collective of a rank is ``#n`` on every rank, because ranks call
them in the same order. The :class:`Progress` it fills is what the watchdog publishes
(:mod:`hpc.watchdog.monitor`): a rank whose ``entered`` is behind its peers' never
entered the collective they wait in.

Only calls made through the ``torch.distributed`` module after ``init_torch`` are seen
(``dist.all_reduce(...)``; not a function imported by name before, not collectives that
C++ issues, e.g. DDP's reducer) and only on the default group; other calls pass through
untouched. Collectives inside a ``torch.compile`` graph are not counted either: while
dynamo traces, the wrapper calls torch's function straight away, so the graph holds
the collective itself (no graph break) and its runs never pass through the wrapper.

A collective that raises is one of two things (:func:`is_job_failure`). A *job failure*
(the backend timed out or lost a peer while waiting for the others) is handed to the
``on_failure`` callback before the error propagates, and may be replaced by what it
returns. Any other error was raised before this rank sent anything (an object that
cannot be pickled, arguments the backend refuses): it reaches the caller as itself and
the collective's number completes, so a script that catches it goes on counting in step
with its peers. An ``async_op=True`` collective completes (or fails) through its future.

A collective on CUDA tensors (:data:`DEVICE_COLLECTIVES`; NCCL returns once it is
queued) is entered and completed by the GPU instead: CUDA events recorded around the
call, asked later by the watchdog thread (:func:`poll`, :mod:`hpc.watchdog.device`).
"""

from __future__ import annotations

import functools
import inspect
import linecache
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from hpc.watchdog import device

__all__ = ["COLLECTIVES", "DEVICE_COLLECTIVES", "STALLED", "Progress", "aside", "begin", "end",
           "hang_next", "install", "is_job_failure", "poll", "start_stall_meter", "uninstall",
           "wait", "waited"]

#: The ``torch.distributed`` functions counted as collectives.
COLLECTIVES = (
    "all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "reduce", "gather", "scatter", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list", "monitored_barrier",
)
#: Those that return once queued when their tensors are on a GPU (NCCL): their start
#: and finish are read from the device (:mod:`hpc.watchdog.device`). The barriers and
#: object collectives wait on the host under NCCL too.
DEVICE_COLLECTIVES = frozenset(
    n for n in COLLECTIVES if "barrier" not in n and not n.endswith(("_object", "_list")))

#: ``on_failure(seq, op, error, raising)``; ``raising`` is False for an ``async_op``
#: collective (nobody raises what it returns). It may return an exception to raise
#: instead of ``error``.
OnFailure = Callable[[int, str, BaseException, bool], Optional[BaseException]]  # noqa: UP045 (runtime, 3.9)


@dataclass
class Progress:
    """This rank's collective progress (times are ``time.time()``).

    For a collective on CUDA tensors "entered" and "completed" are the GPU's: it
    reached the collective, it finished it (:mod:`hpc.watchdog.device`).

    Attributes:
        entered: Sequence number of the last world collective this rank entered.
        completed: Sequence number of the last one that completed here.
        op: Name of collective ``#entered``.
        since: When the rank last made progress (entered or completed one).
        failed: ``"op #n: error"`` once a collective failed on this rank.
        queued: Sequence number of the last one this rank's Python called: ahead of
            ``entered`` while its GPU has not reached what the host queued.
        waited: Seconds this rank's host spent blocked in world collectives so far: in
            the wrapped ones that return when done (not ``async_op``, not queued on a
            GPU) and in the waits :mod:`hpc.sync` makes on its own Works
            (:func:`wait`). The straggler detector reads it (:mod:`hpc.health.straggler`).
    """

    entered: int = 0
    completed: int = 0
    op: str = ""
    since: float = field(default_factory=time.time)
    failed: str = ""
    queued: int = 0
    waited: float = 0.0

    def waiting(self) -> bool:
        """True while a collective this rank entered has not completed."""
        return self.entered > self.completed

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able copy."""
        return asdict(self)


#: A backend's own words for a timeout or a lost peer: gloo raises them as a plain
#: RuntimeError, and a call that blocks inside C++ (``monitored_barrier``) raises them
#: from no ``wait()``.
_TRANSPORT_WORDS = re.compile(
    r"timed out|timeout|connection|closed by peer|reset by peer|broken pipe|socket", re.I)


def _raised_waiting(error: BaseException) -> bool:
    """True when ``error`` came out of a ``.wait(...)`` call: the innermost frame of its
    traceback is a line waiting for a Work (the backend's side, after the send)."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return ".wait(" in linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno)


def is_job_failure(error: BaseException, backend_errors: tuple[type, ...] = ()) -> bool:
    """True when a collective's ``error`` means the job cannot go on: the backend timed
    out or lost a peer.

    That is torch's own backend errors (``backend_errors``: ``torch.distributed.DistError``
    and its ``DistBackendError``, ``DistNetworkError``, ``DistStoreError``),
    ``TimeoutError`` and ``ConnectionError``, and a ``RuntimeError`` raised while waiting
    for the backend's Work or naming a timeout or a lost connection (gloo's kind). Every
    other error (``TypeError`` of an object that cannot be pickled, the backend's
    argument checks when the Work is created, ``NotImplementedError`` of an op the
    backend lacks) is raised before anything was sent: the caller's to handle.
    """
    if isinstance(error, (TimeoutError, ConnectionError, *backend_errors)):
        return True
    if not isinstance(error, RuntimeError) or isinstance(error, NotImplementedError):
        return False
    return _raised_waiting(error) or bool(_TRANSPORT_WORDS.search(str(error)))


_LOCK = threading.Lock()
_ORIGINALS: dict[str, Callable[..., Any]] = {}
#: (backlog, on_failure, backend errors) while installed: for :func:`begin`,
#: :func:`end` and :func:`poll`.
_ACTIVE: list[tuple[device.Backlog, OnFailure, tuple[type, ...]]] = []
#: ``install``'s default ``mark``: CUDA events when wrapping torch.distributed.
_AUTO: Any = object()


#: Set by :func:`hang_next`: the next world collective this rank calls never returns
#: (and is never entered: the peers' report names this rank as the one that did not come).
_HANG: list[bool] = []


def hang_next() -> bool:
    """Make the next world collective this rank calls sleep forever before it is entered
    (``HPC_FAULT``'s ``hang``): False when not installed (nothing would see the collective)."""
    if not _ACTIVE:
        return False
    _HANG.append(True)
    return True


def _hang_forever(name: str, seq: int) -> None:
    import logging

    logging.getLogger(__name__).warning("HPC_FAULT: hanging at %s #%d, never entering it "
                                        "(injected)", name, seq)
    while True:
        time.sleep(3600)


#: Past any call's arguments: "this function takes no such parameter".
_NOWHERE = 1 << 30


def _shape(fn: Callable[..., Any]) -> tuple[int, Any, int, str]:
    """Where ``fn`` takes ``group`` and ``async_op`` by position, read once from its real
    signature (through ``functools.wraps``' ``__wrapped__``): ``(group's index, group's
    default, async_op's index, the first parameter's name)``, :data:`_NOWHERE` for a
    parameter it lacks. So
    ``all_reduce(t, op, group)`` and ``reduce(t, dst, op, group, True)`` are read as
    torch reads them, at the cost of a dict lookup and a tuple index per call."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature: only keywords are seen
        return _NOWHERE, None, _NOWHERE, ""
    positional = [p.name for p in params if p.kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    group = next((p for p in params if p.name == "group"), None)
    default = None if group is None or group.default is inspect.Parameter.empty \
        else group.default
    return (positional.index("group") if "group" in positional else _NOWHERE, default,
            positional.index("async_op") if "async_op" in positional else _NOWHERE,
            positional[0] if positional else "")


def _enter(backlog: device.Backlog, name: str, started: device.Done | None) -> int:
    """Number the collective the host calls now; ``started``: see :meth:`Backlog.add`."""
    with _LOCK:
        p = backlog.progress
        p.queued += 1
        seq = p.queued
        if started is None and not backlog.items:  # nothing pending: entered now
            p.entered, p.op, p.since = seq, name, time.time()
        else:
            backlog.add(seq, name, started, time.time())
        return seq


def _complete(backlog: device.Backlog, seq: int,
              finished: device.Done | bool = True) -> None:
    with _LOCK:
        if backlog.items:
            backlog.finish(seq, finished, time.time())
        elif seq > backlog.progress.completed:
            backlog.progress.completed = seq
            backlog.progress.since = time.time()


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """The first argument (a tensor, or the first of a list of them)."""
    first = args[0] if args else kwargs.get(name)
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    return first


def _watch_future(backlog: device.Backlog, seq: int, name: str, work: Any,
                  on_failure: OnFailure) -> None:
    """Complete ``#seq`` when ``work``'s future does, or report its failure."""
    try:
        future = work.get_future()
    except Exception:  # noqa: BLE001 - a backend without futures: count it as done when issued
        _complete(backlog, seq)
        return

    def done(fut: Any) -> None:
        try:
            fut.value()
        except Exception as e:  # noqa: BLE001 - report off the backend's callback thread
            threading.Thread(target=on_failure, args=(seq, name, e, False),
                             daemon=True).start()
            return
        _complete(backlog, seq)

    future.add_done_callback(done)


def _is_compiling() -> Callable[[], bool]:
    """``torch.compiler.is_compiling`` (always False without it): dynamo evaluates it to
    True while it traces, and the wrapper then hands over to torch's own function, which
    dynamo knows how to trace (its lock and clock it does not: a graph break at every
    collective, an error under ``fullgraph=True``)."""
    try:
        import torch.compiler

        return torch.compiler.is_compiling
    except (ImportError, AttributeError):
        return lambda: False


def _wrap(name: str, fn: Callable[..., Any], backlog: device.Backlog,
          on_failure: OnFailure, members: Any, backend_errors: tuple[type, ...],
          mark: Callable[[Any], device.Done | None] | None) -> Callable[..., Any]:
    group_at, group_default, async_at, first_name = _shape(fn)
    compiling = _is_compiling()
    on_device = mark is not None and name in DEVICE_COLLECTIVES
    # closure locals: the common path (nothing pending on a GPU) is _enter and
    # _complete inlined, with no global or attribute lookups it can avoid
    progress, items, lock, clock = backlog.progress, backlog.items, _LOCK, time.time
    perf, stalled = time.perf_counter, STALLED

    @functools.wraps(fn)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        if compiling():  # inside a graph being traced: not counted
            return fn(*args, **kwargs)
        group = kwargs["group"] if "group" in kwargs else \
            args[group_at] if group_at < len(args) else group_default
        # members.WORLD is read at each call: init_process_group replaces it
        if group is not None and (members is None or group is not members.WORLD):
            return fn(*args, **kwargs)
        started = first = None
        if on_device:
            first = _first_tensor(args, kwargs, first_name)
            if getattr(first, "is_cuda", False):
                started = mark(first)  # type: ignore[misc]
        if _HANG:  # HPC_FAULT's hang: frozen at the collective's door, never entering it
            _hang_forever(name, progress.queued + 1)
        with lock:
            progress.queued = seq = progress.queued + 1
            if started is None and not items:  # nothing pending: entered now
                progress.entered, progress.op, progress.since = seq, name, clock()
            else:
                backlog.add(seq, name, started, clock())
        t0, s0 = perf(), stalled[0]
        try:
            result = fn(*args, **kwargs)
        except Exception as e:
            if not is_job_failure(e, backend_errors):
                _complete(backlog, seq)
                raise
            instead = on_failure(seq, name, e, True)
            if instead is not None:
                raise instead from e
            raise
        async_op = kwargs["async_op"] if "async_op" in kwargs else \
            async_at < len(args) and args[async_at]
        if started is not None:  # queued on the GPU: finished when the device says so
            finished = (getattr(result, "is_completed", None) if async_op else None) \
                or mark(first) or True  # type: ignore[misc]
            with lock:
                backlog.finish(seq, finished, clock())
        elif async_op and result is not None:
            _watch_future(backlog, seq, name, result, on_failure)
        else:
            with lock:
                progress.waited += perf() - t0 - (stalled[0] - s0)
                if items:
                    backlog.finish(seq, True, clock())
                elif seq > progress.completed:
                    progress.completed, progress.since = seq, clock()
        return result

    tracked.__hpc_tracked__ = True  # type: ignore[attr-defined]
    return tracked


def install(progress: Progress, on_failure: OnFailure, module: Any | None = None,
            mark: Callable[[Any], device.Done | None] | None = _AUTO) -> None:
    """Wrap the :data:`COLLECTIVES` of ``module`` (default ``torch.distributed``).

    ``mark(tensor)`` returns "has the device reached this point?" for a CUDA tensor
    (default: :func:`hpc.watchdog.device.cuda_marker` for ``torch.distributed``, none
    for another module). Idempotent: a second call re-targets the wrappers to the new
    ``progress``.
    """
    if mark is _AUTO:
        mark = device.cuda_marker() if module is None else None
    if module is None:
        import torch.distributed as module  # type: ignore[no-redef]
    uninstall(module)
    members = getattr(module, "GroupMember", None)  # looked up once, not per collective
    backend_errors = tuple(e for e in [getattr(module, "DistError", None)] if e is not None)
    backlog = device.Backlog(progress)
    for name in COLLECTIVES:
        fn = getattr(module, name, None)
        if fn is None:
            continue
        _ORIGINALS[name] = fn
        setattr(module, name, _wrap(name, fn, backlog, on_failure, members, backend_errors,
                                    mark))
    _ACTIVE[:] = [(backlog, on_failure, backend_errors)]


def uninstall(module: Any | None = None) -> None:
    """Put the original functions back."""
    if module is None:
        import torch.distributed as module  # type: ignore[no-redef]
    for name, fn in _ORIGINALS.items():
        setattr(module, name, fn)
    _ORIGINALS.clear()
    _ACTIVE.clear()


def begin(name: str) -> Optional[int]:
    """Count a world collective made of other calls (``hpc.sync`` sends a two-rank
    broadcast as ``isend``/``irecv``, which are not wrapped); its sequence number, or
    None when not installed. Every rank must count it, in the same order as its
    wrapped collectives; finish it with :func:`end`."""
    if not _ACTIVE:
        return None
    return _enter(_ACTIVE[0][0], name, None)


def end(seq: Optional[int], name: str, error: Optional[BaseException] = None
        ) -> Optional[BaseException]:
    """Complete :func:`begin`'s ``seq``, or report its ``error`` when it is a job
    failure (:func:`is_job_failure`; returns what to raise instead, as the wrapped
    collectives do); any other error completes ``seq`` and is the caller's to raise."""
    if seq is None or not _ACTIVE:
        return None
    backlog, on_failure, backend_errors = _ACTIVE[0]
    if error is not None and is_job_failure(error, backend_errors):
        return on_failure(seq, name, error, True)
    _complete(backlog, seq)
    return None


_WAITING = threading.local()

#: Seconds this process did not run (SIGSTOP, a frozen VM), as :func:`start_stall_meter`'s
#: thread sees them; a wait that holds a stall does not count it as waiting: the peers
#: waited for this rank, not it for them.
STALLED = [0.0]
_METER: list[threading.Thread] = []


def start_stall_meter(period: float = 0.005, late: float = 0.010) -> None:
    """Start (once) a daemon thread that wakes every ``period`` seconds and adds to
    ``STALLED`` every wake-up later than ``late`` seconds: the process did not run."""
    if _METER:
        return

    def meter() -> None:
        clock = time.perf_counter
        last = clock()
        while True:
            time.sleep(period)
            now = clock()
            behind = now - last - period
            if behind > late:
                STALLED[0] += behind
            last = now

    t = threading.Thread(target=meter, name="hpc-stall-meter", daemon=True)
    _METER.append(t)
    t.start()


def wait(work: Any) -> Any:
    """``work.wait()``, its time counted in :attr:`Progress.waited` while installed
    (:mod:`hpc.sync` waits on its own Works through this)."""
    if not _ACTIVE or getattr(_WAITING, "depth", 0):  # an outer wait counts it
        return work.wait()
    t0, s0 = time.perf_counter(), STALLED[0]
    _WAITING.depth = 1
    try:
        return work.wait()
    finally:
        _WAITING.depth = 0
        progress = _ACTIVE[0][0].progress
        with _LOCK:
            progress.waited += time.perf_counter() - t0 - (STALLED[0] - s0)


class aside:
    """``with tracker.aside():`` counts the block's time in :attr:`Progress.waited`: work
    the job chose to do on one rank while the others wait for it (the master writing a
    checkpoint) is not a straggler's compute."""

    def __enter__(self) -> "aside":
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if _ACTIVE:
            progress = _ACTIVE[0][0].progress
            with _LOCK:
                progress.waited += time.perf_counter() - self._t0


def waited() -> Optional[float]:
    """:attr:`Progress.waited` of the installed tracker; None when not installed."""
    return _ACTIVE[0][0].progress.waited if _ACTIVE else None


def poll() -> bool:
    """Ask the device about the collectives queued on it (the watchdog thread calls
    this before it publishes or reports); True when the progress moved."""
    if not _ACTIVE:
        return False
    backlog = _ACTIVE[0][0]
    with _LOCK:
        return bool(backlog.items) and backlog.poll(time.time())
