"""The policy-loss family: NoIS, VIS (GRPO), TIS, ReCo and their filtered variants
(docs/math.md §3-§5, §8).

Shapes: N sequences, T tokens (padded completion width).

Structure:

- ``LOSS_TERMS`` is the registry of loss terms (:func:`register_loss_term`), one function per
  base method: per-token terms (``nois``, ``vis``, ``tis``, ``reco``) and per-sequence terms
  (``gspo``, ``hacpo``); ``TOKEN_TERMS``, ``SEQUENCE_METHODS`` and ``LOSS_METHODS`` are views
  of it;
- :func:`sequence_divergence` and :func:`filter_sequences` are the filter (the "f-" prefix),
  applied to the advantages before the per-token term;
- :func:`policy_loss` (the public contract) sanitizes inputs, resolves the method, applies the
  filter and any per-sequence weights (ReCo's response weights), calls the registered term,
  aggregates per sequence then over sequences, and computes metrics. It never branches on a
  method's name.

Where this deviates from the authors' code (docs/math.md §5): defaults follow the paper
(g = 50, k averaged over the sequence's own tokens, filtered sequences zeroed not dropped);
the authors' choices are options (``filter_stat_norm="padded"``, ``filter_mode="drop"``).

Micro-batches (docs/math.md §3, §5): every normalisation that spans sequences takes a global
quantity as an argument (``num_sequences``, ``padded_width``), so the result does not depend on
how a batch is split. Under ``filter_mode="drop"`` the global count of kept sequences is only
known after every micro-batch ran; :func:`drop_mode_grad_scale` gives the factor that fixes the
accumulated gradient afterwards. Per-sequence weights that span a group (ReCo's response
weights, which are normalised within each group) are likewise computed by the caller over the
whole batch and passed in (``sequence_weights``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ftis.core.hacpo import gspo_ratio, gspo_term, peer_term
from ftis.core.reco import variance_ratio
from ftis.core.shaping import luffy_weight

# Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp (docs/math.md §3.4):
# exp(20) ~ 4.9e8 is far beyond any cap or clip range, and finite in fp32.
LOG_RATIO_CLAMP = 20.0
# c of the dual clip on peers' samples (docs/math.md §3.5): for A < 0 a peer's ratio term is at
# most c |A|, and a ratio above c gets no gradient. 3 is dual-clip PPO's value (Ye et al.
# 2020) and verl's clip_ratio_c. ``LossConfig.peer_dual_clip``; inf turns it off.
PEER_DUAL_CLIP = 3.0

FilterStatNorm = Literal["sequence", "padded"]
FilterMode = Literal["zero", "drop"]
FILTER_STAT_NORMS: tuple[str, ...] = ("sequence", "padded")
FILTER_MODES: tuple[str, ...] = ("zero", "drop")
FILTER_PREFIX = "f-"
RecoClip = Literal["direction", "sign"]
RECO_CLIPS: tuple[str, ...] = ("direction", "sign")


@dataclass(frozen=True)
class RecoOptions:
    """The switches of the ``reco`` term (docs/math.md §8.3); other terms ignore them.

    Attributes:
        token_ratio: use the variance ratio r in place of the PPO ratio (off: the ratio of the
            base method: VIS's rho, or 1 under ``tis``).
        tis: multiply by TIS's detached truncated weight ``min(rho, C)`` (for peers' samples).
        clip: which tokens the clip masks when r is outside [1 - eps, 1 + eps]: "direction"
            (default: those whose gradient step moves r further out, sign(A) * sign(1 - 2p))
            or "sign" (PPO's rule verbatim: A > 0 above the range, A < 0 below it).
    """

    token_ratio: bool = True
    tis: bool = False
    clip: RecoClip = "direction"


@dataclass(frozen=True)
class TokenTermInputs:
    """What a per-token term sees. All tensors are fp32 (or wider) and finite where masked out.

    Attributes:
        logprobs: (N, T) receiver's log-probs, with grad; 0 at masked-out positions.
        log_ratio: (N, T) ``clamp(logprobs - sampler_logprobs)``, with grad through logprobs;
            0 at masked-out positions.
        advantages: (N, 1) advantages after the filter (and any sequence weights), no grad.
        is_cap: C, the TIS truncation cap.
        clip_eps: eps_c, the VIS clip range.
        sampler_logprobs: (N, T) generator's log-probs, no grad; 0 at masked-out positions.
        reco: the switches of the ``reco`` term.
        peer_dual_clip: c of the dual clip (docs/math.md §3.5), applied by the ratio terms
            (``vis``, ``reco``) on ``peer_rows`` only.
        peer_rows: (N, 1) bool, True on peers' sequences; None: no row is a peer's (the dual
            clip is off).
    """

    logprobs: Tensor
    log_ratio: Tensor
    advantages: Tensor
    is_cap: float
    clip_eps: float
    sampler_logprobs: Tensor
    reco: RecoOptions = RecoOptions()
    peer_dual_clip: float = math.inf
    peer_rows: Tensor | None = None


@dataclass(frozen=True)
class TokenTermOutput:
    """A per-token term: ``per_token`` (N, T) loss terms l[i,t]; ``clipped`` (N, T) bool where
    the PPO clip was active (VIS and ReCo, else None)."""

    per_token: Tensor
    clipped: Tensor | None = None


TokenTerm = Callable[[TokenTermInputs], TokenTermOutput]


@dataclass(frozen=True)
class SequenceTermInputs:
    """What a per-sequence term sees (docs/math.md §12). Tensors as in :class:`TokenTermInputs`
    but ``advantages`` is (N,).

    Attributes:
        logprobs, sampler_logprobs, mask: (N, T), as for the token terms.
        advantages: (N,) after the filter (and any sequence weights), no grad.
        own: (N,) bool, True on the receiver's own sequences; None: all own.
        peer_scale: (N,) HACPO's discrepancy coefficient of each peer sequence; None: 1.
        peer_clip_lower: the lower clamp of a peer sequence's ratio at this update.
        hacpo_alpha: the stop-gradient power of the peer weight.
        gspo_eps: (eps_low, eps_high), GSPO's sequence clip range.
        peer_dual_clip: c of the dual clip on ``peer_rows`` (§3.5).
        peer_rows: (N,) bool, True on peers' sequences; None: none is a peer's.
    """

    logprobs: Tensor
    sampler_logprobs: Tensor
    mask: Tensor
    advantages: Tensor
    own: Tensor | None = None
    peer_scale: Tensor | None = None
    peer_clip_lower: float = 0.8
    hacpo_alpha: float = 1.0
    gspo_eps: tuple[float, float] = (3e-4, 4e-4)
    peer_dual_clip: float = math.inf
    peer_rows: Tensor | None = None


@dataclass(frozen=True)
class SequenceTermOutput:
    """A per-sequence term: ``per_sequence`` (N,) loss terms; ``clipped`` (N,) bool where a
    clip was active; ``metrics``: the term's own 0-dim diagnostics (no grad)."""

    per_sequence: Tensor
    clipped: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


SequenceTerm = Callable[[SequenceTermInputs], SequenceTermOutput]


@dataclass(frozen=True)
class LossTerm:
    """A registered loss term: its function and how :func:`policy_loss` uses it.

    Attributes:
        name: the base method name (``method`` in configs).
        fn: a :data:`TokenTerm` (level "token") or a :data:`SequenceTerm` (level "sequence").
        level: "token": ``l[i, t]``, averaged over each sequence's tokens; "sequence": one
            term per sequence.
        filterable: whether ``"f-" + name`` (the F-TIS filter before the term) is a method.
        paper: one of the F-TIS paper's own terms (listed first among the method names).
    """

    name: str
    fn: Callable
    level: Literal["token", "sequence"]
    filterable: bool = True
    paper: bool = False


LOSS_TERMS: dict[str, LossTerm] = {}
METHOD_ALIASES: dict[str, str] = {"grpo": "vis"}


def register_loss_term(
    name: str,
    *,
    level: Literal["token", "sequence"] = "token",
    filterable: bool = True,
    paper: bool = False,
) -> Callable[[Callable], Callable]:
    """Register the decorated function as loss term ``name`` (docs/math.md lists each term's
    formula). A new method is a new registered function: :func:`policy_loss` itself only
    masks, filters, weights and averages."""
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if name in LOSS_TERMS or name in METHOD_ALIASES or name.startswith(FILTER_PREFIX):
        raise ValueError(f"loss term {name!r} is already registered or not a valid name")

    def add(fn: Callable) -> Callable:
        LOSS_TERMS[name] = LossTerm(name, fn, level, filterable and level == "token", paper)
        return fn

    return add


def loss_methods() -> tuple[str, ...]:
    """Every method name, in the order errors list them: the paper's terms, their filtered
    names and aliases, then later terms (each with its filtered name), then the others."""
    terms = list(LOSS_TERMS.values())
    paper = [t.name for t in terms if t.paper]
    return (
        *paper,
        *(FILTER_PREFIX + n for n in paper),
        *METHOD_ALIASES,
        *(
            m
            for t in terms
            if not t.paper
            for m in ((t.name, FILTER_PREFIX + t.name) if t.filterable else (t.name,))
        ),
    )


def _on_policy_factor(logprobs: Tensor) -> Tensor:
    """``exp(lp - sg(lp))``: value 1, gradient grad lp."""
    return torch.exp(logprobs - logprobs.detach())


def dual_clip(
    term: Tensor, advantages: Tensor, c: float, rows: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """The dual clip of a ratio loss term on ``rows`` (docs/math.md §3.5): ``min(l, -c A)``
    where ``A < 0``, i.e. dual-clip PPO's ``max(min(rho A, clip(rho) A), c A)`` written for the
    term ``l`` to minimise. Where it bites the term is the constant ``-c A`` (no gradient), so a
    term whose gradient is ``q |A| grad lp`` (q the ratio) keeps ``q <= c`` wherever it has a
    gradient. Other rows, and ``A >= 0``, keep ``l`` bit for bit.

    Args:
        term: (N, T) or (N,) loss terms.
        advantages: broadcastable to ``term``, no grad.
        c: the bound, > 1; ``inf`` returns ``term`` unchanged.
        rows: bool, broadcastable to ``term``, True where the dual clip applies (peers'
            sequences); None: nowhere.

    Returns:
        (the clipped term, bool where the dual clip was active, or None when it is off).
    """
    if rows is None or math.isinf(c):
        return term, None
    bound = -c * advantages.detach()
    active = rows & (advantages < 0) & (term > bound)
    return torch.where(active, bound.expand_as(term), term), active


@register_loss_term("nois", paper=True)
def nois_term(x: TokenTermInputs) -> TokenTermOutput:
    """NoIS: ``l = -exp(lp - sg(lp)) * A`` (docs/math.md §3.1). Every sample as on-policy."""
    return TokenTermOutput(per_token=-_on_policy_factor(x.logprobs) * x.advantages)


@register_loss_term("vis", paper=True)
def vis_term(x: TokenTermInputs) -> TokenTermOutput:
    """VIS / GRPO: ``l = -min(rho A, clip(rho, 1-eps, 1+eps) A)``, ``rho = exp(lp - glp)``
    (docs/math.md §3.2). The generator plays PPO's old policy."""
    rho = torch.exp(x.log_ratio)
    unclipped = rho * x.advantages
    clipped = rho.clamp(1.0 - x.clip_eps, 1.0 + x.clip_eps) * x.advantages
    per_token, dual = dual_clip(
        -torch.minimum(unclipped, clipped), x.advantages, x.peer_dual_clip, x.peer_rows
    )
    ppo = clipped < unclipped
    return TokenTermOutput(per_token=per_token, clipped=ppo if dual is None else ppo | dual)


@register_loss_term("tis", paper=True)
def tis_term(x: TokenTermInputs) -> TokenTermOutput:
    """TIS: ``l = -min(exp(sg(lp) - glp), C) * exp(lp - sg(lp)) * A`` (docs/math.md §3.3).
    A detached per-token weight, capped from above only."""
    weight = torch.exp(x.log_ratio.detach()).clamp(max=x.is_cap)
    return TokenTermOutput(per_token=-weight * _on_policy_factor(x.logprobs) * x.advantages)


@register_loss_term("reco")
def reco_term(x: TokenTermInputs) -> TokenTermOutput:
    """ReCo's token level (docs/math.md §8.3), optionally composed with TIS's weight.

    ``l = -W * (c ? clip(q, 1-eps, 1+eps) A : sg(q) exp(lp - sg(lp)) A)``: value ``-q A`` and
    gradient ``-W q A grad lp`` on tokens the clip ``c`` leaves alone, a constant on the others.
    q is the variance ratio r (``reco.token_ratio``), else the base method's ratio; W is
    ``min(exp(sg(lp) - glp), C)`` under ``reco.tis``, else 1. With the token ratio off the term
    *is* VIS (no TIS) or TIS (with it), computed by their own functions so that ReCo with both
    levels off equals ``vis`` bit for bit. Response weights enter through the advantages.
    """
    if not x.reco.token_ratio:
        return tis_term(x) if x.reco.tis else vis_term(x)
    lp = x.logprobs
    r = variance_ratio(lp, x.sampler_logprobs)  # detached
    eps = x.clip_eps
    if x.reco.clip == "direction":
        # A gradient step moves p in the direction of A; dr/dp has the sign of (1 - 2p).
        push = torch.sign(x.advantages) * torch.sign(1.0 - 2.0 * torch.exp(lp.detach()))
    else:
        push = torch.sign(x.advantages).expand_as(r)
    clipped = ((r > 1.0 + eps) & (push > 0)) | ((r < 1.0 - eps) & (push < 0))
    free = r * _on_policy_factor(lp) * x.advantages
    per_token = -torch.where(clipped, r.clamp(1.0 - eps, 1.0 + eps) * x.advantages, free)
    per_token, dual = dual_clip(per_token, x.advantages, x.peer_dual_clip, x.peer_rows)
    if dual is not None:
        clipped = clipped | dual
    if x.reco.tis:
        per_token = torch.exp(x.log_ratio.detach()).clamp(max=x.is_cap) * per_token
    return TokenTermOutput(per_token=per_token, clipped=clipped)


@register_loss_term("gspo", level="sequence")
def gspo_sequence_term(x: SequenceTermInputs) -> SequenceTermOutput:
    """GSPO (docs/math.md §12): ``-min(s A, clip(s, 1 - eps_low, 1 + eps_high) A)`` with ``s``
    the length-normalised sequence ratio; the dual clip (§3.5) on peers' sequences."""
    ratio = gspo_ratio(x.logprobs, x.sampler_logprobs, x.mask)
    low, high = x.gspo_eps
    term = gspo_term(ratio, x.advantages, eps_low=low, eps_high=high)
    with torch.no_grad():
        clipped = (ratio < 1.0 - low) | (ratio > 1.0 + high)
    per_seq, active = dual_clip(term, x.advantages, x.peer_dual_clip, x.peer_rows)
    if active is not None:
        clipped = clipped | active
    return SequenceTermOutput(per_sequence=per_seq, clipped=clipped)


@register_loss_term("hacpo", level="sequence")
def hacpo_sequence_term(x: SequenceTermInputs) -> SequenceTermOutput:
    """HACPO (docs/math.md §12): GSPO's term on the receiver's own sequences, the clamped
    exponential IS term ``-c sg(c)^alpha omega A`` on peers' (ftis.core.hacpo.peer_term), with
    ``peer_frac`` and ``peer_clipped_frac`` (peers' sequences whose ratio left [lower, 1])."""
    adv = x.advantages
    ratio = gspo_ratio(x.logprobs, x.sampler_logprobs, x.mask)
    low, high = x.gspo_eps
    own_term = gspo_term(ratio, adv, eps_low=low, eps_high=high)
    is_own = torch.ones_like(adv, dtype=torch.bool) if x.own is None else x.own.to(adv.device)
    omega = torch.ones_like(adv) if x.peer_scale is None else x.peer_scale.to(adv)
    peer = peer_term(ratio, adv, omega, x.peer_clip_lower, x.hacpo_alpha)
    per_seq = torch.where(is_own, own_term, peer)
    with torch.no_grad():
        own_clipped = (ratio < 1.0 - low) | (ratio > 1.0 + high)
        peer_out = ~is_own & ((ratio < x.peer_clip_lower) | (ratio > 1.0))
        metrics = {
            "peer_frac": _safe_mean(~is_own, torch.ones_like(is_own)),
            "peer_clipped_frac": _safe_mean(peer_out, torch.ones_like(peer_out)),
        }
    return SequenceTermOutput(
        per_sequence=per_seq, clipped=torch.where(is_own, own_clipped, peer_out), metrics=metrics
    )


# Views of the registry as it is once the built-in terms are registered (taken at import, so a
# plugin's later terms are not in them): for callers and tests that name the built-in
# families. What a config accepts is `loss_methods()`, read at each check.
TOKEN_TERMS: dict[str, TokenTerm] = {
    t.name: t.fn for t in LOSS_TERMS.values() if t.level == "token"
}
SEQUENCE_METHODS: tuple[str, ...] = tuple(
    t.name for t in LOSS_TERMS.values() if t.level == "sequence"
)
LOSS_METHODS: tuple[str, ...] = loss_methods()


def resolve_method(method: str) -> tuple[str, bool]:
    """Split a method name into (base term name, whether the filter applies).

    >>> resolve_method("f-tis")
    ('tis', True)
    >>> resolve_method("grpo")
    ('vis', False)
    """
    methods = loss_methods()
    if method not in methods:
        raise ValueError(f"unknown loss method {method!r}; valid methods: {', '.join(methods)}")
    filtered = method.startswith(FILTER_PREFIX)
    base = method.removeprefix(FILTER_PREFIX)
    return METHOD_ALIASES.get(base, base), filtered


def sequence_divergence(
    *,
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    norm: FilterStatNorm = "sequence",
    padded_width: int | None = None,
) -> Tensor:
    """Per-sequence divergence D_i from the k3 estimator (docs/math.md §4), without grad.

    ``k = exp(glp - lp) - (glp - lp) - 1 >= 0`` per token; ``D_i`` is the sum of k over the
    sequence's masked tokens divided by ``|a_i|`` (``norm="sequence"``, default) or by the padded
    width (``norm="padded"``, the authors' code, docs/math.md §5). Empty sequences give 0.

    Args:
        logprobs: (N, T) receiver's log-probs (grad is ignored).
        sampler_logprobs: (N, T) generator's log-probs.
        mask: (N, T) bool, True = token counts.
        norm: "sequence" or "padded".
        padded_width: the width D_i is divided by under ``norm="padded"``: the padded width of
            the whole batch when these tensors are a micro-batch trimmed to its own longest
            sequence, so that D_i does not depend on the split. None: T = ``mask.shape[1]``.
            Ignored under ``norm="sequence"``.

    Returns:
        (N,) D_i, fp32 or wider, no grad.
    """
    if norm not in FILTER_STAT_NORMS:
        raise ValueError(f"filter_stat_norm must be one of {FILTER_STAT_NORMS}, got {norm!r}")
    _check_padded_width(padded_width)
    with torch.no_grad():
        lp = _masked_float(logprobs, mask)
        glp = _masked_float(sampler_logprobs, mask)
        # Only the exp argument is clamped: k is exact for d <= 20 and saturates (monotone) above;
        # for d < 0 it stays exact (~ |d| - 1), so a receiver far more confident than the
        # generator still shows a large divergence. expm1 keeps k >= 0 near d = 0.
        d = (glp - lp).clamp(max=LOG_RATIO_CLAMP)
        k = (torch.expm1(d) - d).clamp(min=0.0)
        total = torch.where(mask, k, torch.zeros_like(k)).sum(dim=1)
        if norm == "padded":
            width = mask.shape[1] if padded_width is None else padded_width
            return total / max(width, 1)
        return total / mask.sum(dim=1).clamp(min=1).to(total.dtype)


def filter_sequences(*, advantages: Tensor, divergence: Tensor, threshold: float) -> Tensor:
    """(N,) bool, True where a sequence is filtered: ``A_i <= 0 and D_i > g`` (docs/math.md §4).

    Args:
        advantages: (N,) advantages computed over the whole group.
        divergence: (N,) D_i from :func:`sequence_divergence`.
        threshold: g.
    """
    return (advantages <= 0) & (divergence > threshold)


def policy_loss(
    logprobs: Tensor,
    sampler_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    method: str = "f-tis",
    is_cap: float = 2.0,
    clip_eps: float = 0.2,
    filter_threshold: float = 50.0,
    filter_stat_norm: FilterStatNorm = "sequence",
    filter_mode: FilterMode = "zero",
    num_sequences: int | None = None,
    padded_width: int | None = None,
    sequence_weights: Tensor | None = None,
    reco_token_ratio: bool = True,
    reco_tis: bool = False,
    reco_clip: RecoClip = "direction",
    own: Tensor | None = None,
    shaping_gamma: float | None = None,
    peer_scale: Tensor | None = None,
    peer_clip_lower: float = 0.8,
    hacpo_alpha: float = 1.0,
    gspo_eps_low: float = 3e-4,
    gspo_eps_high: float = 4e-4,
    peer_dual_clip: float = PEER_DUAL_CLIP,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of docs/math.md §3-§5, §8, §12 and §13.

    ``L = (1/N) sum_i (1/|a_i|) sum_t mask[i,t] * l[i,t]``, with l the method's per-token term.

    Args:
        logprobs: (N, T) float, requires grad: the receiver's per-token log-probs.
        sampler_logprobs: (N, T) float: the generator's per-token log-probs, as received.
        advantages: (N,) float, computed over whole groups (before filtering).
        mask: (N, T) bool, True = token counts. Values at masked-out positions are ignored, even
            NaN or inf.
        method: one of ``LOSS_METHODS``: "nois", "vis" (= "grpo"), "tis", "reco", "f-nois",
            "f-vis", "f-tis", "f-reco". The "f-" prefix applies the filter of §4.
        is_cap: C, the TIS cap (may be ``inf`` for untruncated IS).
        clip_eps: eps_c, the VIS clip range, in [0, 1).
        filter_threshold: g, the filter threshold on D_i.
        filter_stat_norm: "sequence" (default: mean k over the sequence's own tokens) or
            "padded" (sum over the sequence divided by the padded width, the authors' code), §5.
        filter_mode: "zero" (default: a filtered sequence's advantage becomes 0, it still counts
            in N) or "drop" (it is also removed from N, the authors' code), §5.
        num_sequences: the global N when a batch is split into micro-batches: each micro-batch
            loss is the sum of its per-sequence losses divided by it, so summing the micro-batch
            losses gives the full-batch loss and gradient. None: the local N (under "drop": the
            local count of kept sequences, which makes the accumulated gradient depend on the
            split). Under ``filter_mode="drop"`` pass the batch's total N (filtered sequences
            included) to every micro-batch, sum ``metrics["kept_sequences"]`` over them, and
            multiply the accumulated gradient and loss by
            ``drop_mode_grad_scale(num_sequences, kept_total)`` (docs/math.md §5). Passing the
            batch's global kept count instead (if known beforehand) also works; the scale is 1.
        padded_width: under ``filter_stat_norm="padded"``, the width D_i is divided by: pass
            the whole batch's padded width when these tensors are a micro-batch trimmed to its
            own longest completion. None: T = ``logprobs.shape[1]``. Ignored otherwise.
        sequence_weights: (N,) float, positive, no grad, or None (all 1): a weight multiplying
            each sequence's term, applied after the filter (which decides on the unweighted
            advantages). ReCo's response weights (§8.1): compute them with
            ``ftis.core.reco.reco_weights`` over the **whole** batch (they are normalised within
            each group) and pass each micro-batch its slice, so the result does not depend on
            the split. ``method="reco"`` without them is ReCo with the response level off. Any
            method accepts them.
        reco_token_ratio: ``reco`` only: the variance ratio replaces the PPO ratio (§8.2);
            False: the ratio of VIS (or TIS's, under ``reco_tis``).
        reco_tis: ``reco`` only: also multiply by TIS's weight ``min(exp(sg(lp) - glp), C)``,
            detached (§8.3: a truncated ReCo for peers' samples).
        reco_clip: ``reco`` only: "direction" (default) or "sign", which out-of-range tokens
            the clip masks (§8.3).
        own: (N,) bool, True for the receiver's own sequences, False for peers'; None: all own.
            Used by ``hacpo`` and by shaping.
        shaping_gamma: token-level methods only: replace the per-token term of every *peer*
            token by LUFFY's ``-f(p) A`` with ``f(p) = p / (p + gamma)``, p the receiver's token
            probability (§13); own tokens keep the method's term, and the filter still decides
            on the unweighted advantages. None: off.
        peer_scale: ``hacpo`` only: (N,) HACPO's discrepancy coefficient omega of each peer
            sequence's generator (ignored on own sequences); None: 1.
        peer_clip_lower: ``hacpo`` only: lo_m, the lower clamp of a peer sequence's ratio at
            this optimizer update (``ftis.core.hacpo.peer_clip_lower``).
        hacpo_alpha: ``hacpo`` only: the stop-gradient power of the peer weight.
        gspo_eps_low, gspo_eps_high: ``gspo``/``hacpo``: GSPO's sequence clip range.
        peer_dual_clip: c > 1 (``inf``: off), the dual clip on *peers'* sequences (``own``
            False) under the ratio methods ``vis`` (``grpo``), ``reco`` and ``gspo`` and their
            filtered variants (§3.5): for ``A_i < 0`` a peer's term is ``min(l, -c A_i)``, so
            its weight never exceeds ``c |A_i|`` and a ratio above c gets no gradient. Own
            sequences (and every sequence when ``own`` is None) keep the published term.

    Returns:
        ``(loss, metrics)``: loss a scalar tensor (fp32 or wider); metrics 0-dim tensors without
        grad: ``loss``, ``filtered_frac``, ``kept_sequences`` (number of sequences of this call
        not filtered, as a float; all of them for methods without the "f-" prefix),
        ``is_weight_mean``, ``is_weight_max`` (ratio ``exp(lp - glp)`` over masked tokens,
        before truncation), ``truncated_frac`` (masked tokens with ratio > C), ``clip_frac``
        (VIS and ReCo: masked tokens whose clip was active, else 0), ``filter_stat_mean`` (mean
        D_i over non-empty sequences, reported for every method). ``hacpo`` adds ``peer_frac``
        (the fraction of this call's sequences that are peers') and ``peer_clipped_frac`` (the
        fraction that are peers' with a ratio outside [peer_clip_lower, 1], hence no gradient);
        for the sequence methods ``clip_frac`` counts sequences, not tokens. ``clip_frac``
        includes the peers' tokens (sequences) where the dual clip was active.
    """
    term_name, use_filter = resolve_method(method)
    if shaping_gamma is not None and not shaping_gamma > 0:
        raise ValueError(f"shaping_gamma must be > 0 (or None: off), got {shaping_gamma}")
    if own is not None and (own.dtype != torch.bool or tuple(own.shape) != logprobs.shape[:1]):
        raise ValueError(
            f"own must be a bool tensor of shape ({logprobs.shape[0]},), got "
            f"{own.dtype} {tuple(own.shape)}"
        )
    _check_inputs(logprobs, sampler_logprobs, advantages, mask)
    _check_options(is_cap, clip_eps, filter_threshold, filter_stat_norm, filter_mode)
    _check_dual_clip(peer_dual_clip)
    _check_padded_width(padded_width)
    _check_sequence_weights(sequence_weights, logprobs.shape[0])
    if reco_clip not in RECO_CLIPS:
        raise ValueError(f"reco_clip must be one of {RECO_CLIPS}, got {reco_clip!r}")
    num_local = logprobs.shape[0]
    _check_num_sequences(num_sequences, num_local, filter_mode)

    lp = _masked_float(logprobs, mask)
    glp = _masked_float(sampler_logprobs, mask).detach()
    adv = advantages.detach().to(lp.dtype)
    log_ratio = (lp - glp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    divergence = sequence_divergence(
        logprobs=lp,
        sampler_logprobs=glp,
        mask=mask,
        norm=filter_stat_norm,
        padded_width=padded_width,
    )
    if use_filter:
        filtered = filter_sequences(
            advantages=adv, divergence=divergence, threshold=filter_threshold
        )
    else:
        filtered = torch.zeros_like(adv, dtype=torch.bool)
    adv = torch.where(filtered, torch.zeros_like(adv), adv)
    if sequence_weights is not None:
        adv = adv * sequence_weights.detach().to(device=adv.device, dtype=adv.dtype)
    denominator = _loss_denominator(num_local, filtered, filter_mode, num_sequences, dtype=lp.dtype)
    peer_rows = None if own is None else ~own.to(lp.device)

    def shared_metrics(loss: Tensor, clipped: Tensor | None) -> dict[str, Tensor]:
        return _metrics(
            loss=loss,
            log_ratio=log_ratio,
            mask=mask,
            filtered=filtered,
            divergence=divergence,
            clipped=clipped,
            is_cap=is_cap,
        )

    spec = LOSS_TERMS[term_name]
    if spec.level == "sequence":
        out = spec.fn(
            SequenceTermInputs(
                logprobs=lp,
                sampler_logprobs=glp,
                mask=mask,
                advantages=adv,
                own=own,
                peer_scale=peer_scale,
                peer_clip_lower=peer_clip_lower,
                hacpo_alpha=hacpo_alpha,
                gspo_eps=(gspo_eps_low, gspo_eps_high),
                peer_dual_clip=peer_dual_clip,
                peer_rows=peer_rows,
            )
        )
        # an empty completion has no token to move: it contributes 0, as under the token terms
        per_seq = torch.where(mask.any(dim=1), out.per_sequence, torch.zeros_like(adv))
        loss = per_seq.sum() / denominator
        metrics = shared_metrics(loss, None)
        with torch.no_grad():  # the sequence terms' clip_frac counts sequences, not tokens
            metrics["clip_frac"] = _safe_mean(out.clipped, torch.ones_like(out.clipped))
        return loss, {**metrics, **out.metrics}

    term = spec.fn(
        TokenTermInputs(
            logprobs=lp,
            log_ratio=log_ratio,
            advantages=adv[:, None],
            is_cap=is_cap,
            clip_eps=clip_eps,
            sampler_logprobs=glp,
            reco=RecoOptions(token_ratio=reco_token_ratio, tis=reco_tis, clip=reco_clip),
            peer_dual_clip=peer_dual_clip,
            peer_rows=None if peer_rows is None else peer_rows[:, None],
        )
    )
    per_token = term.per_token
    if shaping_gamma is not None and own is not None:
        shaped = -luffy_weight(lp, shaping_gamma) * adv[:, None]
        per_token = torch.where(own.to(lp.device)[:, None], per_token, shaped)
    loss = _aggregate(per_token, mask) / denominator
    metrics = shared_metrics(loss, term.clipped)
    return loss, metrics


def drop_mode_grad_scale(num_sequences: int, kept_total: float | int | Tensor) -> float:
    """The factor that turns ``filter_mode="drop"`` micro-batch losses into the batch's loss.

    Each micro-batch loss was divided by ``num_sequences`` (the same for all of them, normally
    the batch's total N), but under "drop" the batch loss divides by the number of sequences
    kept over the whole batch, known only after every micro-batch ran (docs/math.md §5). Since
    gradients are linear in the loss, multiplying the accumulated gradients (and the summed
    loss) by ``max(num_sequences, 1) / max(kept_total, 1)`` gives exactly
    ``(1 / kept_total) sum_{kept i} loss_i``, whatever the split. Apply it before clipping.

    >>> drop_mode_grad_scale(8, 6)
    1.3333333333333333
    >>> drop_mode_grad_scale(8, 0)  # everything dropped: the gradient is 0 whatever the factor
    8.0

    Args:
        num_sequences: the ``num_sequences`` passed to every micro-batch's :func:`policy_loss`.
        kept_total: the sum over micro-batches of ``metrics["kept_sequences"]``.
    """
    if isinstance(num_sequences, bool) or not isinstance(num_sequences, int) or num_sequences < 0:
        raise ValueError(f"num_sequences must be an int >= 0, got {num_sequences!r}")
    kept = float(kept_total)
    if not 0 <= kept <= max(num_sequences, 0) or kept != round(kept):
        raise ValueError(
            f"kept_total must be a whole number in [0, num_sequences={num_sequences}], got "
            f"{kept_total!r}; it is the sum of metrics['kept_sequences'] over the micro-batches "
            "that were each called with this num_sequences"
        )
    return max(num_sequences, 1) / max(kept, 1.0)


def _aggregate(per_token: Tensor, mask: Tensor) -> Tensor:
    """``sum_i (1/|a_i|) sum_t mask * l`` (not yet divided by N); empty rows give 0."""
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    lengths = mask.sum(dim=1).clamp(min=1).to(per_token.dtype)
    return (per_token.sum(dim=1) / lengths).sum()


def _loss_denominator(
    num_local: int,
    filtered: Tensor,
    filter_mode: str,
    num_sequences: int | None,
    *,
    dtype: torch.dtype,
) -> Tensor | float:
    """N: the global count if given, else the local one (minus filtered ones under "drop").

    Floored at 1 so that an empty batch, or one whose sequences were all dropped, gives 0.
    """
    if num_sequences is not None:
        return float(max(num_sequences, 1))
    if filter_mode == "drop":
        return (num_local - filtered.sum()).clamp(min=1).to(dtype)
    return float(max(num_local, 1))


def _metrics(
    *,
    loss: Tensor,
    log_ratio: Tensor,
    mask: Tensor,
    filtered: Tensor,
    divergence: Tensor,
    clipped: Tensor | None,
    is_cap: float,
) -> dict[str, Tensor]:
    """Diagnostics, all 0-dim tensors without grad; means over empty sets are 0."""
    with torch.no_grad():
        zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
        ratio = torch.exp(log_ratio.detach())
        num_tokens = mask.sum()
        nonempty = mask.any(dim=1)
        masked_ratio = torch.where(mask, ratio, torch.zeros_like(ratio))
        return {
            "loss": loss.detach(),
            "filtered_frac": _safe_mean(filtered, torch.ones_like(filtered)),
            "kept_sequences": (~filtered).sum().to(loss.dtype),
            "is_weight_mean": masked_ratio.sum() / num_tokens.clamp(min=1),
            "is_weight_max": masked_ratio.amax() if masked_ratio.numel() > 0 else zero,
            "truncated_frac": _safe_mean(ratio > is_cap, mask),
            "clip_frac": zero if clipped is None else _safe_mean(clipped, mask),
            "filter_stat_mean": _safe_mean(divergence, nonempty),
        }


def _safe_mean(values: Tensor, where: Tensor) -> Tensor:
    """Mean of ``values`` over positions where ``where`` is True; 0 if there are none."""
    values = values.to(torch.float32) if not values.dtype.is_floating_point else values
    total = torch.where(where, values, torch.zeros_like(values)).sum()
    return total / where.sum().clamp(min=1).to(total.dtype)


def _masked_float(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` in fp32 (or wider), with masked-out positions replaced by 0.

    ``torch.where`` (not multiplication) so that NaN/inf at padding never reaches the loss or
    the gradient (docs/math.md §3.4).
    """
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.where(mask, x, torch.zeros_like(x))


def _check_inputs(
    logprobs: Tensor, sampler_logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> None:
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must have shape (N, T), got {tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    if tuple(sampler_logprobs.shape) != shape:
        raise ValueError(
            f"sampler_logprobs must have the shape of logprobs {shape}, "
            f"got {tuple(sampler_logprobs.shape)}"
        )
    if tuple(mask.shape) != shape:
        raise ValueError(f"mask must have the shape of logprobs {shape}, got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (True = token counts), got {mask.dtype}")
    if tuple(advantages.shape) != shape[:1]:
        raise ValueError(
            f"advantages must have shape ({shape[0]},), one per sequence, "
            f"got {tuple(advantages.shape)}"
        )
    for name, t in (("logprobs", logprobs), ("sampler_logprobs", sampler_logprobs)):
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating point, got {t.dtype}")


def _check_num_sequences(num_sequences: int | None, num_local: int, filter_mode: str) -> None:
    if num_sequences is None:
        return
    if isinstance(num_sequences, bool) or not isinstance(num_sequences, int):
        raise ValueError(f"num_sequences must be an int or None, got {num_sequences!r}")
    # Under "drop" the global count excludes filtered sequences, so it may be below the local N.
    minimum = 0 if filter_mode == "drop" else num_local
    if num_sequences < minimum:
        raise ValueError(
            f"num_sequences (the global N) must be >= {minimum}, the number of sequences in "
            f"this micro-batch, got {num_sequences}"
        )


def _check_sequence_weights(weights: Tensor | None, num_local: int) -> None:
    if weights is None:
        return
    if tuple(weights.shape) != (num_local,) or not weights.dtype.is_floating_point:
        raise ValueError(
            f"sequence_weights must be a float tensor of shape ({num_local},), one per "
            f"sequence, got {weights.dtype} {tuple(weights.shape)}"
        )


def _check_padded_width(padded_width: int | None) -> None:
    if padded_width is None:
        return
    if isinstance(padded_width, bool) or not isinstance(padded_width, int) or padded_width < 1:
        raise ValueError(
            f"padded_width must be an int >= 1 (the whole batch's padded completion width) or "
            f"None, got {padded_width!r}"
        )


def _check_dual_clip(c: float) -> None:
    if not c > 1.0:
        raise ValueError(
            f"peer_dual_clip (c) must be > 1 (3 is dual-clip PPO's value; inf turns it off), "
            f"got {c}"
        )


def _check_options(
    is_cap: float, clip_eps: float, filter_threshold: float, stat_norm: str, filter_mode: str
) -> None:
    if not is_cap > 0:
        raise ValueError(f"is_cap (C) must be > 0, got {is_cap}")
    if not 0.0 <= clip_eps < 1.0:
        raise ValueError(f"clip_eps must be in [0, 1), got {clip_eps}")
    if filter_threshold != filter_threshold:  # NaN
        raise ValueError("filter_threshold must not be NaN")
    if stat_norm not in FILTER_STAT_NORMS:
        raise ValueError(f"filter_stat_norm must be one of {FILTER_STAT_NORMS}, got {stat_norm!r}")
    if filter_mode not in FILTER_MODES:
        raise ValueError(f"filter_mode must be one of {FILTER_MODES}, got {filter_mode!r}")
