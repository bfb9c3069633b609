"""Tests for ftis.core.kl (docs/math.md §14). Expected values are worked out by hand: with
d = ref - lp chosen as log 2, -log 2 and 0, k3 = exp(d) - d - 1 is 1 - log 2, log 2 - 1/2 and 0.
fp32 on O(1) numbers: 1e-6 absolute catches any wrong term or factor."""

from __future__ import annotations

import math

import pytest
import torch

from ftis.core.kl import k3, kl_penalty

ATOL = 1e-6


def example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # row 0: d = (log 2, -log 2, 0); row 1: d = (log 2, <masked, NaN garbage>)
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, float("nan"), 0.0]], requires_grad=True)
    ref = torch.tensor(
        [[-1.0 + math.log(2), -2.0 - math.log(2), -0.5], [-3.0 + math.log(2), float("inf"), 0.0]]
    )
    mask = torch.tensor([[True, True, True], [True, False, False]])
    return lp, ref, mask


def test_k3_per_token_by_hand() -> None:
    lp, ref, mask = example()
    got = k3(lp, ref_logprobs=ref, mask=mask)
    a, b = 1 - math.log(2), math.log(2) - 0.5  # exp(log2)-log2-1, exp(-log2)+log2-1
    expected = torch.tensor([[a, b, 0.0], [a, 0.0, 0.0]])
    torch.testing.assert_close(got.detach(), expected, atol=ATOL, rtol=0)


def test_kl_penalty_value_and_gradient_by_hand() -> None:
    lp, ref, mask = example()
    loss = kl_penalty(lp, ref_logprobs=ref, mask=mask, num_sequences=4)
    a, b = 1 - math.log(2), math.log(2) - 0.5
    # row means: (a + b + 0) / 3 and a / 1; summed and divided by the global N = 4
    torch.testing.assert_close(
        loss.detach(), torch.tensor(((a + b) / 3 + a) / 4), atol=ATOL, rtol=0
    )
    loss.backward()
    # d k3 / d lp = -exp(d) + 1: d = log 2 -> -1, d = -log 2 -> 1/2, d = 0 -> 0; times 1/(len * N)
    expected = torch.tensor([[-1 / 12, 0.5 / 12, 0.0], [-1 / 4, 0.0, 0.0]])
    torch.testing.assert_close(lp.grad, expected, atol=ATOL, rtol=0)
    assert torch.isfinite(lp.grad).all()


def test_kl_penalty_split_into_micro_batches_is_the_same() -> None:
    lp, ref, mask = example()
    whole = kl_penalty(lp, ref_logprobs=ref, mask=mask, num_sequences=2)
    parts = sum(
        kl_penalty(
            lp[i : i + 1], ref_logprobs=ref[i : i + 1], mask=mask[i : i + 1], num_sequences=2
        )
        for i in range(2)
    )
    torch.testing.assert_close(whole.detach(), parts.detach(), atol=ATOL, rtol=0)


def test_equal_models_give_zero_and_empty_rows_give_zero() -> None:
    lp = torch.tensor([[-1.0, -2.0]])
    assert (
        float(
            kl_penalty(
                lp,
                ref_logprobs=lp.clone(),
                mask=torch.ones(1, 2, dtype=torch.bool),
                num_sequences=1,
            )
        )
        == 0.0
    )
    empty = kl_penalty(
        torch.zeros(2, 3),
        ref_logprobs=torch.ones(2, 3),
        mask=torch.zeros(2, 3, dtype=torch.bool),
        num_sequences=2,
    )
    assert float(empty) == 0.0


def test_extreme_log_ratio_is_clamped_and_finite() -> None:
    lp = torch.tensor([[-1000.0]])
    got = k3(lp, ref_logprobs=torch.tensor([[0.0]]), mask=torch.ones(1, 1, dtype=torch.bool))
    assert float(got) == pytest.approx(math.exp(20.0) - 21.0, rel=1e-6)


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="same"):
        k3(
            torch.zeros(2, 3),
            ref_logprobs=torch.zeros(2, 2),
            mask=torch.ones(2, 3, dtype=torch.bool),
        )
