"""RandOpt and CoRP math (docs/math.md §10): seeded noise, the population's seeds, pooling,
elite selection, CoRP's two-pass merge weights and majority voting.

Pure: tensors, floats and lists in, tensors, floats and lists out; no config, no I/O.

Why plain Python floats for the small vectors (rewards, weights, z-scores): every party of a
collaborative population must derive the same merge weights from the same pooled rewards. A
Python float sum in a fixed order rounds the same way on every machine; a vectorised tensor
reduction may not (its summation order depends on the SIMD width). Only the inner products of
noise vectors with the provisional mean (model-sized) are tensor reductions; the algorithm
adopts one party's merge result so that tiny cross-machine differences there cannot split the
parties (docs/randopt.md, "Agreement").
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator, Sequence

import torch

NOISE_STREAMS = ("independent", "shared")
SEED_RANGE = 2**31 - 1  # member seeds are drawn from [0, SEED_RANGE)

Triple = tuple[int, float, float]  # (seed, sigma, weight): one term weight * sigma * eps(seed)


def seeded_noise(
    seed: int, shapes: Sequence[torch.Size | tuple[int, ...]], *, stream: str = "independent"
) -> Iterator[torch.Tensor]:
    """eps(seed): one standard-normal float32 CPU tensor per shape, in the order given (drawn
    in float64, rounded to float32).

    stream "independent" (default): one CPU generator, seeded once with `seed`, draws the
    tensors one after another, so every tensor gets its own stretch of the stream.
    stream "shared": the generator is reseeded with `seed` before every tensor, as in the RandOpt
    authors' code; tensors of the same shape then receive identical noise.

    The noise depends only on (seed, shapes, stream) and is the same bits on every CPU: each
    tensor is drawn in float64 and rounded to float32. torch's float32 `randn` picks its kernel
    by the CPU's instruction set (the default and AVX2 kernels give different numbers from the
    same generator state, 1569 of 4096 here); its float64 draw does not (docs/math.md §10.1;
    tests/test_randopt.py runs both kernels). The caller fixes the order of the shapes.
    """
    if stream not in NOISE_STREAMS:
        raise ValueError(f"unknown noise stream {stream!r}; choose one of {NOISE_STREAMS}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must lie in [0, 2**63), got {seed}")
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    for shape in shapes:
        if stream == "shared":
            g.manual_seed(seed)
        yield torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(torch.float32)


def combine_noise(
    shapes: Sequence[torch.Size | tuple[int, ...]],
    triples: Sequence[Triple],
    *,
    stream: str = "independent",
) -> list[torch.Tensor]:
    """Delta = sum_j weight_j * sigma_j * eps(seed_j), float32, one tensor per shape.

    Terms are added in list order; each term is a multiply (by the float32 rounding of the
    Python product weight * sigma) followed by an add, two separately rounded operations, never
    a fused multiply-add: the same triples give the same bits everywhere.
    """
    acc = [torch.zeros(tuple(s), dtype=torch.float32) for s in shapes]
    for seed, sigma, weight in triples:
        coef = float(weight) * float(sigma)
        for a, e in zip(acc, seeded_noise(int(seed), shapes, stream=stream), strict=True):
            a.add_(e.mul_(coef))
    return acc


def draw_population(seed: int, size: int, sigmas: Sequence[float]) -> tuple[list[int], list[float]]:
    """(seeds, sigmas) of a population of `size` members: distinct seeds in [0, 2**31 - 1) and
    each member's sigma drawn uniformly from `sigmas` (the RandOpt authors' rule), both from
    Python's Mersenne Twister seeded with `seed`, which is the same on every platform."""
    if size < 1 or not sigmas:
        raise ValueError("a population needs size >= 1 and at least one sigma")
    rng = random.Random(seed)
    seeds = rng.sample(range(SEED_RANGE), size)
    return seeds, [float(sigmas[rng.randrange(len(sigmas))]) for _ in range(size)]


def pool(values: Sequence[Sequence[float]], counts: Sequence[int]) -> list[float]:
    """Pooled rewards: sum_r n_r * v_r / sum_r n_r per column, over the rows given (one per
    party, in rank order), accumulated left to right in Python floats. counts[r] = n_r > 0 is
    how many problems party r's values average over, so the pooled value is the mean over
    every problem of every party."""
    if not values:
        raise ValueError("nothing to pool")
    if len(values) != len(counts) or any(n <= 0 for n in counts):
        raise ValueError("need one positive count per row")
    width = len(values[0])
    if any(len(v) != width for v in values):
        raise ValueError("rows to pool must have the same length")
    total = float(sum(counts))
    out = []
    for j in range(width):
        s = 0.0
        for row, n in zip(values, counts, strict=True):
            s += n * float(row[j])
        out.append(s / total)
    return out


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of `values` with linear interpolation between order statistics (numpy's
    default rule): q = 0 is the minimum, q = 1 the maximum."""
    if not values:
        raise ValueError("quantile of nothing")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must lie in [0, 1], got {q}")
    xs = sorted(float(v) for v in values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def elite(rewards: Sequence[float], q: float) -> list[int]:
    """Indices (ascending) of the elite tail: every member whose reward is >= the q-quantile of
    the rewards. Ties at the threshold are all in; the best member always is."""
    threshold = quantile(rewards, q)
    return [i for i, r in enumerate(rewards) if float(r) >= threshold]


def softmax(logits: Sequence[float]) -> list[float]:
    """softmax in Python floats (max subtracted first)."""
    if not logits:
        raise ValueError("softmax of nothing")
    top = max(logits)
    ex = [math.exp(x - top) for x in logits]
    total = sum(ex)
    return [e / total for e in ex]


def zscores(values: Sequence[float]) -> list[float]:
    """(x - mean) / std with the population std; all zeros when the values (nearly) agree, so a
    constant statistic never reweights anything."""
    n = len(values)
    if n == 0:
        return []
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n
    std = math.sqrt(var)
    if std <= 1e-12 * max(1.0, abs(mean)):
        return [0.0] * n
    return [(v - mean) / std for v in values]


def _dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """sum over tensors of <a_t, b_t>, accumulated across tensors in Python floats."""
    return sum(float(torch.dot(x.reshape(-1), y.reshape(-1))) for x, y in zip(a, b, strict=True))


def corp_weights(
    rewards: Sequence[float],
    seeds: Sequence[int],
    sigmas: Sequence[float],
    shapes: Sequence[torch.Size | tuple[int, ...]],
    *,
    beta: float,
    compatibility: float = 1.0,
    leave_one_out: bool = False,
    stream: str = "independent",
) -> tuple[list[float], list[float], dict[str, float]]:
    """CoRP stage 1's two passes over the elite members given (docs/math.md §10.3).

    rewards, seeds, sigmas: one entry per elite member; u_i = sigma_i * eps(seed_i).
    Pass 1: w1 = softmax(beta * R); provisional mean m = sum_i w1_i u_i.
    Pass 2: alignment a_i = cos(u_i, m) and dispersion d_i = ||u_i - m|| (with m minus member
    i's own term when `leave_one_out`), compatibility c_i = z(a)_i - z(d)_i over the elite, and
    w2 = softmax(beta * R + compatibility * c), i.e. w1 reweighted by exp(compatibility * c).

    Returns (w1, w2, stats): stats has the mean alignment and dispersion and ||m||.
    """
    k = len(rewards)
    if not (k == len(seeds) == len(sigmas)) or k == 0:
        raise ValueError("rewards, seeds and sigmas need one entry per elite member")
    w1 = softmax([beta * float(r) for r in rewards])
    if k == 1:
        return w1, [1.0], {"alignment": 1.0, "dispersion": 0.0, "mean_norm": float(sigmas[0])}
    m = combine_noise(shapes, list(zip(seeds, sigmas, w1, strict=True)), stream=stream)
    mm = _dot(m, m)
    align, disp = [], []
    for i, (seed, sigma) in enumerate(zip(seeds, sigmas, strict=True)):
        eps = list(seeded_noise(int(seed), shapes, stream=stream))
        ee = _dot(eps, eps)
        uu = sigma * sigma * ee  # ||u_i||^2
        um = sigma * _dot(eps, m)  # <u_i, m>
        mn = mm
        if leave_one_out:  # m_-i = m - w1_i u_i
            um, mn = um - w1[i] * uu, mm - 2 * w1[i] * um + w1[i] ** 2 * uu
        mn = max(mn, 0.0)
        denom = math.sqrt(uu) * math.sqrt(mn)
        align.append(um / denom if denom > 0 else 0.0)
        disp.append(math.sqrt(max(uu - 2 * um + mn, 0.0)))
    c = [za - zd for za, zd in zip(zscores(align), zscores(disp), strict=True)]
    w2 = softmax([beta * float(r) + compatibility * ci for r, ci in zip(rewards, c, strict=True)])
    stats = {
        "alignment": sum(align) / k,
        "dispersion": sum(disp) / k,
        "mean_norm": math.sqrt(max(mm, 0.0)),
    }
    return w1, w2, stats


def rank_members(rewards: Sequence[float | None]) -> list[int]:
    """Member indices by reward, best first; ties by index; unscored members (None) left out."""
    scored = [(i, float(r)) for i, r in enumerate(rewards) if r is not None]
    return [i for i, _ in sorted(scored, key=lambda t: (-t[1], t[0]))]


def majority_vote(answers: Sequence[Sequence[str | None]]) -> list[int | None]:
    """Top-K majority vote. answers[k][j] is the answer of the k-th best member to problem j
    (None: it gave none). For each problem, the index k of the best-ranked member whose answer
    won: the most frequent answer among those given; a tie goes to the tied answer given by the
    best-ranked member (the RandOpt authors' Counter order). None when no member answered."""
    if not answers:
        return []
    n = len(answers[0])
    if any(len(a) != n for a in answers):
        raise ValueError("every member needs an answer slot for every problem")
    out: list[int | None] = []
    for j in range(n):
        given = [(k, a[j]) for k, a in enumerate(answers) if a[j] is not None]
        if not given:
            out.append(None)
            continue
        winner, _ = Counter(a for _, a in given).most_common(1)[0]
        out.append(next(k for k, a in given if a == winner))
    return out
