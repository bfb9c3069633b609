"""Tests for ftis.core.population (docs/math.md §10): expected values are derived by hand in the
test, or (for the two-pass weights) recomputed here step by step from the definitions in
float64. Python-float results are compared at 1e-12 (a few ulps); float32 noise sums at 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from ftis.core.population import (
    combine_noise,
    corp_weights,
    draw_population,
    elite,
    majority_vote,
    pool,
    quantile,
    rank_members,
    seeded_noise,
    softmax,
    zscores,
)

SHAPES = [(3, 4), (5,), (3, 4)]


# ---- noise -----------------------------------------------------------------------------------


def test_independent_noise_is_one_stream_drawn_tensor_after_tensor():
    """float64 standard normals from one generator, tensor after tensor, rounded to float32."""
    got = list(seeded_noise(7, SHAPES))
    g = torch.Generator().manual_seed(7)
    want = [torch.randn(s, generator=g, dtype=torch.float64).float() for s in SHAPES]
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    assert not torch.equal(got[0], got[2])  # same shape, different stretch of the stream


# sha256 of the noise bytes of seeded_noise(7, NOISE_SHAPES) for each stream, recorded with
# torch 2.13's default and AVX2 kernels (ATEN_CPU_CAPABILITY) on an AMD EPYC (AVX-512): every CPU
# must draw these bits (docs/math.md §10.1); a torch whose float64 normal sampler changes would
# fail here, and every saved direction would then rebuild other weights.
NOISE_SHAPES = [(4096,), (3, 4), (5,), (3, 4)]
NOISE_SHA256 = {
    "independent": "321e3bf968fa0b521c7c713a43c5e412917582c8e5ceaab9c9e6cd90eebd5844",
    "shared": "63baabb99abf1b3aef49ab4a3fd635da20c8d133b97924649c912a91bfab5c7f",
}


@pytest.mark.parametrize("stream", ["independent", "shared"])
def test_noise_is_the_recorded_bits(stream):
    import hashlib

    data = b"".join(e.numpy().tobytes() for e in seeded_noise(7, NOISE_SHAPES, stream=stream))
    assert hashlib.sha256(data).hexdigest() == NOISE_SHA256[stream]


def test_shared_noise_reseeds_for_every_tensor_like_the_authors():
    got = list(seeded_noise(7, SHAPES, stream="shared"))
    assert torch.equal(got[0], got[2])  # same shape, same seed: the same noise
    assert torch.equal(got[0], next(seeded_noise(7, SHAPES)))  # first tensor: both streams agree
    assert torch.equal(got[1], torch.randn(5, generator=torch.Generator().manual_seed(7)))


def test_noise_rejects_bad_seeds_and_streams():
    with pytest.raises(ValueError, match="stream"):
        next(seeded_noise(1, SHAPES, stream="iid"))
    with pytest.raises(ValueError, match="seed"):
        next(seeded_noise(-1, SHAPES))


def test_combine_is_the_weighted_sum_of_sigma_times_noise():
    e1, e2 = list(seeded_noise(1, [(6,)])), list(seeded_noise(2, [(6,)]))
    # (seed, sigma, weight): 0.5 * 2.0 * e1 + 1.0 * (-1.0) * e2 = e1 - e2
    (delta,) = combine_noise([(6,)], [(1, 0.5, 2.0), (2, 1.0, -1.0)])
    torch.testing.assert_close(delta, e1[0] - e2[0], atol=1e-6, rtol=0)
    assert torch.equal(combine_noise([(6,)], [])[0], torch.zeros(6))


def test_population_seeds_are_distinct_reproducible_and_sigmas_from_the_list():
    seeds, sigmas = draw_population(3, 200, [0.1, 0.2])
    assert len(set(seeds)) == 200 and all(0 <= s < 2**31 - 1 for s in seeds)
    assert set(sigmas) == {0.1, 0.2}
    assert (seeds, sigmas) == draw_population(3, 200, [0.1, 0.2])
    assert draw_population(4, 200, [0.1, 0.2])[0] != seeds


# ---- pooling, elite, softmax, z-scores -------------------------------------------------------


def test_pool_weights_each_party_by_its_problem_count():
    # member 0: (1 * 1.0 + 3 * 0.0) / 4 = 0.25; member 1: (1 * 0.0 + 3 * 1.0) / 4 = 0.75
    assert pool([[1.0, 0.0], [0.0, 1.0]], [1, 3]) == pytest.approx([0.25, 0.75], abs=1e-12)
    assert pool([[0.5]], [64]) == [0.5]  # a party alone: its own values
    with pytest.raises(ValueError):
        pool([[1.0]], [0])


def test_quantile_interpolates_linearly_between_order_statistics():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted 1, 2, 3, 4; position q * 3
    assert quantile(xs, 0.0) == 1.0 and quantile(xs, 1.0) == 4.0
    assert quantile(xs, 0.5) == pytest.approx(2.5, abs=1e-12)  # between 2 and 3
    assert quantile(xs, 0.9) == pytest.approx(3.7, abs=1e-12)  # 2.7 -> 3 + 0.7 * (4 - 3)


def test_elite_keeps_every_member_at_or_above_the_quantile():
    # sorted 0.1 0.2 0.5 0.5; q = 0.5 -> position 1.5 -> 0.2 + 0.5 * 0.3 = 0.35
    assert elite([0.1, 0.5, 0.5, 0.2], 0.5) == [1, 2]
    assert elite([0.3, 0.3, 0.3], 0.9) == [0, 1, 2]  # ties at the threshold are all in
    assert elite([0.0, 1.0], 1.0) == [1]  # the best member always is


def test_softmax_and_zscores_by_hand():
    # softmax([0, ln 3]) = [1/4, 3/4]
    assert softmax([0.0, math.log(3.0)]) == pytest.approx([0.25, 0.75], abs=1e-12)
    assert softmax([1000.0, 1000.0]) == [0.5, 0.5]  # max subtracted: no overflow
    # mean 2, population std sqrt(2/3): z = -+sqrt(3/2), 0
    z = zscores([1.0, 2.0, 3.0])
    assert z == pytest.approx([-math.sqrt(1.5), 0.0, math.sqrt(1.5)], abs=1e-12)
    assert zscores([5.0, 5.0]) == [0.0, 0.0]  # a constant statistic reweights nothing


# ---- CoRP's two passes -----------------------------------------------------------------------


def _two_pass_by_definition(rewards, seeds, sigmas, shapes, beta, gamma, loo):
    """Pass 1 and 2 from the definitions, in float64 on flattened vectors."""
    u = [
        sg * torch.cat([e.double().reshape(-1) for e in seeded_noise(s, shapes)])
        for s, sg in zip(seeds, sigmas, strict=True)
    ]
    ex = [math.exp(beta * r) for r in rewards]
    w1 = [e / sum(ex) for e in ex]
    m = sum(w * ui for w, ui in zip(w1, u, strict=True))
    align, disp = [], []
    for i, ui in enumerate(u):
        mi = m - w1[i] * ui if loo else m
        align.append(float(ui @ mi / (ui.norm() * mi.norm())))
        disp.append(float((ui - mi).norm()))

    def z(xs):
        mu = sum(xs) / len(xs)
        sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / len(xs))
        return [(x - mu) / sd for x in xs]

    c = [a - d for a, d in zip(z(align), z(disp), strict=True)]
    ex2 = [math.exp(beta * r + gamma * ci) for r, ci in zip(rewards, c, strict=True)]
    return w1, [e / sum(ex2) for e in ex2]


@pytest.mark.parametrize("loo", [False, True])
def test_two_pass_weights_follow_the_definitions(loo):
    rewards, seeds, sigmas = [0.5, 0.7, 0.6, 0.9], [11, 12, 13, 14], [0.01, 0.02, 0.01, 0.05]
    shapes = [(20, 10), (30,)]
    w1, w2, stats = corp_weights(
        rewards, seeds, sigmas, shapes, beta=5.0, compatibility=0.7, leave_one_out=loo
    )
    e1, e2 = _two_pass_by_definition(rewards, seeds, sigmas, shapes, 5.0, 0.7, loo)
    # float32 noise and inner products against float64 ones: 1e-5 on weights of order 0.25
    assert w1 == pytest.approx(e1, abs=1e-12)
    assert w2 == pytest.approx(e2, abs=1e-5)
    assert sum(w2) == pytest.approx(1.0, abs=1e-12)
    assert stats["mean_norm"] > 0 and -1 <= stats["alignment"] <= 1


def test_two_pass_without_compatibility_is_pass_one_and_one_member_is_everything():
    w1, w2, _ = corp_weights([0.1, 0.3], [1, 2], [0.1, 0.1], [(4,)], beta=2.0, compatibility=0.0)
    assert w2 == pytest.approx(w1, abs=1e-12)
    assert w1 == pytest.approx(softmax([0.2, 0.6]), abs=1e-12)
    assert corp_weights([0.4], [9], [0.1], [(4,)], beta=2.0)[1] == [1.0]


# ---- ranking and the vote --------------------------------------------------------------------


def test_rank_members_best_first_ties_by_index_unscored_left_out():
    assert rank_members([0.2, None, 0.5, 0.2, 0.9]) == [4, 2, 0, 3]


def test_majority_vote_by_hand():
    answers = [  # members best first; problems in columns
        ["1", "2", None, "a"],
        ["3", "2", None, "b"],
        ["3", "4", None, None],
    ]
    # p0: "3" twice (members 1, 2) -> member 1; p1: "2" twice -> member 0; p2: nobody answered;
    # p3: "a" and "b" once each: the tie goes to the best-ranked member's answer
    assert majority_vote(answers) == [1, 0, None, 0]
    assert majority_vote([]) == []
    with pytest.raises(ValueError):
        majority_vote([["1"], []])
