"""AgreedStop with a StepHealth of the caller's choosing (no process group needed: the
calls below are not on agreed steps)."""

from __future__ import annotations

from hpc.preempt.stop import AgreedStop


class _Guard:
    requested = False
    signal_name = "SIGUSR2"

    def __call__(self) -> bool:
        return False


class _Health:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def boundary(self, step: int) -> None:
        self.steps.append(step)

    def due(self, step: int) -> bool:
        return False


def test_the_given_health_is_the_step_boundary_of_every_call() -> None:
    health = _Health()
    stop = AgreedStop(_Guard(), every=10, health=health)
    assert stop.health is health
    assert [stop(s) for s in (1, 2, 3)] == [False, False, False]
    assert health.steps == [1, 2, 3]
