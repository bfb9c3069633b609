"""How often an interval excludes zero when nothing differs: the calibration of every document's
intervals (docs/results/calibration.md, docs/math.md §11).

    python -m ftis.study.calibration                       # rewrite docs/results/calibration.md
    python -m ftis.study.calibration --trials 400 --out /tmp/cal.md   # a quicker look

A 95% interval should exclude zero on about 5% of null comparisons. This module runs the
interval documents print (`ftis.study.stats.paired_difference`, Student t) and the percentile
bootstrap they printed before (`bootstrap_difference`) on two kinds of null comparison:

- simulated: per-seed scalars drawn from a normal distribution, and per-problem 0/1 outcomes
  from a model of how runs of one arm vary (a problem difficulty shared by every run, a
  per-run effect on the logit, and for some cells a per-problem difference between the two
  arms that is zero on average over problems), at 3, 5 and 8 seeds;
- real: the same arm twice with disjoint seeds, from committed run directories (every arm with
  at least four seeds: its seeds split into two disjoint pairs, every way, each pair paired by
  order), on every node and eval split at the last evaluation.

Everything is seeded: the document regenerates byte for byte.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ftis.study.stats import (
    PairedDifference,
    bootstrap_difference,
    crossed_variance,
    paired_difference,
    read_evals,
    t_interval,
)
from ftis.study.tables import table

DEFAULT_OUT = Path("docs/results/calibration.md")
DEFAULT_RUNS = (Path("docs/results/collab-runs"), Path("docs/results/groups-runs"))
SEEDS = (3, 5, 8)
BOOT_RESAMPLES = 1000  # the calibration's bootstrap: the documents used 10,000 (same quantiles
# to within Monte Carlo error; 1,000 keeps the simulation to minutes)

Method = Callable[[dict, dict], PairedDifference]


def _boot(a: dict, b: dict) -> PairedDifference:
    return bootstrap_difference(a, b, resamples=BOOT_RESAMPLES)


def _crossed(a: dict, b: dict) -> PairedDifference:
    """The t interval with seeds and problems crossed (`crossed_variance`), not printed by
    documents: shown here to say why."""
    d = np.stack([np.asarray(a[k], float) - np.asarray(b[k], float) for k in sorted(a)])
    mean = float(d.mean())
    low, high = t_interval(mean, *crossed_variance(d))
    return PairedDifference(mean, low, high, d.shape[0], d.shape[1])


@dataclass(frozen=True)
class Rate:
    """`hits` of `trials` null comparisons excluded zero."""

    hits: int
    trials: int

    @property
    def value(self) -> float:
        return self.hits / self.trials if self.trials else float("nan")

    def cell(self) -> str:
        """'5.1% (±0.7)': the rate and its binomial standard error, in percent."""
        if not self.trials:
            return "-"
        p = self.value
        se = math.sqrt(max(p * (1 - p), 1e-12) / self.trials)
        return f"{100 * p:.1f}% (±{100 * se:.1f})"


def _rate(method: Method, draws: Sequence[tuple[dict, dict]]) -> Rate:
    return Rate(sum(bool(method(a, b).excludes_zero) for a, b in draws), len(draws))


# ------------------------------------------------------------------------------ simulations


def scalar_nulls(seeds: int, trials: int, *, rng_seed: int) -> list[tuple[dict, dict]]:
    """`trials` null comparisons of per-seed scalars: d_s ~ N(0, 1)."""
    rng = np.random.default_rng(rng_seed)
    d = rng.normal(size=(trials, seeds))
    zero = {s: 0.0 for s in range(seeds)}
    return [({s: float(x) for s, x in enumerate(row)}, zero) for row in d]


def _arm(rng: np.random.Generator, seeds: int, run_sd: float, logit: np.ndarray) -> dict:
    """seed -> (P,) 0/1 outcomes of one arm's runs: each adds its own logit effect."""
    run = rng.normal(0.0, run_sd, (seeds, 1)) if run_sd else 0.0
    p = 1.0 / (1.0 + np.exp(-(logit + run)))
    drawn = (rng.random((seeds, len(logit))) < p).astype(np.float64)
    return {s: drawn[s] for s in range(seeds)}


def outcome_nulls(
    seeds: int,
    problems: int,
    trials: int,
    *,
    run_sd: float,
    problem_sd: float,
    rng_seed: int,
) -> list[tuple[dict, dict]]:
    """`trials` null comparisons of per-problem 0/1 outcomes. Each trial draws P problem
    difficulties (logit, sd 1.5) shared by every run, and, with `problem_sd`, a per-problem
    difference between the arms (logit, sd `problem_sd`, split half to each arm with opposite
    signs: zero on average over problems, not on the drawn ones); each run of either arm adds
    its own effect (logit, sd `run_sd`) and draws each outcome."""
    rng = np.random.default_rng(rng_seed)
    out = []
    for _ in range(trials):
        difficulty = rng.normal(0.0, 1.5, problems)
        shift = rng.normal(0.0, problem_sd, problems) / 2 if problem_sd else 0.0

        out.append(tuple(_arm(rng, seeds, run_sd, difficulty + sign * shift) for sign in (1, -1)))
    return out


# -------------------------------------------------------------------------- real-run nulls


_SEED = re.compile(r"^(?P<arm>.+)-s(?P<seed>\d+)$")


def arms_with_seeds(runs_dir: Path, *, fewest: int = 4) -> dict[str, dict[int, Path]]:
    """arm -> seed -> run directory, for every arm of `runs_dir` with at least `fewest` seeds
    that have evals.jsonl (run ids end in -s<seed>)."""
    arms: dict[str, dict[int, Path]] = {}
    for run in sorted(Path(runs_dir).iterdir()):
        m = _SEED.match(run.name)
        if m and (run / "evals.jsonl").is_file():
            arms.setdefault(m["arm"], {})[int(m["seed"])] = run
    return {a: s for a, s in arms.items() if len(s) >= fewest}


def real_nulls(runs_dirs: Sequence[Path], *, pair: int = 2) -> tuple[list[tuple[dict, dict]], int]:
    """Null comparisons from real runs: for every arm with at least 2 x `pair` seeds, every
    node and split at its last evaluation, every way of taking `pair` seeds for A and another
    `pair` for B (paired by order: A's i-th with B's i-th). Returns (comparisons, arms)."""
    out, arms = [], 0
    for runs_dir in runs_dirs:
        for _, by_seed in arms_with_seeds(runs_dir, fewest=2 * pair).items():
            arms += 1
            evals = {s: read_evals(run) for s, run in by_seed.items()}
            seeds = sorted(evals)
            nodes = set.intersection(*(set(e) for e in evals.values()))
            for node in sorted(nodes):
                splits = set.intersection(*(set(evals[s][node]) for s in seeds))
                for split in sorted(splits):
                    last = {s: evals[s][node][split].correct[-1] for s in seeds}
                    if len({len(v) for v in last.values()}) != 1:
                        continue
                    for a_seeds in itertools.combinations(seeds, pair):
                        rest = [s for s in seeds if s not in a_seeds]
                        for b_seeds in itertools.permutations(rest, pair):
                            if b_seeds != tuple(sorted(b_seeds)):
                                continue  # B's order is fixed: each split once
                            a = {i: last[s] for i, s in enumerate(a_seeds)}
                            b = {i: last[s] for i, s in enumerate(b_seeds)}
                            out.append((a, b))
    return out, arms


# ------------------------------------------------------------------------------- document


def render(*, trials: int, runs_dirs: Sequence[Path]) -> str:
    boot_trials = max(trials // 4, 50)
    lines = [
        "# Calibration: how often an interval excludes zero when nothing differs",
        "",
        "Generated by `python -m ftis.study.calibration` "
        f"(`--trials {trials}`; everything seeded, so it regenerates byte for byte). Every "
        "results document prints paired differences with a 95% interval and bolds the cells "
        "whose interval excludes zero; on a comparison where nothing differs that should "
        "happen about 5% of the time. This page runs the interval the documents print "
        "(Student t over the per-seed differences; per-problem outcomes are averaged over the "
        "split's problems first, docs/math.md §11), the alternative that crosses seeds and "
        "problems, and the percentile bootstrap they printed before "
        f"(resampling seeds, and problems where there are outcomes; {BOOT_RESAMPLES:,} "
        f"resamples here, {boot_trials} trials a cell) on null comparisons, and prints the "
        "share that excluded zero, with its binomial standard error. Goal: 4-6%.",
        "",
        "## Simulated per-seed scalars",
        "",
        "d_s = a_s - b_s drawn from N(0, 1), S seeds.",
        "",
    ]
    rows = []
    for i, s in enumerate(SEEDS):
        draws = scalar_nulls(s, trials, rng_seed=100 + i)
        rows.append(
            [
                str(s),
                _rate(paired_difference, draws).cell(),
                _rate(_boot, draws[:boot_trials]).cell(),
            ]
        )
    lines += [*table(["seeds", "t interval", "percentile bootstrap"], rows), ""]
    lines += [
        "## Simulated per-problem outcomes",
        "",
        "Each trial draws P problems (difficulty on the logit scale, sd 1.5, shared by every "
        "run) and S runs of each arm; a run adds its own logit effect (run sd: how much one "
        "arm's seeds differ) and draws every outcome. Problem sd: a per-problem difference "
        "between the arms, zero on average over problems but not on the drawn ones (A better "
        "on some problems, worse on others). Both arms come from the same distribution: every "
        "excluded zero is a false call.",
        "",
    ]
    rows = []
    cells = [
        (s, p, r, q)
        for s in SEEDS
        for p in (64, 256)
        for r, q in ((0.0, 0.0), (0.4, 0.0), (1.0, 0.0), (0.0, 0.5), (0.4, 0.5))
    ]
    rates: dict[str, list[float]] = {"t0": [], "tq": [], "c0": [], "cq": [], "b": []}
    for i, (s, p, r, q) in enumerate(cells):
        draws = outcome_nulls(s, p, trials, run_sd=r, problem_sd=q, rng_seed=1000 + i)
        t, c = _rate(paired_difference, draws), _rate(_crossed, draws)
        b = _rate(_boot, draws[:boot_trials])
        rates["tq" if q else "t0"].append(t.value)
        rates["cq" if q else "c0"].append(c.value)
        rates["b"].append(b.value)
        rows.append([str(s), str(p), f"{r:g}", f"{q:g}", t.cell(), c.cell(), b.cell()])
    header = [
        "seeds",
        "problems",
        "run sd",
        "problem sd",
        "t over seeds (printed)",
        "t, seeds x problems",
        "percentile bootstrap",
    ]
    lines += [*table(header, rows), ""]

    def span(values: list[float]) -> str:
        return f"{100 * min(values):.1f}-{100 * max(values):.1f}%"

    lines += [
        f"Where the arms do not differ on any problem (problem sd 0), the t interval over seeds "
        f"that documents print excludes zero on {span(rates['t0'])} of null comparisons; the "
        f"percentile bootstrap on {span(rates['b'])} over all settings: near 0% where the "
        "seeds do not differ (resampling problems counts their noise up to three times, "
        "docs/math.md §11) and up to about 1 in 4 where they do (3 seeds resampled reach only "
        "the range of the three).",
        "",
        f"Where the arms differ problem by problem (problem sd 0.5), the printed interval "
        f"excludes zero on {span(rates['tq'])}: it is conditional on the split's problems, and "
        "on the drawn problems these arms do differ, so these are not its null comparisons; "
        "they say how far it is from an interval that takes the problems as a sample of the "
        "task. The seeds-x-problems t interval (two-way mean squares, Satterthwaite degrees of "
        f"freedom; `crossed_variance`) is that interval: {span(rates['cq'])} there and "
        f"{span(rates['c0'])} where the arms do not differ per problem, conservative where the "
        "seeds do not differ. Documents print the conditional interval: on the real null "
        "comparisons below, the crossed interval's Satterthwaite degrees of freedom make it "
        "exclude zero too often at 2 seeds, and a document's claim is about its held-out "
        "split (at least 256 problems in the studies that make claims).",
        "",
    ]
    draws, arms = real_nulls(runs_dirs)
    lines += [
        "## Real runs: the same arm twice, disjoint seeds",
        "",
        "From the committed runs in "
        + ", ".join(f"`{d}`" for d in runs_dirs)
        + f": {arms} arms with at least 4 seeds, each node and eval split at its last "
        "evaluation. Their seeds split into two disjoint pairs every way (A's i-th paired with "
        "B's i-th), so this is a 2-seed comparison: the committed arms have 5 seeds, too few "
        "for two disjoint sets of 3. The comparisons share runs, so they are not independent "
        "and the standard error printed (as if they were) is too small.",
        "",
    ]
    rows = [
        [
            "2",
            str(len(draws)),
            _rate(paired_difference, draws).cell(),
            _rate(_crossed, draws).cell(),
            _rate(_boot, draws).cell(),
        ]
    ]
    header = [
        "seeds",
        "comparisons",
        "t over seeds (printed)",
        "t, seeds x problems",
        "percentile bootstrap",
    ]
    lines += [*table(header, rows), ""]
    lines += [
        "## What follows",
        "",
        "Every document prints the t interval over seeds and bolds a cell only where its "
        "printed ends exclude zero (`ftis.study.tables.is_bold`). A bold cell is still "
        "exploratory unless its study file named the comparison as primary before the runs "
        "(`primary:`, ftis.study.primary): among N exploratory cells about N/20 are bold when "
        "nothing differs, and every document says so next to its count. Primary comparisons "
        "are corrected for their number (Bonferroni).",
        "",
        "## How to regenerate",
        "",
        "```bash",
        f"python -m ftis.study.calibration --trials {trials}   # about 2 minutes on one core",
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ftis.study.calibration", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--trials", type=int, default=2000, help="null comparisons per simulated cell")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the document to write")
    ap.add_argument(
        "--runs",
        type=Path,
        nargs="*",
        default=list(DEFAULT_RUNS),
        help="run folders whose arms give the real nulls",
    )
    args = ap.parse_args(argv)
    if args.trials < 10:
        ap.error("--trials must be at least 10")
    missing = [d for d in args.runs if not d.is_dir()]
    if missing:
        ap.error(f"no run folder {missing[0]} (run from the repository root, or pass --runs)")
    text = render(trials=args.trials, runs_dirs=args.runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger(__name__).info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
