"""The bad-node ledger: strikes against hosts, kept where every job of the user sees them.

A strike is one verdict against one host: ``hpc check`` flagged it, a straggler verdict
persisted (:mod:`hpc.health.step`), its replica went silently corrupt. Two live strikes
(:data:`STRIKES`) and ``hpc submit`` excludes the host from the next job and says so;
``hpc nodes`` lists the ledger and clears hosts. A strike expires ``HPC_LEDGER_TTL``
seconds after it was made (default 24 h; ``0`` turns the ledger off: nothing is written,
nothing excluded). Only verdicts about the host strike: a rank whose Python code raised
is not a bad node, and nothing here is called for it.

The ledger lives in ``HPC_STATE_DIR/bad-nodes/`` (default
``~/.local/state/torch-hpc/bad-nodes/``, in the home directory that the login node and
the compute nodes share), **one small JSON file per strike**::

    {"host": "node3", "time": 1717171717.5, "reason": "slow node node3: ...",
     "source": "check", "job": "1234"}

Why not one appended file: appends from several hosts are only atomic where the file
system makes ``O_APPEND`` so (NFS does not), and a lock file over NFS needs a working
lock daemon. A file per strike, written under a unique name and renamed into place, needs
neither: concurrent writers never touch the same file, a reader never sees half a
strike, and a corrupt file costs that one strike (it is skipped with a warning). Clearing
a host deletes its files; files expired for more than :data:`KEEP_EXPIRED_S` are deleted
when a strike is added.

This module imports nothing of the package but :mod:`hpc.envvars`: every room may use it.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from hpc import envvars

__all__ = ["STRIKES", "KEEP_EXPIRED_S", "DEFAULT_STATE_DIR", "Ledger", "Strike",
           "describe_exclusion", "state_dir", "strike"]

logger = logging.getLogger(__name__)

#: Live strikes that exclude a host from the next submission.
STRIKES = 2
#: Expired strikes are still listed (``hpc nodes --all``) this long after they expired.
KEEP_EXPIRED_S = 7 * 24 * 3600.0
#: The default of ``HPC_STATE_DIR``, under the user's home.
DEFAULT_STATE_DIR = "~/.local/state/torch-hpc"
_FOLDER = "bad-nodes"


@dataclass(frozen=True)
class Strike:
    """One verdict against one host.

    Attributes:
        host: The hostname, as Slurm names the node.
        time: When (seconds since the epoch).
        reason: The verdict's sentence.
        source: Who struck: ``check``, ``straggler``, ``sdc`` (or a caller's own word).
        job: The Slurm job it came from, if any.
    """

    host: str
    time: float
    reason: str
    source: str
    job: Optional[str] = None


def state_dir(environ: Optional[Mapping[str, str]] = None) -> Path:
    """``HPC_STATE_DIR``, or :data:`DEFAULT_STATE_DIR` (``~`` expanded)."""
    return Path(envvars.value("HPC_STATE_DIR", environ) or DEFAULT_STATE_DIR).expanduser()


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:g} h"


class Ledger:
    """The strikes in ``root`` (default ``state_dir()/bad-nodes``).

    Args:
        root: The ledger's folder.
        ttl: Seconds a strike lives (default ``HPC_LEDGER_TTL``).
        clock: The time now (tests inject one).
        environ: Where ``HPC_STATE_DIR`` and ``HPC_LEDGER_TTL`` are read.
    """

    def __init__(self, root: Optional[os.PathLike[str] | str] = None, *,
                 ttl: Optional[float] = None, clock: Callable[[], float] = time.time,
                 environ: Optional[Mapping[str, str]] = None) -> None:
        self.root = Path(root) if root is not None else state_dir(environ) / _FOLDER
        self.ttl = float(envvars.value("HPC_LEDGER_TTL", environ) if ttl is None else ttl)
        self.clock = clock

    @property
    def enabled(self) -> bool:
        """False when ``HPC_LEDGER_TTL=0``: no strike is written, none is live."""
        return self.ttl > 0

    def add(self, host: str, reason: str, source: str, job: Optional[str] = None) -> Strike:
        """Record a strike against ``host`` now (atomically: a unique file renamed into
        place) and delete files expired for more than :data:`KEEP_EXPIRED_S`.

        Raises:
            OSError: the ledger's folder is not writable.
        """
        s = Strike(host, self.clock(), " ".join(reason.split()), source, job)
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"{s.time:.6f}-{uuid.uuid4().hex[:12]}"
        tmp = self.root / f".{name}.tmp"
        tmp.write_text(json.dumps(asdict(s)) + "\n", encoding="utf-8")
        os.replace(tmp, self.root / f"{name}.json")
        self._prune()
        return s

    def _files(self) -> list[Path]:
        try:
            return sorted(self.root.glob("*.json"))
        except OSError:
            return []

    def _read(self, warn: bool = True) -> list[tuple[Path, Strike]]:
        out = []
        for path in self._files():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                s = Strike(str(data["host"]), float(data["time"]), str(data["reason"]),
                           str(data["source"]), data.get("job"))
            except FileNotFoundError:  # cleared meanwhile
                continue
            except (OSError, ValueError, KeyError, TypeError) as e:
                if warn:
                    logger.warning("bad-node ledger: skipping %s, which is not a strike "
                                   "(%s)", path, e)
                continue
            out.append((path, s))
        return sorted(out, key=lambda ps: ps[1].time)

    def expires(self, s: Strike) -> float:
        """When ``s`` stops counting."""
        return s.time + self.ttl

    def strikes(self, include_expired: bool = False) -> list[Strike]:
        """Every readable strike, oldest first; only the live ones unless asked."""
        now = self.clock()
        return [s for _, s in self._read() if include_expired or self.expires(s) > now]

    def live(self) -> dict[str, list[Strike]]:
        """Host -> its live strikes (oldest first), hosts in order of their last strike."""
        by: dict[str, list[Strike]] = {}
        for s in self.strikes():
            by.setdefault(s.host, []).append(s)
        return dict(sorted(by.items(), key=lambda kv: kv[1][-1].time))

    def excluded(self) -> dict[str, list[Strike]]:
        """The hosts the next submission leaves out: :data:`STRIKES` or more live strikes."""
        return {h: ss for h, ss in self.live().items() if len(ss) >= STRIKES}

    def clear(self, host: Optional[str] = None) -> int:
        """Delete ``host``'s strikes (every host's when None); how many were deleted."""
        n = 0
        for path, s in self._read():
            if host is None or s.host == host:
                try:
                    path.unlink()
                    n += 1
                except FileNotFoundError:
                    pass
        return n

    def _prune(self) -> None:
        now = self.clock()
        for path, s in self._read(warn=False):
            if self.expires(s) + KEEP_EXPIRED_S < now:
                try:
                    path.unlink()
                except OSError:
                    pass


def describe_exclusion(host: str, strikes: list[Strike], ttl: float) -> str:
    """``excluding node3 (2 strikes in 24 h: <last reason>; hpc nodes --clear node3 to
    allow it)``: the line ``hpc submit`` prints for each excluded host."""
    sources = ", ".join(dict.fromkeys(s.source for s in strikes))
    return (f"excluding {host} ({len(strikes)} strikes in {_hours(ttl)} from {sources}, "
            f"last: {strikes[-1].reason}; hpc nodes --clear {host} to allow it)")


def strike(hosts: Iterable[str], reason: str, source: str,
           environ: Optional[Mapping[str, str]] = None) -> list[Strike]:
    """One strike per host, for the verdicts of running jobs: never raises (an
    unwritable ledger is a warning, not a failed job); nothing when the ledger is off.
    The job is ``SLURM_JOB_ID`` of ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    hosts = list(dict.fromkeys(hosts))
    try:
        ledger = Ledger(environ=env)
    except Exception as e:  # noqa: BLE001 - a malformed HPC_LEDGER_TTL must not end the job
        logger.warning("bad-node ledger: not recording %s: %s", ", ".join(hosts), e)
        return []
    if not ledger.enabled:
        return []
    out = []
    for host in hosts:
        try:
            out.append(ledger.add(host, reason, source, env.get("SLURM_JOB_ID")))
        except OSError as e:
            logger.warning("bad-node ledger: could not record a strike against %s in %s: %s",
                           host, ledger.root, e)
    if out:
        logger.warning("bad-node ledger: a strike against %s (%s); %d strikes in %s "
                       "exclude a host from hpc submit (hpc nodes lists them)",
                       ", ".join(s.host for s in out), source, STRIKES, _hours(ledger.ttl))
    return out
