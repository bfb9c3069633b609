"""The FGRPO study's results document (docs/results/fgrpo.md): per-client final accuracy,
accuracy across rounds, stability across rounds and the federated arms' aggregation weights,
all recomputed from the run directories (metrics.jsonl; a centralized run's client-eval.jsonl).

Numbers are means ± sample std over seeds. A section between READING_BEGIN and READING_END in an
existing document is hand-written and carried over verbatim when the file is regenerated.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftis.algos.fgrpo.study import CLIENT_EVAL, FGRPORun, FGRPOStudy, run_state
from ftis.models.sources import model_label
from ftis.study.document import partial_lines, reading_lines
from ftis.study.pages import figure_lines, finish_axes, save
from ftis.study.runner import complete_runs
from ftis.study.tables import (
    DIFFERENCES_NOTE,
    Differences,
    code_line,
    fmt_pct,
    invocations_line,
    regenerate_lines,
    spread,
)
from ftis.study.tables import rel as _rel
from ftis.study.tables import table as _table
from ftis.train.metrics import read_metrics

MEAN = "mean over clients"


# ------------------------------------------------------------------------------------- data


@dataclass
class RunData:
    """One complete run: per client, accuracy by round; for federated runs, the aggregation
    weight each client got each round and the rejected / dropped replies."""

    run: FGRPORun
    acc: dict[str, dict[int, float]]
    weights: dict[str, list[float]] = field(default_factory=dict)
    rejected: float = 0.0
    dropped: float = 0.0
    seconds: float | None = None
    code: str | None = None


def run_data(run: FGRPORun, rows: Iterable[dict[str, Any]], meta: dict | None = None) -> RunData:
    """A run's RunData from its rows: metrics.jsonl's (federated, alone: a client's row at the
    end of a round) or client-eval.jsonl's (centralized: they carry their round)."""
    meta = meta or {}
    acc: dict[str, dict[int, float]] = {c: {} for c in run.clients}
    weights: dict[str, list[float]] = {c: [] for c in run.clients}
    rejected = dropped = 0.0
    for row in rows:
        c = row.get("node")
        if c not in acc:
            continue
        r = row.get("round") if run.kind == "centralized" else run.round_of(row.get("step", -1))
        if r is None:
            continue
        if row.get("eval/accuracy") is not None:
            acc[c][int(r)] = float(row["eval/accuracy"])
        if run.kind == "federated" and r > 0:
            if row.get("fgrpo/weight") is not None:
                weights[c].append(float(row["fgrpo/weight"]))
            rejected += float(row.get("fgrpo/rejected") or 0.0)
            dropped += float(row.get("fgrpo/dropped") or 0.0)
    return RunData(
        run,
        acc,
        weights if run.kind == "federated" else {},
        rejected,
        dropped,
        meta.get("seconds"),
        meta.get("code"),
    )


def collect(study: FGRPOStudy, out_dir: Path) -> tuple[list[RunData], list[str]]:
    """RunData of the study's complete runs, and the ids of the others."""
    results = []
    done, missing = complete_runs(study, out_dir, status=run_state)
    for run, d, meta in done:
        if run.kind == "centralized":
            rows = read_metrics(d / CLIENT_EVAL)
            meta = {
                **meta,
                "seconds": (meta.get("seconds") or 0.0) + (meta.get("client_eval_seconds") or 0.0),
            }
        else:
            rows = read_metrics(d / "metrics.jsonl")
        results.append(run_data(run, rows, meta))
    return results, missing


def curves(results: list[RunData], arm: str, client: str) -> dict[int, dict[int, float]]:
    """seed -> round -> accuracy of `client` in `arm` (alone: the client's own run)."""
    out: dict[int, dict[int, float]] = {}
    for res in results:
        if res.run.arm == arm and client in res.acc and res.acc[client]:
            out[res.run.seed] = res.acc[client]
    return out


def finals(results: list[RunData], arm: str, client: str, last_round: int) -> dict[int, float]:
    """seed -> accuracy of `client` in `arm` at the last round."""
    return {
        s: acc[last_round] for s, acc in curves(results, arm, client).items() if last_round in acc
    }


def starts(results: list[RunData], client: str) -> dict[int, float]:
    """seed -> round-0 accuracy of `client` (the base model; the same in every arm)."""
    out: dict[int, float] = {}
    for res in results:
        if 0 in res.acc.get(client, {}):
            out.setdefault(res.run.seed, res.acc[client][0])
    return out


def mean_over_clients(per_client: dict[str, dict[int, float]]) -> dict[int, float]:
    """seed -> mean over clients, for the seeds every client has (equal-size eval splits are
    the union's accuracy)."""
    seeds = set.intersection(*(set(v) for v in per_client.values())) if per_client else set()
    return {s: statistics.fmean(v[s] for v in per_client.values()) for s in sorted(seeds)}


@dataclass(frozen=True)
class Stability:
    """One accuracy curve's stability: the (population) std of its last `last` evaluated
    rounds, how many times it fell by more than `drop` from one evaluated round to the next,
    and its largest such fall (0 when it never fell)."""

    last_std: float
    drops: int
    worst_drop: float


def stability(acc: dict[int, float], *, last: int, drop: float) -> Stability:
    ys = [acc[r] for r in sorted(acc)]
    tail = ys[-last:]
    falls = [a - b for a, b in itertools.pairwise(ys)]
    return Stability(
        last_std=statistics.pstdev(tail) if len(tail) > 1 else 0.0,
        drops=sum(1 for f in falls if f > drop + 1e-12),
        worst_drop=max([0.0, *falls]),
    )


# ------------------------------------------------------------------------------------ plots


def _arm_style(study: FGRPOStudy, arm: str) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    arms = list(study.spec.arms)
    colors = [*plt.cm.tab10.colors]
    kind = study.spec.arms[arm].kind
    return {
        "color": colors[arms.index(arm) % len(colors)],
        "linestyle": {"federated": "-", "centralized": "-.", "alone": "--"}[kind],
    }


def _panels(study: FGRPOStudy, results: list[RunData]) -> list[tuple[str, dict[str, dict]]]:
    """(title, arm -> seed -> round -> accuracy) per client, then the mean over clients."""
    clients = study.clients
    panels = []
    for c in clients:
        panels.append((c, {a: curves(results, a, c) for a in study.spec.arms}))
    mean: dict[str, dict[int, dict[int, float]]] = {}
    for a in study.spec.arms:
        by_seed: dict[int, dict[int, float]] = {}
        per = {c: curves(results, a, c) for c in clients}
        seeds = set.intersection(*(set(v) for v in per.values())) if per else set()
        for s in seeds:
            rounds = set.intersection(*(set(per[c][s]) for c in clients))
            by_seed[s] = {r: statistics.fmean(per[c][s][r] for c in clients) for r in rounds}
        mean[a] = by_seed
    panels.append((MEAN, mean))
    return panels


def plot_curves(study: FGRPOStudy, results: list[RunData], path: Path) -> bool:
    """One panel per client (and the mean over clients): accuracy against round, one line per
    arm (mean over seeds, band ± std)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(study, results)
    if not results:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6), squeeze=False)
    for ax, (title, by_arm) in zip(axes[0], panels, strict=True):
        for arm, by_seed in by_arm.items():
            if not by_seed:
                continue
            rounds = sorted(set.intersection(*(set(v) for v in by_seed.values())))
            if not rounds:
                continue
            ys = [[100 * by_seed[s][r] for s in by_seed] for r in rounds]
            m = [statistics.fmean(y) for y in ys]
            sd = [statistics.stdev(y) if len(y) > 1 else 0.0 for y in ys]
            style = _arm_style(study, arm)
            ax.plot(
                rounds,
                m,
                marker="o",
                ms=2.5,
                label=f"{study.label(arm)} (n={len(by_seed)})",
                **style,
            )
            ax.fill_between(
                rounds,
                [a - b for a, b in zip(m, sd, strict=True)],
                [a + b for a, b in zip(m, sd, strict=True)],
                color=style["color"],
                alpha=0.12,
                linewidth=0,
            )
        ax.set_title(title, fontsize=10)
        finish_axes(
            ax,
            xlabel="round (single-node arms: step / E)",
            ylabel="greedy test accuracy (%)",
            legend=6.5,
            fontsize=8,
        )
    return save(fig, path)


def plot_finals(study: FGRPOStudy, results: list[RunData], path: Path, last_round: int) -> bool:
    """Grouped bars: final accuracy per client (and the mean over clients), one bar per arm,
    error bars = sample std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not results:
        return False
    groups = [*study.clients, MEAN]
    arms = [a for a in study.spec.arms if any(r.run.arm == a for r in results)]
    width = 0.8 / len(arms)
    fig, ax = plt.subplots(figsize=(1.6 + 1.9 * len(groups), 3.8))
    start = {c: starts(results, c) for c in study.clients}
    start_values = [list(start[c].values()) for c in study.clients]
    start_values.append(list(mean_over_clients(start).values()) if all(start.values()) else [])
    for g, v in enumerate(start_values):
        if v:
            ax.hlines(
                100 * statistics.fmean(v),
                g - 0.45,
                g + 0.45,
                colors="black",
                linestyles=":",
                zorder=3,
            )
    ax.plot([], [], "k:", label="start (round 0)")
    for i, arm in enumerate(arms):
        per = {c: finals(results, arm, c, last_round) for c in study.clients}
        values = [list(per[c].values()) for c in study.clients]
        values.append(list(mean_over_clients(per).values()) if all(per.values()) else [])
        ms = [100 * statistics.fmean(v) if v else 0.0 for v in values]
        sds = [100 * statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
        xs = [g + (i - (len(arms) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(
            xs,
            ms,
            width,
            yerr=sds,
            capsize=2,
            label=study.label(arm),
            color=_arm_style(study, arm)["color"],
        )
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel(f"greedy test accuracy at round {last_round} (%)", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, path)


# ---------------------------------------------------------------------------------- document


def _ops(task: dict[str, Any]) -> str:
    ops = task.get("ops")
    if not ops:
        return str(task.get("kind"))
    total = sum(ops.values())
    return ", ".join(f"{100 * w / total:.0f}% `{op}`" for op, w in ops.items() if w > 0)


def _setup(study: FGRPOStudy) -> list[str]:
    run0 = study.runs[0]
    fed = run0.federation
    algo = fed.algorithm
    E, R = algo.local_steps, fed.train.steps  # type: ignore[attr-defined]
    G = fed.train.group_size
    node = fed.nodes[0]
    model = model_label(node.model)
    if node.model.lora:
        model += f" + LoRA r={node.model.lora.r}"
    ws = node.warm_start
    ws_txt = (
        f"warm-started once for {ws.steps} steps on the base task ({_ops(fed.task.model_dump())}), "
        "shared by every arm (the single-node arms load the same cached model)"
        if ws
        else "no warm start"
    )
    L = [
        f"Federation: `{_rel(study.path.parent / study.spec.config)}` with the study's overrides "
        f"({', '.join(f'`{s}`' for s in study.spec.set) or 'none'}). Model: {model}, {ws_txt}. "
        f"{R} rounds of E = {E} local GRPO steps, G = {G} completions per prompt, "
        f"at most {fed.train.max_new_tokens} new tokens, {node.optim.name} lr {node.optim.lr:g}, "
        f"loss `{node.loss.method}` (advantages: group {node.loss.advantage_scale}); a fresh "
        "local optimizer every round in the federation.",
        "",
    ]
    prompts = {}
    rows = []
    for n in fed.nodes:
        spec = algo.client_spec(n.name)  # type: ignore[attr-defined]
        task = run0.client_tasks[n.name]
        prompts[n.name] = spec.prompts_per_step or fed.train.prompts_per_step
        rows.append(
            [
                f"`{n.name}`",
                _ops(task),
                f"0/{spec.reward_scale:g}",
                str(prompts[n.name]),
                f"`test`, {min(fed.eval.size, task.get('test_size', fed.eval.size))} problems",
            ]
        )
    L += _table(["client", "task mix", "reward", "prompts per local step", "eval split"], rows)
    agg = (
        f"Relative-gain settings: gain `{algo.gain}`, baseline `{algo.baseline}` (momentum "  # type: ignore[attr-defined]
        f"{algo.baseline_momentum:g}), temperature {algo.temperature:g}, floor {algo.floor:g}, "  # type: ignore[attr-defined]
        f"gain clip {algo.gain_clip}, performance signal `{algo.performance}` "  # type: ignore[attr-defined]
        f"({algo.performance_size} held-out local problems); server lr {algo.server_lr:g}; "  # type: ignore[attr-defined]
        f"clients per round: {algo.clients_per_round or 'all'}."  # type: ignore[attr-defined]
    )
    L += ["", agg, ""]
    arm_rows = []
    total = sum(prompts.values())
    for arm, a in study.spec.arms.items():
        example = next((r for r in study.runs if r.arm == arm), None)
        if example is None:
            continue
        cfg = example.config
        if a.kind == "federated":
            what = f"`algorithm.aggregation: {cfg.algorithm.aggregation}` (Flower simulation)"  # type: ignore[attr-defined]
            steps = f"{R * E} per client ({R} x {E})"
            samples = f"{R * E * total * G:,}"
        elif a.kind == "centralized":
            what = f"one model, union of the clients' data ({_ops(cfg.task.model_dump())})"
            steps = f"{cfg.train.steps}"
            samples = f"{cfg.train.steps * cfg.train.prompts_per_step * G:,}"
        else:
            what = "each client by itself on its own task (one run per client)"
            steps = f"{cfg.train.steps} per client"
            samples = f"{R * E * total * G:,} (all clients' runs)"
        if a.set:
            what += "; " + ", ".join(f"`{s}`" for s in a.set)
        arm_rows.append([study.label(arm), a.kind, what, steps, samples])
    L += _table(
        ["arm", "kind", "what trains", "optimizer steps", "completions sampled (per seed)"],
        arm_rows,
    )
    L += [
        "",
        "Single-node arms evaluate every E x `eval.every` steps, so their step / E is the "
        "federation's round. A client's accuracy is greedy accuracy on its own task's `test` "
        "split in every arm: a federated run's client rows, an alone run's own rows (its task "
        "is the client's), and for the centralized run the study's evaluation of its "
        f"checkpoints on each client's split (`{CLIENT_EVAL}`, the federated client's "
        "evaluation code and settings). Single-node arms train with the verifier's own 0/1 "
        "rewards: with group-std advantages a client's reward scale cancels within each group.",
    ]
    return L


def _final_table(study: FGRPOStudy, results: list[RunData], last_round: int) -> list[str]:
    clients = study.clients
    header = ["arm", *[f"`{c}`" for c in clients], MEAN, "seeds"]
    start = {c: starts(results, c) for c in clients}
    rows = [
        ["start (round 0)"]
        + [fmt_pct(list(start[c].values())) for c in clients]
        + [fmt_pct(list(mean_over_clients(start).values())) if all(start.values()) else "-", ""]
    ]
    for arm in study.spec.arms:
        per = {c: finals(results, arm, c, last_round) for c in clients}
        if not any(per.values()):
            continue
        mean = mean_over_clients(per) if all(per.values()) else {}
        seeds = sorted(set().union(*(set(v) for v in per.values())))
        rows.append(
            [study.label(arm)]
            + [fmt_pct(list(per[c].values())) for c in clients]
            + [fmt_pct(list(mean.values())), str(len(seeds))]
        )
    return _table(header, rows)


def _difference_table(study: FGRPOStudy, results: list[RunData], last_round: int) -> list[str]:
    """Each federated arm minus each reference (the FedAvg arms, the centralized arm, the alone
    arm), per client and over clients, at the last round, paired by seed with an interval."""
    clients = study.clients
    arms = study.spec.arms
    fed = [a for a, spec in arms.items() if spec.kind == "federated"]
    refs = [a for a in fed if arms[a].aggregation == "fedavg"]
    refs += [a for a, spec in arms.items() if spec.kind in ("centralized", "alone")]
    per = {a: {c: finals(results, a, c, last_round) for c in clients} for a in arms}
    diffs = Differences()
    rows = []
    for ref in refs:
        for arm in fed:
            if arm == ref or not any(per[arm].values()) or not any(per[ref].values()):
                continue
            where = f"{study.label(arm)} − {study.label(ref)}"
            cells = [diffs.cell(f"{where}, {c}", per[arm][c], per[ref][c]) for c in clients]
            mine = mean_over_clients(per[arm]) if all(per[arm].values()) else {}
            theirs = mean_over_clients(per[ref]) if all(per[ref].values()) else {}
            cells.append(diffs.cell(f"{where}, {MEAN}", mine, theirs))
            seeds = len(set(mine) & set(theirs))
            rows.append([study.label(arm), study.label(ref), *cells, str(seeds)])
    if not rows:
        return []
    header = ["arm (A)", "minus (B)", *[f"`{c}`" for c in clients], MEAN, "seeds"]
    return [
        f"Final accuracy at round {last_round}, arm minus reference. {DIFFERENCES_NOTE}",
        "",
        *_table(header, rows),
        "",
        diffs.summary(),
        "",
    ]


def _stability_tables(study: FGRPOStudy, results: list[RunData]) -> list[str]:
    st = study.spec.stability
    clients = study.clients
    stats: dict[tuple[str, str], list[Stability]] = {}
    for arm in study.spec.arms:
        for c in clients:
            stats[(arm, c)] = [
                stability(acc, last=st.last, drop=st.drop)
                for acc in curves(results, arm, c).values()
            ]
    L: list[str] = []
    specs = [
        (
            f"Std of accuracy over the last {st.last} evaluated rounds (percentage points; "
            "population std of each curve's tail, then mean ± std over seeds):",
            lambda s: 100 * s.last_std,
            spread,
        ),
        (
            f"Drops: evaluated rounds where accuracy fell by more than {100 * st.drop:g} points "
            "since the previous evaluation (count per run, mean ± std over seeds):",
            lambda s: float(s.drops),
            spread,
        ),
        (
            "Largest fall between consecutive evaluations (percentage points, mean ± std over "
            "seeds):",
            lambda s: 100 * s.worst_drop,
            spread,
        ),
    ]
    for title, value, fmt in specs:
        rows = []
        for arm in study.spec.arms:
            cells = [fmt([value(s) for s in stats[(arm, c)]]) for c in clients]
            if any(c != "-" for c in cells):
                rows.append([study.label(arm), *cells])
        L += [title, "", *_table(["arm", *[f"`{c}`" for c in clients]], rows), ""]
    return L


def _weights_table(study: FGRPOStudy, results: list[RunData]) -> list[str]:
    clients = study.clients
    rows = []
    for arm, a in study.spec.arms.items():
        if a.kind != "federated":
            continue
        mine = [r for r in results if r.run.arm == arm]
        if not mine:
            continue
        cells = [
            spread([100 * statistics.fmean(r.weights[c]) for r in mine if r.weights.get(c)])
            for c in clients
        ]
        rej = sum(r.rejected for r in mine)
        drp = sum(r.dropped for r in mine)
        rows.append([study.label(arm), *cells, f"{rej:g} / {drp:g}"])
    if not rows:
        return ["_No complete federated run._"]
    return _table(
        ["arm", *[f"`{c}` (%)" for c in clients], "rejected / dropped replies (all runs)"], rows
    )


def _runs_table(study: FGRPOStudy, results: list[RunData], out_dir: Path) -> list[str]:
    rows = []
    for arm in study.spec.arms:
        total = [r for r in study.runs if r.arm == arm]
        mine = [r for r in results if r.run.arm == arm]
        secs = [r.seconds for r in mine if r.seconds is not None]
        rows.append(
            [
                study.label(arm),
                f"{len(mine)} of {len(total)}",
                f"{statistics.fmean(secs):.0f}" if secs else "-",
                f"{sum(secs) / 60:.1f}" if secs else "-",
            ]
        )
    L = _table(["arm", "runs complete", "mean s per run", "total min"], rows)
    L += [
        "",
        code_line(results, arm=lambda r: study.label(r.run.arm))
        + " "
        + invocations_line(out_dir, codes=False),
    ]
    return L


def render(
    study: FGRPOStudy,
    results: list[RunData],
    missing: list[str],
    out_dir: Path,
    report_path: Path,
    reading: str,
) -> str:
    rel = _rel(study.path)
    last_round = study.runs[0].federation.train.steps if study.runs else 0
    L = [
        f"# Results: FGRPO study `{study.spec.name}`",
        "",
        f"<!-- Generated by `ftis sweep {rel}` from the run directories; edit only the "
        "hand-written section below. -->",
        "",
    ]
    L += partial_lines(len(results), len(study.runs), missing, rel)
    if study.spec.description:
        L += [study.spec.description.strip(), ""]
    seeds = sorted({r.run.seed for r in results})
    L += regenerate_lines(
        rel, out_dir, "Seeds (`train.seed`): " + (", ".join(map(str, seeds)) or "none yet") + "."
    )
    L += [
        "## Setup",
        "",
        *(_setup(study) if study.runs else []),
        "",
        "## Final accuracy per client",
        "",
        f"Greedy accuracy on each client's eval split at round {last_round}, percent, mean ± "
        "sample std over seeds. `start` is the shared base model. "
        f"'{MEAN}' is the mean of a seed's client accuracies (the clients' eval splits are of "
        "equal size, so this is the accuracy on their union).",
        "",
        *_final_table(study, results, last_round),
        "",
    ]
    assets = report_path.parent / report_path.stem
    final = assets / "final.png"
    drawn = plot_finals(study, results, final, last_round)
    L += figure_lines(drawn, final, report_path, "final accuracy per client")
    diff = _difference_table(study, results, last_round)
    if diff:
        L += ["## Paired differences with intervals", "", *diff]
    L += ["## Accuracy across rounds", ""]
    curves_png = assets / "curves.png"
    L += figure_lines(
        plot_curves(study, results, curves_png),
        curves_png,
        report_path,
        "accuracy against round",
        "Mean over seeds, band ± sample std. Dashed: each client alone; dash-dot: centralized "
        "GRPO on the union.",
    )
    L += ["## Stability across rounds", "", *_stability_tables(study, results)]
    L += [
        "## Aggregation weights (federated arms)",
        "",
        "Mean weight each client's delta got per round (percent; mean over rounds, then mean ± "
        "std over seeds), and the replies the server rejected or missed.",
        "",
        *_weights_table(study, results),
        "",
        "## Runs",
        "",
        *_runs_table(study, results, out_dir),
        "",
        *reading_lines(reading),
    ]
    return "\n".join(L)


def write_fgrpo_results(
    study: FGRPOStudy, *, out_dir: Path | None = None, report_path: Path | None = None
) -> Path:
    """Regenerate the study's results document (and its plots) from its run directories (the
    study kind "fgrpo" names this module's renderer; ftis.study.engine.write_results)."""
    from ftis.study.engine import write_results

    return write_results(study, out_dir=out_dir, report_path=report_path)
