"""Tests for ftis.core.advantages (docs/math.md §2). Expected numbers are worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftis.core.advantages import flat_group_advantages, group_advantages

# fp32 arithmetic on O(1) values is good to ~1e-7; 1e-6 is tight enough that forgetting eps
# (which moves the results by ~1e-4 relative) fails.
ATOL = 1e-6


def test_group_advantages_std_2x3_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0], [2.0, 4.0, 6.0]])
    eps = 1e-4
    # Row 0: mean 1/3; centered (2/3, -1/3, -1/3); unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3.
    std0 = math.sqrt(1 / 3)
    row0 = [(2 / 3) / (std0 + eps), (-1 / 3) / (std0 + eps), (-1 / 3) / (std0 + eps)]
    # Row 1: mean 4; centered (-2, 0, 2); unbiased var (4 + 0 + 4) / 2 = 4, std 2.
    row1 = [-2 / (2 + eps), 0.0, 2 / (2 + eps)]
    expected = torch.tensor([row0, row1])
    torch.testing.assert_close(group_advantages(rewards, eps=eps), expected, atol=ATOL, rtol=0)


def test_group_advantages_none_is_centered_rewards() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0], [2.0, 4.0, 6.0]])
    expected = torch.tensor([[2 / 3, -1 / 3, -1 / 3], [-2.0, 0.0, 2.0]])
    torch.testing.assert_close(group_advantages(rewards, scale="none"), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("scale", ["std", "none"])
@pytest.mark.parametrize("eps", [1e-4, 0.0])
def test_constant_group_gives_exact_zeros(scale: str, eps: float) -> None:
    # 0.1 and 0.7 are not exact in binary: their float mean need not equal them bit for bit.
    rewards = torch.tensor([[0.1, 0.1, 0.1, 0.1, 0.1], [0.7, 0.7, 0.7, 0.7, 0.7]])
    out = group_advantages(rewards, scale=scale, eps=eps)  # type: ignore[arg-type]
    assert torch.equal(out, torch.zeros_like(out))


def test_integer_rewards_are_promoted_to_float32() -> None:
    out = group_advantages(torch.tensor([[1, 0], [1, 1]]))
    assert out.dtype == torch.float32
    # Row 0: mean 1/2, centered (1/2, -1/2), unbiased var (1/4 + 1/4) / 1 = 1/2.
    std = math.sqrt(0.5)
    expected = torch.tensor([[0.5 / (std + 1e-4), -0.5 / (std + 1e-4)], [0.0, 0.0]])
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_float64_rewards_stay_float64() -> None:
    assert group_advantages(torch.tensor([[1.0, 0.0]], dtype=torch.float64)).dtype == torch.float64


def test_std_with_one_completion_per_group_raises() -> None:
    with pytest.raises(ValueError, match="unbiased std"):
        group_advantages(torch.tensor([[1.0], [0.0]]))
    # "none" is fine with G = 1: every reward is its own mean.
    assert torch.equal(
        group_advantages(torch.tensor([[1.0], [0.0]]), scale="none"), torch.zeros(2, 1)
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rewards_raise(bad: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([[1.0, bad]]))
    with pytest.raises(ValueError, match="finite"):
        flat_group_advantages(torch.tensor([1.0, bad]), torch.tensor([0, 0]))


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(2, 3), scale="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(2, 3), eps=-1.0)
    with pytest.raises(ValueError, match=r"\(B, G\)"):
        group_advantages(torch.zeros(6))
    with pytest.raises(ValueError, match="integer"):
        flat_group_advantages(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="shape"):
        flat_group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.int64))


def test_flat_uneven_noncontiguous_groups_by_hand() -> None:
    rewards = torch.tensor([1.0, 5.0, 0.0, 3.0, 0.0, 2.0, 2.0])
    group_ids = torch.tensor([10, 20, 10, 20, 10, -3, -3])
    eps = 1e-4
    # Group 10 = (1, 0, 0): as row 0 of the 2x3 example, std 1/sqrt(3).
    std10 = math.sqrt(1 / 3)
    # Group 20 = (5, 3): mean 4, centered (1, -1), unbiased var (1 + 1) / 1 = 2.
    std20 = math.sqrt(2)
    # Group -3 = (2, 2): constant, exactly 0.
    expected = torch.tensor(
        [
            (2 / 3) / (std10 + eps),
            1 / (std20 + eps),
            (-1 / 3) / (std10 + eps),
            -1 / (std20 + eps),
            (-1 / 3) / (std10 + eps),
            0.0,
            0.0,
        ]
    )
    out = flat_group_advantages(rewards, group_ids, eps=eps)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    assert torch.equal(out[5:], torch.zeros(2))


def test_flat_singleton_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 7.0])
    group_ids = torch.tensor([0, 0, 1])
    with pytest.raises(ValueError, match=r"one sequence: \[1\]"):
        flat_group_advantages(rewards, group_ids)
    # With "none" a singleton group is its own mean: advantage 0.
    out = flat_group_advantages(rewards, group_ids, scale="none")
    assert torch.equal(out, torch.tensor([0.5, -0.5, 0.0]))


def test_flat_empty_input() -> None:
    out = flat_group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0,)


@settings(max_examples=30, deadline=None)
@given(
    num_groups=st.integers(1, 4),
    group_size=st.integers(2, 5),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from(["std", "none"]),
)
def test_flat_matches_rectangular_on_shuffled_groups(
    num_groups: int, group_size: int, seed: int, scale: str
) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Binary rewards (as from a verifier) make constant groups common, which is the edge case.
    rewards = torch.randint(0, 2, (num_groups, group_size), generator=gen).float()
    expected = group_advantages(rewards, scale=scale).flatten()  # type: ignore[arg-type]
    perm = torch.randperm(num_groups * group_size, generator=gen)
    group_ids = torch.arange(num_groups).repeat_interleave(group_size) * 7 + 3
    out = flat_group_advantages(
        rewards.flatten()[perm],
        group_ids[perm],
        scale=scale,  # type: ignore[arg-type]
    )
    # Same formula, different summation order: agree to fp32 rounding.
    torch.testing.assert_close(out, expected[perm], atol=1e-5, rtol=0)
    # Each group's advantages sum to 0 (up to rounding).
    sums = torch.zeros(num_groups).index_add_(0, (group_ids[perm] - 3) // 7, out)
    torch.testing.assert_close(sums, torch.zeros(num_groups), atol=1e-5, rtol=0)
