"""``hpc nodes``: the bad-node ledger, its strikes per host, and clearing them.

Each strike is a verdict against a host (``hpc check`` flagged it, a straggler verdict
persisted, a corrupt replica), kept in ``HPC_STATE_DIR/bad-nodes/`` for
``HPC_LEDGER_TTL`` seconds (24 h). A host with two live strikes is excluded by the next
``hpc submit`` (``--exclude``, said in its output); ``hpc nodes --clear HOST`` allows it
again. Lists the live strikes per host (``--all``: the expired ones too).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from hpc._command import subcommand

__all__ = ["add_parser", "format_ledger", "main"]


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def format_ledger(book: Any, include_expired: bool = False) -> str:
    """The table ``hpc nodes`` prints for the :class:`~hpc.ledger.Ledger` ``book``."""
    from hpc.ledger import STRIKES

    now = book.clock()
    strikes = book.strikes(include_expired=include_expired)
    head = (f"bad-node ledger {book.root}: a strike counts {book.ttl / 3600:g} h, "
            f"{STRIKES} exclude a host from hpc submit")
    if not book.enabled:
        return f"{head}\nthe ledger is off (HPC_LEDGER_TTL=0): nothing is recorded or excluded"
    if not strikes:
        return (f"{head}\nno {'' if include_expired else 'live '}strikes\n"
                "the next hpc submit excludes: none")
    by: dict[str, list[Any]] = {}
    for s in strikes:
        by.setdefault(s.host, []).append(s)
    width = max(len("host"), *(len(h) for h in by))
    lines = [head, f"{'host':<{width}}  live  {'excluded until':<16}  {'last strike':<16}  "
             "source     reason"]
    excluded = book.excluded()
    for host, ss in sorted(by.items(), key=lambda kv: kv[1][-1].time):
        live = [s for s in ss if book.expires(s) > now]
        until = _when(book.expires(live[-STRIKES])) if host in excluded else "-"
        last = ss[-1]
        gone = "" if book.expires(last) > now else " (expired)"
        lines.append(f"{host:<{width}}  {len(live):>4}  {until:<16}  {_when(last.time):<16}  "
                     f"{last.source:<9}  {last.reason}{gone}")
    lines.append("the next hpc submit excludes: " + (", ".join(excluded) or "none"))
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    from hpc.errors import HPCError
    from hpc.ledger import Ledger

    try:
        book = Ledger()
    except HPCError as e:
        print(f"hpc nodes: {e}", file=sys.stderr)
        return 2
    for host in args.clear:
        n = book.clear(host)
        print(f"cleared {n} strike(s) against {host}" if n else
              f"no strikes against {host} (hosts in the ledger: "
              f"{', '.join(sorted({s.host for s in book.strikes(True)})) or 'none'})")
    if args.clear_all:
        print(f"cleared {book.clear()} strike(s)")
    print(format_ledger(book, include_expired=args.all))
    return 0


def add_parser(sub: Any) -> None:
    """Register ``hpc nodes`` on the ``hpc`` subparsers ``sub``."""
    p = sub.add_parser("nodes", help="the bad-node ledger: strikes per host, which hosts "
                       "hpc submit excludes; --clear HOST", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true", help="list expired strikes too")
    p.add_argument("--clear", action="append", default=[], metavar="HOST",
                   help="delete HOST's strikes, so hpc submit uses it again (repeatable)")
    p.add_argument("--clear-all", action="store_true", help="delete every strike")
    p.set_defaults(func=_run)


main = subcommand(add_parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
