"""Which sub-networks to evaluate next: exhaustive order or Single-Path One-Shot evolution.

Pure and collective-free: every function here is a deterministic function of its
arguments, and every random draw comes from a CPU ``torch.Generator`` seeded with
:func:`~hpc.pretrain.space.derive_seed` ``(seed, SEARCH_STREAM, generation)``. Every
rank therefore proposes the same candidates in the same order, and the random state a
resumed search needs is just the generation number.

Evolution (Guo et al., 2020, "Single Path One-Shot NAS"): generation 0 is drawn at
random; every later generation takes the ``top_k`` best sub-networks evaluated so far as
parents and proposes half mutations (each choice redrawn with ``mutation_prob``) and
half crossovers (each choice from one of two parents), topping up with random draws
when those run dry. A proposal is kept only when it is new (never evaluated, not
already proposed) and ``feasible`` (the constraints); ``feasible`` may be collective, so
it is called in the same order on every rank.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from hpc.pretrain.space import derive_seed

__all__ = [
    "SEARCH_STREAM",
    "Arch",
    "enumerate_archs",
    "generation_rng",
    "pareto_front",
    "propose",
    "rank_key",
    "space_size",
]

Arch = tuple[int, ...]

#: Pseudo-rank of the search's random stream (pretrain uses ranks >= 0 and -1).
SEARCH_STREAM = -2
#: Proposals tried per wanted candidate before a phase gives up.
TRIES_PER_CANDIDATE = 50


def generation_rng(seed: int, generation: int) -> torch.Generator:
    """The generator of one generation's draws: a pure function of its arguments."""
    return torch.Generator().manual_seed(derive_seed(seed, SEARCH_STREAM, generation))


def space_size(choices: Sequence[int]) -> int:
    """Number of sub-networks: the product of the choices per position."""
    return math.prod(int(c) for c in choices)


def enumerate_archs(choices: Sequence[int]) -> list[Arch]:
    """Every sub-network, in lexicographic order."""
    return [tuple(a) for a in itertools.product(*(range(int(c)) for c in choices))]


def rank_key(record: dict[str, Any]) -> tuple[Any, ...]:
    """Sort key, best first: accuracy, then lower loss, fewer params, then the arch."""
    return (-record["val_acc"], record["val_loss"], record["params"], tuple(record["arch"]))


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: ``(cost, accuracy)``, cost lower is
    better, accuracy higher; sorted by cost."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front: list[int] = []
    best = -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def _mutate(parent: Arch, choices: Sequence[int], prob: float,
            gen: torch.Generator) -> Arch:
    flips = torch.rand(len(parent), generator=gen).tolist()
    out = list(parent)
    for i, f in enumerate(flips):
        if f < prob:
            out[i] = int(torch.randint(int(choices[i]), (1,), generator=gen))
    return tuple(out)


def _crossover(a: Arch, b: Arch, gen: torch.Generator) -> Arch:
    pick = torch.randint(2, (len(a),), generator=gen).tolist()
    return tuple(x if p == 0 else y for x, y, p in zip(a, b, pick))


def _pick(parents: Sequence[Arch], gen: torch.Generator) -> Arch:
    return parents[int(torch.randint(len(parents), (1,), generator=gen))]


def propose(n: int, generation: int, *, seed: int, choices: Sequence[int],
            sample: Callable[[torch.Generator], Any], parents: Sequence[Arch],
            seen: Iterable[Arch], feasible: Callable[[Arch], bool],
            mutation_prob: float) -> list[Arch]:
    """Up to ``n`` new feasible sub-networks for ``generation``.

    Args:
        n: How many to propose.
        generation: Seeds the draws with ``seed``.
        seed: The search seed.
        choices: Candidates per position.
        sample: The space's ``sample(generator)`` (random draws).
        parents: The best sub-networks so far (empty in generation 0: all random).
        seen: Sub-networks already evaluated or known infeasible.
        feasible: The constraints (called once per new proposal, in a fixed order).
        mutation_prob: Per-choice redraw probability of a mutation.

    Returns:
        Fewer than ``n`` only when every phase ran out of tries (a small or tightly
        constrained space).
    """
    gen = generation_rng(seed, generation)
    taken: set[Arch] = set(seen)
    out: list[Arch] = []

    def phase(want: int, make: Callable[[], Arch]) -> None:
        goal = len(out) + want
        for _ in range(TRIES_PER_CANDIDATE * max(want, 1)):
            if len(out) >= goal:
                return
            arch = tuple(int(c) for c in make())
            if arch in taken:
                continue
            taken.add(arch)
            if feasible(arch):
                out.append(arch)

    if parents:
        phase(n // 2, lambda: _mutate(_pick(parents, gen), choices, mutation_prob, gen))
        phase(n - len(out),  # the other half, and what mutation could not fill
              lambda: _crossover(_pick(parents, gen), _pick(parents, gen), gen))
    phase(n - len(out), lambda: sample(gen))
    return out
