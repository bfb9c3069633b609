"""Policy shaping of peers' tokens (LUFFY; docs/math.md §13, shared/spec/hacpo.md).

``f(p) = p / (p + gamma)`` of the receiver's own token probability ``p = exp(logprobs)`` replaces
the truncated importance weight of a peer's token. Its gradient
``gamma p / (p + gamma)^2 * grad log p`` peaks at ``p = gamma``: the receiver learns most from
tokens it finds unlikely but not impossible, where a truncated weight ``p / q`` would be near 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def luffy_weight(logprobs: Tensor, gamma: float = 0.1) -> Tensor:
    """``f(exp(logprobs)) = p / (p + gamma)``, elementwise and differentiable.

    Computed as ``sigmoid(logprobs - log(gamma))``, which equals p / (p + gamma) and stays
    finite for any finite log-prob.
    """
    if not gamma > 0:
        raise ValueError(f"shaping gamma must be > 0, got {gamma}")
    lp = logprobs.to(torch.promote_types(logprobs.dtype, torch.float32))
    return torch.sigmoid(lp - torch.log(torch.tensor(gamma, dtype=lp.dtype)))
