"""GSPO and HACPO's four mechanisms, as pure tensor functions (docs/math.md §12;
shared/spec/hacpo.md).

Shapes: n agents, G completions per agent and prompt, N sequences, T tokens.

- :func:`gspo_ratio` is GSPO's length-normalised sequence ratio ``s_i``;
- :func:`capability_weights`, :func:`hacpo_advantages` and :func:`discrepancy` are HACPO's
  capability-aware advantage (mechanism 2) and capability discrepancy coefficient (mechanism 3);
- :func:`peer_clip_lower` and :func:`peer_term` are its exponential importance sampling with
  stepwise clipping of peers' samples (mechanism 4);
- :func:`gspo_term` is GSPO's per-sequence loss on a learner's own samples.

Every loss term here is a quantity to *minimise*, one value per sequence; the caller averages
over the batch's sequences. Capabilities (mechanism 1, a moving average of success rates) are
bookkeeping across steps and live with the algorithm (ftis.algos.ftis.hacpo).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

# Log-ratios are clamped before exp, as in ftis.core.losses.
_LOG_RATIO_CLAMP = 20.0
_CAPABILITY_FLOOR = 1e-8
_SIGMA_EPS = 1e-6


def _mean_over_mask(x: Tensor, mask: Tensor) -> Tensor:
    """(N,) mean of ``x`` over each row's True positions (0 for an empty row); x is (N, T)."""
    x = torch.where(mask, x.to(torch.promote_types(x.dtype, torch.float32)), 0.0)
    return x.sum(dim=1) / mask.sum(dim=1).clamp(min=1).to(x.dtype)


def gspo_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """(N,) ``s_i = exp(mean_t m_it (logprobs - old_logprobs))``, GSPO's sequence ratio.

    The mean is over each sequence's own tokens (``mask`` True), so the ratio does not grow with
    length. Gradients flow through ``logprobs`` only. Values at masked-out positions are ignored
    (even NaN). An empty sequence has ratio 1.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must have the same (N, T) shape"
        )
    lp = torch.where(mask, logprobs.to(torch.promote_types(logprobs.dtype, torch.float32)), 0.0)
    old = torch.where(mask, old_logprobs.to(lp.dtype), 0.0).detach()
    log_s = _mean_over_mask(lp - old, mask)
    return torch.exp(log_s.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def gspo_term(
    seq_ratio: Tensor, advantages: Tensor, *, eps_low: float = 3e-4, eps_high: float = 4e-4
) -> Tensor:
    """(N,) GSPO's loss per sequence: ``-min(s A, clip(s, 1 - eps_low, 1 + eps_high) A)``."""
    adv = advantages.detach().to(seq_ratio.dtype)
    clipped = seq_ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    return -torch.minimum(seq_ratio * adv, clipped)


def _check_capability(capability: Tensor, learner: int) -> int:
    if capability.ndim != 1 or capability.numel() == 0:
        raise ValueError(f"capability must have shape (n,), got {tuple(capability.shape)}")
    n = capability.numel()
    if not -n <= learner < n:
        raise ValueError(f"learner {learner} is not an agent index of n={n} agents")
    return learner % n


def capability_weights(
    capability: Tensor, learner: int, clip: tuple[float, float] = (0.1, 10.0)
) -> Tensor:
    """(n,) ``w(k, j) = clip(P_k / max(P_j, 1e-8), lo, hi)`` for every agent j; ``w(k, k) = 1``.

    k is ``learner``. A peer the learner is stronger than (P_j < P_k) gets w > 1: its rewards
    count for more in the learner's baseline, since they were harder-won."""
    k = _check_capability(capability, learner)
    p = capability.to(torch.promote_types(capability.dtype, torch.float32))
    w = (p[k] / p.clamp(min=_CAPABILITY_FLOOR)).clamp(*clip)
    w[k] = 1.0
    return w


def discrepancy(
    capability: Tensor, learner: int, clip: tuple[float, float] = (0.1, 10.0)
) -> Tensor:
    """(n,) ``omega(j, k) = clip(P_j / max(P_k, 1e-8), lo, hi)`` for every agent j; 1 at j = k.

    Source over learner: a stronger peer's samples push harder, a weaker one's softer."""
    k = _check_capability(capability, learner)
    p = capability.to(torch.promote_types(capability.dtype, torch.float32))
    omega = (p / p[k].clamp(min=_CAPABILITY_FLOOR)).clamp(*clip)
    omega[k] = 1.0
    return omega


def hacpo_advantages(
    rewards: Tensor, capability: Tensor, learner: int, max_reward: float = 1.0
) -> Tensor:
    """(n, G) capability-aware advantages of one prompt's joint group, for learner k.

    ``mu_k = mean_{j,i} w(k, j) R_ji`` (w from :func:`capability_weights`),
    ``sigma = std(R) + 1e-6`` (unbiased, over all n G rewards), ``A_ji = (R_ji - mu_k) / sigma``.
    If every reward is equal every advantage is 0. If ``mu_k > max_reward`` the baseline falls
    back to the mean of the learner's own G rewards. With equal capabilities this is GRPO over
    the joint group.

    Args:
        rewards: (n, G) rewards, row j = agent j's completions of the prompt.
        capability: (n,) success rates P_j in [0, 1].
        learner: k, the row of the learner.
        max_reward: the largest reward the learner's reward gives: 1 for one 0/1 function,
            the sum of the positive weights for a weighted sum of such functions
            (:func:`max_reward_of`; ``loss.hacpo_max_reward``).
    """
    if rewards.ndim != 2 or rewards.shape[0] != capability.shape[0]:
        raise ValueError(
            f"rewards must have shape (n, G) with n = len(capability) = {capability.shape[0]}, "
            f"got {tuple(rewards.shape)}"
        )
    k = _check_capability(capability, learner)
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite")
    if bool((r == r.flatten()[0]).all()):
        return torch.zeros_like(r)
    w = capability_weights(capability, k).to(r.dtype)
    mu = (w[:, None] * r).mean()
    if mu > max_reward:
        mu = r[k].mean()
    sigma = r.flatten().std() + _SIGMA_EPS
    return (r - mu) / sigma


def max_reward_of(weights: Iterable[float], function_max: float = 1.0) -> float:
    """The largest reward a weighted sum of reward functions can give, for
    :func:`hacpo_advantages`'s ``max_reward``: ``function_max`` times the sum of the positive
    weights (each function taken to return a value in [0, function_max]; a negative weight's
    term is at most 0). 1.0 for the default single function of weight 1. Raises when no weight
    is positive (no reward above 0 exists, so there is no range for the baseline to leave)."""
    ws = [float(w) for w in weights]
    top = function_max * sum(max(w, 0.0) for w in ws)
    if not top > 0 or not math.isfinite(top):
        raise ValueError(
            f"max_reward_of: the reward weights must include a positive finite one, got {ws!r} "
            f"(function_max {function_max}); set loss.hacpo_max_reward explicitly"
        )
    return top


def peer_clip_lower(update_index: int, lower: float = 0.8, step: float = 0.025) -> float:
    """``lo_m = min(1, lower + m * step)``: the lower clip bound of a peer's sequence ratio at
    the m-th optimizer update (m = 0, 1, ...) made on one step's batch."""
    if update_index < 0:
        raise ValueError(f"update_index must be >= 0, got {update_index}")
    return min(1.0, lower + update_index * step)


def peer_term(
    seq_ratio: Tensor, advantages: Tensor, omega: Tensor, lower: float, alpha: float = 1.0
) -> Tensor:
    """(N,) HACPO's loss per peer sequence: ``-c * sg(c)^alpha * omega * A``, with
    ``c = clamp(s, lower, 1)``.

    The clamp (not PPO's min) means a peer's sample can only be down-weighted, and one whose
    ratio lies outside [lower, 1] contributes no gradient. ``advantages`` and ``omega`` are
    constants (detached).
    """
    if not 0.0 <= lower <= 1.0:
        raise ValueError(f"lower must be in [0, 1], got {lower}")
    c = seq_ratio.clamp(lower, 1.0)
    weight = c * c.detach().pow(alpha)
    return -weight * omega.detach().to(c.dtype) * advantages.detach().to(c.dtype)
