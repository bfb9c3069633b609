"""Direct preference optimisation with a frozen reference (docs/math.md, "DPO and gossip
mixing").

    margin_b = beta * ((pc_b - pr_b) - (rc_b - rr_b))
    loss     = mean_b -log sigmoid(margin_b) = mean_b softplus(-margin_b)

pc/pr: summed completion log-probs of the chosen / rejected response under the policy (with
gradient); rc/rr: the same under the frozen reference (the starting weights). softplus keeps the
loss finite for any margin (-log sigmoid(x) overflows for very negative x when written naively).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The DPO loss of a batch of B preference pairs (architecture §5b).

    Args:
        policy_chosen, policy_rejected: (B,) summed completion log-probs (prompt tokens excluded)
            of the chosen / rejected response under the policy being trained, with gradient.
        ref_chosen, ref_rejected: (B,) the same under the frozen reference (no gradient needed;
            detached here).
        beta: the KL strength; > 0.

    Returns:
        loss: scalar, mean over pairs of -log sigmoid(margin); 0 for an empty batch.
        metrics: "reward_margin" (mean of beta*((pc-rc)-(pr-rr)), the implicit reward of the
            chosen minus that of the rejected response) and "accuracy" (fraction of pairs with
            margin > 0), detached.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    shapes = {t.shape for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1 or policy_chosen.dim() != 1:
        raise ValueError(
            f"dpo_loss takes four (B,) tensors, got shapes {sorted(map(tuple, shapes))}"
        )
    ref_margin = (ref_chosen - ref_rejected).detach()
    margin = beta * ((policy_chosen - policy_rejected) - ref_margin)
    if margin.numel() == 0:
        zero = policy_chosen.sum() * 0.0  # keeps the graph: backward gives zero gradients
        return zero, {"reward_margin": zero.detach(), "accuracy": zero.detach()}
    loss = F.softplus(-margin).mean()
    m = margin.detach()
    return loss, {"reward_margin": m.mean(), "accuracy": (m > 0).float().mean()}
