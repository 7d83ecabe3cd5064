"""Save a sharded checkpoint on N ranks, load it on M (hpc.checkpoint.sharded).

``save``: an MLP (BatchNorm, then ``--layers`` square layers of ``--width``; the
BatchNorm statistics differ across ranks) with Adam, trained
``--step`` steps on batches drawn from (rank, step) with gradients averaged by
``hpc.sync_gradients`` (``--fsdp``: each Linear and then the model ``fully_shard``ed
over a CPU mesh instead), saved by ``hpc.save_checkpoint(..., sharded=True)``. Rank 0
also writes ``reference.pt``: the full model and optimizer state dicts
(``get_state_dict(full_state_dict=True)``, keyed by parameter name) and each item's
bytes; then prints ``BYTES {json}``: the bytes of the files each rank wrote.

``load``: a plain MLP (``--fsdp``: sharded over these ranks) and Adam from another
seed, ``hpc.restore_checkpoint(..., allow_world_change=True)`` into them (the newest
checkpoint of the directory); then each rank compares every tensor and
``param_groups`` with ``reference.pt`` and prints ``rank R: loaded step S bitwise
(saved by W ranks, whose buffers differed)`` (the master's buffers are saved); a
difference ends it with 1.

Usage: sharded_ckpt.py {save,load} --out DIR --step S [--fsdp] [--layers L] [--width W]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hpc
from hpc.checkpoint.sharded import SPLIT_BYTES, sharded_path
from hpc.checkpoint.shardfiles import MANIFEST


def build(layers: int, width: int, seed: int, fsdp: bool = False
          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.BatchNorm1d(width), *[
        m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])
    if fsdp:  # before the optimizer: fully_shard replaces the parameters
        shard(model, hpc.get_world_size())
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def shard(model: nn.Module, size: int) -> None:
    """FSDP2 over a CPU mesh of every rank: each Linear, then the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The full (unsharded) state dicts on every rank, keyed by parameter name
    (collective for FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=options)
    return {"model": {k: v.clone() for k, v in msd.items()},
            "optim": {"state": {k: {n: t.clone() for n, t in s.items()}
                                for k, s in osd["state"].items()},
                      "param_groups": osd["param_groups"]}}


def save(args: argparse.Namespace, info: hpc.DistInfo) -> None:
    model, opt = build(args.layers, args.width, seed=0, fsdp=args.fsdp)
    for step in range(args.step):
        g = torch.Generator().manual_seed(1000 * step + info.rank)
        model(torch.randn(16, args.width, generator=g)).square().mean().backward()
        if not args.fsdp:
            hpc.sync_gradients(model)
        opt.step()
        opt.zero_grad()
    path = hpc.save_checkpoint(args.out, args.step, model=model, optimizer=opt, keep=2,
                               batch=args.step, sharded=True)
    reference = full_state(model, opt)
    if info.rank == 0:
        items = [t.numel() * t.element_size() for t in reference["model"].values()]
        items += [t.numel() * t.element_size() for s in reference["optim"]["state"].values()
                  for t in s.values()]
        torch.save({**reference, "items": items}, Path(args.out) / "reference.pt")
        files = json.loads((path / MANIFEST).read_text())["files"]
        written = [0] * info.world_size
        shards = [0] * info.world_size
        for name, entry in files.items():
            written[entry["rank"]] += entry["size"]
            if name.endswith(".distcp"):
                shards[entry["rank"]] += entry["size"]
        whole = [n for n in items if n < SPLIT_BYTES]  # larger ones: a slice per rank
        print("BYTES " + json.dumps({"written": written, "shards": shards,
                                     "tensor_bytes": sum(items), "largest": max(whole),
                                     "items": len(items), "split": len(items) - len(whole)}),
              flush=True)


def compare(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """The keys whose tensors or param_groups differ (empty: bitwise equal)."""
    bad = [k for k in want["model"].keys() | got["model"].keys()
           if k not in got["model"] or k not in want["model"]
           or not torch.equal(got["model"][k], want["model"][k])]
    gs, ws = got["optim"]["state"], want["optim"]["state"]
    bad += [f"{k}.{n}" for k in ws.keys() | gs.keys() for n in ws.get(k, {"?": 0})
            if k not in gs or n not in gs[k] or not torch.equal(gs[k][n], ws[k][n])]
    if got["optim"]["param_groups"] != want["optim"]["param_groups"]:
        bad.append("param_groups")
    return sorted(bad)


def load(args: argparse.Namespace, info: hpc.DistInfo) -> int:
    model, opt = build(args.layers, args.width, seed=1, fsdp=args.fsdp)
    restored = hpc.restore_checkpoint(args.out, model=model, optimizer=opt,
                                      allow_world_change=True)
    assert restored is not None and restored.path == str(sharded_path(args.out, args.step))
    meta = restored.payload
    want = torch.load(Path(args.out) / "reference.pt", weights_only=True)
    bad = compare(full_state(model, opt), want)
    if bad or meta["step"] != args.step or len(meta["rng"]) != meta["world_size"]:
        print(f"rank {info.rank}: MISMATCH {bad[:8]} meta step {meta['step']}", flush=True)
        return 1
    buffers = "differed" if "rank_buffers" in meta else "agreed"
    print(f"rank {info.rank}: loaded step {meta['step']} bitwise (saved by "
          f"{meta['world_size']} ranks, whose buffers {buffers})", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()

    info = hpc.init_torch(seed=0)
    hpc.setup_logging(info)
    if args.mode == "save":
        save(args, info)
        return 0
    return load(args, info)


if __name__ == "__main__":
    sys.exit(main())
