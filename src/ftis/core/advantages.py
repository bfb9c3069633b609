"""Group-relative advantages (docs/math.md §2).

Shapes: B prompts, G completions per prompt, N sequences.

Two entry points compute the same thing:

- :func:`group_advantages` for a rectangular (B, G) reward matrix, one row per group;
- :func:`flat_group_advantages` for N rewards tagged with a group id each (groups may differ in
  size and need not be contiguous). The trainer uses this one, grouping sequences by prompt index.

Advantages are always computed over the whole group, before any filtering (docs/math.md §2, §4).
Validation that needs to look at values (finite rewards, group sizes) reads them on the host;
rewards are small, and a bad reward is a bug worth stopping on.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Scale = Literal["std", "none"]
SCALES: tuple[str, ...] = ("std", "none")


def group_advantages(rewards: Tensor, scale: Scale = "std", eps: float = 1e-4) -> Tensor:
    """Advantages of each completion relative to its group (docs/math.md §2).

    Args:
        rewards: (B, G) rewards; row b holds the G completions of prompt b.
        scale: "std" gives ``(r - mean) / (std + eps)`` with the unbiased std of the row;
            "none" gives ``r - mean`` (what the authors' code does).
        eps: added to the std so near-constant groups do not blow up.

    Returns:
        (B, G) advantages, floating point (at least fp32). A row whose rewards are all equal
        gives exactly zeros.

    Raises:
        ValueError: on a non-2-D or non-finite input, an unknown ``scale``, a negative ``eps``, or
            G < 2 with ``scale="std"`` (the unbiased std of one value is undefined).
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must have shape (B, G), got {tuple(rewards.shape)}")
    _check_scale_and_eps(scale, eps)
    num_per_group = rewards.shape[1]
    if scale == "std" and num_per_group < 2:
        raise ValueError(
            f"scale='std' needs at least 2 completions per group (the unbiased std of one "
            f"reward is undefined), got G={num_per_group}; sample G >= 2 or use scale='none'"
        )
    r = _as_float(rewards)
    _check_finite(r)
    centered = r - r.mean(dim=1, keepdim=True)
    # Exact zeros for constant groups: the mean of equal floats need not equal them bit for bit.
    is_constant = (r == r[:, :1]).all(dim=1, keepdim=True)
    centered = torch.where(is_constant, torch.zeros_like(centered), centered)
    if scale == "none":
        return centered
    std = (centered.square().sum(dim=1, keepdim=True) / (num_per_group - 1)).sqrt()
    return _standardize(centered, std, is_constant, eps)


def flat_group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    scale: Scale = "std",
    eps: float = 1e-4,
    valid: Tensor | None = None,
) -> Tensor:
    """Group-relative advantages for N sequences tagged with a group id (docs/math.md §2).

    Equivalent to :func:`group_advantages` applied to each group separately, vectorized with
    ``index_add``/``scatter_reduce`` (no Python loop over groups).

    Args:
        rewards: (N,) rewards.
        group_ids: (N,) integer group id of each sequence (e.g. its prompt index). Any integer
            values; groups may have different sizes and need not be contiguous.
        scale: "std" or "none", as in :func:`group_advantages`.
        eps: added to each group's std.
        valid: optional (N,) bool, False for a sequence left out (a reward function gave it
            no reward): its advantage is 0 and its reward (which may be NaN) takes no part in
            its group's mean and std, as if it were not there. A group left with fewer valid
            sequences than a baseline needs (2 with ``scale="std"``, 1 with "none") gets 0.

    Returns:
        (N,) advantages, floating point (at least fp32), in the input order.

    Raises:
        ValueError: on shape or dtype mismatch, non-finite rewards, an unknown ``scale``, a
            negative ``eps``, or a group of one sequence with ``scale="std"``.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids must have the shape of rewards {tuple(rewards.shape)}, "
            f"got {tuple(group_ids.shape)}"
        )
    if (
        group_ids.dtype.is_floating_point
        or group_ids.dtype.is_complex
        or group_ids.dtype == torch.bool
    ):
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    _check_scale_and_eps(scale, eps)
    r = _as_float(rewards)
    if valid is not None:
        return _valid_only(r, group_ids, valid, scale=scale, eps=eps)
    _check_finite(r)
    if r.numel() == 0:
        return r.clone()

    # inverse: (N,) index of each sequence's group in 0..K-1.
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()
    counts = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(
        0, inverse, torch.ones_like(r)
    )
    if scale == "std" and bool((counts < 2).any()):
        lonely = unique_ids[counts < 2].tolist()
        raise ValueError(
            f"scale='std' needs at least 2 sequences per group (the unbiased std of one reward "
            f"is undefined); groups with one sequence: {lonely[:10]}; send whole groups or use "
            f"scale='none'"
        )
    sums = torch.zeros_like(counts).index_add_(0, inverse, r)
    means = sums / counts
    group_max = _group_reduce(r, inverse, num_groups, "amax")
    group_min = _group_reduce(r, inverse, num_groups, "amin")
    is_constant = (group_max == group_min)[inverse]

    centered = r - means[inverse]
    centered = torch.where(is_constant, torch.zeros_like(centered), centered)
    if scale == "none":
        return centered
    sum_sq = torch.zeros_like(counts).index_add_(0, inverse, centered.square())
    std = (sum_sq / (counts - 1)).sqrt()
    return _standardize(centered, std[inverse], is_constant, eps)


def _valid_only(r: Tensor, group_ids: Tensor, valid: Tensor, *, scale: Scale, eps: float) -> Tensor:
    """`flat_group_advantages` over the valid sequences only, 0 for the others (and for groups
    with too few valid sequences for a baseline)."""
    if valid.shape != r.shape or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor of shape {tuple(r.shape)}")
    valid = valid.to(r.device)
    _check_finite(r[valid])
    out = torch.zeros_like(r)
    if r.numel() == 0:
        return out
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if scale == "std" and bool((counts < 2).any()):  # as without a mask: lonely groups raise
        flat_group_advantages(torch.where(valid, r, 0.0), group_ids, scale=scale, eps=eps)
    per_group = torch.zeros(counts.shape, dtype=torch.long, device=r.device)
    per_group.index_add_(0, inverse.to(r.device), valid.long())
    keep = valid & (per_group[inverse.to(r.device)] >= (2 if scale == "std" else 1))
    if bool(keep.any()):
        out[keep] = flat_group_advantages(r[keep], group_ids[keep], scale=scale, eps=eps)
    return out


def _standardize(centered: Tensor, std: Tensor, is_constant: Tensor, eps: float) -> Tensor:
    """``centered / (std + eps)``, exactly 0 for constant groups even when ``eps == 0``."""
    scaled = centered / (std + eps)
    return torch.where(is_constant, torch.zeros_like(scaled), scaled)


def _group_reduce(values: Tensor, inverse: Tensor, num_groups: int, reduce: str) -> Tensor:
    """(K,) per-group max or min of ``values`` (N,) under the group index ``inverse`` (N,)."""
    out = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, inverse, values, reduce=reduce, include_self=False)


def _as_float(rewards: Tensor) -> Tensor:
    """Rewards as a floating tensor of at least fp32 (ints, bools, bf16 are promoted)."""
    dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    return rewards.to(torch.promote_types(dtype, torch.float32))


def _check_finite(rewards: Tensor) -> None:
    if not bool(torch.isfinite(rewards).all()):
        bad = (~torch.isfinite(rewards)).nonzero().tolist()
        raise ValueError(
            f"rewards must be finite; non-finite values at indices {bad[:10]}; "
            f"check the verifier/reward function"
        )


def _check_scale_and_eps(scale: str, eps: float) -> None:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if not eps >= 0.0:  # also rejects NaN
        raise ValueError(f"eps must be >= 0, got {eps}")
