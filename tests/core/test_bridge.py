"""The bridged path's sequence-level math (docs/math.md §16): values derived by hand in each
test's comment."""

from __future__ import annotations

import math

import pytest
import torch

from ftis.core.bridge import (
    bridged_divergence,
    bridged_log_ratio,
    bridged_loss,
    bridged_mean_log_ratio,
    bridged_tis_weight,
    sequence_logprob,
)
from ftis.core.hacpo import gspo_ratio
from ftis.core.losses import policy_loss, sequence_divergence

# Receiver: row 0 has tokens -1, -2 (a NaN at padding, ignored); row 1 one token -0.5; row 2
# none (an empty re-tokenization).
LP = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
MASK = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])


def test_sequence_logprob_sums_real_tokens_only():
    assert sequence_logprob(LP, MASK).tolist() == [-3.0, -0.5, 0.0]


def test_tis_weight_is_the_truncated_ratio_of_totals():
    # row 0: S_recv = -3, S_send = -3.5 -> exp(0.5) = 1.6487 (under C = 2)
    # row 1: S_recv = -0.5, S_send = -2.5 -> exp(2) = 7.39 -> capped at 2
    # row 2: empty receiver row, S_recv = 0, S_send = -0.1 -> exp(0.1)
    total = torch.tensor([-3.5, -2.5, -0.1])
    w = bridged_tis_weight(logprobs=LP, mask=MASK, sampler_total=total, is_cap=2.0)
    torch.testing.assert_close(w, torch.tensor([math.exp(0.5), 2.0, math.exp(0.1)]))
    log_ratio = bridged_log_ratio(logprobs=LP, mask=MASK, sampler_total=total)
    torch.testing.assert_close(log_ratio, torch.tensor([0.5, 2.0, 0.1]))


def test_mean_log_ratio_normalises_each_total_by_its_own_token_count():
    # row 0: -3 / 2 - (-3.5 / 5) = -1.5 + 0.7 = -0.8
    # row 1: -0.5 / 1 - (-2.5 / 5) = 0.0
    # row 2: empty receiver (length floored to 1): 0 - (-1.0 / 4) = 0.25
    total = torch.tensor([-3.5, -2.5, -1.0])
    length = torch.tensor([5, 5, 4])
    delta = bridged_mean_log_ratio(
        logprobs=LP, mask=MASK, sampler_total=total, sampler_length=length
    )
    torch.testing.assert_close(delta, torch.tensor([-0.8, 0.0, 0.25]))
    # D = k3(-delta): k3(0.8) = e^0.8 - 0.8 - 1 = 0.4255409; k3(0) = 0; k3(-0.25) = 0.0288008
    d = bridged_divergence(logprobs=LP, mask=MASK, sampler_total=total, sampler_length=length)
    torch.testing.assert_close(d, torch.tensor([math.exp(0.8) - 1.8, 0.0, math.exp(-0.25) - 0.75]))


def test_divergence_is_a_lower_bound_of_the_exact_statistic_on_identical_tokens():
    # identical tokenizations: per-token log-ratios glp - lp of row 0 are (+1, -1), of row 1
    # (0.3, 0.3). Exact D: row 0 = (k3(1) + k3(-1)) / 2 = ((e - 2) + (1/e)) / 2 = 0.5431;
    # bridged: mean log-ratio 0 -> k3(0) = 0 (<= 0.5431). Row 1: equal ratios -> both k3(0.3).
    lp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    glp = torch.tensor([[0.0, -3.0], [-0.7, -0.7]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    exact = sequence_divergence(logprobs=lp, sampler_logprobs=glp, mask=mask)
    bridged = bridged_divergence(
        logprobs=lp,
        mask=mask,
        sampler_total=glp.sum(dim=1),
        sampler_length=torch.tensor([2, 2]),
    )
    torch.testing.assert_close(exact[0], torch.tensor((math.e - 2 + 1 / math.e) / 2))
    assert bridged[0] == 0.0
    torch.testing.assert_close(bridged[1], exact[1])
    torch.testing.assert_close(bridged[1], torch.tensor(math.exp(0.3) - 1.3))


@pytest.mark.parametrize("d", [-70.0, -30.0, -0.5, 0.5, 25.0])
def test_divergence_is_not_clamped_and_equals_the_exact_statistic_on_equal_ratios(d):
    # Every token has the log-ratio glp - lp = d: the bridged statistic equals the exact one
    # (Jensen's equality) at any d, computed before the loss's clamp of the ratio at +-20:
    # k3(-70) = e^-70 + 70 - 1 = 69 (not k3(-20) = 19), so a forgery that far out passes the
    # filter's g = 50 on both paths. Above +20 both saturate alike (docs/math.md §4).
    lp = torch.full((1, 3), -1.0)
    glp = lp + d
    mask = torch.ones(1, 3, dtype=torch.bool)
    exact = sequence_divergence(logprobs=lp, sampler_logprobs=glp, mask=mask)
    bridged = bridged_divergence(
        logprobs=lp, mask=mask, sampler_total=glp.sum(dim=1), sampler_length=torch.tensor([3])
    )
    torch.testing.assert_close(bridged, exact)
    if d < 0:
        torch.testing.assert_close(bridged, torch.tensor([math.expm1(d) - d]))


def test_f_vis_filter_drops_a_far_forgery_on_the_bridged_path_as_on_the_exact_one():
    # The sender reports -71 nats per token for tokens the receiver puts at -1: d = -70 per
    # token, D = 69 > g = 50, A < 0: filtered on both paths (the bridged one used to see the
    # clamped d = -20, D = 19, and kept it).
    lp = torch.full((1, 3), -1.0, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = bridged_loss(
        lp,
        mask,
        torch.tensor([-1.0]),
        sampler_total=torch.tensor([-71.0 * 3]),
        sampler_length=torch.tensor([3]),
        method="vis",
        use_filter=True,
    )
    assert out.filtered.tolist() == [True]
    torch.testing.assert_close(out.divergence, torch.tensor([69.0]))
    _, metrics = policy_loss(
        lp, torch.full((1, 3), -71.0), torch.tensor([-1.0]), mask, method="f-vis"
    )
    assert metrics["filtered_frac"].item() == 1.0


def test_vis_and_gspo_dual_clip_a_peer_ratio_above_c_for_a_negative_advantage():
    # delta = +2 (sender -3 per token, receiver -1): s = e^2 = 7.39 > c = 3, A = -1: PPO's
    # min takes s A = -7.39 (term +7.39, gradient weight 7.39); the dual clip takes
    # max(-7.39, c A = -3) = -3: term +3, a constant. With c = 10 the ratio is under it and the
    # published term (and gradient) is back. A > 0 is never dual-clipped.
    mask = torch.ones(1, 2, dtype=torch.bool)
    for method in ("vis", "gspo"):
        kw = dict(sampler_total=torch.tensor([-6.0]), sampler_length=torch.tensor([2]))
        lp = torch.full((1, 2), -1.0, requires_grad=True)
        out = bridged_loss(lp, mask, torch.tensor([-1.0]), method=method, **kw)
        torch.testing.assert_close(out.per_sequence, torch.tensor([3.0]))
        out.per_sequence.sum().backward()
        assert lp.grad.abs().max().item() == 0.0
        lp = torch.full((1, 2), -1.0, requires_grad=True)
        out = bridged_loss(lp, mask, torch.tensor([-1.0]), method=method, peer_dual_clip=10.0, **kw)
        torch.testing.assert_close(out.per_sequence, torch.tensor([math.exp(2.0)]))
        out.per_sequence.sum().backward()
        torch.testing.assert_close(lp.grad, torch.full((1, 2), math.exp(2.0) / 2))
        lp = torch.full((1, 2), -1.0, requires_grad=True)
        out = bridged_loss(lp, mask, torch.tensor([1.0]), method=method, **kw)
        assert out.per_sequence.item() < 0  # A > 0: PPO's clipped branch, as published


def test_shaping_replaces_the_vis_term_on_the_bridged_path():
    # loss.shaping_gamma takes every token method's peer term on the bridged path, vis
    # included (it used to keep vis's ratio term): -A mean_t f(p_t), f(p) = p / (p + gamma).
    lp = torch.full((1, 2), -1.0, requires_grad=True)
    out = bridged_loss(
        lp,
        torch.ones(1, 2, dtype=torch.bool),
        torch.tensor([-1.0]),
        sampler_total=torch.tensor([-41.0]),
        sampler_length=torch.tensor([2]),
        method="vis",
        shaping_gamma=0.1,
    )
    p = math.exp(-1.0)
    torch.testing.assert_close(out.per_sequence, torch.tensor([p / (p + 0.1)]))


def test_tis_loss_value_and_gradient():
    # one sequence of 2 receiver tokens, A = 1.5, S_recv = -3, S_send = -3.5: w = e^0.5.
    # term = -w A g, g = mean_t exp(lp - sg lp) = 1: value -1.5 e^0.5;
    # d term / d lp_t = -w A / 2 = -0.75 e^0.5 on each real token, 0 at padding.
    lp = LP[:1].clone().nan_to_num(0.0).requires_grad_(True)
    out = bridged_loss(
        lp,
        MASK[:1],
        torch.tensor([1.5]),
        sampler_total=torch.tensor([-3.5]),
        sampler_length=torch.tensor([4]),
        method="tis",
    )
    torch.testing.assert_close(out.per_sequence, torch.tensor([-1.5 * math.exp(0.5)]))
    torch.testing.assert_close(out.weight, torch.tensor([math.exp(0.5)]))
    out.per_sequence.sum().backward()
    g = -0.75 * math.exp(0.5)
    torch.testing.assert_close(lp.grad, torch.tensor([[g, g, 0.0]]))


def test_nois_filter_and_empty_rows():
    # row 0: A = -1, delta = -0.8 -> D = 0.4255 > g = 0.4: filtered, term 0.
    # row 1: A = -1, D = 0 -> kept: term -A g = 1.0, weight 1.
    # row 2: empty receiver row: 0 whatever A.
    total = torch.tensor([-3.5, -2.5, -1.0])
    out = bridged_loss(
        LP.nan_to_num(0.0),
        MASK,
        torch.tensor([-1.0, -1.0, 2.0]),
        sampler_total=total,
        sampler_length=torch.tensor([5, 5, 4]),
        method="nois",
        use_filter=True,
        filter_threshold=0.4,
    )
    assert out.filtered.tolist() == [True, False, False]
    torch.testing.assert_close(out.per_sequence, torch.tensor([0.0, 1.0, 0.0]))


def test_vis_clips_the_length_normalised_ratio():
    # delta = -0.8 -> s = e^-0.8 = 0.4493; A = 2 > 0: min(s A, clip(s, 0.8, 1.2) A) = s A
    # = 0.8987 -> term -0.8987. A = -2: min(-0.8987, -1.6) = -1.6 -> term +1.6 (clipped, const).
    lp = LP[:1].nan_to_num(0.0)
    kw = dict(sampler_total=torch.tensor([-3.5]), sampler_length=torch.tensor([5]), method="vis")
    up = bridged_loss(lp, MASK[:1], torch.tensor([2.0]), **kw)
    down = bridged_loss(lp, MASK[:1], torch.tensor([-2.0]), **kw)
    torch.testing.assert_close(up.per_sequence, torch.tensor([-2 * math.exp(-0.8)]))
    torch.testing.assert_close(down.per_sequence, torch.tensor([1.6]))


def test_reco_has_no_bridged_form():
    with pytest.raises(ValueError, match="reco.*no bridged form"):
        bridged_loss(
            LP,
            MASK,
            torch.zeros(3),
            sampler_total=torch.zeros(3),
            sampler_length=torch.ones(3, dtype=torch.long),
            method="reco",
        )


class TestIdenticalTokenizations:
    """One tokenizer, identical tokens: the F-TIS family's sequence weight exp(S_recv - S_send)
    equals the exact path's product of per-token ratios bit for bit (the same sums of the same
    per-token log-probs); HACPO's and GSPO's length-normalised ratio is mean(lp) - mean(glp)
    on the bridged path and mean(lp - glp) on the exact one: equal up to float32 rounding (the
    tolerance below, 1e-6 relative, is a few ulp; a wrong normalisation is off by > 1e-2)."""

    lp = torch.tensor([[-0.7, -1.2, -0.1, 0.0], [-2.0, -0.3, 0.0, 0.0]])
    glp = torch.tensor([[-0.9, -1.0, -0.4, 0.0], [-1.5, -0.6, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])

    def _bridged_inputs(self):
        return dict(
            sampler_total=sequence_logprob(self.glp, self.mask),
            sampler_length=self.mask.sum(dim=1),
        )

    def test_hacpo_and_gspo_ratio_and_loss_equal_the_exact_path(self):
        adv = torch.tensor([0.8, -0.4])
        for method in ("hacpo", "gspo"):
            lp_a = self.lp.clone().requires_grad_(True)
            lp_b = self.lp.clone().requires_grad_(True)
            loss_exact, _ = policy_loss(
                lp_a,
                self.glp,
                adv,
                self.mask,
                method=method,
                own=torch.zeros(2, dtype=torch.bool),
                peer_clip_lower=0.5,
            )
            out = bridged_loss(
                lp_b, self.mask, adv, method=method, peer_clip_lower=0.5, **self._bridged_inputs()
            )
            loss_bridged = out.per_sequence.sum() / 2
            tight = dict(rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(loss_exact.detach(), loss_bridged.detach(), **tight)
            assert abs(float(loss_exact)) > 1e-2  # not trivially 0
            loss_exact.backward()
            loss_bridged.backward()
            torch.testing.assert_close(lp_a.grad, lp_b.grad, **tight)
        delta = bridged_mean_log_ratio(logprobs=self.lp, mask=self.mask, **self._bridged_inputs())
        torch.testing.assert_close(
            torch.exp(delta), gspo_ratio(self.lp, self.glp, self.mask), rtol=1e-6, atol=0.0
        )

    def test_tis_sequence_weight_is_the_product_of_the_per_token_ratios(self):
        # exact path, sequence level: prod_t exp(lp - glp) = exp(sum lp - sum glp);
        # row 0: (-2.0) - (-2.3) = 0.3 -> e^0.3; row 1: -2.3 - (-2.1) = -0.2 -> e^-0.2.
        w = bridged_tis_weight(
            logprobs=self.lp,
            mask=self.mask,
            sampler_total=self._bridged_inputs()["sampler_total"],
            is_cap=2.0,
        )
        exact = torch.exp(
            sequence_logprob(self.lp, self.mask) - sequence_logprob(self.glp, self.mask)
        ).clamp(max=2.0)
        assert torch.equal(w, exact)
        torch.testing.assert_close(w, torch.tensor([math.exp(0.3), math.exp(-0.2)]))
