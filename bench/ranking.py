"""How well a pretrained supernet ranks sub-networks: Kendall's tau against stand-alone training.

For ``--archs`` sub-networks of the default supernet (the largest, the smallest, and
random distinct others, drawn from ``--seed``), this compares

- the **inherited** accuracy: the supernet's weights of each pretrain run given with
  ``--run`` (a ``hpc pretrain --out`` directory), BatchNorm recalibrated on ``--recal``
  training images, scored on the validation split;
- the **stand-alone** accuracy: each sub-network trained from scratch for ``--epochs``
  epochs (SGD, cosine, batch 64) with ``--seeds`` seeds, the mean of the seeds.

Prints per run: Kendall's tau with a 95 % bootstrap interval (2000 resamples of the
sub-networks), the top-10 % overlap, where the run's best inherited sub-network lands in
the stand-alone ranking, and the largest's and the smallest's inherited accuracies. When
the run holds ``search/search.json`` (``hpc search --run RUN``), its pick is trained
stand-alone too (same budget and seeds) and placed among the others. Stand-alone results
are cached in ``--cache`` (they do not depend on the supernet). Distributed like ``hpc
search``: under ``hpc run --nproc N`` each rank trains and scores its share, the results
are gathered.

    hpc run --nproc 2 -- hpc pretrain --data digits-hard --width 16 --out runs/uniform
    hpc run --nproc 2 -- hpc pretrain --data digits-hard --width 16 --sampling sandwich \\
        --distill --out runs/sandwich
    hpc run --nproc 2 -- hpc search --run runs/uniform    # optional: place its pick
    flock /tmp/hpc-heavy.lock hpc run --nproc 2 -- python bench/ranking.py \\
        --run runs/uniform --run runs/sandwich
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hpc  # noqa: E402
from hpc.pretrain.config import PretrainConfig  # noqa: E402
from hpc.pretrain.data import load_data  # noqa: E402
from hpc.pretrain.evaluate import validate  # noqa: E402
from hpc.pretrain.space import Supernet, derive_seed  # noqa: E402
from hpc.search.export import SubNet  # noqa: E402


def choose_archs(space: Supernet, n: int, seed: int) -> list[tuple[int, ...]]:
    """The largest, the smallest, then distinct random sub-networks: ``n`` in all."""
    archs = [space.largest(), space.smallest()]
    g = torch.Generator().manual_seed(derive_seed(seed, 32))
    while len(archs) < n:
        a = space.sample(g)
        if a not in archs:
            archs.append(a)
    return archs


def standalone(arch: tuple[int, ...], seed: int, data: Any, width: int, epochs: int,
               ops: tuple[str, ...]) -> float:
    """Validation accuracy of ``arch`` trained from scratch with ``seed``."""
    torch.manual_seed(derive_seed(seed, *arch))
    net = SubNet(arch, in_channels=data.in_channels, num_classes=data.num_classes, width=width,
                 ops=ops)
    n, batch = data.x_train.shape[0], 64
    steps = epochs * (n // batch)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g = torch.Generator().manual_seed(derive_seed(seed, 7))
    net.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for i in range(n // batch):
            idx = order[i * batch:(i + 1) * batch]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
            sched.step()
    net.eval()
    with torch.no_grad():
        return float((net(data.x_val).argmax(1) == data.y_val).float().mean())


def run_ops(run: Path) -> tuple[str, ...]:
    """The candidate operations of a pretrain run's supernet."""
    cfg = json.loads((run / "config.json").read_text())
    return PretrainConfig.from_dict(cfg).op_names()


def inherited(run: Path, archs: list, data: Any, recal: int, seed: int) -> list[float]:
    """Each arch's validation accuracy with the run's newest checkpoint, BN recalibrated."""
    cfg = json.loads((run / "config.json").read_text())
    space = Supernet(data.in_channels, data.num_classes, width=int(cfg["width"]),
                     ops=run_ops(run))
    newest = max((run / "checkpoints").glob("ckpt-*.pt"))
    space.load_state_dict(torch.load(newest, map_location="cpu", weights_only=True)["model"])
    g = torch.Generator().manual_seed(derive_seed(seed, 33))
    recal_x = data.x_train[torch.randperm(data.x_train.shape[0], generator=g)[:recal]]
    _, acc = validate(space, data.x_val, data.y_val, archs, recal_x=recal_x, reduce=False)
    return acc


def _search_pick(run: Path) -> tuple[int, ...] | None:
    found = run / "search" / "search.json"
    if not found.exists():
        return None
    return tuple(json.loads(found.read_text())["best"]["arch"])


def kendall(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b."""
    from scipy.stats import kendalltau

    tau = kendalltau(a, b).statistic
    return float(tau) if not math.isnan(tau) else 0.0


def interval(a: list[float], b: list[float], resamples: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of tau over the sub-networks."""
    rng, n, taus = random.Random(0), len(a), []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        taus.append(kendall([a[i] for i in pick], [b[i] for i in pick]))
    taus.sort()
    return taus[int(0.025 * resamples)], taus[int(0.975 * resamples) - 1]


def _shared(items: list, compute: Any) -> list:
    """``compute(item)`` for this rank's share of ``items``, gathered in item order."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {i: compute(items[i]) for i in range(rank, len(items), world)}
    parts: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(parts, mine)
    else:
        parts = [mine]
    merged = {k: v for p in parts for k, v in p.items()}
    return [merged[i] for i in range(len(items))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", action="append", required=True, type=Path)
    p.add_argument("--data", default="digits-hard")
    p.add_argument("--archs", type=int, default=32)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--recal", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", type=Path, default=Path("runs/ranking-standalone.json"))
    args = p.parse_args()
    hpc.init_torch(seed=args.seed)
    master = not dist.is_initialized() or dist.get_rank() == 0
    data = load_data(args.data, args.seed, 0.2)
    ops = run_ops(args.run[0])
    if any(run_ops(run) != ops for run in args.run):
        raise SystemExit("the runs' supernets have different --ops; rank them separately")
    archs = choose_archs(Supernet(data.in_channels, data.num_classes, width=args.width,
                                  ops=ops), args.archs, args.seed)
    key = f"{args.data}:{args.width}:{args.epochs}:{args.seeds}:{args.seed}"
    if ops != PretrainConfig().op_names():
        key += ":" + ",".join(ops)
    cached = json.loads(args.cache.read_text()) if args.cache.exists() else {}
    if key in cached and len(cached[key]) == len(archs):
        alone = cached[key]
    else:
        jobs = [(a, s) for a in archs for s in range(args.seeds)]
        accs = _shared(jobs, lambda j: standalone(j[0], j[1], data, args.width, args.epochs,
                                                  ops))
        alone = [sum(accs[i * args.seeds:(i + 1) * args.seeds]) / args.seeds
                 for i in range(len(archs))]
        if master:
            args.cache.parent.mkdir(parents=True, exist_ok=True)
            args.cache.write_text(json.dumps({**cached, key: alone}))
    order = sorted(range(len(archs)), key=lambda i: -alone[i])
    k = max(1, round(0.1 * len(archs)))
    if master:
        print(f"{len(archs)} sub-networks of width {args.width} on {args.data}, stand-alone "
              f"{args.epochs} epochs x {args.seeds} seeds: best {alone[order[0]]:.4f}, "
              f"worst {alone[order[-1]]:.4f}, largest {alone[0]:.4f}, smallest {alone[1]:.4f}")
    picks = [_search_pick(run) for run in args.run]
    extra = sorted({p for p in picks if p is not None and p not in archs})
    picked: dict[tuple[int, ...], float] = {}
    if extra:  # the searches' picks outside the set: trained stand-alone the same way
        pkey = f"{key}:picks"
        have = {tuple(json.loads(k)): v for k, v in cached.get(pkey, {}).items()}
        todo = [(a, sd) for a in extra if a not in have for sd in range(args.seeds)]
        accs = _shared(todo, lambda j: standalone(j[0], j[1], data, args.width, args.epochs,
                                                  ops))
        for i in range(0, len(todo), args.seeds):
            have[todo[i][0]] = sum(accs[i:i + args.seeds]) / args.seeds
        picked = have
        if master:
            cached = json.loads(args.cache.read_text()) if args.cache.exists() else {}
            cached[pkey] = {json.dumps(list(a)): v for a, v in have.items()}
            args.cache.write_text(json.dumps(cached))
    for run, searched in zip(args.run, picks):
        got = _shared(list(range(len(archs))), lambda i, run=run: inherited(
            run, [archs[i]], data, args.recal, args.seed)[0])
        if not master:
            continue
        if searched is not None:
            acc = alone[archs.index(searched)] if searched in archs else picked[searched]
            place = 1 + sum(a > acc for a in alone)
            print(f"{run}: hpc search picked {searched}: stand-alone {acc:.4f}, #{place} "
                  f"among the {len(archs)} ({'in' if place <= k else 'not in'} the top {k})")
        tau, (low, high) = kendall(got, alone), interval(got, alone)
        top = set(sorted(range(len(archs)), key=lambda i: -got[i])[:k])
        pick = max(range(len(archs)), key=lambda i: got[i])
        print(f"{run}: tau {tau:.3f} [{low:.3f}, {high:.3f}]; top-{k} overlap "
              f"{len(top & set(order[:k]))}/{k}; best inherited {archs[pick]} is "
              f"#{order.index(pick) + 1} of {len(archs)} stand-alone; inherited largest "
              f"{got[0]:.4f} smallest {got[1]:.4f} best {got[pick]:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
