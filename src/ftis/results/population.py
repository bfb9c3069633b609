"""The population study's document (studies/population.yaml, `results: population`): RandOpt and
CoRP, alone and pooled, against a gradient baseline at matched compute.

Compute is `train/forward_tokens_total` summed over a run's nodes at the evaluated step. Where an
arm is read: a RandOpt run at every evaluated step (best member: `eval/randopt/best_accuracy`;
top-K vote: `eval/accuracy`, the members scored so far), a CoRP run at its last step (its
consolidated model), the baseline series (`options.base_series`, a one-node gradient run) along
its evaluations, linearly interpolated in tokens to compare with any other arm seed for seed.
Numbers are means ± sample std over seeds; differences are paired by seed.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from pathlib import Path

from ftis.study.arms import ArmResult
from ftis.study.pages import Page, arms_renderer, finish_axes, save, section
from ftis.study.spec import Study
from ftis.study.tables import DIFFERENCES_NOTE, Differences, fmt_pct, paired_count, spread
from ftis.study.tables import table as _table

ACC = "eval/accuracy"
BEST = "eval/randopt/best_accuracy"
TOKENS = "train/forward_tokens_total"
POPULATION = ("randopt", "corp")  # the gradient-free kinds


# ------------------------------------------------------------------------------------ reading


def _by_step(res: ArmResult, key: str) -> dict[int, float]:
    """step -> mean over the run's nodes of `key` (steps where every node logged it)."""
    per: dict[int, list[float]] = defaultdict(list)
    for r in res.rows:
        if key in r and r[key] is not None:
            per[int(r["step"])].append(float(r[key]))
    n = len(res.nodes)
    return {s: statistics.fmean(v) for s, v in sorted(per.items()) if len(v) == n}


def _tokens(res: ArmResult) -> dict[int, float]:
    """step -> forward tokens spent so far, summed over the run's nodes (0 at step 0)."""
    per: dict[int, float] = defaultdict(float)
    for r in res.rows:
        if TOKENS in r:
            per[int(r["step"])] += float(r[TOKENS])
    return {0: 0.0, **dict(sorted(per.items()))}


def _kind(res: ArmResult) -> str:
    return res.run.config.algorithm.kind


def _members(res: ArmResult, step: int) -> int:
    a = res.run.config.algorithm
    return min(a.population, step * a.per_step)  # type: ignore[attr-defined]


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """Linear interpolation of (x, y) points sorted by x; None outside their range."""
    if not points or x < points[0][0] or x > points[-1][0]:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


class Point:
    """One arm read at one step of one seed's run."""

    def __init__(self, res: ArmResult, step: int, acc: float, tokens: float) -> None:
        self.res, self.step, self.acc, self.tokens = res, step, acc, tokens
        self.start = _by_step(res, ACC).get(0)

    @property
    def seed(self) -> int:
        return self.res.run.seed


def points(
    results: list[ArmResult],
    arm: str,
    metric: str,
    step: int | None,
    token_step: int | None = None,
) -> list[Point]:
    """Every seed's reading of `arm`: `metric` at `step` (None: the run's last step), with the
    forward tokens spent by `token_step` (None: by `step`)."""
    out = []
    for res in results:
        if res.run.arm != arm:  # type: ignore[attr-defined]
            continue
        vals, toks = _by_step(res, metric), _tokens(res)
        s = step if step is not None else res.run.config.train.steps
        t = s if token_step is None else token_step
        if s in vals and t in toks:
            out.append(Point(res, s, vals[s], toks[t]))
    return out


def base_curve(results: list[ArmResult], arm: str) -> dict[int, list[tuple[float, float]]]:
    """seed -> [(tokens, accuracy)] of the baseline arm's evaluations."""
    out = {}
    for res in results:
        if res.run.arm == arm:  # type: ignore[attr-defined]
            acc, toks = _by_step(res, ACC), _tokens(res)
            out[res.run.seed] = [(toks[s], a) for s, a in acc.items() if s in toks]
    return out


# ------------------------------------------------------------------------------------- rows


# A CoRP run logs its stage-0 population read by RandOpt's rules at its last evaluation
# (report_randopt): the study shows those rows when `options.corp_randopt_rows` is true.
CORP_RANDOPT = (
    ("eval/randopt/best_accuracy", "best of"),
    ("eval/randopt/vote_accuracy", "vote of"),
)

RowSpec = tuple[str, str, str, int | None, int | None]


def _rows_spec(study: Study, results: list[ArmResult]) -> list[RowSpec]:
    """(label, arm, metric, step, token step) of every row of the matched-compute table, in
    study order (token step None: the forward tokens at `step`)."""
    rows: list[RowSpec] = []
    base = study.spec.options.get("base_series")  # type: ignore[attr-defined]
    corp_randopt = bool(study.spec.options.get("corp_randopt_rows"))  # type: ignore[attr-defined]
    for key, arm in study.spec.arms.items():  # type: ignore[attr-defined]
        if key == base:
            continue
        mine = [r for r in results if r.run.arm == key]  # type: ignore[attr-defined]
        if not mine or _kind(mine[0]) not in POPULATION:
            continue
        label = arm.label or key
        cfg = mine[0].run.config
        if cfg.algorithm.kind == "randopt":
            members = study.spec.options.get("members")  # type: ignore[attr-defined]
            steps = [s for s in sorted(_by_step(mine[0], ACC)) if s > 0]
            a = cfg.algorithm
            wanted = [s for s in steps if members is None or _members(mine[0], s) in members]
            for s in wanted:
                n = _members(mine[0], s)
                rows.append((f"{label}: best of {n}", key, BEST, s, None))
                rows.append((f"{label}: top-{a.top_k} vote of {n}", key, ACC, s, None))
        else:
            rows.append((label, key, ACC, None, None))
            if corp_randopt:  # RandOpt needs only stage 0: its tokens end there
                a = cfg.algorithm
                for metric, what in CORP_RANDOPT:
                    what = what.replace("vote", f"top-{a.top_k} vote")
                    rows.append(
                        (
                            f"{label}: RandOpt {what} {a.population}",
                            key,
                            metric,
                            None,
                            a.stage0_steps(),
                        )
                    )
    return rows


def _matched_table(study: Study, results: list[ArmResult]) -> list[str]:
    base = study.spec.options.get("base_series")  # type: ignore[attr-defined]
    curve = base_curve(results, base) if base else {}
    base_label = (study.spec.arms[base].label or base) if base in study.spec.arms else "baseline"  # type: ignore[attr-defined]
    out = []
    for label, arm, metric, step, token_step in _rows_spec(study, results):
        pts = points(results, arm, metric, step, token_step)
        if not pts:
            continue
        tokens = statistics.fmean(p.tokens for p in pts)
        gains = [p.acc - p.start for p in pts if p.start is not None]
        vs = []
        at_base = []
        for p in pts:
            b = interpolate(curve.get(p.seed, []), p.tokens)
            if b is not None:
                at_base.append(b)
                vs.append(p.acc - b)
        out.append(
            [
                label,
                f"{tokens:.3g}",
                fmt_pct([p.acc for p in pts]),
                spread(gains, scale=100, signed=True),
                fmt_pct(at_base),
                spread(vs, scale=100, signed=True),
                str(len(pts)),
            ]
        )
    header = [
        "arm",
        "forward tokens (all parties)",
        "test accuracy",
        "vs theta_0 (pp)",
        f"{base_label} at the same tokens",
        f"vs {base_label} (pp)",
        "seeds",
    ]
    return _table(header, out) if out else ["_No complete runs yet._"]


def difference_tables(study: Study, results: list[ArmResult]) -> list[str]:
    """Paired by seed, with intervals: each population row minus theta_0 and minus the
    baseline at the same forward tokens (as in the matched-compute table), and each party
    alone against its pooled twin (as in the alone table)."""
    base = study.spec.options.get("base_series")  # type: ignore[attr-defined]
    curve = base_curve(results, base) if base else {}
    arms = study.spec.arms  # type: ignore[attr-defined]
    base_label = (arms[base].label or base) if base in arms else "baseline"
    diffs = Differences()
    rows = []
    for label, arm, metric, step, token_step in _rows_spec(study, results):
        pts = points(results, arm, metric, step, token_step)
        if not pts:
            continue
        acc = {p.seed: p.acc for p in pts}
        start = {p.seed: p.start for p in pts if p.start is not None}
        at_base = {
            p.seed: b
            for p in pts
            for b in [interpolate(curve.get(p.seed, []), p.tokens)]
            if b is not None
        }
        rows.append(
            [
                label,
                diffs.cell(f"{label} − theta_0", acc, start),
                diffs.cell(f"{label} − {base_label}", acc, at_base),
                paired_count(acc, at_base),
            ]
        )
    for key, arm in arms.items():  # the gradient arms at their last step
        res = [r for r in results if r.run.arm == key and _kind(r) not in POPULATION]  # type: ignore[attr-defined]
        if not res:
            continue
        pts = points(res, key, ACC, None)
        label = f"{arm.label or key} (last step)"
        acc = {p.seed: p.acc for p in pts}
        start = {p.seed: p.start for p in pts if p.start is not None}
        # another gradient arm spends the baseline's tokens step for step: last against last
        at_base = {s: c[-1][1] for s, c in curve.items() if c} if key != base else {}
        rows.append(
            [
                label,
                diffs.cell(f"{label} − theta_0", acc, start),
                diffs.cell(f"{label} − {base_label}", acc, at_base) if at_base else "-",
                str(len(acc)),
            ]
        )
    pooled = []
    for name, twin, mine_pts, theirs_pts in _alone_pairs(study, results):
        mine = {p.seed: p.acc for p in mine_pts}
        theirs = {p.seed: p.acc for p in theirs_pts}
        if not set(mine) & set(theirs):
            continue
        pooled.append(
            [
                name,
                arms[twin].label or twin,
                diffs.cell(f"{arms[twin].label or twin} − {name}", theirs, mine),
                paired_count(mine, theirs),
            ]
        )
    return diffs.block(
        DIFFERENCES_NOTE,
        _table(
            ["arm (A)", "A − theta_0 (pp)", f"A − {base_label} at the same tokens", "seeds"],
            rows,
            empty="",
        ),
        _table("party alone (B) | pooled run (A) | pooled − alone (pp) | seeds", pooled, empty=""),
    )


def _gradient_table(study: Study, results: list[ArmResult]) -> list[str]:
    """Each gradient arm's accuracy at the budgets of `options.budgets` (forward tokens; its
    evaluations interpolated, seed by seed) and at its last step."""
    budgets = [float(b) for b in study.spec.options.get("budgets", [])]  # type: ignore[attr-defined]
    rows = []
    for key, arm in study.spec.arms.items():  # type: ignore[attr-defined]
        mine = [r for r in results if r.run.arm == key and _kind(r) not in POPULATION]  # type: ignore[attr-defined]
        if not mine:
            continue
        curves = base_curve(mine, key)
        cells = []
        for b in budgets:
            vals = [v for c in curves.values() for v in [interpolate(c, b)] if v is not None]
            cells.append(fmt_pct(vals) if len(vals) == len(curves) else "-")
        last = [c[-1][1] for c in curves.values()]
        tokens = statistics.fmean(c[-1][0] for c in curves.values())
        rows.append([arm.label or key, *cells, f"{fmt_pct(last)} ({tokens:.3g})", str(len(curves))])
    header = ["arm", *[f"at {b:.3g} tokens" for b in budgets], "last (tokens)", "seeds"]
    return _table(header, rows, empty="")


def _pooled_twin(study: Study, results: list[ArmResult], kind: str, members: int) -> str | None:
    """The first multi-party arm of `kind` whose population holds `members` (RandOpt: at least
    that many, read when it had scored them; CoRP: exactly that many)."""
    for key in study.spec.arms:  # type: ignore[attr-defined]
        res = [r for r in results if r.run.arm == key]  # type: ignore[attr-defined]
        if not res or len(res[0].nodes) < 2 or _kind(res[0]) != kind:
            continue
        n = res[0].run.config.algorithm.population
        if n == members or (kind == "randopt" and n > members):
            return key
    return None


def _alone_pairs(study: Study, results: list[ArmResult]):
    """(row name, pooled twin arm, the party's points, the twin's points) for every single-party
    population arm with a pooled twin of as many members and each metric it is scored on: the
    top-K vote and the best member for RandOpt (at the step by which both had scored them all),
    the consolidated model for CoRP (last step)."""
    for key, arm in study.spec.arms.items():  # type: ignore[attr-defined]
        res = [r for r in results if r.run.arm == key]  # type: ignore[attr-defined]
        if not res or len(res[0].nodes) != 1 or _kind(res[0]) not in POPULATION:
            continue
        kind, a = _kind(res[0]), res[0].run.config.algorithm
        twin = _pooled_twin(study, results, kind, a.population)
        if twin is None:
            continue
        if kind == "randopt":
            step = -(-a.population // a.per_step)  # the step at which both had scored them all
            metrics = [(ACC, f"top-{a.top_k} vote"), (BEST, "best member")]
        else:
            step, metrics = None, [(ACC, "consolidated")]
        for metric, what in metrics:
            yield (
                f"{arm.label or key} ({what}, {a.population} members)",
                twin,
                points(results, key, metric, step),
                points(results, twin, metric, step),
            )


def _alone_table(study: Study, results: list[ArmResult]) -> list[str]:
    """Each party alone against the pooled population at equal members per party: paired by
    seed, the pooled run's accuracy minus the party's alone accuracy."""
    arms = study.spec.arms  # type: ignore[attr-defined]
    rows = []
    for name, twin, mine_pts, theirs_pts in _alone_pairs(study, results):
        mine = {p.seed: p for p in mine_pts}
        theirs = {p.seed: p for p in theirs_pts}
        common = sorted(set(mine) & set(theirs))
        if not common:
            continue
        rows.append(
            [
                name,
                fmt_pct([mine[s].acc for s in common]),
                arms[twin].label or twin,
                fmt_pct([theirs[s].acc for s in common]),
                spread([theirs[s].acc - mine[s].acc for s in common], scale=100, signed=True),
                f"{statistics.fmean(mine[s].tokens for s in common):.3g}",
            ]
        )
    header = (
        "party alone | accuracy | pooled run | accuracy | pooled - alone (pp) | "
        "tokens (the party alone)"
    )
    return _table(header, rows, empty="_No alone/pooled pairs among the complete runs._")


def _corp_table(study: Study, results: list[ArmResult]) -> list[str]:
    """CoRP's choices per run: (q, beta, alpha), elite, probe rewards, agreement of weights,
    and (runs with CoRP's validation gate) the validation rewards and whether it applied."""
    rows = []
    gated = any("corp/applied" in r for res in results if _kind(res) == "corp" for r in res.rows)
    for res in results:
        if _kind(res) != "corp":
            continue
        last = res.run.config.train.steps
        final = [r for r in res.rows if r.get("step") == last]
        if not final:
            continue
        f0 = final[0]
        shas = {r.get("population/weights_sha256") for r in final}
        pps = [r.get("population/perturbations_per_second") for r in res.rows]
        pps = [p for p in pps if p]
        rows.append(
            [
                res.run.id,
                f"({f0.get('corp/q', float('nan')):g}, {f0.get('corp/beta', float('nan')):g}, "
                f"{f0.get('corp/alpha', float('nan')):g})",
                f"{f0.get('corp/elite_size', float('nan')):.0f}",
                f"{100 * f0.get('corp/probe_base', float('nan')):.1f} -> "
                f"{100 * f0.get('corp/probe_reward', float('nan')):.1f}",
                "yes" if len(shas) == 1 and None not in shas else "NO",
                _rate(statistics.fmean(pps)) if pps else "-",
            ]
        )
        if gated:
            rows[-1].insert(
                4,
                f"{100 * f0.get('corp/validation_base', float('nan')):.1f} -> "
                f"{100 * f0.get('corp/validation_reward', float('nan')):.1f} "
                f"({'applied' if f0.get('corp/applied') else 'kept theta_0'})",
            )
    if not rows:
        return []
    header = [
        "run",
        "(q, beta, alpha)",
        "elite",
        "pooled probe reward %: theta_0 -> chosen",
        "same weights on every party",
        "members/s per party",
    ]
    if gated:
        header.insert(4, "pooled validation reward %: theta_0 -> chosen")
    return _table(header, rows)


def _rate(v: float) -> str:
    """A rate with one decimal, or two significant digits below 1 (a real model scores a
    member in seconds: 0.07/s, not 0.0)."""
    return f"{v:.1f}" if v >= 1 else f"{v:.2g}"


# ------------------------------------------------------------------------------------- plot


def plot(study: Study, results: list[ArmResult], path: Path) -> bool:
    """Test accuracy against forward tokens (log scale): the baseline's curve (mean ± std over
    seeds, interpolated on a common grid), RandOpt's curves, CoRP's and the alone arms' points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not results:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    base = study.spec.options.get("base_series")  # type: ignore[attr-defined]
    arms = study.spec.arms  # type: ignore[attr-defined]
    gradient = [  # arms trained by gradient: a curve each (the baseline in black)
        k
        for k in arms
        if any(r.run.arm == k and _kind(r) not in POPULATION for r in results)  # type: ignore[attr-defined]
    ]
    for k in sorted(gradient, key=lambda k: k != base):
        curve = base_curve(results, k)
        lo = max(min(x for x, _ in c if x > 0) for c in curve.values())
        hi = min(c[-1][0] for c in curve.values())
        grid = np.geomspace(lo, hi, 40)
        ys = np.array([[interpolate(c, x) for x in grid] for c in curve.values()], dtype=float)
        m, s = ys.mean(0), ys.std(0, ddof=1) if len(ys) > 1 else np.zeros(len(grid))
        color = "black" if k == base else "grey"
        ax.plot(grid, 100 * m, "-", color=color, label=f"{arms[k].label or k} (n={len(ys)})")
        ax.fill_between(grid, 100 * (m - s), 100 * (m + s), color=color, alpha=0.12)
    colors = iter(plt.cm.tab10.colors)
    series: dict[tuple[str, str], list[tuple[float, list[float]]]] = defaultdict(list)
    for _label, arm, metric, step, token_step in _rows_spec(study, results):
        pts = points(results, arm, metric, step, token_step)
        if not pts:
            continue
        name = arms[arm].series or arms[arm].label or arm
        what = (
            "best member"
            if metric in (BEST, CORP_RANDOPT[0][0])
            else (
                "top-K vote"
                if _kind(pts[0].res) == "randopt" or metric == CORP_RANDOPT[1][0]
                else ""
            )
        )
        key = (name, what)
        series[key].append((statistics.fmean(p.tokens for p in pts), [p.acc for p in pts]))
    theta0 = [p for r in results for p in [_by_step(r, ACC).get(0)] if p is not None]
    if theta0:
        ax.axhline(100 * statistics.fmean(theta0), color="grey", ls=":", label="theta_0")
    for (name, what), pts in series.items():
        pts.sort()
        xs = [x for x, _ in pts]
        ms = [100 * statistics.fmean(v) for _, v in pts]
        ss = [100 * statistics.stdev(v) if len(v) > 1 else 0.0 for _, v in pts]
        alone = "alone" in name
        ax.errorbar(
            xs,
            ms,
            yerr=ss,
            fmt=("--" if alone else "-") + ("s" if "corp" in name else "o"),
            ms=4,
            capsize=2,
            color=next(colors),
            label=f"{name}{': ' + what if what else ''}",
        )
    ax.set_xscale("log")
    finish_axes(
        ax,
        xlabel="forward-pass tokens, summed over the run's parties",
        ylabel="greedy test accuracy (%)",
    )
    return save(fig, path)


# ------------------------------------------------------------------------------------ render


def _body(page: Page) -> list[str]:
    study, results = page.study, page.results
    L = []
    starts = [v for r in results for v in [_by_step(r, ACC).get(0)] if v is not None]
    if starts:
        L += [
            f"theta_0 (the shared warm start), greedy test accuracy: {fmt_pct(starts)} "
            f"(every run's step 0; {len(starts)} runs).",
            "",
        ]
    L += section(
        "At matched compute",
        _matched_table(study, results),
        "Each arm's test accuracy, its compute, and the baseline's accuracy when it had spent "
        "the same forward tokens (its evaluations linearly interpolated, seed for seed). A "
        "top-K vote costs K forward passes per question at inference; CoRP's model and GRPO's "
        "cost one.",
    )
    grad = _gradient_table(study, results)
    if grad:
        L += [
            "The gradient baselines by themselves, at fixed budgets (test accuracy when the run "
            "had spent that many forward tokens):",
            "",
            *grad,
            "",
        ]
    L += page.figure("accuracy-vs-tokens.png", "accuracy against forward tokens", plot)
    L += section(
        "Alone against pooled",
        _alone_table(study, results),
        "A party alone scores the population on its own support set only (one task); pooled, "
        "both parties' rewards choose the members. Same members per party, same seeds.",
    )
    L += section("Paired differences with intervals", difference_tables(study, results), end=False)
    return L + section("CoRP's choices", _corp_table(study, results))


render = arms_renderer(
    title="gradient-free post-training against GRPO at matched compute",
    note="Means ± sample std over seeds; differences paired by seed.",
    body=_body,
)


__all__ = ["interpolate", "plot", "points", "render"]
