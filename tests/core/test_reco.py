"""Tests for ftis.core.reco and the ``reco`` loss term (docs/math.md §8).

Expected values are worked out by hand in each test. Tolerances: reco_weights computes in
float64 and returns float32, so 1e-6 absolute on O(1) weights is a few float32 ulps. The loss
examples go through float32 log/exp/expm1 of O(1) numbers (each ~1 ulp ~ 6e-8 relative, a
handful of them per value), so 2e-6 absolute leaves headroom while every alternative the tests
tell apart (a wrong clip, a missing weight) differs by more than 0.1.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ftis.core.losses import LOSS_METHODS, TOKEN_TERMS, policy_loss, resolve_method
from ftis.core.reco import reco_weights, variance_ratio, variance_ratio_summary

W_ATOL = 1e-6
L_ATOL = 2e-6
NAN, INF = float("nan"), float("inf")
log = math.log


def close(actual: torch.Tensor, expected: object, atol: float) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual.detach(), expected_t, atol=atol, rtol=0)


# ---- reco_weights -------------------------------------------------------------------------------


def test_reco_weights_by_hand() -> None:
    """G = 4, w_max = 5; groups interleaved (ids 0, 7, 3), one of them a group of one.

    group 0: pbar = 1/2, 1/8 (geometric mean of 1/4 and 1/16), 1/40
             raw = 1/(4 pbar) = 0.5, 2, 10 -> clipped 0.5, 2, 5; mean 2.5 -> w = 0.2, 0.8, 2.0
    group 7: a group of one -> w = 1 (its pbar does not matter)
    group 3: an empty sequence (pbar = 1, raw = 1/4) and pbar = 1/4 (raw = 1)
             mean 0.625 -> w = 0.4, 1.6
    """
    pad = NAN  # garbage at masked-out positions is ignored
    glp = torch.tensor(
        [
            [log(0.5), log(0.5)],  # group 0
            [log(1e-3), -30.0],  # group 7
            [pad, -INF],  # group 3, empty
            [log(1 / 4), log(1 / 16)],  # group 0
            [log(1 / 4), pad],  # group 3
            [log(1 / 40), INF],  # group 0
        ]
    )
    mask = torch.tensor(
        [[True, True], [True, True], [False, False], [True, True], [True, False], [True, False]]
    )
    ids = torch.tensor([0, 7, 3, 0, 3, 0])
    w = reco_weights(glp, mask, ids, 4, w_max=5.0)
    assert w.dtype == torch.float32 and not w.requires_grad
    close(w, [0.2, 1.0, 0.4, 0.8, 1.6, 2.0], W_ATOL)


def test_reco_weights_have_mean_one_per_group_and_stay_in_range() -> None:
    gen = torch.Generator().manual_seed(0)
    n, t, g = 40, 6, 8
    glp = -torch.rand(n, t, generator=gen) * 3.0
    mask = torch.arange(t)[None, :] < torch.randint(0, t + 1, (n,), generator=gen)[:, None]
    ids = torch.randint(0, 9, (n,), generator=gen)
    w = reco_weights(glp, mask, ids, g, w_max=5.0)
    for gid in ids.unique():
        members = w[ids == gid]
        close(members.mean(), 1.0, W_ATOL)
        # Raw weights lie in [1/G, w_max], so every weight is positive; a group of one has
        # weight exactly 1.
        assert (members > 0).all()
        if members.numel() == 1:
            assert members.item() == 1.0
    # A permutation of the batch permutes the weights (no dependence on order).
    perm = torch.randperm(n, generator=gen)
    torch.testing.assert_close(reco_weights(glp[perm], mask[perm], ids[perm], g), w[perm])


def test_group_size_only_sets_where_the_clip_bites() -> None:
    glp = torch.tensor([[log(0.5)], [log(0.1)]])
    mask = torch.ones(2, 1, dtype=torch.bool)
    ids = torch.tensor([0, 0])
    # No clip reached (w_max large): raw ~ (2, 10) / G for any G -> w = (2, 10) / 6.
    for g in (2, 8):
        close(reco_weights(glp, mask, ids, g, w_max=1e6), [2 / 6, 10 / 6], W_ATOL)
    # G = 1, w_max = 5: raw (2, 10) -> clipped (2, 5), mean 3.5 -> (4/7, 10/7).
    close(reco_weights(glp, mask, ids, 1, w_max=5.0), [2 / 3.5, 5 / 3.5], W_ATOL)


def test_reco_weights_extreme_log_probs_stay_finite() -> None:
    """G = 4, w_max = 5.
    group 0: mean -inf and mean ~ -5e29: both raw -> infinite, clipped to 5 -> w = (1, 1).
    group 1: a claimed +inf (impossible, counted as mean 0: raw 1/4) and mean -1e4 (raw 5):
             mean 2.625 -> w = (0.25 / 2.625, 5 / 2.625).
    """
    glp = torch.tensor([[-INF, -1.0], [-1e30, -1.0], [INF, NAN], [-1e4, NAN]])
    mask = torch.tensor([[True, True], [True, True], [True, False], [True, False]])
    w = reco_weights(glp, mask, torch.tensor([0, 0, 1, 1]), 4, w_max=5.0)
    assert torch.isfinite(w).all()
    close(w, [1.0, 1.0, 0.25 / 2.625, 5 / 2.625], W_ATOL)


def test_reco_weights_empty_masks_and_empty_batches() -> None:
    # Every sequence empty: pbar = 1 for all, equal raw weights -> 1 each.
    glp = torch.full((3, 2), NAN)
    w = reco_weights(glp, torch.zeros(3, 2, dtype=torch.bool), torch.tensor([1, 1, 2]), 4)
    assert torch.equal(w, torch.ones(3))
    empty = reco_weights(
        torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool), torch.zeros(0).long(), 4
    )
    assert empty.shape == (0,)


def test_reco_weights_accept_numpy_and_reject_bad_inputs() -> None:
    glp = np.array([[log(0.5)], [log(1 / 8)]], dtype=np.float32)
    w = reco_weights(glp, np.ones((2, 1), dtype=bool), np.array([0, 0]), np.int64(4))
    close(w, [0.4, 1.6], W_ATOL)  # raw 0.5, 2 -> mean 1.25
    ok = (torch.zeros(2, 1), torch.ones(2, 1, dtype=torch.bool), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="w_max"):
        reco_weights(*ok, 4, w_max=INF)
    with pytest.raises(ValueError, match="w_max"):
        reco_weights(*ok, 4, w_max=0.0)
    with pytest.raises(ValueError, match="group_size"):
        reco_weights(*ok, 0)
    with pytest.raises(ValueError, match="group_size"):
        reco_weights(*ok, True)
    with pytest.raises(ValueError, match="mask"):
        reco_weights(ok[0], ok[1].long(), ok[2], 4)
    with pytest.raises(ValueError, match="group_ids"):
        reco_weights(ok[0], ok[1], torch.tensor([0.0, 0.0]), 4)
    with pytest.raises(ValueError, match="group_ids"):
        reco_weights(ok[0], ok[1], torch.tensor([0, 0, 0]), 4)


# ---- variance_ratio ---------------------------------------------------------------------------


def test_variance_ratio_by_hand() -> None:
    # p(1-p) / (p0(1-p0)): (0.5*0.5)/(0.25*0.75) = 4/3;  (0.9*0.1)/(0.5*0.5) = 0.36;
    # (0.2*0.8)/(0.1*0.9) = 16/9;  equal probabilities -> 1.
    lp = torch.tensor([[log(0.5), log(0.9)], [log(0.2), log(0.3)]], requires_grad=True)
    glp = torch.tensor([[log(0.25), log(0.5)], [log(0.1), log(0.3)]])
    r = variance_ratio(lp, glp)
    assert not r.requires_grad and r.dtype == torch.float32
    close(r, [[4 / 3, 0.36], [16 / 9, 1.0]], L_ATOL)


def test_variance_ratio_is_one_on_policy_and_finite_at_the_extremes() -> None:
    x = torch.tensor([0.0, -1e-30, -1.0, -1e4, -INF, -3.0e38])
    assert torch.equal(variance_ratio(x, x.clone()), torch.ones_like(x))
    # p = 1 against p0 = e^-1: log r = log(tiny) - log(e^-1 (1 - e^-1)) ~ -86 -> clamped to -20;
    # p = 0 (log-prob -inf) against p0 = 1/2: clamped to e^-20; the reverse pairs to e^20.
    lp = torch.tensor([0.0, -INF, -1.0, log(0.5)])
    glp = torch.tensor([-1.0, log(0.5), 0.0, -INF])
    r = variance_ratio(lp, glp)
    assert torch.isfinite(r).all()
    e20 = math.exp(20.0)
    torch.testing.assert_close(r, torch.tensor([1 / e20, 1 / e20, e20, e20]), rtol=1e-5, atol=0)


def test_variance_ratio_summary_by_hand() -> None:
    lp = torch.tensor([[log(0.5), NAN], [log(0.9), log(0.3)]])
    glp = torch.tensor([[log(0.25), 5.0], [log(0.5), log(0.3)]])
    mask = torch.tensor([[True, False], [True, True]])
    s = variance_ratio_summary(lp, glp, mask)
    close(s["variance_ratio_mean"], (4 / 3 + 0.36 + 1.0) / 3, L_ATOL)
    close(s["variance_ratio_max"], 4 / 3, L_ATOL)
    s = variance_ratio_summary(lp, glp, torch.zeros(2, 2, dtype=torch.bool))
    assert s["variance_ratio_mean"] == 0 and s["variance_ratio_max"] == 0


# ---- the reco loss term ---------------------------------------------------------------------------
#   eps = 0.2, so the clip range is [0.8, 1.2]. p = receiver, p0 = sampler.
#   row 0, A = +1:  t0 p .2  p0 .1  r = 16/9 > 1.2, p < .5: a step up raises r   -> clipped (both)
#                   t1 p .9  p0 .6  r = .09/.24 = .375 < .8, p > .5: a step up lowers r
#                                   -> clipped ("direction"); free under "sign" (A > 0)
#                   t2 p .3  p0 .3  r = 1                                          -> free
#   row 1, A = -2:  t0 p .8  p0 .5  r = .64 < .8, p > .5: a step down raises r (back toward range)
#                                   -> free ("direction"); clipped under "sign" (A < 0)
#                   t1 p .05 p0 .5  r = .0475/.25 = .19 < .8, p < .5: a step down lowers r
#                                   -> clipped (both)
#                   t2 padding
#   A clipped token's value is -clip(r) A (no gradient); a free token's is -r A with gradient
#   -r A / (|a_i| N).
# ---------------------------------------------------------------------------------------------
def reco_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = torch.tensor([[log(0.2), log(0.9), log(0.3)], [log(0.8), log(0.05), NAN]])
    glp = torch.tensor([[log(0.1), log(0.6), log(0.3)], [log(0.5), log(0.5), INF]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return lp.requires_grad_(True), glp, adv, mask


def test_reco_token_ratio_direction_clip_by_hand() -> None:
    lp, glp, adv, mask = reco_example()
    loss, metrics = policy_loss(lp, glp, adv, mask, method="reco", clip_eps=0.2)
    # row 0: (-1.2 - 0.8 - 1) / 3 = -1;  row 1: (0.64*2 + 0.8*2) / 2 = 1.44;  L = 0.44 / 2.
    close(loss, 0.22, L_ATOL)
    (grad,) = torch.autograd.grad(loss, lp)
    close(grad, [[0.0, 0.0, -1 / 6], [0.64 * 2 / 4, 0.0, 0.0]], L_ATOL)
    close(metrics["clip_frac"], 3 / 5, L_ATOL)


def test_reco_token_ratio_sign_clip_by_hand() -> None:
    lp, glp, adv, mask = reco_example()
    loss, metrics = policy_loss(lp, glp, adv, mask, method="reco", reco_clip="sign")
    # row 0: (-1.2 - 0.375 - 1) / 3;  row 1: (0.8*2 + 0.8*2) / 2 = 1.6.
    close(loss, ((-1.2 - 0.375 - 1) / 3 + 1.6) / 2, L_ATOL)
    (grad,) = torch.autograd.grad(loss, lp)
    close(grad, [[0.0, -0.375 / 6, -1 / 6], [0.0, 0.0, 0.0]], L_ATOL)
    close(metrics["clip_frac"], 3 / 5, L_ATOL)


def test_sequence_weights_scale_each_sequence_by_hand() -> None:
    lp, glp, adv, mask = reco_example()
    w = torch.tensor([0.5, 2.0])
    loss, _ = policy_loss(lp, glp, adv, mask, method="reco", sequence_weights=w)
    # The direction example's rows (-1, 1.44) weighted: (0.5 * -1 + 2 * 1.44) / 2.
    close(loss, (-0.5 + 2.88) / 2, L_ATOL)
    (grad,) = torch.autograd.grad(loss, lp)
    close(grad, [[0.0, 0.0, -0.5 / 6], [2 * 0.64 * 2 / 4, 0.0, 0.0]], L_ATOL)


def test_filtered_truncated_reco_by_hand() -> None:
    """f-reco with reco_tis, C = 1.5, g = 5, response weights (0.5, 2, 3); row 2 is added.

    TIS weights min(p/p0, 1.5): row 0 (2 -> 1.5, 1.5, 1), row 1 (1.6 -> 1.5, 0.1).
    Filter (A <= 0 and D > g), d = glp - lp, k = e^d - d - 1:
      row 1: k(log .625) = .0950, k(log 10) = 6.697 -> D = 3.40 < 5: kept
      row 2: A = -1, p .01 vs p0 .5: k(log 50) = 45.09 > 5: filtered (weight 3 is irrelevant)
      row 0: A > 0: kept whatever D.
    row 0: 0.5 * (1.5 * -1.2 + 1.5 * -0.8 + 1 * -1) / 3 = 0.5 * -4/3
    row 1: 2 * (1.5 * 1.28 + 0.1 * 1.6) / 2 = 2 * 1.04
    L = (-2/3 + 2.08) / 3 (N = 3 counts the filtered row).
    Gradients: row 0 t2: -1 * 1 * 1 * 0.5 / (3 * 3); row 1 t0: -1.5 * 0.64 * -2 * 2 / (2 * 3).
    """
    lp, glp, adv, mask = reco_example()
    lp = torch.cat([lp.detach(), torch.tensor([[log(0.01), NAN, NAN]])]).requires_grad_(True)
    glp = torch.cat([glp, torch.tensor([[log(0.5), 0.0, 0.0]])])
    adv = torch.tensor([1.0, -2.0, -1.0])
    mask = torch.cat([mask, torch.tensor([[True, False, False]])])
    kw = {"method": "f-reco", "is_cap": 1.5, "filter_threshold": 5.0, "reco_tis": True}
    w = torch.tensor([0.5, 2.0, 3.0])
    loss, metrics = policy_loss(lp, glp, adv, mask, sequence_weights=w, **kw)
    close(loss, (-2 / 3 + 2.08) / 3, L_ATOL)
    (grad,) = torch.autograd.grad(loss, lp)
    close(grad, [[0, 0, -0.5 / 9], [1.5 * 0.64 * 2 * 2 / 6, 0, 0], [0, 0, 0]], L_ATOL)
    close(metrics["filtered_frac"], 1 / 3, L_ATOL)
    # Without the filter, row 2 (r = .0099/.25 < .8, A < 0, p < .5: clipped, value 0.8) counts,
    # with TIS weight min(.01/.5, 1.5) = .02 and response weight 3.
    loss_nf, _ = policy_loss(lp, glp, adv, mask, sequence_weights=w, **{**kw, "method": "reco"})
    close(loss_nf, (-2 / 3 + 2.08 + 3 * 0.02 * 0.8) / 3, L_ATOL)


# ---- invariances ----------------------------------------------------------------------------------


def random_batch(seed: int, n: int = 6, t: int = 5, spread: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    # Log-probs of probabilities in (0.02, 0.98), both sides of 1/2.
    lp = torch.log(torch.rand(n, t, generator=gen) * 0.96 + 0.02).requires_grad_(True)
    glp = (lp.detach() + spread * torch.randn(n, t, generator=gen)).clamp(max=-0.01)
    adv = torch.randn(n, generator=gen)
    mask = torch.arange(t)[None, :] < torch.randint(0, t + 1, (n,), generator=gen)[:, None]
    return lp, glp, adv, mask


def _loss_and_grad(lp, *args, **kw):
    loss, metrics = policy_loss(lp, *args, **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad, metrics


@pytest.mark.parametrize("seed", [0, 1])
def test_reco_with_both_levels_off_is_vis_exactly(seed: int) -> None:
    lp, glp, adv, mask = random_batch(seed)
    for base, reco in (("vis", "reco"), ("f-vis", "f-reco")):
        a, ga, ma = _loss_and_grad(lp, glp, adv, mask, method=base, filter_threshold=0.3)
        b, gb, mb = _loss_and_grad(
            lp, glp, adv, mask, method=reco, filter_threshold=0.3, reco_token_ratio=False
        )
        assert torch.equal(a, b) and torch.equal(ga, gb)
        assert all(torch.equal(ma[k], mb[k]) for k in ma)
    # ... and with reco_tis on too, it is TIS exactly.
    a, ga, _ = _loss_and_grad(lp, glp, adv, mask, method="f-tis", filter_threshold=0.3)
    b, gb, _ = _loss_and_grad(
        lp,
        glp,
        adv,
        mask,
        method="f-reco",
        filter_threshold=0.3,
        reco_token_ratio=False,
        reco_tis=True,
    )
    assert torch.equal(a, b) and torch.equal(ga, gb)
    # The token ratio on makes a difference here (the test above can fail).
    reco_grad = _loss_and_grad(lp, glp, adv, mask, method="reco")[1]
    assert not torch.allclose(reco_grad, _loss_and_grad(lp, glp, adv, mask, method="vis")[1])


@pytest.mark.parametrize("clip", ["direction", "sign"])
def test_reco_on_own_samples_is_grpo(clip: str) -> None:
    """On-policy the variance ratio is exactly 1, so ReCo's token level is GRPO's term."""
    lp, _, adv, mask = random_batch(2)
    glp = lp.detach().clone()
    ref, gref, _ = _loss_and_grad(lp, glp, adv, mask, method="grpo")
    for tis in (False, True):
        loss, grad, m = _loss_and_grad(
            lp, glp, adv, mask, method="f-reco", reco_clip=clip, reco_tis=tis
        )
        torch.testing.assert_close(loss, ref, atol=1e-7, rtol=0)
        torch.testing.assert_close(grad, gref, atol=1e-8, rtol=0)
        assert m["clip_frac"] == 0


def test_micro_batches_with_whole_batch_weights_equal_the_full_batch() -> None:
    lp, glp, adv, mask = random_batch(3, n=8, spread=0.5)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    w = reco_weights(glp, mask, ids, 4, w_max=2.0)
    kw = {"method": "f-reco", "filter_threshold": 0.5, "reco_tis": True}
    full, gfull, _ = _loss_and_grad(lp, glp, adv, mask, sequence_weights=w, **kw)
    for size in (1, 3):
        total, grad = torch.zeros(()), torch.zeros_like(lp)
        wrong = torch.zeros_like(lp)
        for s in range(0, 8, size):
            sl = slice(s, s + size)
            part = lp.detach()[sl].clone().requires_grad_(True)
            args = (part, glp[sl], adv[sl], mask[sl])
            loss, g, _ = _loss_and_grad(*args, sequence_weights=w[sl], num_sequences=8, **kw)
            total, grad[sl] = total + loss, g
            # Weights computed over the micro-batch alone are normalised within partial groups.
            w_local = reco_weights(glp[sl], mask[sl], ids[sl], 4, w_max=2.0)
            wrong[sl] = _loss_and_grad(*args, sequence_weights=w_local, num_sequences=8, **kw)[1]
        torch.testing.assert_close(total, full, atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, gfull, atol=1e-7, rtol=0)
        assert not torch.allclose(wrong, gfull, atol=1e-4)


def test_registry_knows_reco() -> None:
    assert "reco" in TOKEN_TERMS and {"reco", "f-reco"} <= set(LOSS_METHODS)
    assert resolve_method("f-reco") == ("reco", True)
    lp, glp, adv, mask = reco_example()
    with pytest.raises(ValueError, match="reco_clip"):
        policy_loss(lp, glp, adv, mask, method="reco", reco_clip="ppo")
    with pytest.raises(ValueError, match="sequence_weights"):
        policy_loss(lp, glp, adv, mask, method="reco", sequence_weights=torch.ones(3))
