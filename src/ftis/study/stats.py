"""Paired differences with intervals that hold at few seeds, for every study document
(docs/math.md §11).

A study compares method A with method B over seeds: each seed is one run of A and one run of B
(same seed, same problems). What a document prints for a comparison is

    mean over matched seeds of (A - B)   [95% Student-t interval]

at one of two resolutions:

    per-seed scalars       a[s], b[s] (e.g. final accuracy): the t interval over the S per-seed
                           differences, S - 1 degrees of freedom.
    per-problem outcomes   a[s, p], b[s, p] in {0, 1} on the same P problems for every seed
                           (evals.jsonl): each seed's mean over the problems, then the t
                           interval over seeds (conditional on the split's problems); one seed
                           alone: the t interval over its problems (`mean_variance`).

Why not the percentile bootstrap these documents printed before: over 3 seeds it can only
reach the range of the three per-seed differences, and a null comparison excludes zero about 1
time in 4 instead of 1 in 20. `ftis.study.calibration` measures both on null comparisons
(docs/results/calibration.md); `bootstrap_difference` is kept for that comparison only.

The reading may call A better or worse than B only where the interval excludes zero
(`verdict`). Equal generated tokens: `at_equal_tokens` reads B's curve at A's token budget, seed
by seed, by linear interpolation, and refuses to extrapolate (NaN: that seed is not paired).

Generic: no algorithm is imported here. `read_evals` loads a run directory's evals.jsonl.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import t as student_t

from ftis.train.metrics import decode_outcomes, read_metrics

log = logging.getLogger(__name__)

RESAMPLES = 10_000
CONFIDENCE = 0.95
BOOTSTRAP_SEED = 0
NO_DIFFERENCE = "no difference detected at this resolution"
MINUS = "\u2212"  # typographic minus, as in "+1.2 [−0.3, +2.6]"


@dataclass(frozen=True)
class PairedDifference:
    """mean(A - B) over `seeds` matched seeds, with a `confidence` percentile bootstrap interval
    [low, high]. `problems` is P at the per-problem resolution, 0 for per-seed scalars;
    `dropped` counts seeds present in both A and B but left out because a value was NaN (e.g. B
    never reached A's token budget). With no paired seed, every number is NaN."""

    mean: float
    low: float
    high: float
    seeds: int
    problems: int = 0
    dropped: int = 0
    confidence: float = CONFIDENCE

    @property
    def excludes_zero(self) -> bool:
        """True when the whole interval lies on one side of zero (NaN: False)."""
        return bool(self.low > 0 or self.high < 0)

    def cells(self, *, scale: float = 100.0, digits: int = 1) -> str:
        """'+1.2 [−0.3, +2.6]' (x `scale`: 100 prints accuracy points); 'n/a' without seeds."""
        return format_difference(self, scale=scale, digits=digits)

    def verdict(self, *, higher_is_better: bool = True) -> str:
        """'better' / 'worse' (A against B) only where the interval excludes zero."""
        return verdict(self, higher_is_better=higher_is_better)


def _signed(x: float, scale: float, digits: int) -> str:
    v = round(x * scale, digits)
    if v == 0:
        return f"{0.0:.{digits}f}"  # no "+0.0" / "-0.0": zero has no sign
    text = f"{abs(v):.{digits}f}"
    return ("+" if v > 0 else MINUS) + text


def format_difference(d: PairedDifference, *, scale: float = 100.0, digits: int = 1) -> str:
    """A markdown cell: mean and interval, signed, times `scale`, e.g. '+1.2 [−0.3, +2.6]'."""
    if d.seeds == 0 or not math.isfinite(d.mean):
        return "n/a"
    parts = (_signed(x, scale, digits) for x in (d.mean, d.low, d.high))
    mean, low, high = parts
    return f"{mean} [{low}, {high}]"


def verdict(d: PairedDifference, *, higher_is_better: bool = True) -> str:
    """The only words a reading may use for a comparison: 'better' or 'worse' when the interval
    excludes zero, else 'no difference detected at this resolution'."""
    if not d.excludes_zero:
        return NO_DIFFERENCE
    return "better" if (d.low > 0) == higher_is_better else "worse"


# ----------------------------------------------------------------------------- the bootstrap


def _matched(
    a: Mapping[Any, Any], b: Mapping[Any, Any]
) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """Values of the seeds present in both (sorted), less those holding a NaN; the drop count."""
    xs, ys, dropped = [], [], 0
    for seed in sorted(set(a) & set(b)):
        x = np.asarray(a[seed], dtype=np.float64)
        y = np.asarray(b[seed], dtype=np.float64)
        if np.isnan(x).any() or np.isnan(y).any():
            dropped += 1
            continue
        if np.isinf(x).any() or np.isinf(y).any():
            raise ValueError(
                f"seed {seed}: a value is infinite; accuracies and outcomes are finite"
            )
        xs.append(x)
        ys.append(y)
    return xs, ys, dropped


def _difference_table(
    a: Mapping[Any, Any], b: Mapping[Any, Any]
) -> tuple[np.ndarray | None, np.ndarray | None, int, int]:
    """(d (S,) per-seed scalars or None, d (S, P) per-problem or None, problems, dropped)."""
    xs, ys, dropped = _matched(a, b)
    if not xs:
        return None, None, 0, dropped
    ndim = {x.ndim for x in xs + ys}
    if ndim == {0}:
        return np.array([float(x - y) for x, y in zip(xs, ys, strict=True)]), None, 0, dropped
    if ndim == {1}:
        sizes = {x.shape[0] for x in xs + ys}
        if len(sizes) != 1:
            raise ValueError(
                "per-problem outcomes must cover the same problems for every seed of both "
                f"methods; got problem counts {sorted(sizes)}: compare runs evaluated on the "
                "same eval split and eval.size"
            )
        problems = sizes.pop()
        if problems == 0:
            raise ValueError("per-problem outcomes are empty (0 problems)")
        return None, np.stack(xs) - np.stack(ys), problems, dropped
    raise ValueError(
        "each seed's value must be a number (per-seed scalars) or a 1-D array of "
        f"per-problem outcomes, the same kind for every seed; got array dimensions {ndim}"
    )


def _check(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")


def mean_variance(d: np.ndarray) -> tuple[float, float]:
    """(variance of the mean of d, its degrees of freedom): what `paired_difference`'s t
    interval uses (docs/math.md §11).

    d (S,) per-seed differences, or (S, P) per-problem differences with S >= 2: the S per-seed
    means, var / S with S - 1 degrees of freedom. The interval is conditional on the split's
    problems (the held-out problems every seed answers), so a difference that holds on these
    problems and not on others of the task is not its error (`crossed_variance` would count it;
    docs/results/calibration.md shows why documents do not use it). One seed of per-problem
    outcomes: over its problems, var(d_p) / P with P - 1 degrees of freedom. (nan, nan) for
    one seed of scalars or one seed of one problem."""
    if d.ndim == 2 and d.shape[0] == 1:
        p = d.shape[1]
        if p < 2:
            return float("nan"), float("nan")
        return float(d[0].var(ddof=1) / p), float(p - 1)
    by_seed = d.mean(axis=1) if d.ndim == 2 else d
    s = len(by_seed)
    if s < 2:
        return float("nan"), float("nan")
    return float(by_seed.var(ddof=1) / s), float(s - 1)


def crossed_variance(d: np.ndarray) -> tuple[float, float]:
    """(variance, degrees of freedom) of the mean of d (S, P), S >= 2, P >= 2, with seeds and
    problems crossed and the problems taken as a sample of the task's (d_sp = mu + alpha_s +
    beta_p + gamma_sp, variances sa2, sb2, sg2; the mean's variance sa2/S + sb2/P + sg2/(S P)).
    From the two-way mean squares (E[MS_S] = sg2 + P sa2, E[MS_P] = sg2 + S sb2, E[MS_E] = sg2):

        V = MS_S / (S P)  +  max(0, MS_P - MS_E) / (S P)

    with Satterthwaite's degrees of freedom over the mean squares used. Only the calibration
    runs it (docs/results/calibration.md): at 2 seeds the Satterthwaite degrees of freedom it
    adds make it exclude zero too often on real null comparisons."""
    s, p = d.shape
    grand = d.mean()
    by_seed, by_problem = d.mean(axis=1), d.mean(axis=0)
    ms_s = p * float(((by_seed - grand) ** 2).sum()) / (s - 1)
    ms_p = s * float(((by_problem - grand) ** 2).sum()) / (p - 1)
    resid = d - by_seed[:, None] - by_problem[None, :] + grand
    ms_e = float((resid**2).sum()) / ((s - 1) * (p - 1))
    parts = [(ms_s, s - 1)]
    if ms_p > ms_e:  # a problem effect shared by every seed
        parts += [(ms_p, p - 1), (-ms_e, (s - 1) * (p - 1))]
    total = sum(ms for ms, _ in parts)
    if total <= 0:  # every seed and problem alike: the differences are one number
        return 0.0, float(s - 1)
    return total / (s * p), total * total / sum(ms * ms / df for ms, df in parts)


def t_interval(
    mean: float, var: float, df: float, confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """mean -+ t(df) * sqrt(var) at `confidence`; (nan, nan) without a finite variance."""
    if not math.isfinite(var):
        return float("nan"), float("nan")
    half = float(student_t.ppf(0.5 + confidence / 2, df)) * math.sqrt(var) if var > 0 else 0.0
    return mean - half, mean + half


def paired_difference(
    a: Mapping[Any, Any],
    b: Mapping[Any, Any],
    *,
    confidence: float = CONFIDENCE,
) -> PairedDifference:
    """Paired difference A - B, by seed, with a Student-t interval that holds at few seeds.

    a, b: seed -> a float (per-seed scalars), or seed -> a (P,) array of per-problem outcomes
        (the same P problems, in the same order, for every seed of both). Only seeds present in
        both count; a seed with a NaN in either is dropped (counted in `dropped`).

    The point estimate is the mean of d = a - b; the interval is mean +- t * sqrt(V), V and the
    t distribution's degrees of freedom from `mean_variance`: over the per-seed differences
    (per-problem outcomes are averaged over the split's problems first), S - 1 degrees of
    freedom; one seed of per-problem outcomes, over its problems. Its coverage
    at 3, 5 and 8 seeds is measured on null comparisons, simulated and from real runs, by
    `ftis.study.calibration` (docs/results/calibration.md). With one seed of scalars there is no
    interval (low = high = NaN)."""
    _check(confidence)
    d1, d2, problems, dropped = _difference_table(a, b)
    nan = float("nan")
    if d1 is None and d2 is None:
        return PairedDifference(nan, nan, nan, 0, dropped=dropped, confidence=confidence)
    d = d1 if d1 is not None else d2
    mean = float(d.mean())
    seeds = len(d)
    low, high = t_interval(mean, *mean_variance(d), confidence)
    return PairedDifference(
        mean=mean,
        low=low,
        high=high,
        seeds=seeds,
        problems=problems,
        dropped=dropped,
        confidence=confidence,
    )


def bootstrap_difference(
    a: Mapping[Any, Any],
    b: Mapping[Any, Any],
    *,
    resamples: int = RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = BOOTSTRAP_SEED,
) -> PairedDifference:
    """The percentile bootstrap documents printed before the calibration (kept to show, in
    ftis.study.calibration, how far from 95% it covers at few seeds; no document uses it).

    Per-seed scalars: each resample draws S seeds with replacement and takes the mean of their
    d. Per-problem outcomes: each resample draws S seeds and, once for all of them, P problems
    with replacement. The interval is the (1-c)/2 and (1+c)/2 quantiles of the means."""
    _check(confidence)
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    d1, d2, problems, dropped = _difference_table(a, b)
    if d1 is None and d2 is None:
        nan = float("nan")
        return PairedDifference(nan, nan, nan, 0, dropped=dropped, confidence=confidence)
    if d1 is not None:
        d = d1
        rng = np.random.default_rng(seed)
        means = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    else:
        d = d2.mean(axis=1)
        means = _problem_bootstrap(d2, resamples=resamples, seed=seed)
    q = (1 - confidence) / 2
    low, high = np.quantile(means, [q, 1 - q])
    return PairedDifference(
        mean=float(d.mean()),
        low=float(low),
        high=float(high),
        seeds=len(d),
        problems=problems,
        dropped=dropped,
        confidence=confidence,
    )


def _problem_bootstrap(d: np.ndarray, *, resamples: int, seed: int) -> np.ndarray:
    """(resamples,) means of the seeds-and-problems bootstrap of d (S, P), vectorised.

    Every seed is evaluated on the same P problems (the split's fixed order), so one resample
    draws S seeds with replacement and one multiset of P problems with replacement, shared by
    every drawn seed and by both methods (docs/math.md §11). The draw of problems only matters
    through how often each distinct column d[:, p] is drawn: those counts are Multinomial(P, f),
    f the frequencies of the distinct columns. For 0/1 outcomes there are at most 3^S of them
    (at most P), so R multinomial draws over them replace R x P index draws, exactly."""
    S, P = d.shape
    columns, inverse = np.unique(d.T, axis=0, return_inverse=True)  # (U, S), (P,)
    freq = np.bincount(inverse.ravel(), minlength=len(columns)) / P  # (U,)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(P, freq, size=resamples)  # (R, U) problems drawn per column
    per_seed = counts @ columns / P  # (R, S) each seed's mean over the drawn problems
    drawn = rng.integers(0, S, size=(resamples, S))  # (R, S) the drawn seeds
    return np.take_along_axis(per_seed, drawn, axis=1).mean(axis=1)


# ------------------------------------------------------------------- equal generated tokens


def value_at(x: Any, y: Any, at: float) -> float | np.ndarray:
    """Linear interpolation of y at x = `at`, over the evaluations of one run.

    x: (E,) strictly increasing (e.g. generated tokens at each evaluation); y: (E,) or (E, P).
    Outside [x[0], x[-1]] the curve says nothing: NaN (an array of NaN for (E, P)), never an
    extrapolation."""
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y, dtype=np.float64)
    if xs.ndim != 1 or ys.shape[:1] != xs.shape or ys.ndim not in (1, 2):
        raise ValueError(f"x must be (E,) and y (E,) or (E, P); got {xs.shape} and {ys.shape}")
    if len(xs) == 0:
        raise ValueError("a curve needs at least one evaluation")
    if np.any(np.diff(xs) <= 0):
        raise ValueError("x must be strictly increasing (one evaluation per token count)")
    if not xs[0] <= at <= xs[-1]:
        return float("nan") if ys.ndim == 1 else np.full(ys.shape[1], np.nan)
    i = int(np.searchsorted(xs, at, side="left"))
    if xs[i] == at:
        return float(ys[i]) if ys.ndim == 1 else ys[i].copy()
    w = (at - xs[i - 1]) / (xs[i] - xs[i - 1])
    out = (1 - w) * ys[i - 1] + w * ys[i]
    return float(out) if ys.ndim == 1 else out


def at_equal_tokens(
    a: Mapping[Any, tuple[Any, Any]], b: Mapping[Any, tuple[Any, Any]]
) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """Per seed in both: A's last value, and B's value at A's last token count.

    a, b: seed -> (tokens (E,), values (E,) or (E, P)), one run's evaluations. Returns two
    seed -> value mappings for `paired_difference`; a seed where A's budget lies outside B's
    curve gets NaN for B (so it is dropped and counted, never extrapolated)."""
    out_a: dict[Any, Any] = {}
    out_b: dict[Any, Any] = {}
    for seed in sorted(set(a) & set(b)):
        tokens_a, values_a = (np.asarray(v, dtype=np.float64) for v in a[seed])
        tokens_b, values_b = b[seed]
        if len(tokens_a) == 0:
            raise ValueError(f"seed {seed}: method A has no evaluation")
        out_a[seed] = float(values_a[-1]) if values_a.ndim == 1 else values_a[-1]
        out_b[seed] = value_at(tokens_b, values_b, float(tokens_a[-1]))
    return out_a, out_b


# ------------------------------------------------------------------------- run directories


@dataclass(frozen=True)
class SplitOutcomes:
    """One node's greedy outcomes on one eval split: `steps` (E,) ascending, `correct` (E, P)
    uint8, row e the P problems (the split's fixed order) at step steps[e]."""

    steps: np.ndarray
    correct: np.ndarray

    def at_step(self, step: int) -> np.ndarray:
        """(P,) outcomes at `step`; KeyError when that step was not evaluated."""
        hit = np.flatnonzero(self.steps == step)
        if len(hit) == 0:
            raise KeyError(f"no evaluation at step {step} (evaluated: {self.steps.tolist()})")
        return self.correct[hit[0]]


def read_evals(run_dir: Path) -> dict[str, dict[str, SplitOutcomes]]:
    """node -> split -> SplitOutcomes from RUN_DIR/evals.jsonl.

    A torn line (a crash mid-write) is skipped with a warning; when a (node, split, step) occurs
    twice the later line wins. Raises FileNotFoundError when the run has no evals.jsonl (runs
    made before it existed) and ValueError when a node's split changes size between steps."""
    path = Path(run_dir) / "evals.jsonl"
    rows: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                key = (str(row["node"]), str(row["split"]))
                bits = decode_outcomes(row["correct"], int(row["n"]))
                step = int(row["step"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                log.warning("%s:%d: skipping a malformed line (%s)", path, lineno, e)
                continue
            rows.setdefault(key, {})[step] = bits
    out: dict[str, dict[str, SplitOutcomes]] = {}
    for (node, split), by_step in rows.items():
        steps = sorted(by_step)
        sizes = {len(by_step[s]) for s in steps}
        if len(sizes) != 1:
            raise ValueError(
                f"{path}: node {node!r} split {split!r} has evaluations of different sizes "
                f"{sorted(sizes)}: one run must evaluate the same problems at every step"
            )
        out.setdefault(node, {})[split] = SplitOutcomes(
            steps=np.array(steps, dtype=np.int64),
            correct=np.stack([by_step[s] for s in steps]),
        )
    return out


def token_curve(
    run_dir: Path, node: str, split: str, *, tokens_key: str = "train/generated_tokens_total"
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (E,), correct (E, P)) of one node and split: the per-problem outcomes of each
    evaluation in evals.jsonl against the node's `tokens_key` in metrics.jsonl at that step (0 at
    a step without it, e.g. step 0), for `at_equal_tokens`. KeyError when the run has no such
    node or split in evals.jsonl."""
    outcomes = read_evals(run_dir)
    if node not in outcomes or split not in outcomes[node]:
        raise KeyError(f"{run_dir}/evals.jsonl has no evaluations of node {node!r} split {split!r}")
    o = outcomes[node][split]
    tokens = {
        int(r["step"]): float(r.get(tokens_key) or 0.0)
        for r in read_metrics(Path(run_dir) / "metrics.jsonl")
        if r.get("node") == node and "step" in r
    }
    return np.array([tokens.get(int(s), 0.0) for s in o.steps]), o.correct
