"""``users=`` and ``comm_dtype`` of sync_gradients: the pure parts (no process group)."""

from __future__ import annotations

import pytest
import torch

from hpc.errors import HPCError
from hpc.sync import _pack, grads
from hpc.sync._collective import same_on_all_ranks
from hpc.sync._users import check_own_row, users_matrix


def _setup() -> tuple[torch.nn.Module, dict[int, int], list[tuple[str, torch.Tensor]]]:
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    named = list(net.named_parameters())
    return net, {id(p): i for i, (_, p) in enumerate(named)}, named


def test_users_from_parameter_lists_and_from_a_tensor_agree() -> None:
    net, index, named = _setup()
    first, second = net[0], net[1]
    lists = [[first.weight, first.bias], [second.weight, first.weight]]
    m = users_matrix(lists, 2, index, named)
    assert m.dtype == torch.uint8 and m.tolist() == [[1, 1, 0, 0], [1, 0, 1, 0]]
    as_bool = torch.tensor([[True, True, False, False], [True, False, True, False]])
    assert torch.equal(users_matrix(as_bool, 2, index, named), m)
    assert torch.equal(users_matrix(as_bool.int() * 7, 2, index, named), m)


@pytest.mark.parametrize("users,message", [
    (torch.ones(3, 4, dtype=torch.bool), "shape (3, 4); the tensor form needs (2, 4)"),
    (torch.ones(2, 4), "torch.float32 tensor"),
    ([[]], "users has 1 entries for a world size of 2"),
    ([[torch.zeros(5)], []], ("users[0] holds a tensor of shape (5,) that is not one of "
                              "the 4 parameters")),
])
def test_malformed_users_are_refused_with_a_hint(users: object, message: str) -> None:
    _, index, named = _setup()
    with pytest.raises(HPCError, match="HINT:") as err:
        users_matrix(users, 2, index, named)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_comm_dtype_applies_to_float32_only_and_keeps_its_own_buckets() -> None:
    f32, bf16, f64 = (torch.zeros(1, dtype=d) for d in
                      (torch.float32, torch.bfloat16, torch.float64))
    cpu = torch.device("cpu")
    assert _pack.bucket_key(f32, None) == (cpu, torch.float32)
    assert _pack.bucket_key(f32, torch.bfloat16) == (cpu, torch.bfloat16, torch.float32)
    assert _pack.bucket_key(bf16, torch.bfloat16) == (cpu, torch.bfloat16)  # not mixed in
    assert _pack.bucket_key(f64, torch.bfloat16) == (cpu, torch.float64)


def test_unsupported_comm_dtype_is_refused() -> None:
    with pytest.raises(HPCError, match="comm_dtype=torch.int8 is not supported"):
        grads.GradSync(torch.nn.Linear(2, 2), comm_dtype=torch.int8)


def test_users_is_data_not_a_cached_option() -> None:
    """users is positional (per step); the cache key holds only keyword options."""
    import inspect
    p = inspect.signature(grads.sync_gradients).parameters["users"]
    assert p.kind is p.POSITIONAL_OR_KEYWORD and p.default is None


def test_same_on_all_ranks_is_true_without_a_process_group() -> None:
    assert same_on_all_ranks(b"anything")


def test_an_omitted_gradient_is_refused_a_listed_missing_one_is_not() -> None:
    _, _, named = _setup()
    mine = torch.tensor([1, 1, 0, 0], dtype=torch.uint8)
    check_own_row(mine, torch.tensor([1, 1, 1, 0], dtype=torch.uint8), 0, named)
    with pytest.raises(HPCError, match=r"rank 1 has a gradient for '0.bias' \(1 "):
        check_own_row(mine, torch.tensor([1, 0, 1, 1], dtype=torch.uint8), 1, named)
