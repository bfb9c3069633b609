"""The distributed-DPO study's document (studies/dpo.yaml, `results: dpo`): FedDPO (full and
partial participation, bounded staleness), centralized DPO, DecDPO over graphs and each agent
alone, from the runs' metrics.jsonl.

An agent is a node of the run config (a FedDPO client, a gossip agent; the centralized baseline
writes each client's evaluation as that client's row). Per run and round: the mean over agents
of their evaluation (`eval/preference_accuracy`, `eval/dpo_loss`, `eval/accuracy`) and of the
training DPO loss of the agents that trained that round (`loss/dpo`; the centralized model's
is its `server` row's). Numbers are means ± sample std over seeds.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from ftis.study.arms import ArmResult
from ftis.study.pages import Page, arms_renderer, finish_axes, save, section
from ftis.study.spec import Study
from ftis.study.tables import (
    DIFFERENCES_NOTE,
    Differences,
    fmt_pct,
    paired_count,
    spread,
)
from ftis.study.tables import table as _table

PREF = "eval/preference_accuracy"
EVAL_LOSS = "eval/dpo_loss"
TASK = "eval/accuracy"
TRAIN_LOSS = "loss/dpo"
BEFORE, AFTER = "gossip/consensus_error_before", "gossip/consensus_error_after"
LAST = 5  # rounds the "last rounds" figures average over


def agents(res: ArmResult) -> list[str]:
    return [n.name for n in res.run.config.nodes]


def per_round(res: ArmResult, key: str, nodes: list[str] | None = None) -> dict[int, float]:
    """round -> mean of `key` over the rows of `nodes` (default: the agents) that logged it."""
    nodes = agents(res) if nodes is None else nodes
    vals: dict[int, list[float]] = defaultdict(list)
    for r in res.rows:
        if r.get("node") in nodes and r.get(key) is not None:
            vals[int(r["step"])].append(float(r[key]))
    return {s: statistics.fmean(v) for s, v in sorted(vals.items())}


def train_loss(res: ArmResult) -> dict[int, float]:
    """The round's training DPO loss: the agents' who trained, else the server row's."""
    out = per_round(res, TRAIN_LOSS)
    return out or per_round(res, TRAIN_LOSS, ["server"])


def kind(res: ArmResult) -> str:
    a = res.run.config.algorithm
    if a.kind == "fed-dpo" and getattr(a, "centralized", False):
        return "centralized"
    return a.kind


def _final(curve: dict[int, float]) -> float | None:
    return curve[max(curve)] if curve else None


def _start(curve: dict[int, float]) -> float | None:
    return curve.get(0)


def _runs(results: list[ArmResult], arm: str) -> list[ArmResult]:
    return [r for r in results if r.run.arm == arm]  # type: ignore[attr-defined]


def _arms_of_kind(study: Study, results: list[ArmResult], of_kind: str):
    """(arm key, its spec, its complete runs of kind `of_kind`) for every arm that has some."""
    for key, arm in study.spec.arms.items():  # type: ignore[attr-defined]
        runs = [r for r in _runs(results, key) if kind(r) == of_kind]
        if runs:
            yield key, arm, runs


def _vals(runs: list[ArmResult], fn) -> list[float]:
    return [v for r in runs for v in [fn(r)] if v is not None]


def _last_mean(curve: dict[int, float]) -> float | None:
    keys = sorted(curve)[-LAST:]
    return statistics.fmean(curve[k] for k in keys) if keys else None


def _last_std(curve: dict[int, float]) -> float | None:
    keys = sorted(curve)[-LAST:]
    return statistics.stdev(curve[k] for k in keys) if len(keys) > 1 else None


def main_table(study: Study, results: list[ArmResult]) -> list[str]:
    rows = []
    for key, arm in study.spec.arms.items():  # type: ignore[attr-defined]
        runs = _runs(results, key)
        if not runs:
            continue
        pref = [per_round(r, PREF) for r in runs]
        rows.append(
            [
                arm.label or key,
                fmt_pct(_vals(runs, lambda r: _start(per_round(r, PREF)))),
                fmt_pct([v for c in pref for v in [_final(c)] if v is not None]),
                spread(_vals(runs, lambda r: _final(per_round(r, EVAL_LOSS))), 3),
                spread(_vals(runs, lambda r: _last_mean(train_loss(r))), 3),
                spread(_vals(runs, lambda r: _last_std(train_loss(r))), 3),
                fmt_pct(_vals(runs, lambda r: _start(per_round(r, TASK))))
                + " -> "
                + fmt_pct(_vals(runs, lambda r: _final(per_round(r, TASK)))),
                str(len(runs)),
            ]
        )
    header = [
        "arm",
        "preference accuracy, round 0",
        "final",
        "held-out DPO loss, final",
        f"training DPO loss, last {LAST} rounds",
        "its std over those rounds",
        "task accuracy, round 0 -> final",
        "seeds",
    ]
    return _table(header, rows) if rows else ["_No complete runs yet._"]


def _references(study: Study, results: list[ArmResult]) -> list[str]:
    """The arms the others are compared with: centralized DPO, each agent alone, and the first
    FedDPO arm (the participation and staleness series' full-participation, no-delay point)."""
    kinds = {key: kind(rs[0]) for key in study.spec.arms for rs in [_runs(results, key)] if rs}  # type: ignore[attr-defined]
    refs = [k for k, v in kinds.items() if v == "centralized"]
    refs += [k for k, v in kinds.items() if v == "dpo"]
    refs += [k for k, v in kinds.items() if v == "fed-dpo"][:1]
    return refs


def difference_table(study: Study, results: list[ArmResult]) -> list[str]:
    """Each arm minus each reference, paired by seed: final preference accuracy (mean over the
    agents) and final held-out DPO loss (lower is better)."""
    arms = study.spec.arms  # type: ignore[attr-defined]
    refs = _references(study, results)
    diffs = Differences()

    def final(key: str, metric: str) -> dict[int, float]:
        return {
            r.run.seed: v
            for r in _runs(results, key)
            for v in [_final(per_round(r, metric))]
            if v is not None
        }

    rows = []
    for ref in refs:
        for key, arm in arms.items():
            if key == ref or not _runs(results, key):
                continue
            where = f"{arm.label or key} − {arms[ref].label or ref}"
            pa, pb = final(key, PREF), final(ref, PREF)
            la, lb = final(key, EVAL_LOSS), final(ref, EVAL_LOSS)
            rows.append(
                [
                    arm.label or key,
                    arms[ref].label or ref,
                    diffs.cell(f"{where}, preference accuracy", pa, pb),
                    diffs.cell(
                        f"{where}, held-out loss",
                        la,
                        lb,
                        scale=1.0,
                        digits=3,
                        higher_is_better=False,
                    ),
                    paired_count(pa, pb),
                ]
            )
    header = (
        "arm (A) | minus (B) | preference accuracy, final (pp) | "
        "held-out DPO loss, final (lower is better; not in points) | seeds"
    )
    return diffs.block(
        "Final values, arm minus reference (the agents' mean per run). " + DIFFERENCES_NOTE,
        _table(header, rows, empty=""),
    )


def per_agent_table(study: Study, results: list[ArmResult]) -> list[str]:
    names: list[str] = []
    for r in results:
        for n in agents(r):
            if n not in names:
                names.append(n)
    rows = []
    for key, arm in study.spec.arms.items():  # type: ignore[attr-defined]
        runs = _runs(results, key)
        if not runs:
            continue
        cells = []
        for n in names:
            cells.append(fmt_pct(_vals(runs, lambda r, n=n: _final(per_round(r, PREF, [n])))))
        rows.append([arm.label or key, *cells])
    if not rows:
        return []
    starts = [
        fmt_pct(_vals(results, lambda r, n=n: _start(per_round(r, PREF, [n])))) for n in names
    ]
    rows.insert(0, ["round 0 (every arm)", *starts])
    return _table(["arm", *names], rows)


def _rho(res: ArmResult) -> tuple[float | None, float | None]:
    for r in res.rows:
        if "gossip/rho_full" in r or "gossip/rho" in r:
            rho = r.get("gossip/rho_full", r.get("gossip/rho"))
            gap = r.get("gossip/spectral_gap_full", r.get("gossip/spectral_gap"))
            return rho, gap
    return None, None


def gossip_table(study: Study, results: list[ArmResult]) -> list[str]:
    rows = []
    for key, arm, runs in _arms_of_kind(study, results, "gossip-dpo"):
        rho, gap = _rho(runs[0])
        before = _vals(runs, lambda r: _last_mean(per_round(r, BEFORE)))
        after = _vals(runs, lambda r: _last_mean(per_round(r, AFTER)))
        ratio = [a / b for a, b in zip(after, before, strict=True) if b > 0]
        rows.append(
            [
                arm.label or key,
                "-" if rho is None else f"{rho:.3f}",
                "-" if gap is None else f"{gap:.3f}",
                spread(before, 2, std_digits=1, notation="e"),
                spread(after, 2, std_digits=1, notation="e"),
                spread(ratio, 3),
                "-" if rho is None else f"{rho * rho:.3f}",
                fmt_pct(_vals(runs, lambda r: _final(per_round(r, PREF)))),
                spread(_vals(runs, lambda r: _final(per_round(r, EVAL_LOSS))), 3),
            ]
        )
    header = [
        "graph",
        "rho",
        "spectral gap 1 - rho^2",
        f"consensus error before mixing (last {LAST} rounds)",
        "after mixing",
        "after / before",
        "rho^2",
        "preference accuracy, final",
        "held-out DPO loss, final",
    ]
    return _table(header, rows, empty="")


def fed_table(study: Study, results: list[ArmResult]) -> list[str]:
    rows = []
    for key, arm, runs in _arms_of_kind(study, results, "fed-dpo"):
        a = runs[0].run.config.algorithm
        n = len(agents(runs[0]))
        s = getattr(a, "clients_per_round", 0) or n
        stale = _vals(
            runs,
            lambda r: (
                statistics.fmean(v.values())
                if (v := per_round(r, "fed/staleness_mean", ["server"]))
                else None
            ),
        )
        rows.append(
            [
                arm.label or key,
                f"{s} of {n}",
                str(getattr(a, "max_staleness", 0)),
                str(getattr(a, "staleness", "-")),
                spread(stale, 2),
                fmt_pct(_vals(runs, lambda r: _final(per_round(r, PREF)))),
                spread(_vals(runs, lambda r: _final(per_round(r, EVAL_LOSS))), 3),
                spread(_vals(runs, lambda r: _last_std(train_loss(r))), 3),
            ]
        )
    header = [
        "arm",
        "S",
        "q_max",
        "staleness rule",
        "mean delay (rounds)",
        "preference accuracy, final",
        "held-out DPO loss, final",
        f"training-loss std over the last {LAST} rounds",
    ]
    return _table(header, rows, empty="")


# ------------------------------------------------------------------------------------ plots


def _mean_curve(curves: list[dict[int, float]]) -> tuple[list[int], list[float]]:
    common = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return common, [statistics.fmean(c[s] for c in curves) for s in common]


def plot_curves(study: Study, results: list[ArmResult], path: Path) -> bool:
    """Three panels against rounds: held-out preference accuracy, held-out DPO loss, training
    DPO loss (means over agents, then over seeds), one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not results:
        return False
    panels = [
        (lambda r: per_round(r, PREF), "held-out preference accuracy (%)", 100.0),
        (lambda r: per_round(r, EVAL_LOSS), "held-out DPO loss", 1.0),
        (train_loss, "training DPO loss", 1.0),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (fn, ylabel, scale) in zip(axes, panels, strict=True):
        ax.set_prop_cycle(color=[*plt.cm.tab10.colors, "black", "gold"])
        for key, arm in study.spec.arms.items():  # type: ignore[attr-defined]
            runs = _runs(results, key)
            curves = [c for c in (fn(r) for r in runs) if c]
            if not curves:
                continue
            xs, ys = _mean_curve(curves)
            style = "--" if kind(runs[0]) in ("dpo", "centralized") else "-"
            ax.plot(xs, [scale * y for y in ys], style, marker="o", ms=2, label=arm.label or key)
        ax.set_xlabel("round", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return save(fig, path)


def plot_consensus(study: Study, results: list[ArmResult], path: Path) -> bool:
    """Consensus error before (dashed) and after (solid) mixing against rounds, per graph."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gossip = [
        (k, a)
        for k, a in study.spec.arms.items()  # type: ignore[attr-defined]
        if any(kind(r) == "gossip-dpo" for r in _runs(results, k))
    ]
    if not gossip:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    colors = iter(plt.cm.tab10.colors)
    for key, arm in gossip:
        runs = _runs(results, key)
        _, gap = _rho(runs[0])
        color = next(colors)
        for metric, style in ((BEFORE, "--"), (AFTER, "-")):
            xs, ys = _mean_curve([c for c in (per_round(r, metric) for r in runs) if c])
            what = "before" if metric == BEFORE else "after"
            label = f"{arm.label or key} {what}" + (f" (gap {gap:.2f})" if gap is not None else "")
            ax.plot(xs, ys, style, color=color, label=label)
    ax.set_yscale("log")
    finish_axes(ax, xlabel="round", ylabel="consensus error (1/N) sum ||theta_i - mean||^2")
    return save(fig, path)


# ------------------------------------------------------------------------------------ render


def _body(page: Page) -> list[str]:
    study, results = page.study, page.results
    L = ["## Every arm", "", *main_table(study, results), ""]
    L += page.figure("curves.png", "curves against rounds", plot_curves)
    L += section("Paired differences with intervals", difference_table(study, results), end=False)
    agent = per_agent_table(study, results)
    if agent:
        L += ["Final held-out preference accuracy per agent (its own pairs):", "", *agent, ""]
    L += section("FedDPO: participation and staleness", fed_table(study, results))
    gossip = section(
        "DecDPO: the graph",
        gossip_table(study, results),
        "rho is the second-largest |eigenvalue| of the mixing matrix W; one mixing step "
        "shrinks the disagreement by at most rho^2 (the after/before column measures it).",
    )
    if gossip:
        L += gossip + page.figure("consensus.png", "consensus error", plot_consensus)
    return L


render = arms_renderer(
    title="federated and decentralized DPO",
    note="Agents' figures are averaged over the agents, then over seeds (mean ± sample std).",
    body=_body,
)


__all__ = ["fed_table", "gossip_table", "main_table", "per_round", "render"]
