"""GRPO group advantages, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from miles.algo.advantages import group_advantages, group_advantages_ragged


def test_grpo_normalises_by_population_std() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.0, 1.0], [1.0, 2.0, 3.0, 2.0]])
    adv = group_advantages(rewards, "grpo", eps=0.0)
    # row 0: mean 0.5, std 0.5; row 1: mean 2, std sqrt(0.5)
    expected = torch.tensor([[-1.0, 1.0, -1.0, 1.0], [-math.sqrt(2), 0.0, math.sqrt(2), 0.0]])
    torch.testing.assert_close(adv, expected)


def test_grpo_eps_keeps_division_finite() -> None:
    adv = group_advantages(torch.tensor([[0.0, 1e-9]]), "grpo", eps=1e-6)
    assert torch.isfinite(adv).all()
    assert adv.abs().max() < 1e-3


def test_grpo_no_std_is_centred_only() -> None:
    adv = group_advantages(torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 9.0]]), "grpo_no_std")
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 0.0, 1.0], [-3.0, -3.0, 6.0]]))


@pytest.mark.parametrize("kind", ["grpo", "grpo_no_std"])
def test_equal_rewards_give_exact_zero(kind: str) -> None:
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0], [7.0, 7.0, 7.0]])
    adv = group_advantages(rewards, kind)  # type: ignore[arg-type]
    assert torch.equal(adv[0], torch.zeros(3)) and torch.equal(adv[2], torch.zeros(3))
    assert adv[1].abs().sum() > 0


def test_singleton_groups_and_integer_rewards() -> None:
    assert torch.equal(group_advantages(torch.tensor([[5.0]])), torch.zeros(1, 1))
    adv = group_advantages(torch.tensor([[0, 1]]), eps=0.0)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 1.0]]))


def test_ragged_groups() -> None:
    out = group_advantages_ragged([[1.0, 0.0], [5.0], [2.0, 2.0, 2.0], [], [1.0, 2.0, 3.0]], "grpo_no_std")
    assert out == [[0.5, -0.5], [0.0], [0.0, 0.0, 0.0], [], [-1.0, 0.0, 1.0]]


def test_single_group_as_vector() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]))
    assert torch.equal(group_advantages(torch.tensor([3.0, 3.0])), torch.zeros(2))


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(1, 4), "ppo")  # type: ignore[arg-type]
