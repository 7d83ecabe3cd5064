"""``hpc env``: what this process detected, and with ``--all`` every rank's view."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any

from hpc._command import subcommand

__all__ = ["add_parser", "describe_local", "find_mismatches", "main"]


def describe_local() -> dict[str, Any]:
    """This process's detected layout plus host and GPU facts (no torch.distributed)."""
    import dataclasses
    import os

    from hpc.environments import detect

    row: dict[str, Any] = dataclasses.asdict(detect())
    row["warnings"] = list(row["warnings"])
    row["host"] = socket.gethostname()
    from hpc.bootstrap.gpubind import VISIBLE_DEVICES

    for key in VISIBLE_DEVICES:  # NVIDIA's, and AMD ROCm's when set
        if key == "CUDA_VISIBLE_DEVICES" or key in os.environ:
            row[key] = os.environ.get(key)
    try:
        import torch

        row["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # torch missing or CUDA broken: report, do not fail
        row["cuda"] = []
    return row


def find_mismatches(rows: list[dict[str, Any]]) -> list[str]:
    """Problems visible only across ranks (pure; rows as from :func:`describe_local`)."""
    problems: list[str] = []
    for key in ("world_size", "master_addr", "master_port", "num_nodes", "launcher"):
        values = {str(r[key]) for r in rows}
        if len(values) > 1:
            problems.append(f"{key} differs between ranks: {sorted(values)}")
    ranks = sorted(r["rank"] for r in rows)
    if ranks != list(range(len(rows))):
        problems.append(f"ranks are not 0..{len(rows) - 1}: {ranks}")
    by_host: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_host.setdefault(r["host"], []).append(r)
    for host, group in sorted(by_host.items()):
        local = sorted(r["local_rank"] for r in group)
        if local != list(range(len(group))):
            problems.append(f"{host}: local ranks {local}, expected 0..{len(group) - 1}")
        sizes = {r["local_world_size"] for r in group}
        if sizes != {len(group)}:
            problems.append(f"{host}: local_world_size {sorted(sizes)} but {len(group)} ranks")
        nodes = {r["node_rank"] for r in group}
        if len(nodes) > 1:
            problems.append(f"{host}: several node ranks {sorted(nodes)}")
    return problems


def _run(args: argparse.Namespace) -> int:
    row = describe_local()
    if not args.all:
        print(json.dumps(row, indent=2) if args.json else
              "\n".join(f"{k}={v}" for k, v in row.items()))
        return 0
    import torch.distributed as dist

    import hpc

    info = hpc.init_torch()
    row.update(rank=info.rank, master_addr=info.master_addr, master_port=info.master_port)
    rows: list[Any] = [None] * info.world_size
    dist.all_gather_object(rows, row)
    if not hpc.is_master():
        return 0
    cols: tuple[str, ...] = ("rank", "local_rank", "node_rank", "host", "launcher",
                             "world_size", "local_world_size", "master_addr", "master_port",
                             "CUDA_VISIBLE_DEVICES")
    cols += tuple(k for k in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
                  if any(k in r for r in rows))
    print(" ".join(f"{c:>12}" for c in cols))
    for r in sorted(rows, key=lambda r: r["rank"]):
        print(" ".join(f"{str(r.get(c)):>12}" for c in cols))
    problems = find_mismatches(rows)
    for p in problems:
        print(f"MISMATCH: {p}")
    print(f"{len(rows)} ranks, {len({r['host'] for r in rows})} hosts, "
          f"{'no mismatches' if not problems else f'{len(problems)} mismatch(es)'}")
    return 1 if problems else 0


def add_parser(sub: Any) -> None:
    """Register ``hpc env`` on the ``hpc`` subparsers ``sub``."""
    p = sub.add_parser("env", help="print the detected launch environment",
                       description="Print what this process detected. With --all, init "
                       "torch.distributed and gather every rank's view on the master, "
                       "flagging mismatches.")
    p.add_argument("--all", action="store_true", help="gather all ranks' views (inits torch)")
    p.add_argument("--json", action="store_true", help="JSON output (single process)")
    p.set_defaults(func=_run)


main = subcommand(add_parser)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
