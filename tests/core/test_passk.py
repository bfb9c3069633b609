"""Tests for ftis.core.passk (docs/math.md §6). Expected values are worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftis.core.passk import pass_at_k

# Products of at most k factors in float64: 1e-12 leaves room for rounding and nothing else.
ATOL = 1e-12


def close(actual: torch.Tensor, expected: object) -> None:
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=torch.float64), atol=ATOL, rtol=0
    )


def test_small_cases_by_hand() -> None:
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10.
    close(pass_at_k(5, 2, 2), 0.7)
    # n=10, c=3, k=2: 1 - C(7,2)/C(10,2) = 1 - 21/45 = 24/45.
    close(pass_at_k(10, 3, 2), 24 / 45)
    # k=1 is the fraction correct: 3/10.
    close(pass_at_k(10, 3, 1), 0.3)
    # n=4, c=1, k=4: every draw of 4 holds the correct one.
    close(pass_at_k(4, 1, 4), 1.0)


def test_edge_cases_are_exact() -> None:
    # c = 0 -> exactly 0; n - c < k -> exactly 1 (one factor is exactly 0).
    assert torch.equal(pass_at_k(8, 0, 3), torch.tensor(0.0, dtype=torch.float64))
    assert torch.equal(pass_at_k(8, 6, 3), torch.tensor(1.0, dtype=torch.float64))
    assert torch.equal(pass_at_k(8, 8, 8), torch.tensor(1.0, dtype=torch.float64))


def test_large_n_stays_accurate() -> None:
    # C(n-1, k)/C(n, k) = (n-k)/n, so with one correct sample pass@k = k/n exactly.
    # C(1000, 10) ~ 2.6e23 would lose precision if formed directly; the product form does not.
    close(pass_at_k(1000, 1, 10), 10 / 1000)
    close(pass_at_k(100_000, 1, 50), 50 / 100_000)


def test_vectorized_with_broadcasting() -> None:
    n = torch.tensor([5, 10, 10])
    c = torch.tensor([2, 3, 0])
    close(pass_at_k(n, c, 2), [0.7, 24 / 45, 0.0])
    # A scalar n broadcasts against per-problem c: n=4, k=2, c=0..4:
    # 1 - C(4-c, 2)/6 = 1 - (6, 3, 1, 0, 0)/6.
    out = pass_at_k(4, torch.arange(5), 2)
    close(out, [0.0, 0.5, 5 / 6, 1.0, 1.0])
    assert out.shape == (5,)


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(torch.tensor([5, 3]), torch.tensor([1, 1]), 4)
    with pytest.raises(ValueError, match="positive int"):
        pass_at_k(5, 1, 0)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(5, -1, 1)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_matches_exact_binomials(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 40))
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    expected = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, then one division
    torch.testing.assert_close(
        pass_at_k(n, c, k), torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0
    )
