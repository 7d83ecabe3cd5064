"""The sandwich rule and in-place distillation (hpc.pretrain.sampling): pure functions."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hpc.pretrain.config import PretrainConfig  # noqa: E402
from hpc.pretrain.sampling import (  # noqa: E402
    LARGEST,
    RANDOM,
    SMALLEST,
    arch_for,
    check_space,
    distill_loss,
    role,
)
from hpc.pretrain.space import Supernet, arch_generator  # noqa: E402


@pytest.mark.parametrize("world", [4, 5, 8])
def test_every_step_trains_the_largest_and_the_smallest_once_and_the_roles_rotate(
        world: int) -> None:
    for step in range(1, 3 * world):
        roles = [role(r, world, step) for r in range(world)]
        assert roles.count(LARGEST) == 1 and roles.count(SMALLEST) == 1, (step, roles)
        assert roles.count(RANDOM) == world - 2
    # over `world` consecutive steps every rank trains the largest exactly once
    for rank in range(world):
        assert [role(rank, world, s) for s in range(1, world + 1)].count(LARGEST) == 1


@pytest.mark.parametrize("world", [1, 2, 3])
def test_below_four_ranks_the_four_positions_take_turns_over_steps(world: int) -> None:
    for rank in range(world):  # every 4 steps each rank: largest, smallest, 2 random
        roles = [role(rank, world, s) for s in range(5, 9)]
        assert sorted(roles) == sorted([LARGEST, SMALLEST, RANDOM, RANDOM]), roles
    for step in range(12):  # never two ranks with the same fixed role in one step
        roles = [role(r, world, step) for r in range(world)]
        assert roles.count(LARGEST) <= 1 and roles.count(SMALLEST) <= 1
    assert [role(0, 1, s) for s in range(4)] == [LARGEST, SMALLEST, RANDOM, RANDOM]


def test_the_supernets_largest_and_smallest_and_the_draws_of_the_random_ranks() -> None:
    space = Supernet(width=8, blocks=4)
    assert space.largest() == (1, 1, 1, 1)  # conv5x5: the most parameters
    assert space.smallest() == (3, 3, 3, 3)  # identity: none
    world, step = 4, 7
    for rank in range(world):
        uniform = space.sample(arch_generator(0, rank, step))
        assert arch_for(space, "uniform", 0, rank, world, step) == uniform
        sandwich = arch_for(space, "sandwich", 0, rank, world, step)
        expected = {LARGEST: space.largest(), SMALLEST: space.smallest(),
                    RANDOM: uniform}[role(rank, world, step)]
        assert sandwich == expected


def test_distillation_loss_against_a_hand_computed_value() -> None:
    student = torch.tensor([[1.0, 0.0, -1.0]])
    teacher = torch.tensor([[0.0, 2.0, 0.0]])
    target = torch.tensor([0])
    t = 2.0

    def softmax(xs: list[float]) -> list[float]:
        e = [math.exp(x / t) for x in xs]
        return [v / sum(e) for v in e]

    p, q = softmax([0.0, 2.0, 0.0]), softmax([1.0, 0.0, -1.0])
    kd = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q)) * t * t
    got = distill_loss(student, teacher, target, temperature=t, weight=1.0)
    assert got.item() == pytest.approx(kd, rel=1e-6)
    ce = -math.log(math.exp(1.0) / sum(math.exp(x) for x in (1.0, 0.0, -1.0)))
    mixed = distill_loss(student, teacher, target, temperature=t, weight=0.25)
    assert mixed.item() == pytest.approx(0.75 * ce + 0.25 * kd, rel=1e-6)


def test_the_teachers_logits_get_no_gradient() -> None:
    student = torch.zeros(2, 3, requires_grad=True)
    teacher = torch.ones(2, 3, requires_grad=True)
    distill_loss(student, teacher, torch.tensor([0, 1]), temperature=1.0,
                 weight=1.0).backward()
    assert student.grad is not None and teacher.grad is None


def test_a_space_without_largest_is_refused_with_a_hint_and_bad_values_too() -> None:
    class Plain(torch.nn.Module):
        def sample(self, generator: torch.Generator) -> int:
            return 0

    check_space(Plain(), "uniform", False)
    for sampling, distill in (("sandwich", False), ("uniform", True)):
        with pytest.raises(ValueError, match="(?s)largest and smallest.*HINT"):
            check_space(Plain(), sampling, distill)
    for bad in (dict(sampling="sandwiches"), dict(distill_temperature=0.0),
                dict(distill_weight=1.5)):
        with pytest.raises(ValueError, match="invalid pretrain configuration"):
            PretrainConfig(**bad).validate()


def test_distillation_without_the_sandwich_rule_is_refused() -> None:
    """A helper's finding: --distill under uniform sampling trained nothing (the teacher,
    the largest, is almost never trained); it is refused, naming the fix."""
    from hpc.pretrain.config import PretrainConfig

    with pytest.raises(ValueError, match=r"(?s)distill=True with sampling='uniform'.*"
                       r"HINT: .*add --sampling sandwich"):
        PretrainConfig(distill=True, out=None).validate()
    PretrainConfig(distill=True, sampling="sandwich", out=None).validate()


def test_distillation_settings_without_distillation_are_refused() -> None:
    """--distill-weight or --distill-temperature without --distill changed nothing and
    said nothing; now the run is refused, naming both ways out."""
    from hpc.pretrain.config import PretrainConfig

    for name, value in (("distill_weight", 0.5), ("distill_temperature", 2.0)):
        with pytest.raises(ValueError, match=rf"{name}={value} without distill .*add "
                           r"--distill, or drop it"):
            PretrainConfig(**{name: value}, out=None).validate()
        PretrainConfig(**{name: value}, distill=True, sampling="sandwich", out=None).validate()


def test_virtual_ranks_are_shared_evenly_or_refused() -> None:
    """Each process plays a contiguous share of the virtual ranks; a count the processes
    cannot share is refused before training, naming both fixes."""
    from hpc.pretrain.config import PretrainConfig
    from hpc.pretrain.learn import played_by, virtual_ranks

    assert virtual_ranks(PretrainConfig(), 3) == 3  # default: one per process
    assert virtual_ranks(PretrainConfig(virtual_ranks=4), 2) == 4
    assert [list(played_by(r, 2, 4)) for r in range(2)] == [[0, 1], [2, 3]]
    assert list(played_by(0, 1, 2)) == [0, 1]
    with pytest.raises(ValueError, match=r"(?s)virtual_ranks=4 is not a multiple of the 3 "
                       r"processes.*HINT: launch 4 processes or a divisor of it, or pass "
                       r"--virtual-ranks 3"):
        virtual_ranks(PretrainConfig(virtual_ranks=4), 3)
    with pytest.raises(ValueError, match=r"virtual_ranks=0 \(must be >= 1 or None\)"):
        PretrainConfig(virtual_ranks=0).validate()
