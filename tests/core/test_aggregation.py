"""Tests for ftis.core.aggregation (docs/math.md §9): every expected value is derived by hand in
the test. The functions compute in float64 on a handful of numbers, so 1e-12 absolute is a few
ulps of headroom; every wrong alternative the tests tell apart differs by more than 1e-3.
Deltas are float32: 1e-6 there.
"""

from __future__ import annotations

import math

import pytest
import torch

from ftis.core.aggregation import (
    GAIN_EPS,
    apply_delta,
    clipped_positive_weights,
    combine_deltas,
    delta_norm,
    fedavg_weights,
    floored_gains,
    gain_weights,
    log_ratio_gains,
    mix_weights,
    no_gain_weights,
    performance_weights,
    relative_gains,
    uniform_weights,
    update_baselines,
)

ATOL = 1e-12
NAN = float("nan")


def close(actual: torch.Tensor, expected, atol: float = ATOL) -> None:
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0
    )


# ---- gains ---------------------------------------------------------------------------------


def test_relative_gains_by_hand() -> None:
    """(0.6 - 0.5) / 0.5 = 0.2; (3 - 2) / 2 = 0.5; unset (NaN) -> 0; a negative baseline divides
    by its magnitude: (-1 - -2) / 2 = 0.5; a zero baseline by 1e-8: (0.01 - 0) / 1e-8 = 1e6."""
    g = relative_gains([0.6, 3.0, 0.7, -1.0, 0.01], [0.5, 2.0, NAN, -2.0, 0.0])
    assert g.dtype == torch.float64
    assert GAIN_EPS == 1e-8
    close(g, [0.2, 0.5, 0.0, 0.5, 1e6], atol=1e-6)  # 1e6: the collapse §9.4 bounds


def test_relative_gains_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="finite"):
        relative_gains([NAN], [1.0])
    with pytest.raises(ValueError, match="shape"):
        relative_gains([1.0, 2.0], [1.0])


def test_floored_gains_by_hand() -> None:
    """floor 0.1 (§9.4): 0 -> 1/64 gives (1/64) / 0.1 = 0.15625 (relative_gains: 1.5625e6);
    0.5 -> 0.625 gives 0.125 / 0.5 = 0.25 (above the floor: the plain relative gain); 0.05 ->
    0.04 gives -0.01 / 0.1 = -0.1; -2 -> -1 gives 1 / 2 = 0.5; unset -> 0."""
    g = floored_gains([1 / 64, 0.625, 0.04, -1.0, 0.7], [0.0, 0.5, 0.05, -2.0, NAN], floor=0.1)
    assert g.dtype == torch.float64
    close(g, [0.15625, 0.25, -0.1, 0.5, 0.0])
    # Scale invariance while |B| >= floor: x10 leaves 0.25 and 0.5, and floors nothing else
    close(floored_gains([6.25, -10.0], [5.0, -20.0], floor=0.1), [0.25, 0.5])
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="floor"):
            floored_gains([1.0], [1.0], floor=bad)


def test_no_gain_weights_by_hand() -> None:
    """Some gain > 0: w unchanged. None > 0 (g = (0, -0.5)): fedavg -> n / sum n = (1/4, 3/4),
    skip -> (0, 0), weights -> w unchanged."""
    w = torch.tensor([0.3, 0.7], dtype=torch.float64)
    close(no_gain_weights([0.1, -0.5], w, [8, 24]), [0.3, 0.7])
    close(no_gain_weights([0.0, -0.5], w, [8, 24]), [0.25, 0.75])
    close(no_gain_weights([0.0, -0.5], w, [8, 24], rule="skip"), [0.0, 0.0])
    close(no_gain_weights([0.0, -0.5], w, [8, 24], rule="weights"), [0.3, 0.7])
    with pytest.raises(ValueError, match="no-gain rule"):
        no_gain_weights([0.0], [1.0], [1], rule="nope")  # type: ignore[arg-type]


def test_log_ratio_gains_by_hand() -> None:
    """log(1 / 0.5) = log 2; log(0.25 / 1) = -log 4; unset -> 0; P = 0 uses eps:
    log(1e-8 / 0.5)."""
    g = log_ratio_gains([1.0, 0.25, 0.3, 0.0], [0.5, 1.0, NAN, 0.5])
    close(g, [math.log(2), -math.log(4), 0.0, math.log(1e-8 / 0.5)])


# ---- weights -------------------------------------------------------------------------------


def test_gain_weights_by_hand() -> None:
    """g = (0, log 2): softmax = (1/3, 2/3). With floor 0.1: 0.9 (1/3, 2/3) + 0.05 =
    (0.35, 0.65). Temperature 0.5 doubles the gains: softmax(0, log 4) = (1/5, 4/5)."""
    g = [0.0, math.log(2)]
    close(gain_weights(g), [1 / 3, 2 / 3])
    close(gain_weights(g, floor=0.1), [0.35, 0.65])
    close(gain_weights(g, temperature=0.5), [0.2, 0.8])
    # equal gains -> uniform, whatever the temperature
    close(gain_weights([0.3, 0.3, 0.3, 0.3], temperature=7.0), [0.25] * 4)
    # floor 1 -> uniform
    close(gain_weights([5.0, -5.0], floor=1.0), [0.5, 0.5])


def test_gain_weights_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="temperature"):
        gain_weights([0.0], temperature=0.0)
    with pytest.raises(ValueError, match="floor"):
        gain_weights([0.0], floor=1.5)
    with pytest.raises(ValueError, match="finite"):
        gain_weights([NAN, 0.0])


def test_clipped_positive_weights_by_hand() -> None:
    """max(g, 0) = (0, 1, 3) -> (0, 1/4, 3/4); none positive -> uniform; floor 0.2 on (0, 1/4,
    3/4): 0.8 w + 0.2/3."""
    close(clipped_positive_weights([-1.0, 1.0, 3.0]), [0.0, 0.25, 0.75])
    close(clipped_positive_weights([-1.0, -2.0]), [0.5, 0.5])
    close(
        clipped_positive_weights([-1.0, 1.0, 3.0], floor=0.2),
        [0.2 / 3, 0.8 * 0.25 + 0.2 / 3, 0.8 * 0.75 + 0.2 / 3],
    )


def test_fedavg_uniform_performance_and_mixed_weights() -> None:
    """FedAvg (10, 30) -> (1/4, 3/4); uniform 4 -> 1/4 each; reward-weighted (1, 3) -> (1/4,
    3/4) and negative performance counts as 0; mixing (1, 0) with (0, 1) by 0.25 -> (3/4, 1/4)."""
    close(fedavg_weights([10, 30]), [0.25, 0.75])
    close(uniform_weights(4), [0.25] * 4)
    close(performance_weights([1.0, 3.0]), [0.25, 0.75])
    close(performance_weights([-1.0, 2.0]), [0.0, 1.0])
    close(performance_weights([0.0, 0.0]), [0.5, 0.5])
    close(
        mix_weights(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), 0.25),
        [0.75, 0.25],
    )
    with pytest.raises(ValueError, match="> 0"):
        fedavg_weights([1, 0])


# ---- baselines -----------------------------------------------------------------------------


def test_update_baselines_by_hand() -> None:
    """EMA 0.9: 0.9 * 0.5 + 0.1 * 0.6 = 0.51; unset -> P. Mean with 3 earlier reports:
    0.5 + (0.9 - 0.5) / 4 = 0.6. Best: max."""
    close(update_baselines([0.5, NAN], [0.6, 0.7], rule="ema", momentum=0.9), [0.51, 0.7])
    close(update_baselines([0.5, NAN], [0.9, 0.2], rule="mean", count=[3, 0]), [0.6, 0.2])
    close(update_baselines([0.5, 0.5, NAN], [0.9, 0.1, 0.3], rule="best"), [0.9, 0.5, 0.3])
    with pytest.raises(ValueError, match="count"):
        update_baselines([0.5], [0.6], rule="mean")
    with pytest.raises(ValueError, match="unknown baseline rule"):
        update_baselines([0.5], [0.6], rule="median")  # type: ignore[arg-type]


# ---- the key property ----------------------------------------------------------------------


def _weights_over_rounds(perf_rounds, *, gain, weigh, rule):
    """The weights of every round when K clients report `perf_rounds[r][k]`, with baselines
    kept by `rule` as the server keeps them."""
    k = len(perf_rounds[0])
    base = torch.full((k,), NAN, dtype=torch.float64)
    count = torch.zeros(k, dtype=torch.float64)
    out = []
    for perf in perf_rounds:
        p = torch.tensor(perf, dtype=torch.float64)
        out.append(weigh(gain(p, base), p))
        base = update_baselines(base, p, rule=rule, momentum=0.8, count=count)
        count += 1
    return out


@pytest.mark.parametrize("rule", ["ema", "mean", "best"])
@pytest.mark.parametrize("gain", [relative_gains, log_ratio_gains])
def test_scaling_one_clients_rewards_leaves_every_weight_unchanged(rule, gain) -> None:
    """Client 1's rewards x c (a 0/10 verifier instead of 0/1): its performance values and
    hence its baseline scale by c, its gains do not, so no weight moves, in any round. Weights
    proportional to performance (reward-weighted averaging) do move."""
    rounds = [[0.2, 0.3, 0.5], [0.3, 0.25, 0.55], [0.35, 0.4, 0.5], [0.3, 0.45, 0.6]]
    c = 10.0
    scaled = [[p[0], c * p[1], p[2]] for p in rounds]

    def relative_gain_weights(g, p):
        return gain_weights(g, temperature=0.5, floor=0.1)

    def reward_weighted(g, p):
        return performance_weights(p)

    for weigh in (relative_gain_weights, lambda g, p: clipped_positive_weights(g, floor=0.05)):
        a = _weights_over_rounds(rounds, gain=gain, weigh=weigh, rule=rule)
        b = _weights_over_rounds(scaled, gain=gain, weigh=weigh, rule=rule)
        for wa, wb in zip(a, b, strict=True):
            close(wb, wa, atol=1e-12)
    # The gains do change the weights over the rounds (the property is not vacuous) ...
    a = _weights_over_rounds(rounds, gain=gain, weigh=relative_gain_weights, rule=rule)
    assert float((a[-1] - a[0]).abs().max()) > 1e-3
    # ... and reward-weighted averaging hands the scaled client most of the weight.
    ra = _weights_over_rounds(rounds, gain=gain, weigh=reward_weighted, rule=rule)
    rb = _weights_over_rounds(scaled, gain=gain, weigh=reward_weighted, rule=rule)
    assert float(rb[0][1]) - float(ra[0][1]) > 0.5  # 3 / 7 = 0.43 vs 0.3 / 1.0 = 0.3


def test_fedavg_weights_ignore_performance_entirely() -> None:
    """FedAvg weighs by sample counts alone: a client that improves and one that regresses get
    the same weight; relative-gain weights tell them apart."""
    n = [64, 64]
    close(fedavg_weights(n), [0.5, 0.5])
    g = relative_gains([0.6, 0.4], [0.5, 0.5])  # +20% and -20%
    w = gain_weights(g)
    assert float(w[0]) > 0.59  # softmax(0.2, -0.2) = (0.599, 0.401)
    close(w, [1 / (1 + math.exp(-0.4)), 1 / (1 + math.exp(0.4))])


# ---- deltas --------------------------------------------------------------------------------


def test_combine_and_apply_deltas_by_hand() -> None:
    """0.25 * (1, 2) + 0.75 * (3, 4) = (2.5, 3.5); 0.25 * 1 + 0.75 * -1 = -0.5. theta = (1, 1)
    and 0 plus lr 0.5 times that: (2.25, 2.75) and -0.25."""
    d1 = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[1.0]])}
    d2 = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([[-1.0]])}
    out = combine_deltas([d1, d2], [0.25, 0.75])
    close(out["a"], [2.5, 3.5], atol=1e-6)
    close(out["b"], [[-0.5]], atol=1e-6)
    assert out["a"].dtype == torch.float32
    theta = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([[0.0]])}
    new = apply_delta(theta, out, 0.5)
    close(new["a"], [2.25, 2.75], atol=1e-6)
    close(new["b"], [[-0.25]], atol=1e-6)
    close(theta["a"], [1.0, 1.0], atol=0)  # not modified in place
    assert delta_norm(out) == pytest.approx(math.sqrt(2.5**2 + 3.5**2 + 0.5**2), abs=1e-6)


def test_combine_deltas_rejects_mismatches() -> None:
    d = {"a": torch.zeros(2)}
    with pytest.raises(ValueError, match="lacks or has"):
        combine_deltas([d, {"b": torch.zeros(2)}], [0.5, 0.5])
    with pytest.raises(ValueError, match="shape"):
        combine_deltas([d, {"a": torch.zeros(3)}], [0.5, 0.5])
    with pytest.raises(ValueError, match="weights"):
        combine_deltas([d], [0.5, 0.5])
    with pytest.raises(ValueError, match="differ"):
        apply_delta({"a": torch.zeros(2)}, {"b": torch.zeros(2)})
