"""Unbiased pass@k (docs/math.md §6).

With n samples of a problem of which c are correct, the probability that at least one of k
samples drawn without replacement is correct is

    pass@k = 1 - C(n - c, k) / C(n, k).

Binomials overflow fast, so the ratio is computed as a product of k factors, each in [0, 1]:

    C(n - c, k) / C(n, k) = prod_{j=0}^{k-1} (n - c - j) / (n - j).

When n - c < k one factor is exactly 0, so pass@k is exactly 1 (every draw of k contains a
correct sample). Only k (a Python int) sets the loop length, so the computation is vectorized
over any number of problems with different n and c.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pass_at_k(num_samples: Tensor | int, num_correct: Tensor | int, k: int) -> Tensor:
    """Unbiased pass@k estimate per problem (docs/math.md §6).

    Args:
        num_samples: n, samples drawn per problem; int or integer tensor of any shape.
        num_correct: c, correct samples per problem; broadcastable with ``num_samples``.
        k: the k of pass@k, a positive int with k <= n for every problem.

    Returns:
        float64 tensor of the broadcast shape of n and c, values in [0, 1]. Average it over
        problems for the benchmark's pass@k.

    Raises:
        ValueError: if k < 1, k > n for some problem, c < 0 or c > n.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    n = torch.as_tensor(num_samples, dtype=torch.float64)
    c = torch.as_tensor(num_correct, dtype=torch.float64, device=n.device)
    n, c = torch.broadcast_tensors(n, c)
    if bool((n < k).any()):
        raise ValueError(
            f"pass@k needs k <= n (samples per problem); k={k}, smallest n={int(n.min())}"
        )
    if bool(((c < 0) | (c > n)).any()):
        raise ValueError("num_correct must be between 0 and num_samples for every problem")
    j = torch.arange(k, dtype=torch.float64, device=n.device)  # (k,)
    # factors (..., k): (n - c - j) / (n - j); n - j >= n - k + 1 >= 1, so no division by 0.
    factors = ((n - c)[..., None] - j) / (n[..., None] - j)
    return 1.0 - factors.clamp(min=0.0).prod(dim=-1)
