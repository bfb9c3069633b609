"""Tests for ftis.core.losses (docs/math.md §3-§5).

Expected values are worked out by hand in each test. Tolerances: the hand examples run in fp32 on
O(1) numbers, so 1e-6 absolute is a few ulps of headroom and still catches any wrong factor.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftis.core.losses import (
    LOSS_METHODS,
    TOKEN_TERMS,
    drop_mode_grad_scale,
    filter_sequences,
    policy_loss,
    resolve_method,
    sequence_divergence,
)

ATOL = 1e-6
METRIC_NAMES = {
    "loss",
    "filtered_frac",
    "kept_sequences",
    "is_weight_mean",
    "is_weight_max",
    "truncated_frac",
    "clip_frac",
    "filter_stat_mean",
}


def close(actual: torch.Tensor, expected: object, atol: float = ATOL) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual.detach(), expected_t, atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------
# A 2x3 hand example shared by the per-method tests.
#   token ratios rho = exp(lp - glp):  row 0: (3, 0.5, 1)    row 1: (0.25, 1, <masked>)
#   advantages: A = (1, -2); mask: row 1's last token is padding holding NaN / inf garbage.
# ---------------------------------------------------------------------------------------------
def hand_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, float("nan")]], requires_grad=True)
    glp = torch.tensor(
        [[-1.0 - math.log(3), -2.0 + math.log(2), -0.5], [-1.0 + math.log(4), -1.0, float("inf")]]
    )
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return lp, glp, adv, mask


def test_tis_value_gradient_and_metrics_by_hand() -> None:
    lp, glp, adv, mask = hand_example()
    loss, metrics = policy_loss(lp, glp, adv, mask, method="tis", is_cap=2.0)
    # weights min(rho, 2): row 0 (2, 0.5, 1), row 1 (0.25, 1).
    # row 0: -(2 + 0.5 + 1) * 1 / 3 = -7/6;  row 1: -(0.25 + 1) * (-2) / 2 = 1.25.
    # L = (-7/6 + 1.25) / 2 = 1/24.
    close(loss, 1 / 24)
    loss.backward()
    # dL/dlp = -min(w, C) * A * mask / (|a_i| N)
    expected_grad = [
        [-2 * 1 / (3 * 2), -0.5 * 1 / (3 * 2), -1 * 1 / (3 * 2)],
        [-0.25 * -2 / (2 * 2), -1 * -2 / (2 * 2), 0.0],
    ]
    close(lp.grad, expected_grad)
    assert set(metrics) == METRIC_NAMES
    close(metrics["is_weight_mean"], (3 + 0.5 + 1 + 0.25 + 1) / 5)
    close(metrics["is_weight_max"], 3.0, atol=1e-5)  # exp(log 3) in fp32
    close(metrics["truncated_frac"], 1 / 5)  # only the 3 exceeds C = 2
    close(metrics["clip_frac"], 0.0)
    close(metrics["filtered_frac"], 0.0)
    close(metrics["loss"], 1 / 24)


def test_vis_value_gradient_and_clip_frac_by_hand() -> None:
    lp, glp, adv, mask = hand_example()
    loss, metrics = policy_loss(lp, glp, adv, mask, method="vis", clip_eps=0.2)
    # row 0 (A = 1):  min(3, 1.2) = 1.2 (clipped), min(0.5, 0.8) = 0.5, 1 -> -(2.7) / 3 = -0.9
    # row 1 (A = -2): min(-0.5, 0.8 * -2 = -1.6) = -1.6 (clipped), -2 -> (1.6 + 2) / 2 = 1.8
    # L = (-0.9 + 1.8) / 2 = 0.45
    close(loss, 0.45)
    loss.backward()
    # Clipped tokens get no gradient; elsewhere dl/dlp = -rho * A, then / (|a_i| N).
    expected_grad = [[0.0, -0.5 / 6, -1 / 6], [0.0, 2 / 4, 0.0]]
    close(lp.grad, expected_grad)
    close(metrics["clip_frac"], 2 / 5)


def test_nois_value_and_gradient_by_hand() -> None:
    lp, glp, adv, mask = hand_example()
    loss, metrics = policy_loss(lp, glp, adv, mask, method="nois")
    # l = -A on every token whatever the ratio: row means -1 and 2, L = 1/2.
    close(loss, 0.5)
    loss.backward()
    close(lp.grad, [[-1 / 6, -1 / 6, -1 / 6], [2 / 4, 2 / 4, 0.0]])
    close(metrics["clip_frac"], 0.0)


def test_grpo_is_vis() -> None:
    assert resolve_method("grpo") == ("vis", False)
    lp, glp, adv, mask = hand_example()
    a, ma = policy_loss(lp, glp, adv, mask, method="grpo")
    b, mb = policy_loss(lp, glp, adv, mask, method="vis")
    assert torch.equal(a, b)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
    (ga,) = torch.autograd.grad(a, lp)
    (gb,) = torch.autograd.grad(b, lp)
    assert torch.equal(ga, gb)


def test_registry_and_method_names() -> None:
    assert set(TOKEN_TERMS) == {"nois", "vis", "tis", "reco"}
    assert set(LOSS_METHODS) == {
        *("nois", "vis", "tis", "f-nois", "f-vis", "f-tis", "grpo"),
        *("reco", "f-reco"),
        *("gspo", "hacpo"),  # sequence-level (tests/core/test_hacpo.py)
    }
    assert resolve_method("f-tis") == ("tis", True)
    lp, glp, adv, mask = hand_example()
    with pytest.raises(ValueError, match=r"unknown loss method 'ppo'.*f-tis"):
        policy_loss(lp, glp, adv, mask, method="ppo")


def test_a_registered_term_is_a_method_without_editing_policy_loss() -> None:
    """A new per-token term is one registered function: policy_loss masks, filters and averages
    it like the built-in ones, the config accepts its names, and NoIS doubled gives exactly
    twice NoIS's loss and gradient."""
    from ftis.config import check_loss_method
    from ftis.core.losses import LOSS_TERMS, loss_methods, nois_term, register_loss_term

    @register_loss_term("twice-nois")
    def twice(x):
        out = nois_term(x)
        return type(out)(per_token=2 * out.per_token)

    try:
        assert {"twice-nois", "f-twice-nois"} <= set(loss_methods())
        assert check_loss_method("f-twice-nois") == "f-twice-nois"
        for method, base in (("twice-nois", "nois"), ("f-twice-nois", "f-nois")):
            lp, glp, adv, mask = hand_example()
            lp = lp.clone().requires_grad_()
            a, ma = policy_loss(lp, glp, adv, mask, method=method)
            b, mb = policy_loss(lp, glp, adv, mask, method=base)
            assert torch.equal(a, 2 * b)
            assert torch.equal(ma["filtered_frac"], mb["filtered_frac"])
            (ga,) = torch.autograd.grad(a, lp)
            (gb,) = torch.autograd.grad(b, lp)
            assert torch.equal(ga, 2 * gb)
        with pytest.raises(ValueError, match="already registered"):
            register_loss_term("twice-nois")(twice)
        with pytest.raises(ValueError, match="already registered"):
            register_loss_term("f-anything")(twice)
    finally:
        LOSS_TERMS.pop("twice-nois", None)
    assert "twice-nois" not in loss_methods()
    with pytest.raises(ValueError, match="unknown loss method 'twice-nois'"):
        check_loss_method("twice-nois")


def test_policy_loss_names_no_method() -> None:
    """policy_loss and its private helpers dispatch through the registry only: none of them
    names a method in its code (docstrings aside)."""
    import ast
    import inspect
    import textwrap

    from ftis.core import losses

    names = set(losses.LOSS_TERMS)
    checked = 0
    for fname, fn in vars(losses).items():
        if not inspect.isfunction(fn) or fn.__module__ != losses.__name__:
            continue
        if fname != "policy_loss" and not fname.startswith("_"):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        doc = ast.get_docstring(tree.body[0], clean=False)
        literals = {
            n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value != doc
        }
        assert not literals & names, (fname, literals & names)
        checked += 1
    assert checked >= 5


# ---------------------------------------------------------------------------------------------
# The filter. Four sequences of two tokens; d = glp - lp.
#   k(d) = exp(d) - d - 1;  k(log 100) = 100 - log 100 - 1 =: K ~ 94.39 > g = 50;  k(0) = 0.
#   seq 0: A = +1, d = (log 100, log 100), D = K   -> kept (positive advantage)
#   seq 1: A = -1, d = (log 100, log 100), D = K   -> filtered
#   seq 2: A = -1, d = (0, 0),             D = 0   -> kept (low divergence)
#   seq 3: A =  0, d = (log 100, pad),     D = K (own length) or K/2 ~ 47.2 (padded width 2)
# ---------------------------------------------------------------------------------------------
K = 100 - math.log(100) - 1


def filter_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = torch.full((4, 2), -1.0, requires_grad=True)
    d = math.log(100)
    glp = torch.tensor([[-1 + d, -1 + d], [-1 + d, -1 + d], [-1.0, -1.0], [-1 + d, 123.0]])
    adv = torch.tensor([1.0, -1.0, -1.0, 0.0])
    mask = torch.tensor([[True, True], [True, True], [True, True], [True, False]])
    return lp, glp, adv, mask


def test_divergence_statistic_by_hand() -> None:
    lp, glp, _, mask = filter_example()
    # K ~ 94.4: an fp32 ulp there is ~8e-6, so 1e-4 is a few ulps of exp/log rounding.
    divergence = sequence_divergence(logprobs=lp, sampler_logprobs=glp, mask=mask)
    close(divergence, [K, K, 0.0, K], atol=1e-4)
    close(
        sequence_divergence(logprobs=lp, sampler_logprobs=glp, mask=mask, norm="padded"),
        [K, K, 0.0, K / 2],
        atol=1e-4,
    )


def test_filter_sequences_rule() -> None:
    adv = torch.tensor([1.0, -1.0, -1.0, 0.0, -1.0])
    div = torch.tensor([60.0, 60.0, 10.0, 60.0, 50.0])
    # A <= 0 and D > g (strict): the last one sits exactly at g and is kept.
    expected = torch.tensor([False, True, False, True, False])
    assert torch.equal(filter_sequences(advantages=adv, divergence=div, threshold=50.0), expected)


def test_f_tis_zero_mode_by_hand() -> None:
    lp, glp, adv, mask = filter_example()
    loss, metrics = policy_loss(lp, glp, adv, mask, method="f-tis")
    # rho = exp(lp - glp) = 1/100 where d = log 100, so the TIS weight is 0.01.
    # seq 0: -0.01 * 1 per token -> -0.01;  seq 1: filtered -> 0;  seq 2: -1 * -1 -> 1;
    # seq 3: A = 0 -> 0.  N = 4 (filtered ones still count):  L = (-0.01 + 1) / 4.
    close(loss, 0.99 / 4)
    close(metrics["filtered_frac"], 2 / 4)  # seq 1 and seq 3 (A = 0 <= 0, D = K > 50)
    close(metrics["kept_sequences"], 2.0)
    close(metrics["filter_stat_mean"], 3 * K / 4, atol=1e-4)
    loss.backward()
    # Filtered seq 1 gets no gradient; seq 0: -0.01 * 1 / (2 * 4); seq 2: -1 * -1 / (2 * 4).
    close(lp.grad, [[-0.01 / 8, -0.01 / 8], [0.0, 0.0], [1 / 8, 1 / 8], [0.0, 0.0]])
    # Without the filter seq 1 adds -0.01 * -1 = +0.01:  L = (-0.01 + 0.01 + 1) / 4.
    unfiltered, m = policy_loss(lp, glp, adv, mask, method="tis")
    close(unfiltered, 1 / 4)
    close(m["filtered_frac"], 0.0)


def test_filter_alternative_readings_by_hand() -> None:
    lp, glp, adv, mask = filter_example()
    # "drop": seq 1 and seq 3 leave N, so N = 2:  L = (-0.01 + 1) / 2.
    loss, _ = policy_loss(lp, glp, adv, mask, method="f-tis", filter_mode="drop")
    close(loss, 0.99 / 2)
    # "padded": seq 3's D = K/2 < 50 so only seq 1 is filtered.
    loss, metrics = policy_loss(lp, glp, adv, mask, method="f-tis", filter_stat_norm="padded")
    close(loss, 0.99 / 4)
    close(metrics["filtered_frac"], 1 / 4)
    # Both: N = 3.
    loss, _ = policy_loss(
        lp, glp, adv, mask, method="f-tis", filter_stat_norm="padded", filter_mode="drop"
    )
    close(loss, 0.99 / 3)
    # The authors' g = 5 changes nothing here: every divergent sequence is far above it.
    loss, _ = policy_loss(lp, glp, adv, mask, method="f-tis", filter_threshold=5.0)
    close(loss, 0.99 / 4)


# ---------------------------------------------------------------------------------------------
# Invariances
# ---------------------------------------------------------------------------------------------
def random_batch(
    seed: int, n: int = 6, t: int = 5, spread: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(n, t, generator=gen) * 3).requires_grad_()
    glp = lp.detach() + spread * torch.randn(n, t, generator=gen)
    adv = torch.randn(n, generator=gen)
    lengths = torch.randint(0, t + 1, (n,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return lp, glp, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_own_samples_all_methods_agree(seed: int) -> None:
    """F-TIS on the receiver's own samples is GRPO, TIS and NoIS (value and gradient)."""
    lp, _, adv, mask = random_batch(seed)
    glp = lp.detach().clone()
    ref_loss, ref_metrics = policy_loss(lp, glp, adv, mask, method="grpo")
    (ref_grad,) = torch.autograd.grad(ref_loss, lp)
    # Own samples: every ratio is exactly 1 and every D_i exactly 0.
    close(ref_metrics["is_weight_max"], 1.0 if mask.any() else 0.0)
    close(ref_metrics["filter_stat_mean"], 0.0)
    for method in LOSS_METHODS:
        loss, metrics = policy_loss(lp, glp, adv, mask, method=method)
        (grad,) = torch.autograd.grad(loss, lp)
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(grad, ref_grad)
        close(metrics["filtered_frac"], 0.0)


@pytest.mark.parametrize("method", ["f-tis", "vis", "nois"])
@pytest.mark.parametrize("filter_mode", ["zero", "drop"])
def test_micro_batches_with_global_count_equal_full_batch(method: str, filter_mode: str) -> None:
    # spread 8 makes several sequences divergent enough to be filtered at g = 5.
    lp, glp, adv, mask = random_batch(seed=3, n=7, spread=8.0)
    kwargs = {"method": method, "filter_threshold": 5.0, "filter_mode": filter_mode}
    full, _ = policy_loss(lp, glp, adv, mask, **kwargs)
    (full_grad,) = torch.autograd.grad(full, lp)

    n_global = 7
    if filter_mode == "drop" and method.startswith("f-"):
        divergence = sequence_divergence(logprobs=lp, sampler_logprobs=glp, mask=mask)
        filtered = filter_sequences(advantages=adv, divergence=divergence, threshold=5.0)
        assert 0 < int(filtered.sum()) < 7, "the example should filter some but not all"
        n_global = 7 - int(filtered.sum())
    total = torch.zeros(())
    for idx in (slice(0, 2), slice(2, 5), slice(5, 7)):
        part, _ = policy_loss(
            lp[idx], glp[idx], adv[idx], mask[idx], num_sequences=n_global, **kwargs
        )
        total = total + part
    (split_grad,) = torch.autograd.grad(total, lp)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(split_grad, full_grad)


# ---------------------------------------------------------------------------------------------
# filter_mode="drop" with micro-batches (docs/math.md §5). The caller only learns the global count
# of kept sequences after every micro-batch ran, so each micro-batch divides by the batch's total
# N, reports metrics["kept_sequences"], and the caller rescales the accumulated gradient.
# ---------------------------------------------------------------------------------------------
def split(n: int, parts: int) -> list[slice]:
    """``parts`` contiguous micro-batches of a batch of n sequences (sizes differ by at most 1)."""
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def accumulate_drop_mode(
    lp: torch.Tensor,
    glp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    parts: int,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the training update does: one forward/backward per micro-batch with the batch's
    total N, then the accumulated gradient and loss times ``drop_mode_grad_scale``."""
    n = lp.shape[0]
    lp.grad = None
    loss_sum, kept_total = torch.zeros(()), 0.0
    for idx in split(n, parts):
        loss, metrics = policy_loss(
            lp[idx], glp[idx], adv[idx], mask[idx], filter_mode="drop", num_sequences=n, **kwargs
        )
        loss.backward()  # gradients accumulate in lp.grad, as in parameters' .grad
        loss_sum = loss_sum + loss.detach()
        kept_total += float(metrics["kept_sequences"])
    scale = drop_mode_grad_scale(n, kept_total)
    assert lp.grad is not None
    grad = lp.grad * scale
    lp.grad = None
    return loss_sum * scale, grad


def test_drop_mode_micro_batches_by_hand() -> None:
    lp, glp, adv, mask = filter_example()
    # Two micro-batches {0, 1} and {2, 3}, each divided by the total N = 4:
    #   first: seq 0 -> -0.01, seq 1 dropped;  loss -0.01 / 4, kept 1
    #   second: seq 2 -> 1, seq 3 dropped;     loss 1 / 4,     kept 1
    # kept_total = 2, scale = 4 / 2 = 2:  L = (0.99 / 4) * 2 = 0.99 / 2, the full-batch "drop"
    # loss of test_filter_alternative_readings_by_hand.
    loss, grad = accumulate_drop_mode(lp, glp, adv, mask, parts=2, method="f-tis")
    close(loss, 0.99 / 2)
    # Gradient: seq 0 -0.01 * 1 / (2 tokens * 2 kept), seq 2 -1 * -1 / (2 * 2); dropped ones 0.
    close(grad, [[-0.01 / 4, -0.01 / 4], [0.0, 0.0], [1 / 4, 1 / 4], [0.0, 0.0]])
    assert drop_mode_grad_scale(4, 2) == 2.0
    assert drop_mode_grad_scale(4, 4) == 1.0  # nothing dropped: the total N was right
    assert drop_mode_grad_scale(0, 0) == 1.0  # empty batch


@pytest.mark.parametrize("method", ["f-tis", "f-vis", "f-nois", "tis"])
def test_drop_mode_gradient_does_not_depend_on_the_split(method: str) -> None:
    lp, glp, adv, mask = random_batch(seed=3, n=8, spread=8.0)
    kwargs = {"method": method, "filter_threshold": 5.0}
    # Reference: one call over the whole batch, N = the batch's kept count.
    full, _ = policy_loss(lp, glp, adv, mask, filter_mode="drop", **kwargs)
    (full_grad,) = torch.autograd.grad(full, lp)
    if method.startswith("f-"):
        divergence = sequence_divergence(logprobs=lp, sampler_logprobs=glp, mask=mask)
        kept = ~filter_sequences(advantages=adv, divergence=divergence, threshold=5.0)
        assert 0 < int(kept.sum()) < 8, "the example should filter some but not all"
    for parts in (1, 2, 4):
        loss, grad = accumulate_drop_mode(lp, glp, adv, mask, parts=parts, **kwargs)
        torch.testing.assert_close(loss, full)
        torch.testing.assert_close(grad, full_grad)


def test_drop_mode_without_a_global_count_depends_on_the_split() -> None:
    """Why the contract above exists: with each micro-batch normalised by its own kept count
    (num_sequences=None, the authors' per-micro-batch code), the accumulated gradient is a sum
    of micro-batch means and grows with the number of micro-batches."""
    lp, glp, adv, mask = random_batch(seed=3, n=8, spread=8.0)
    grads = []
    for parts in (1, 2, 4):
        lp.grad = None
        for idx in split(8, parts):
            loss, _ = policy_loss(
                lp[idx],
                glp[idx],
                adv[idx],
                mask[idx],
                method="f-tis",
                filter_threshold=5.0,
                filter_mode="drop",
            )
            loss.backward()
        assert lp.grad is not None
        grads.append(lp.grad.clone())
    lp.grad = None
    norms = [float(g.norm()) for g in grads]
    assert norms[0] < norms[1] < norms[2], norms  # here about 1 : 2 : 4
    # By hand on the filter example: micro-batches {0, 1} and {2, 3} each keep one sequence,
    # so each is divided by 1: L = -0.01 + 1 = 0.99, twice the batch's 0.99 / 2.
    lp4, glp4, adv4, mask4 = filter_example()
    parts = [
        policy_loss(lp4[i], glp4[i], adv4[i], mask4[i], method="f-tis", filter_mode="drop")[0]
        for i in (slice(0, 2), slice(2, 4))
    ]
    close(sum(parts), 0.99)


# ---------------------------------------------------------------------------------------------
# filter_stat_norm="padded" with micro-batches (docs/math.md §5): D_i divides by the whole batch's
# padded width, passed as padded_width, not by the micro-batch's trimmed width.
# ---------------------------------------------------------------------------------------------
def test_padded_width_by_hand() -> None:
    lp, glp, _, mask = filter_example()
    # seq 3 has one token with k = K. Alone in a micro-batch trimmed to width 1, T = 1 gives
    # D = K > 50; with the batch's padded width 2 it is K / 2 ~ 47.2 < 50, as in the full batch.
    alone = {"logprobs": lp[3:, :1], "sampler_logprobs": glp[3:, :1], "mask": mask[3:, :1]}
    close(sequence_divergence(norm="padded", **alone), [K], atol=1e-4)
    close(sequence_divergence(norm="padded", padded_width=2, **alone), [K / 2], atol=1e-4)
    close(sequence_divergence(norm="padded", padded_width=8, **alone), [K / 8], atol=1e-4)
    # Ignored by the default norm: D = mean over the sequence's own token.
    close(sequence_divergence(norm="sequence", padded_width=8, **alone), [K], atol=1e-4)


def test_padded_filter_decision_does_not_depend_on_the_micro_batch() -> None:
    # Lengths 1..8 in a batch of padded width 8; every token has d = glp - lp ~ 1.6, so
    # k ~ e^1.6 - 1.6 - 1 ~ 2.35 and D_i ~ 2.35 * len_i / width. With g = 1 and the batch's
    # width 8 the sequences of length >= 4 are filtered; a micro-batch trimmed to width 4 or
    # less would filter every sequence of length >= 2 instead.
    gen = torch.Generator().manual_seed(11)
    n, width = 8, 8
    lp = (-torch.rand(n, width, generator=gen) * 3).requires_grad_()
    glp = lp.detach() + 1.6 + 0.1 * torch.randn(n, width, generator=gen)
    adv = -torch.rand(n, generator=gen)  # all <= 0: every sequence is a filter candidate
    lengths = torch.arange(1, n + 1)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    g = 1.0
    kwargs = {"method": "f-tis", "filter_threshold": g, "filter_stat_norm": "padded"}

    divergence = sequence_divergence(logprobs=lp, sampler_logprobs=glp, mask=mask, norm="padded")
    expected = filter_sequences(advantages=adv, divergence=divergence, threshold=g)
    assert 0 < int(expected.sum()) < n, "the example should filter some but not all"
    full, _ = policy_loss(lp, glp, adv, mask, **kwargs)
    (full_grad,) = torch.autograd.grad(full, lp)

    for parts in (2, 4, 8):
        lp.grad = None
        total = torch.zeros(())
        trimmed_decisions = []
        for idx in split(n, parts):
            t = int(lengths[idx].max())  # the micro-batch trimmed to its longest sequence
            part = (lp[idx, :t], glp[idx, :t], adv[idx], mask[idx, :t])
            loss, metrics = policy_loss(*part, num_sequences=n, padded_width=width, **kwargs)
            loss.backward()
            total = total + loss.detach()
            # The micro-batch keeps what the full batch keeps of it (with parts = n, one
            # sequence per micro-batch: each sequence's own decision).
            assert metrics["kept_sequences"] == float((~expected[idx]).sum())
            _, trimmed = policy_loss(*part, num_sequences=n, **kwargs)  # T = trimmed width
            trimmed_decisions.append(trimmed["kept_sequences"])
        torch.testing.assert_close(total, full.detach())
        assert lp.grad is not None
        torch.testing.assert_close(lp.grad, full_grad)
        # Without padded_width, short sequences in narrow micro-batches get larger D_i and more
        # of them are filtered: the decision depends on the split.
        assert float(sum(trimmed_decisions)) < n - int(expected.sum())
    lp.grad = None


@pytest.mark.parametrize("method", sorted(LOSS_METHODS))
def test_empty_mask_rows_give_zero_and_finite_grads(method: str) -> None:
    garbage = [float("nan"), float("inf"), -float("inf")]
    lp = torch.tensor([[-1.0, -1.0, -1.0], garbage], requires_grad=True)
    glp = torch.tensor([[-1.0, -1.0, -1.0], [-float("inf"), float("nan"), 5.0]])
    adv = torch.tensor([0.5, -3.0])
    mask = torch.tensor([[True, True, True], [False, False, False]])
    loss, metrics = policy_loss(lp, glp, adv, mask, method=method)
    # Row 0 is on-policy: -A = -0.5; row 1 contributes 0 but counts: L = -0.5 / 2.
    close(loss, -0.25)
    (grad,) = torch.autograd.grad(loss, lp)
    close(grad, [[-0.5 / 6] * 3, [0.0] * 3])
    assert all(torch.isfinite(v) for v in metrics.values())

    all_empty = torch.zeros(2, 3, dtype=torch.bool)
    loss, metrics = policy_loss(lp, glp, adv, all_empty, method=method)
    assert torch.equal(loss.detach(), torch.zeros(()))
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.equal(grad, torch.zeros(2, 3))
    # Empty sequences have D = 0, so none is filtered: both are kept (and contribute 0).
    assert torch.equal(metrics.pop("kept_sequences"), torch.tensor(2.0))
    assert all(torch.equal(v, torch.zeros(())) for v in metrics.values())


def test_empty_batch() -> None:
    lp = torch.zeros(0, 4, requires_grad=True)
    loss, metrics = policy_loss(lp, torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, 4).bool())
    assert torch.equal(loss.detach(), torch.zeros(()))
    assert all(torch.equal(v, torch.zeros(())) for v in metrics.values())


@pytest.mark.parametrize("method", sorted(LOSS_METHODS))
def test_extreme_log_ratios_stay_finite(method: str) -> None:
    lp = torch.tensor([[-1.0, -1.0e4], [-1.0e4, -1.0]], requires_grad=True)
    glp = torch.tensor([[-1.0e4, -1.0], [-1.0, -1.0e4]])  # log-ratios +-1e4
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, metrics = policy_loss(lp, glp, adv, mask, method=method)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss)
    assert torch.isfinite(grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    if method == "tis":
        # Each row has one token at ratio ~e^{1e4} (weight capped at C = 2) and one at ~0:
        # row 0: -(2 + 0) * 1 / 2 = -1;  row 1: -(0 + 2) * -1 / 2 = 1;  L = 0.
        close(loss, 0.0)
        close(grad, [[-2 / 4, 0.0], [0.0, 2 / 4]], atol=1e-6)
    if method.startswith("f-"):
        # Row 1 (A = -1) has D ~ 1e4 / 2 >> 50: filtered. Row 0 has A > 0: kept.
        close(metrics["filtered_frac"], 0.5)


def test_low_precision_inputs_compute_in_fp32() -> None:
    lp, glp, adv, mask = random_batch(seed=4)
    loss32, _ = policy_loss(lp.detach().bfloat16().float(), glp.bfloat16().float(), adv, mask)
    loss16, metrics = policy_loss(lp.detach().bfloat16(), glp.bfloat16(), adv, mask)
    assert loss16.dtype == torch.float32
    assert metrics["is_weight_mean"].dtype == torch.float32
    torch.testing.assert_close(loss16, loss32)


@pytest.mark.parametrize("method", sorted(LOSS_METHODS))
def test_metrics_are_detached_scalars(method: str) -> None:
    lp, glp, adv, mask = random_batch(seed=5)
    _, metrics = policy_loss(lp, glp, adv, mask, method=method)
    extra = {"peer_frac", "peer_clipped_frac"} if method == "hacpo" else set()
    assert set(metrics) == METRIC_NAMES | extra
    for name, value in metrics.items():
        assert value.ndim == 0, name
        assert not value.requires_grad, name


def test_invalid_inputs_raise() -> None:
    lp, glp, adv, mask = hand_example()
    with pytest.raises(ValueError, match="bool"):
        policy_loss(lp, glp, adv, mask.float())
    with pytest.raises(ValueError, match="sampler_logprobs"):
        policy_loss(lp, glp[:, :2], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, glp, adv[:, None], mask)
    with pytest.raises(ValueError, match="is_cap"):
        policy_loss(lp, glp, adv, mask, is_cap=0.0)
    with pytest.raises(ValueError, match="clip_eps"):
        policy_loss(lp, glp, adv, mask, clip_eps=1.5)
    with pytest.raises(ValueError, match="filter_mode"):
        policy_loss(lp, glp, adv, mask, filter_mode="skip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="filter_stat_norm"):
        policy_loss(lp, glp, adv, mask, filter_stat_norm="group")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_sequences"):
        policy_loss(lp, glp, adv, mask, num_sequences=1)  # fewer than the 2 local sequences
    with pytest.raises(ValueError, match="padded_width"):
        policy_loss(lp, glp, adv, mask, filter_stat_norm="padded", padded_width=0)
    with pytest.raises(ValueError, match="padded_width"):
        sequence_divergence(logprobs=lp, sampler_logprobs=glp, mask=mask, padded_width=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kept_total"):
        drop_mode_grad_scale(4, 5)  # more kept than there are sequences
    with pytest.raises(ValueError, match="kept_total"):
        drop_mode_grad_scale(4, 1.5)
    with pytest.raises(ValueError, match="num_sequences"):
        drop_mode_grad_scale(-1, 0)


# ---------------------------------------------------------------------------------------------
# Properties over random inputs
# ---------------------------------------------------------------------------------------------
batches = st.builds(
    random_batch,
    seed=st.integers(0, 2**16),
    n=st.integers(1, 5),
    t=st.integers(1, 4),
    spread=st.sampled_from([0.5, 4.0, 12.0]),
)


@settings(max_examples=40, deadline=None)
@given(batch=batches, threshold=st.sampled_from([0.5, 5.0, 50.0]))
def test_filter_only_drops_negative_advantage_divergent_sequences(
    batch: tuple[torch.Tensor, ...], threshold: float
) -> None:
    lp, glp, adv, mask = batch
    # The filter, re-derived one sequence at a time from the definition.
    expected_adv = adv.clone()
    for i in range(adv.shape[0]):
        n_tokens = int(mask[i].sum())
        d = (glp[i] - lp[i].detach())[mask[i]].double()
        div = float((d.exp() - d - 1).sum()) / n_tokens if n_tokens else 0.0
        if adv[i] <= 0 and div > threshold * (1 + 1e-4):  # margin for fp32 vs fp64
            expected_adv[i] = 0.0
        elif adv[i] <= 0 and div > threshold * (1 - 1e-4):
            return  # too close to the threshold to call; skip this example
    filtered_loss, _ = policy_loss(lp, glp, adv, mask, method="f-tis", filter_threshold=threshold)
    manual_loss, _ = policy_loss(lp, glp, expected_adv, mask, method="tis")
    torch.testing.assert_close(filtered_loss, manual_loss)


@settings(max_examples=40, deadline=None)
@given(batch=batches, cap=st.sampled_from([0.5, 2.0, 10.0]))
def test_tis_gradient_matches_formula(batch: tuple[torch.Tensor, ...], cap: float) -> None:
    lp, glp, adv, mask = batch
    loss, _ = policy_loss(lp, glp, adv, mask, method="tis", is_cap=cap)
    (grad,) = torch.autograd.grad(loss, lp)
    # dL/dlp[i,t] = -min(exp(lp - glp), C) * A_i * mask[i,t] / (|a_i| N)
    weight = torch.exp(lp.detach() - glp).clamp(max=cap)
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
    expected = -weight * adv[:, None] * mask / (lengths * lp.shape[0])
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# The dual clip on peers' samples (docs/math.md §3.5).
# ---------------------------------------------------------------------------------------------
def dual_clip_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # one token per row, rho = (5, 2, 5, 0.5), A = (-1, -1, +1, -1); rows 0-2 a peer's,
    # row 3 the receiver's own with rho 5 too (row 3 is checked in the next test).
    lp = torch.tensor([[-1.0], [-1.0], [-1.0], [-1.0]], requires_grad=True)
    glp = torch.tensor([[-1.0 - math.log(5)], [-1.0 - math.log(2)], [-1.0 - math.log(5)], [0.0]])
    glp[3, 0] = -1.0 - math.log(5)
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    return lp, glp, adv, torch.ones(4, 1, dtype=torch.bool)


@pytest.mark.parametrize("method", ["vis", "f-vis", "grpo", "gspo"])
def test_dual_clip_bounds_a_peers_negative_advantage_term_by_hand(method: str) -> None:
    # c = 3. Row 0 (peer, rho 5, A -1): PPO's min is 5 x -1 = -5 (weight 5); dual clip
    # max(-5, 3 x -1) = -3: term +3, constant. Row 1 (peer, rho 2 < c): -min(-2, -1.2) = 2, its
    # gradient weight 2 (unchanged). Row 2 (peer, A +1, rho 5): PPO's clip, -(1 + eps) = -1.2,
    # constant (never dual-clipped). Row 3 (own, rho 5, A -1): the published term 5, weight 5.
    # (gspo: eps_high 4e-4, so row 2 is -(1 + 4e-4).) Loss = mean over N = 4 rows.
    lp, glp, adv, mask = dual_clip_example()
    own = torch.tensor([False, False, False, True])
    loss, metrics = policy_loss(lp, glp, adv, mask, method=method, own=own)
    upper = 1.0004 if method == "gspo" else 1.2
    close(loss, (3.0 + 2.0 - upper + 5.0) / 4, atol=1e-5)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0], [2.0], [0.0], [5.0]]) / 4)
    # clip_frac counts rows 0 (dual) and 2 (PPO's clip); gspo's counts every sequence whose
    # ratio is outside its (narrow) range, here all four
    close(metrics["clip_frac"], 1.0 if method == "gspo" else 0.5)
    # c = inf: the published term on every row
    lp.grad = None
    loss, _ = policy_loss(lp, glp, adv, mask, method=method, own=own, peer_dual_clip=math.inf)
    close(loss, (5.0 + 2.0 - upper + 5.0) / 4, atol=1e-5)


@pytest.mark.parametrize("method", ["vis", "f-vis", "reco", "f-reco", "gspo", "hacpo"])
def test_dual_clip_leaves_own_rows_bit_for_bit(method: str) -> None:
    # Own rows (own True, or own None: all own) give the same value and gradient, bit for bit,
    # with the dual clip at its default, off (inf) or tight (1.01).
    lp, glp, adv, mask = dual_clip_example()
    results = []
    for own, c in (
        (None, 3.0),
        (torch.ones(4, dtype=torch.bool), 3.0),
        (torch.ones(4, dtype=torch.bool), 1.01),
        (None, math.inf),
    ):
        x = lp.detach().clone().requires_grad_(True)
        loss, _ = policy_loss(x, glp, adv, mask, method=method, own=own, peer_dual_clip=c)
        loss.backward()
        results.append((loss.detach(), x.grad))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])


def test_reco_dual_clips_its_ratio_on_peers_rows() -> None:
    # ReCo's variance ratio r = p(1-p) / (p0(1-p0)) for a peer's token with p = e^-1 and a
    # forged p0 = e^-20.5 is ~1.5e8; A < 0 and the direction rule leave it unclipped (the step
    # lowers p < 1/2, moving r back toward 1). The dual clip makes the term the constant c|A|.
    lp = torch.tensor([[-1.0]], requires_grad=True)
    glp = torch.tensor([[-20.5]])
    args = (lp, glp, torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool))
    loss, _ = policy_loss(*args, method="reco", own=torch.tensor([False]))
    close(loss, 3.0)
    loss.backward()
    assert lp.grad.item() == 0.0
    loss, _ = policy_loss(*args, method="reco", own=torch.tensor([True]))
    assert loss.item() > 1e7  # own rows: the published term


def test_peer_dual_clip_must_exceed_one() -> None:
    lp, glp, adv, mask = dual_clip_example()
    for c in (1.0, 0.5, float("nan")):
        with pytest.raises(ValueError, match="peer_dual_clip"):
            policy_loss(lp, glp, adv, mask, method="vis", peer_dual_clip=c)
