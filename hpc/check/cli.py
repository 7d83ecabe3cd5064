"""``hpc check``: a health check of the allocation, under any launcher.

``srun -N8 --ntasks-per-node=1 hpc check``, ``hpc run --nproc 2 -- hpc check`` or
``mpirun -np 8 hpc check``: every rank times GEMM and memory copy and reports the GPUs it
sees; every node pair and the whole ring time an all_reduce (bus bandwidth and latency);
the master prints a table and a ``VERDICT:`` line naming the outlier nodes, writes
``hpc-check.json`` and ``hpc-check.png`` into ``--out``, and every rank exits 1 when
anything is flagged, else 0.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from hpc._command import subcommand

__all__ = ["add_parser", "main", "parse_size"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"4M"`` -> 4194304: bytes with an optional K/M/G suffix (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"size {text!r} is not a positive number of bytes; HINT: e.g. 4096, 512K, 4M, 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a fraction in (0, 1]; HINT: 0.5 flags below half the median")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _verdict(res: Any) -> str:
    from hpc.check import verdict as v

    t = res.settings["thresholds"]
    th = v.Thresholds(**t)
    res.findings = (v.judge_gpus(res.rows) + v.judge_compute(res.rows, th)
                    + v.judge_network(res.labels, res.pairs, th))
    floor = f" and {th.latency_floor * 1e6:g} us" if th.latency_floor else ""
    summary = (f"{len(res.labels)} {res.unit_kind}s, {len(res.pairs)} pairs, no outliers "
               f"(flagged below {th.bandwidth:g}x the median busbw, {th.compute:g}x the "
               f"median GEMM/copy, latency above {1 / th.latency:g}x the median{floor})")
    return v.verdict_line(res.findings, summary)


def _report(res: Any, out: Path) -> bool:
    from hpc.check import report

    line = _verdict(res)
    print(report.format_table(res))
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(res, out / "hpc-check.json")
    print(report.write_png(res, out / "hpc-check.png"))
    print(line, flush=True)
    _strike(res)
    return bool(res.findings)


def _strike(res: Any) -> None:
    """One strike in the bad-node ledger per host the verdict flags (not for a link)."""
    from hpc import ledger
    from hpc.check.verdict import strikes

    host_of = {label: str(res.rows[m[0]]["host"]) for label, m in zip(res.labels, res.members)}
    for host, reason in strikes(res.findings, host_of).items():
        ledger.strike([host], reason, "check")


def _run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import hpc
    from hpc.check.runner import CheckOptions, measure
    from hpc.check.verdict import Thresholds

    info = hpc.init_torch(backend=args.backend)
    dev = hpc.device()
    floor = None if args.latency_floor is None else args.latency_floor * 1e-6
    opts = CheckOptions(size=args.size, gemm=args.gemm, copy=args.copy, budget=args.budget,
                        thresholds=Thresholds(args.threshold, args.threshold,
                                              args.latency_threshold, args.min_busbw * 1e9,
                                              floor), serial=args.serial)
    opts = opts.resolved(dev.type == "cuda")
    res = measure(opts, dev, info.rank, info.world_size)
    flagged = torch.zeros(1, device=dev)
    if res is not None:
        flagged += float(_report(res, Path(args.out)))
    dist.broadcast(flagged, 0)  # every rank exits with the master's verdict
    return 1 if flagged.item() else 0


def add_parser(sub: Any) -> None:
    """Register ``hpc check`` on the ``hpc`` subparsers ``sub``."""
    p = sub.add_parser("check", help="health check: GEMM, memory, GPUs, all_reduce per "
                       "node pair; exit 1 naming outlier nodes", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=None,
                   help="all_reduce message size (default 4M on CPU, 64M on GPU)")
    p.add_argument("--gemm", type=int, default=None,
                   help="GEMM matrix side n (default 1024 on CPU, 8192 bf16 on GPU)")
    p.add_argument("--copy", type=parse_size, default=None,
                   help="bytes copied for memory bandwidth (default 64M on CPU, 1G on GPU)")
    p.add_argument("--budget", type=_positive, default=0.3,
                   help="seconds per timing, after one warm-up (default 0.3)")
    p.add_argument("--threshold", type=_fraction, default=0.5,
                   help="flag busbw/GEMM/copy below this fraction of the median (0.5)")
    p.add_argument("--latency-threshold", type=_fraction, default=0.25,
                   help="flag latency above 1/this times the median (0.25: 4x)")
    p.add_argument("--min-busbw", type=float, default=0.0, metavar="GB/S",
                   help="also flag pairs below this busbw (GB/s; default off); the only "
                   "rule that can flag the single pair of a 2-node job")
    p.add_argument("--latency-floor", type=float, default=None, metavar="US",
                   help="a pair's latency at or below this many microseconds is never "
                   "flagged (default 1000 on CPU/gloo, 100 on GPU; 0: off)")
    p.add_argument("--serial", action="store_true",
                   help="time one pair at a time instead of rounds of disjoint pairs "
                   "(slower; for nodes that share an uplink or PCIe switch)")
    p.add_argument("--out", default=".", help="where the master writes hpc-check.json "
                   "and hpc-check.png (default: the current directory)")
    p.add_argument("--backend", default=None, help="nccl/gloo (default: auto)")
    p.set_defaults(func=_run)


main = subcommand(add_parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
