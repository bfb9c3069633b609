"""The KL penalty to a reference model (docs/math.md §14): Schulman's k3 estimator, as in TRL's
GRPO and DeepSeekMath.

Per token t of completion i, with d = ref_logprobs - logprobs (both of the sampled token),

    k3 = exp(d) - d - 1  >= 0,

an unbiased estimate of KL(pi || pi_ref) over the sampled tokens when the tokens come from pi, and
exactly 0 where the two models agree. The penalty is averaged like the policy loss: the mean over
a sequence's own tokens, summed over sequences and divided by the global N (`num_sequences`), so
that splitting a batch into micro-batches changes nothing (docs/math.md §3).

Shapes: N sequences, T tokens. Masks: True = a real completion token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftis.core.losses import LOG_RATIO_CLAMP


def k3(logprobs: Tensor, *, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """(N, T) per-token k3 = exp(d) - d - 1 with d = ref_logprobs - logprobs (clamped to
    [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp); 0 at masked-out positions, whatever they
    hold (NaN or inf there never reaches the value or the gradient). The gradient flows through
    `logprobs` only; `ref_logprobs` is a constant."""
    if logprobs.shape != ref_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, ref_logprobs {tuple(ref_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must have the same (N, T) shape"
        )
    mask = mask.to(torch.bool)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp = torch.where(mask, logprobs.to(dtype), torch.zeros((), dtype=dtype, device=mask.device))
    ref = torch.where(
        mask, ref_logprobs.detach().to(dtype), torch.zeros((), dtype=dtype, device=mask.device)
    )
    d = (ref - lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    per_token = torch.exp(d) - d - 1.0
    return torch.where(mask, per_token, torch.zeros_like(per_token))


def kl_penalty(
    logprobs: Tensor, *, ref_logprobs: Tensor, mask: Tensor, num_sequences: int
) -> Tensor:
    """0-dim: sum over sequences of the mean k3 over each sequence's own tokens, divided by
    `num_sequences` (the global N; floored at 1). An empty completion contributes 0."""
    if isinstance(num_sequences, bool) or not isinstance(num_sequences, int) or num_sequences < 0:
        raise ValueError(f"num_sequences must be an int >= 0, got {num_sequences!r}")
    per_token = k3(logprobs, ref_logprobs=ref_logprobs, mask=mask)
    lengths = mask.to(torch.bool).sum(dim=1).clamp(min=1).to(per_token.dtype)
    return (per_token.sum(dim=1) / lengths).sum() / max(num_sequences, 1)
