"""ReCo: reweighting GRPO against distributional concentration (docs/math.md §8).

ftis's reading of arXiv 2607.26862 (methods-wave2 §3; the contracts are architecture §5b):

- :func:`reco_weights`: the expected-occurrence response weight ``w_i``, one per sequence,
  normalised to mean 1 within each group. It down-weights responses the sampler produces so
  often that they recur within a group of G samples.
- :func:`variance_ratio`: the variance-based token ratio ``r = p(1-p) / (p0(1-p0))`` that
  replaces the PPO ratio in the ``reco`` loss term (``ftis.core.losses.reco_term``).
- :func:`variance_ratio_summary`: its mean and max over a batch's tokens, for the metrics.

All three compute without gradient. Shapes: N sequences, T tokens.

Where this is our own reading (the paper's full text was not available): the per-token geometric
mean stands in for the sequence probability (a whole-sequence probability underflows), and the
numerical floors below. docs/math.md §8 states each.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import Tensor

# |log r| is clamped like the log importance ratio (ftis.core.losses.LOG_RATIO_CLAMP,
# docs/math.md §3.4): e^20 ~ 4.9e8.
LOG_RATIO_CLAMP = 20.0


def reco_weights(
    sampler_logprobs: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    group_size: int,
    w_max: float = 5.0,
) -> Tensor:
    """Expected-occurrence response weights (docs/math.md §8.1), no grad.

    ``pbar_i = exp(mean over masked t of sampler_logprobs[i, t])``,
    ``raw_i = 1 / (group_size * pbar_i)``, clipped above at ``w_max``, then divided by the mean
    of the clipped weights of its group, so the weights of every group have mean 1.

    Numerics: computed in float64 in log space (``log raw_i = -log G - mean_t glp``), so no
    exp over- or underflows. A sequence with no masked token has mean log-prob 0 (``pbar = 1``,
    ``raw = 1/G``). A mean log-prob above 0 (impossible for a probability: only a garbled peer
    claim) counts as 0; -inf (a claimed probability 0) gives ``w_max`` before normalisation.
    Weights are then in ``[1/G, w_max]`` before normalisation, always finite and > 0. A NaN
    among a sequence's masked log-probs makes its group's weights NaN (the loss then refuses it).

    Args:
        sampler_logprobs: (N, T) float, the sampler's per-token log-probs (a tensor or a numpy
            array, as are the next two); values at masked-out positions are ignored, even NaN
            or inf.
        mask: (N, T) bool, True = token counts.
        group_ids: (N,) int, the group of each sequence (ftis uses the prompt index); groups
            may be of any size and in any order.
        group_size: G, the number of samples drawn per prompt (``train.group_size``): how many
            draws a response is expected to recur in. It only sets where the clip bites (the
            normalisation cancels a common factor).
        w_max: the cap on raw weights, finite and > 0.

    Returns:
        (N,) weights with the dtype of ``sampler_logprobs`` promoted to at least float32.
    """
    glp = torch.as_tensor(sampler_logprobs)
    mask = torch.as_tensor(mask)
    gids = torch.as_tensor(group_ids)
    _check_weight_inputs(glp, mask, gids, group_size, w_max)
    out_dtype = torch.promote_types(glp.dtype, torch.float32)
    with torch.no_grad():
        x = torch.where(mask, glp.detach().to(torch.float64), torch.zeros((), dtype=torch.float64))
        lengths = mask.sum(dim=1).clamp(min=1).to(torch.float64)
        mean_lp = (x.sum(dim=1) / lengths).clamp(max=0.0)  # NaN stays NaN
        log_w = (-math.log(operator.index(group_size)) - mean_lp).clamp(max=math.log(w_max))
        w = torch.exp(log_w)  # in [1/G, w_max]
        if w.numel() == 0:
            return w.to(out_dtype)
        _, inverse = torch.unique(gids, return_inverse=True)
        num_groups = int(inverse.max()) + 1
        sums = torch.zeros(num_groups, dtype=w.dtype).index_add_(0, inverse, w)
        counts = torch.zeros(num_groups, dtype=w.dtype).index_add_(0, inverse, torch.ones_like(w))
        return (w / (sums / counts)[inverse]).to(out_dtype)


def variance_ratio(logprobs: Tensor, sampler_logprobs: Tensor) -> Tensor:
    """The variance-based token ratio ``r = p(1-p) / (p0(1-p0))`` (docs/math.md §8.2), no grad.

    ``p = exp(logprobs)`` (this model now), ``p0 = exp(sampler_logprobs)`` (the sampler).
    Computed in log space, ``log p(1-p) = lp + log(-expm1(lp))``, which is exact for tiny p.
    Floors: log-probs are clamped to ``[finfo.min, -finfo.tiny]`` first, so p = 1 (log-prob 0)
    has variance ``~finfo.tiny`` instead of 0 and p = 0 (-inf) a finite log-variance; then
    ``log r`` is clamped to [-20, 20] before exp (as the importance ratio is, §3.4). Equal
    inputs give exactly 1, also at log-prob 0 or -inf. NaN stays NaN.

    Args:
        logprobs: (N, T) float, the receiver's log-probs (any grad is ignored).
        sampler_logprobs: (N, T) float, the sampler's log-probs.

    Returns:
        (N, T) ratio, dtype of the inputs promoted to at least float32, no grad.
    """
    lp = torch.as_tensor(logprobs)
    glp = torch.as_tensor(sampler_logprobs)
    if lp.shape != glp.shape:
        raise ValueError(
            f"logprobs {tuple(lp.shape)} and sampler_logprobs {tuple(glp.shape)} must have the "
            "same shape"
        )
    for name, t in (("logprobs", lp), ("sampler_logprobs", glp)):
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    dtype = torch.promote_types(torch.promote_types(lp.dtype, glp.dtype), torch.float32)
    with torch.no_grad():
        log_r = _log_variance(lp.detach().to(dtype)) - _log_variance(glp.detach().to(dtype))
        return torch.exp(log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def variance_ratio_summary(
    logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """``variance_ratio_mean`` and ``variance_ratio_max`` over masked tokens (0 if none), as
    0-dim tensors without grad; values at masked-out positions are ignored."""
    with torch.no_grad():
        zero = torch.zeros((), dtype=torch.promote_types(logprobs.dtype, torch.float32))
        lp = torch.where(mask, logprobs.detach(), zero)
        glp = torch.where(mask, sampler_logprobs.detach(), zero)
        r = torch.where(mask, variance_ratio(lp, glp), zero)
        count = mask.sum().clamp(min=1).to(r.dtype)
        return {
            "variance_ratio_mean": r.sum() / count,
            "variance_ratio_max": r.amax() if r.numel() else zero,
        }


def _log_variance(x: Tensor) -> Tensor:
    """``log(p(1-p))`` with ``p = exp(x)``, x clamped to ``[finfo.min, -finfo.tiny]``."""
    info = torch.finfo(x.dtype)
    x = x.clamp(min=info.min, max=-info.tiny)
    return x + torch.log(-torch.expm1(x))


def _check_weight_inputs(
    glp: Tensor, mask: Tensor, gids: Tensor, group_size: int, w_max: float
) -> None:
    if glp.ndim != 2:
        raise ValueError(f"sampler_logprobs must have shape (N, T), got {tuple(glp.shape)}")
    if not glp.dtype.is_floating_point:
        raise ValueError(f"sampler_logprobs must be floating point, got {glp.dtype}")
    if tuple(mask.shape) != tuple(glp.shape) or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool tensor of shape {tuple(glp.shape)}, got {mask.dtype} "
            f"{tuple(mask.shape)}"
        )
    if tuple(gids.shape) != (glp.shape[0],) or gids.dtype.is_floating_point:
        raise ValueError(
            f"group_ids must be integers of shape ({glp.shape[0]},), got {gids.dtype} "
            f"{tuple(gids.shape)}"
        )
    try:
        size = operator.index(group_size)
    except TypeError:
        size = 0
    if isinstance(group_size, bool) or size < 1:
        raise ValueError(f"group_size (G) must be an int >= 1, got {group_size!r}")
    if not (0 < w_max < math.inf):
        raise ValueError(f"w_max must be finite and > 0, got {w_max!r}")
