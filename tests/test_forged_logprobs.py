"""A peer that forges low behaviour log-probs cannot buy an unbounded gradient (issue 37 item 5;
docs/math.md §3.5).

The attack: a peer's sequence with a negative advantage, each token reported at glp = -20.5
while the receiver finds it at lp = -1, so the ratio is exp(19.5) ~ 3e8. PPO's minimum takes the
unclipped branch for A < 0, so under ``vis``/``f-vis``/``gspo`` (and ReCo's ratio) the weight
of that sample grew with the ratio: a gradient of ~3e8 on the exact path
(``ftis.core.losses.policy_loss``) and on the bridged one (``ftis.core.bridge.bridged_loss``).

The bound every method must keep on a peer's tokens: with W = max(peer_dual_clip, is_cap) = 3
at the defaults (HACPO's peer weight is at most omega = 1 here, shaping's f(p) < 1, NoIS's 1),

    |dL / dlp[i,t]| <= W |A_i| / (|a_i| N)                        (the per-token weight)
    ||dL / dlogits[i]|| <= W |A_i| sqrt(2) / (sqrt(|a_i|) N)       (||p - onehot|| <= sqrt 2)

Receiver logits are built so that the sampled token has log-prob exactly -1 (V = 8 symbols).
Batch: row 0 the receiver's own honest sequence (A = +1), row 1 the peer's forged one (A = -1).
"""

from __future__ import annotations

import math

import pytest
import torch

from ftis.core.bridge import BRIDGED_METHODS, bridged_loss
from ftis.core.losses import LOSS_METHODS, SEQUENCE_METHODS, policy_loss, resolve_method

T, V, N = 4, 8, 2
RECEIVER_LP = -1.0
FORGED_LP = -20.5  # the report: ratio exp(19.5) per token
DUAL_CLIP = 3.0  # LossConfig.peer_dual_clip's default
IS_CAP = 2.0
W = max(DUAL_CLIP, IS_CAP)
ADV = torch.tensor([1.0, -1.0])
OWN = torch.tensor([True, False])
# from just under the cap (the gradient still flows, at weight 2.9) to far beyond the clamp
FORGED_SWEEP = (RECEIVER_LP - math.log(2.9), -5.0, FORGED_LP, -60.0)
TOKEN_METHODS = tuple(m for m in LOSS_METHODS if resolve_method(m)[0] not in SEQUENCE_METHODS)
BRIDGED = tuple(m for m in LOSS_METHODS if resolve_method(m)[0] in BRIDGED_METHODS)


def receiver_logits() -> torch.Tensor:
    """(N, T, V) logits, leaf with grad: token 0 has probability e^-1 at every position."""
    other = math.log((math.e - 1.0) / (V - 1))
    logits = torch.full((N, T, V), other)
    logits[..., 0] = 0.0
    return logits.requires_grad_(True)


def logprobs_of(logits: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits, dim=-1)[..., 0]
    lp.retain_grad()
    return lp


def exact_grads(method: str, forged: float, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/dlp, dL/dlogits) of the exact path for the own + forged-peer batch."""
    logits = receiver_logits()
    lp = logprobs_of(logits)
    glp = torch.stack([lp.detach()[0], torch.full((T,), forged)])
    loss, _ = policy_loss(
        lp, glp, ADV, torch.ones(N, T, dtype=torch.bool), method=method, own=OWN, **kw
    )
    loss.backward()
    return lp.grad, logits.grad


def bridged_grads(method: str, forged: float, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/dlp, dL/dlogits) of the bridged path, both rows a peer's (row 0 honest, row 1
    forged), the loss summed and divided by N as the update does."""
    base, use_filter = resolve_method(method)
    logits = receiver_logits()
    lp = logprobs_of(logits)
    out = bridged_loss(
        lp,
        torch.ones(N, T, dtype=torch.bool),
        ADV,
        sampler_total=torch.tensor([RECEIVER_LP * T, forged * T]),
        sampler_length=torch.tensor([T, T]),
        method=base,
        use_filter=use_filter,
        **kw,
    )
    (out.per_sequence.sum() / N).backward()
    return lp.grad, logits.grad


def assert_bounded(lp_grad: torch.Tensor, logits_grad: torch.Tensor, what: str) -> None:
    weight = lp_grad[1].abs().max().item() * T * N / abs(ADV[1].item())
    norm = logits_grad[1].norm().item()
    norm_bound = W * abs(ADV[1].item()) * math.sqrt(2) / (math.sqrt(T) * N)
    assert weight <= W * (1 + 1e-5), f"{what}: per-token weight {weight:.3g} > {W}"
    assert norm <= norm_bound * (1 + 1e-5), f"{what}: |grad logits| {norm:.3g} > {norm_bound:.3g}"


@pytest.mark.parametrize("forged", FORGED_SWEEP)
@pytest.mark.parametrize("method", LOSS_METHODS)
def test_exact_path_peer_weight_is_bounded(method: str, forged: float) -> None:
    lp_grad, logits_grad = exact_grads(method, forged)
    assert_bounded(lp_grad, logits_grad, f"{method} exact, glp {forged}")


@pytest.mark.parametrize("forged", FORGED_SWEEP)
@pytest.mark.parametrize("method", TOKEN_METHODS)
def test_exact_path_shaped_peer_weight_is_bounded(method: str, forged: float) -> None:
    lp_grad, logits_grad = exact_grads(method, forged, shaping_gamma=0.1)
    assert_bounded(lp_grad, logits_grad, f"{method} + shaping exact, glp {forged}")


@pytest.mark.parametrize("forged", FORGED_SWEEP)
@pytest.mark.parametrize("method", BRIDGED)
def test_bridged_path_peer_weight_is_bounded(method: str, forged: float) -> None:
    lp_grad, logits_grad = bridged_grads(method, forged)
    assert_bounded(lp_grad, logits_grad, f"{method} bridged, glp {forged}")


@pytest.mark.parametrize("method", [m for m in BRIDGED if m not in SEQUENCE_METHODS])
def test_bridged_path_shaped_peer_weight_is_bounded(method: str) -> None:
    lp_grad, logits_grad = bridged_grads(method, FORGED_LP, shaping_gamma=0.1)
    assert_bounded(lp_grad, logits_grad, f"{method} + shaping bridged")


@pytest.mark.parametrize("method", ["vis", "f-vis", "gspo", "reco", "f-reco"])
def test_forged_ratio_beyond_the_dual_clip_gets_no_gradient(method: str) -> None:
    # Past c the dual clip's branch is the constant c A: the forged sample moves nothing.
    lp_grad, logits_grad = exact_grads(method, FORGED_LP)
    assert lp_grad[1].abs().max().item() == 0.0
    assert logits_grad[1].abs().max().item() == 0.0
    if method in ("vis", "f-vis", "gspo"):
        lp_grad, logits_grad = bridged_grads(method, FORGED_LP)
        assert lp_grad[1].abs().max().item() == 0.0


def test_nois_ignores_the_report() -> None:
    # NoIS has no ratio: the forged row's weight is |A| / (|a_i| N) whatever glp says.
    for forged in FORGED_SWEEP:
        lp_grad, _ = exact_grads("nois", forged)
        torch.testing.assert_close(lp_grad[1], torch.full((T,), 1.0 / (T * N)))
        lp_grad, _ = bridged_grads("nois", forged)
        torch.testing.assert_close(lp_grad[1], torch.full((T,), 1.0 / (T * N)))


def test_own_samples_keep_the_published_term() -> None:
    # The same forged row marked as the receiver's own (own=None: all own) keeps VIS's
    # unbounded unclipped branch: weight exp(19.5) (the clamp at 20 is not reached).
    logits = receiver_logits()
    lp = logprobs_of(logits)
    glp = torch.stack([lp.detach()[0], torch.full((T,), FORGED_LP)])
    loss, _ = policy_loss(lp, glp, ADV, torch.ones(N, T, dtype=torch.bool), method="vis")
    loss.backward()
    weight = lp.grad[1].abs().max().item() * T * N
    assert weight == pytest.approx(math.exp(RECEIVER_LP - FORGED_LP), rel=1e-4)


@pytest.mark.chaos_case("F-TIS", "forged low behaviour log-prob (every loss method, both paths)")
def test_chaos_forged_low_behaviour_logprob_every_method() -> None:
    worst = {}
    for method in LOSS_METHODS:
        lp_grad, logits_grad = exact_grads(method, FORGED_LP)
        assert_bounded(lp_grad, logits_grad, f"{method} exact")
        worst[f"{method} exact"] = logits_grad[1].norm().item()
        if method in BRIDGED:
            lp_grad, logits_grad = bridged_grads(method, FORGED_LP)
            assert_bounded(lp_grad, logits_grad, f"{method} bridged")
            worst[f"{method} bridged"] = logits_grad[1].norm().item()
    assert max(worst.values()) < 1.0, worst
