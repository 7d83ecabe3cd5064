"""``--data digits-hard``: the documented generator, seeded, and its split sizes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from hpc.pretrain.data import (  # noqa: E402
    HARD_CANVAS,
    load_data,
    load_digits,
    load_digits_hard,
)


def test_digits_hard_is_shifted_noisy_half_the_training_split_and_seeded() -> None:
    plain, hard = load_digits(0), load_digits_hard(0)
    assert hard.x_train.shape == (plain.x_train.shape[0] // 2, 1, HARD_CANVAS, HARD_CANVAS)
    assert hard.x_val.shape == (plain.x_val.shape[0], 1, HARD_CANVAS, HARD_CANVAS)
    assert torch.equal(hard.y_val, plain.y_val)  # the same validation digits
    assert hard.y_train.bincount().min() >= 70  # stratified: every class kept
    assert abs(float(hard.x_train.mean())) < 1e-4 and abs(float(hard.x_train.std()) - 1) < 1e-3
    again, other = load_digits_hard(0), load_digits_hard(1)
    assert torch.equal(again.x_train, hard.x_train) and torch.equal(again.x_val, hard.x_val)
    assert not torch.equal(other.x_val, hard.x_val)
    assert load_data("digits-hard").name == "digits-hard"
    assert load_data("digits").name == load_data(None).name == "sklearn-digits"
