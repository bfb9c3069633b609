"""Receiver-side screens of peers' samples against poisoned rollouts (docs/math.md §15).

Pure tensor math: N sequences, T tokens; `logprobs` are the receiver's own per-token log-probs
(no grad needed), `sampler_logprobs` the sender's as reported, `mask` True on real tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x.detach().float(), torch.zeros((), dtype=torch.float32))


def mean_abs_logratio(*, logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """(N,) mean over a sequence's masked tokens of |lp - glp| (nats); 0 for an empty one.

    Two-sided on purpose: the F-TIS filter's k3 statistic grows only linearly when the sender
    claims a token was *less* likely than the receiver finds it (the forged report that buys a
    large importance weight), exponentially in the other direction."""
    d = (_masked(logprobs, mask) - _masked(sampler_logprobs, mask)).abs()
    return d.sum(dim=1) / mask.sum(dim=1).clamp(min=1).float()


def rare_tokens(*, logprobs: Tensor, mask: Tensor, floor: float) -> Tensor:
    """(N,) number of masked tokens whose receiver log-prob is below `floor`."""
    return ((logprobs.detach().float() < floor) & mask).sum(dim=1)


def implausible(
    *,
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    max_logratio: float,
    min_token_logprob: float,
    max_rare_tokens: int = 0,
) -> Tensor:
    """(N,) bool, True where a sequence is implausible to the receiver: its mean |lp - glp| per
    token exceeds `max_logratio`, or more than `max_rare_tokens` of its tokens have receiver
    log-prob below `min_token_logprob`."""
    far = mean_abs_logratio(logprobs=logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    rare = rare_tokens(logprobs=logprobs, mask=mask, floor=min_token_logprob)
    return (far > max_logratio) | (rare > max_rare_tokens)


def max_abs_logprob_gap(*, logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """(N,) the largest |lp - glp| over a sequence's masked tokens; 0 for an empty one. For a
    peer that holds the receiver's weights this is numerical noise only."""
    d = (_masked(logprobs, mask) - _masked(sampler_logprobs, mask)).abs()
    return d.amax(dim=1) if d.shape[1] else torch.zeros(d.shape[0])


def update_distrust(distrust: Tensor, flagged_fraction: Tensor, *, rate: float) -> Tensor:
    """(P,) running distrust of P peers after one step: (1 - rate) * distrust + rate * flagged,
    for the peers with samples this step; `flagged_fraction` is NaN for a peer without samples,
    whose distrust is kept. Trust is 1 - distrust, in [0, 1]."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"rate must be in (0, 1], got {rate}")
    seen = ~torch.isnan(flagged_fraction)
    new = (1.0 - rate) * distrust + rate * torch.nan_to_num(flagged_fraction, nan=0.0)
    return torch.where(seen, new, distrust)


def share_cap(generator: Tensor, *, protected: Tensor, max_share: float) -> Tensor:
    """(N,) bool keep-mask: every unprotected generator keeps its first floor(max_share * N)
    sequences (in batch order) and loses the rest; `protected` (N,) bool rows (the receiver's
    own) are always kept. max_share = 1 keeps everything."""
    n = generator.shape[0]
    cap = int(max_share * n + 1e-9)
    keep = torch.ones(n, dtype=torch.bool)
    for g in torch.unique(generator[~protected]).tolist():
        rows = torch.nonzero((generator == g) & ~protected).flatten()
        keep[rows[cap:]] = False
    return keep
