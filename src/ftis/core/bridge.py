"""Sequence-level weights for peers on a different tokenizer: the bridged path (docs/math.md §16).

A peer on another tokenizer sends the text of each completion and its own total log-prob of
that text (the sum of its per-token log-probs over the tokens that spell it, EOS included when
the completion ended). The receiver re-tokenizes the text with its own tokenizer and scores
those tokens with its own model. Per-token ratios do not exist (the tokens differ), but both
totals are log-probs of the *same string*, so their difference is a sequence-level log-ratio.

Shapes: N sequences, T the receiver's padded token width. `logprobs` (N, T) are the receiver's
per-token log-probs of its re-tokenization (with grad), `mask` (N, T) its real tokens;
`sampler_total` (N,) the sender's total log-prob of the string, `sampler_length` (N,) the number
of sender tokens in that total. Pure tensor math: no tokenizer, no config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ftis.core.hacpo import gspo_term, peer_term
from ftis.core.losses import PEER_DUAL_CLIP, dual_clip
from ftis.core.shaping import luffy_weight

# Log-ratios are clamped before exp, as in ftis.core.losses (docs/math.md §3.4).
LOG_RATIO_CLAMP = 20.0
# The loss methods with a bridged form (docs/math.md §16.3); "reco" needs the sender's
# per-token probabilities (its variance ratio) and has none.
BRIDGED_METHODS: tuple[str, ...] = ("nois", "vis", "tis", "gspo", "hacpo")


def _masked(logprobs: Tensor, mask: Tensor) -> Tensor:
    lp = logprobs.to(torch.promote_types(logprobs.dtype, torch.float32))
    return torch.where(mask, lp, torch.zeros_like(lp))


def sequence_logprob(logprobs: Tensor, mask: Tensor) -> Tensor:
    """(N,) ``S_i = sum_t mask[i,t] lp[i,t]``, the total log-prob of each sequence (with grad
    through `logprobs`; masked-out values, even NaN, ignored; an empty row gives 0)."""
    return _masked(logprobs, mask).sum(dim=1)


def bridged_log_ratio(*, logprobs: Tensor, mask: Tensor, sampler_total: Tensor) -> Tensor:
    """(N,) ``S_recv - S_send``: the log of the sequence importance ratio
    ``pi_recv(y) / pi_send(y)`` of the string y, clamped to +-LOG_RATIO_CLAMP (§16.1)."""
    d = sequence_logprob(logprobs, mask) - sampler_total.detach().to(torch.float32)
    return d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _mean_log_ratio(
    logprobs: Tensor, mask: Tensor, sampler_total: Tensor, sampler_length: Tensor
) -> Tensor:
    """(N,) ``delta_i`` of `bridged_mean_log_ratio`, not clamped."""
    s_recv = sequence_logprob(logprobs, mask)
    l_recv = mask.sum(dim=1).clamp(min=1).to(s_recv.dtype)
    l_send = sampler_length.detach().clamp(min=1).to(s_recv.dtype)
    return s_recv / l_recv - sampler_total.detach().to(s_recv.dtype) / l_send


def bridged_mean_log_ratio(
    *, logprobs: Tensor, mask: Tensor, sampler_total: Tensor, sampler_length: Tensor
) -> Tensor:
    """(N,) ``delta_i = S_recv / L_recv - S_send / L_send``: the length-normalised log-ratio,
    each total divided by that model's own token count (HACPO's; §16.2). With one tokenizer and
    identical tokens it is GSPO's ``mean_t (lp - glp)`` exactly. Lengths are floored at 1.
    Clamped to +-LOG_RATIO_CLAMP (it goes into exp)."""
    d = _mean_log_ratio(logprobs, mask, sampler_total, sampler_length)
    return d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def bridged_tis_weight(
    *, logprobs: Tensor, mask: Tensor, sampler_total: Tensor, is_cap: float = 2.0
) -> Tensor:
    """(N,) ``w_i = min(exp(S_recv - S_send), C)``, detached: the truncated sequence-level IS
    weight of the F-TIS family on the bridged path (§16.1)."""
    with torch.no_grad():
        return torch.exp(
            bridged_log_ratio(logprobs=logprobs, mask=mask, sampler_total=sampler_total)
        ).clamp(max=is_cap)


def bridged_divergence(
    *, logprobs: Tensor, mask: Tensor, sampler_total: Tensor, sampler_length: Tensor
) -> Tensor:
    """(N,) the filter statistic of the bridged path, without grad (§16.4):
    ``D_i = k3(d_i) = exp(d_i) - d_i - 1`` with ``d_i = -delta_i = S_send / L_send - S_recv /
    L_recv``, the per-token k3 estimator applied to the length-normalised log-ratio. With
    identical tokenizations it is at most the exact path's D_i (Jensen: k3 is convex), with
    equality when every per-token log-ratio is the same.

    ``d_i`` is *not* the clamped log-ratio of the loss: as on the exact path (§4) only the exp
    argument is clamped, at +20 (k saturates, monotone, near 4.9e8 > any g), while for
    ``d_i < 0`` k stays exact (``|d_i| - 1``), so a sender that reports its tokens far less
    likely than the receiver finds them (a forged low report, §3.5) shows ``D_i`` beyond g and
    not the clamp's 19."""
    with torch.no_grad():
        d = -_mean_log_ratio(logprobs, mask, sampler_total, sampler_length)
        d = d.clamp(max=LOG_RATIO_CLAMP)
        return (torch.expm1(d) - d).clamp(min=0.0)


@dataclass(frozen=True)
class BridgedLoss:
    """What `bridged_loss` returns: ``per_sequence`` (N,) loss terms (to be summed and divided
    by the global N), ``weight`` (N,) the sequence weight the method applied (detached),
    ``divergence`` (N,) D_i, ``filtered`` (N,) bool, ``clipped`` (N,) bool: under ``hacpo``
    the sequences whose ratio s_i fell outside HACPO's window [lower, 1] (they get no
    gradient), as the exact path's ``peer_clipped_frac`` counts them; all False otherwise."""

    per_sequence: Tensor
    weight: Tensor
    divergence: Tensor
    filtered: Tensor
    clipped: Tensor


def bridged_loss(
    logprobs: Tensor,
    mask: Tensor,
    advantages: Tensor,
    *,
    sampler_total: Tensor,
    sampler_length: Tensor,
    method: str,
    use_filter: bool = False,
    is_cap: float = 2.0,
    clip_eps: float = 0.2,
    filter_threshold: float = 50.0,
    shaping_gamma: float | None = None,
    peer_scale: Tensor | None = None,
    peer_clip_lower: float = 0.8,
    hacpo_alpha: float = 1.0,
    gspo_eps: tuple[float, float] = (3e-4, 4e-4),
    peer_dual_clip: float = PEER_DUAL_CLIP,
) -> BridgedLoss:
    """Per-sequence loss terms of bridged (peer) sequences, docs/math.md §16.3.

    With ``g_i = (1/L_i) sum_t exp(lp - sg(lp))`` (value 1, gradient the mean of grad lp over the
    receiver's L_i tokens) and A_i after the filter:

    - ``nois``: ``-A_i g_i`` (weight 1);
    - ``tis``:  ``-w_i A_i g_i``, ``w_i = min(exp(S_recv - S_send), C)`` detached;
    - ``vis``:  ``-min(s_i A_i, clip(s_i, 1 - eps_c, 1 + eps_c) A_i)``, ``s_i = exp(delta_i)``,
      dual-clipped for ``A_i < 0`` at ``c = peer_dual_clip`` (every bridged sequence is a
      peer's: the term is at most ``c |A_i|`` and constant above it, §3.5);
    - ``gspo``: the same with GSPO's (eps_low, eps_high);
    - ``hacpo``: HACPO's peer term with ``s_i = exp(delta_i)`` (``ftis.core.hacpo.peer_term``);
    - shaping (``shaping_gamma``, token methods: nois, vis, tis): ``-(A_i / L_i) sum_t f(p_t)``,
      LUFFY's ``f(p) = p / (p + gamma)`` of the receiver's own token probabilities, which need
      nothing from the sender; it replaces the method's term, as on the exact path.

    ``use_filter``: a sequence with ``A_i <= 0`` and ``D_i > filter_threshold`` gets A_i = 0.
    Empty rows (no receiver token) contribute 0.
    """
    if not peer_dual_clip > 1.0:
        raise ValueError(f"peer_dual_clip must be > 1 (inf: off), got {peer_dual_clip}")
    if method not in BRIDGED_METHODS:
        raise ValueError(
            f"loss method {method!r} has no bridged form; bridged methods: "
            f"{', '.join(BRIDGED_METHODS)} (and their f- variants)"
        )
    lp = _masked(logprobs, mask)
    adv = advantages.detach().to(lp.dtype)
    divergence = bridged_divergence(
        logprobs=lp, mask=mask, sampler_total=sampler_total, sampler_length=sampler_length
    )
    filtered = (adv <= 0) & (divergence > filter_threshold)
    if not use_filter:
        filtered = torch.zeros_like(filtered)
    adv = torch.where(filtered, torch.zeros_like(adv), adv)
    lengths = mask.sum(dim=1).clamp(min=1).to(lp.dtype)
    on_policy = torch.where(mask, torch.exp(lp - lp.detach()), torch.zeros_like(lp))
    g = on_policy.sum(dim=1) / lengths
    ones = torch.ones_like(adv)
    clipped = torch.zeros_like(filtered)
    if shaping_gamma is not None and method not in ("gspo", "hacpo"):
        f = torch.where(mask, luffy_weight(lp, shaping_gamma), torch.zeros_like(lp))
        per_seq = -adv * f.sum(dim=1) / lengths
        weight = ones
    elif method in ("vis", "gspo", "hacpo"):
        s = torch.exp(
            bridged_mean_log_ratio(
                logprobs=lp, mask=mask, sampler_total=sampler_total, sampler_length=sampler_length
            )
        )
        if method == "hacpo":
            omega = ones if peer_scale is None else peer_scale.to(adv)
            per_seq = peer_term(s, adv, omega, peer_clip_lower, hacpo_alpha)
            weight = s.detach().clamp(peer_clip_lower, 1.0)
            clipped = (s.detach() < peer_clip_lower) | (s.detach() > 1.0)
        else:
            low, high = gspo_eps if method == "gspo" else (clip_eps, clip_eps)
            per_seq = gspo_term(s, adv, eps_low=low, eps_high=high)
            per_seq, _ = dual_clip(per_seq, adv, peer_dual_clip, torch.ones_like(filtered))
            weight = s.detach()
    elif method == "tis":
        weight = bridged_tis_weight(
            logprobs=lp, mask=mask, sampler_total=sampler_total, is_cap=is_cap
        )
        per_seq = -weight * adv * g
    else:  # nois
        weight = ones
        per_seq = -adv * g
    nonempty = mask.any(dim=1)
    per_seq = torch.where(nonempty, per_seq, torch.zeros_like(per_seq))
    return BridgedLoss(
        per_sequence=per_seq,
        weight=weight.detach(),
        divergence=divergence,
        filtered=filtered,
        clipped=clipped,
    )
