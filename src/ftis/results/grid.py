"""The F-TIS family's study document (docs/RESULTS.md, docs/results/reco.md, ...): a grid study's
run directories turned into tables (mean ± std over seeds), curves and the equal-budget plots.
Everything is recomputed from each run's metrics.jsonl. Registered as the study renderer "ftis"
(the default of a grid study's `results`) in ftis.algos.

A section between READING_BEGIN and READING_END in an existing results file is hand-written and is
carried over verbatim when the file is regenerated (ftis.study.document).
"""

from __future__ import annotations

import json
import logging
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftis.models.sources import model_label
from ftis.study.document import partial_lines, reading_lines
from ftis.study.pages import figure_lines, finish_axes, save, section
from ftis.study.runner import RUN_META, run_status
from ftis.study.spec import RunSpec, Study
from ftis.study.stats import at_equal_tokens
from ftis.study.tables import (
    DIFFERENCES_NOTE,
    Differences,
    fmt_pct,
    regenerate_lines,
    spread,
)
from ftis.study.tables import code_line as _code_line
from ftis.study.tables import invocations_line as _invocations_line
from ftis.study.tables import rel as _rel
from ftis.study.tables import table as _table
from ftis.train.metrics import read_metrics

log = logging.getLogger(__name__)

SPLITS = ("test", "ood")


@dataclass
class NodeCurve:
    """One node of one run: eval points (step, tokens generated, RL wall seconds, accuracy per
    split, other eval metrics such as pass@k) and per-step training statistics."""

    steps: list[int] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    acc: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    # other eval/* metrics (pass@k, distinct answers, ...), keyed without eval/: step -> value
    evals: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    filtered: float | None = None
    is_mean: float | None = None  # mean over steps of loss/is_weight_mean
    is_max: float | None = None  # max over steps of loss/is_weight_max
    lengths: list[float] = field(default_factory=list)  # train/completion_tokens per RL step
    # every numeric loss/* metric over the RL steps: its mean and its largest value
    loss_mean: dict[str, float] = field(default_factory=dict)
    loss_max: dict[str, float] = field(default_factory=dict)

    def final(self, split: str) -> float | None:
        v = self.acc.get(split)
        return v[-1] if v else None

    def start(self, split: str) -> float | None:
        v = self.acc.get(split)
        return v[0] if v else None

    def final_eval(self, key: str) -> float | None:
        """The metric at the last eval point (None when that eval did not log it)."""
        return self.evals.get(key, {}).get(self.steps[-1]) if self.steps else None

    def start_eval(self, key: str) -> float | None:
        """The metric at the first eval point, step 0 (None when that eval did not log it)."""
        return self.evals.get(key, {}).get(self.steps[0]) if self.steps else None


@dataclass
class RunResult:
    run: RunSpec
    nodes: dict[str, NodeCurve]
    seconds: float | None
    code: str | None = None  # the ftis version (and git commit) that made the run


def _mean_of(rows: list[dict], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def node_curves(rows: list[dict[str, Any]]) -> dict[str, NodeCurve]:
    """Per node, the eval points of a run. Tokens and wall time are 0 at step 0; wall time is the
    RL part (train/elapsed_seconds minus the step-0 row's time/setup: model build, warm start)."""
    out: dict[str, NodeCurve] = {}
    by_node: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if "node" in r:
            by_node[r["node"]].append(r)
    for node, mine in by_node.items():
        mine.sort(key=lambda r: r["step"])
        c = NodeCurve()
        setup = next((float(r.get("time/setup") or 0.0) for r in mine if r["step"] == 0), 0.0)
        c.filtered = _mean_of(mine, "loss/filtered_frac")
        c.is_mean = _mean_of(mine, "loss/is_weight_mean")
        maxes = [float(r["loss/is_weight_max"]) for r in mine if r.get("loss/is_weight_max")]
        c.is_max = max(maxes) if maxes else None
        per_key: dict[str, list[float]] = defaultdict(list)
        for r in mine:
            for key, v in r.items():
                if key.startswith("loss/") and isinstance(v, int | float):
                    per_key[key[len("loss/") :]].append(float(v))
        c.loss_mean = {k: sum(v) / len(v) for k, v in per_key.items()}
        c.loss_max = {k: max(v) for k, v in per_key.items()}
        c.lengths = [
            float(r["train/completion_tokens"])
            for r in mine
            if r.get("train/completion_tokens") is not None and r["step"] > 0
        ]
        for r in mine:
            if r.get("eval/accuracy") is None:
                continue
            c.steps.append(int(r["step"]))
            c.tokens.append(float(r.get("train/generated_tokens_total") or 0.0))
            el = r.get("train/elapsed_seconds")
            c.seconds.append(max(0.0, float(el) - setup) if el is not None else 0.0)
            for key, v in r.items():
                if not key.startswith("eval/") or not isinstance(v, int | float):
                    continue
                name = key[len("eval/") :]
                if name.endswith("/accuracy"):
                    c.acc[name[: -len("/accuracy")]].append(float(v))
                elif name not in ("accuracy", "size"):
                    c.evals[name][int(r["step"])] = float(v)
        out[node] = c
    return out


def collect(study: Study, out_dir: Path) -> tuple[list[RunResult], list[str]]:
    """Results of the study's complete runs, and the ids of the runs that are not complete."""
    results, missing = [], []
    for run in study.runs:
        d = out_dir / run.id
        if run_status(d, run.config) != "done":
            missing.append(run.id)
            continue
        meta = {}
        try:
            meta = json.loads((d / RUN_META).read_text())
        except (OSError, ValueError):
            pass
        curves = node_curves(read_metrics(d / "metrics.jsonl"))
        results.append(RunResult(run, curves, meta.get("seconds"), meta.get("code")))
    return results, missing


# ------------------------------------------------------------------------------------ grouping


def _node_order(study: Study, pairing: str) -> list[str]:
    for r in study.runs:
        if r.pairing == pairing and r.node is None:
            return [n.name for n in r.config.nodes]
    return list(dict.fromkeys(r.node for r in study.runs if r.pairing == pairing and r.node))


def _variant_order(study: Study, pairing: str) -> list[str]:
    return list(dict.fromkeys(r.variant for r in study.runs if r.pairing == pairing))


def _label(study: Study, variant: str) -> str:
    method, *rest = variant.split(" ")
    m = study.spec.methods.get(method)
    label = (m.label if m and m.label else method) if m else method
    extra = ["horizontal" if x == "h" else x for x in rest]
    return " ".join([label, *extra]) if extra else label


def finals(
    results: list[RunResult], pairing: str, variant: str, node: str, split: str
) -> list[float]:
    """Final accuracy of `node` over seeds, for one pairing and variant (alone runs included)."""
    return node_values(results, pairing, variant, node, lambda c: c.final(split))


def starts(results: list[RunResult], pairing: str, node: str, split: str) -> list[float]:
    """Step-0 accuracy of a node (the warm-started model), one value per distinct seed."""
    return _per_seed_start(results, pairing, node, lambda c: c.start(split))


def _per_seed_start(results: list[RunResult], pairing: str, node: str, fn) -> list[float]:
    """`fn(curve)` at step 0 of a node, one value per distinct seed (the first run's)."""
    by_seed = {}
    for res in results:
        c = res.nodes.get(node)
        v = fn(c) if res.run.pairing == pairing and c is not None else None
        if v is not None:
            by_seed.setdefault(res.run.seed, v)
    return list(by_seed.values())


def node_values(results: list[RunResult], pairing: str, variant: str, node: str, fn) -> list[float]:
    """`fn(curve)` of `node` over the seeds of one pairing and variant (None results dropped)."""
    out = []
    for res in results:
        r = res.run
        if r.pairing != pairing or r.variant != variant or (r.node not in (None, node)):
            continue
        c = res.nodes.get(node)
        v = fn(c) if c is not None else None
        if v is not None:
            out.append(float(v))
    return out


def splits_of(results: list[RunResult], pairing: str) -> list[str]:
    """The eval splits logged in a pairing's runs: `test` and `ood` first, then the others."""
    seen: dict[str, None] = {}
    for res in results:
        if res.run.pairing == pairing:
            for c in res.nodes.values():
                seen.update(dict.fromkeys(c.acc))
    return [s for s in SPLITS if s in seen] + [s for s in seen if s not in SPLITS]


def eval_keys_of(results: list[RunResult], pairing: str, match) -> list[str]:
    """Other eval metrics (pass@k, distinct answers) logged in a pairing's runs, pass@k by k."""
    seen: dict[str, None] = {}
    for res in results:
        if res.run.pairing == pairing:
            for c in res.nodes.values():
                seen.update(dict.fromkeys(k for k in c.evals if match(k)))

    def order(key: str):
        tail = key.rsplit("@", 1)[-1]
        return (key.split("@")[0], int(tail) if tail.isdigit() else 0, key)

    return sorted(seen, key=order)


# ---------------------------------------------------------------------------------------- plots


def _mean_curve(curves: list[NodeCurve], x: str, split: str = "test"):
    """Mean x and mean accuracy at each eval index over seeds (curves share their eval steps)."""
    n = min(len(c.steps) for c in curves)
    xs = [statistics.fmean(getattr(c, x)[i] for c in curves) for i in range(n)]
    ys = [100 * statistics.fmean(c.acc[split][i] for c in curves) for i in range(n)]
    return xs, ys


def _curves_for(results, pairing, variant, node) -> list[NodeCurve]:
    out = []
    for res in results:
        r = res.run
        if r.pairing == pairing and r.variant == variant and r.node in (None, node):
            c = res.nodes.get(node)
            if c is not None and c.steps:
                out.append(c)
    return out


def _node_panels(study: Study, pairings: list[str], path: Path, draw, *, xlabel, ylabel) -> None:
    """One figure: rows = pairings, columns = the pairing's nodes; `draw(ax, pairing, node)`
    plots one panel, then the panel gets its title, labels, grid and legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = max(len(_node_order(study, p)) for p in pairings)
    fig, axes = plt.subplots(
        len(pairings), ncols, figsize=(5.2 * ncols, 3.4 * len(pairings)), squeeze=False
    )
    for i, p in enumerate(pairings):
        nodes = _node_order(study, p)
        for j in range(ncols):
            ax = axes[i][j]
            if j >= len(nodes):
                ax.axis("off")
                continue
            ax.set_prop_cycle(color=[*plt.cm.tab10.colors, "black", "gold"])  # 12 distinct
            draw(ax, p, nodes[j])
            ax.set_title(f"{study.spec.pairings[p].label or p}: {nodes[j]}", fontsize=10)
            finish_axes(ax, xlabel=xlabel, ylabel=ylabel, legend=6.5, fontsize=8)
    save(fig, path)


def plot_grid(study: Study, results: list[RunResult], path: Path, *, x: str, variants=None) -> bool:
    """Rows = pairings, columns = the pairing's nodes; one line per variant (mean over seeds)."""
    pairings = [p for p in study.spec.pairings if any(r.run.pairing == p for r in results)]
    if not pairings:
        return False

    def draw(ax, p: str, node: str) -> None:
        for v in variants or _variant_order(study, p):
            if v not in _variant_order(study, p):
                continue
            curves = _curves_for(results, p, v, node)
            if not curves:
                continue
            xs, ys = _mean_curve(curves, x)
            style = "--" if v.split(" ")[0] == "alone" else "-"
            label = f"{_label(study, v)} (n={len(curves)})"
            ax.plot(xs, ys, style, marker="o", ms=2.5, label=label)

    xlabel = {
        "steps": "RL step",
        "tokens": "completion tokens generated by this node",
        "seconds": "RL wall time of the run (s)",
    }[x]
    _node_panels(study, pairings, path, draw, xlabel=xlabel, ylabel="greedy test accuracy (%)")
    return True


def plot_passk(study: Study, results: list[RunResult], path: Path) -> bool:
    """Rows = pairings, columns = nodes; pass@k against k (log scale) per variant at the last
    eval, and the step-0 curve of the warm start. False (nothing drawn) without pass@k."""

    def passk_keys(p: str) -> list[str]:
        return eval_keys_of(results, p, lambda k: k.startswith("pass@"))

    pairings = [p for p, _ in _pairings_with_results(study, results) if passk_keys(p)]
    if not pairings:
        return False

    def draw(ax, p: str, node: str) -> None:
        keys = passk_keys(p)
        ks = [int(k.split("@")[1]) for k in keys]
        start = [_starts_eval(results, p, node, k) for k in keys]
        if all(start):
            ys = [100 * statistics.fmean(v) for v in start]
            ax.plot(ks, ys, "--", color="grey", marker="o", ms=2.5, label="step 0")
        for v in _variant_order(study, p):
            vals = [node_values(results, p, v, node, lambda c, k=k: c.final_eval(k)) for k in keys]
            if not all(vals):
                continue
            ys = [100 * statistics.fmean(x) for x in vals]
            label = f"{_label(study, v)} (n={len(vals[0])})"
            ax.plot(ks, ys, "-", marker="o", ms=2.5, label=label)
        ax.set_xscale("log", base=2)

    _node_panels(study, pairings, path, draw, xlabel="k", ylabel="pass@k (%)")
    return True


# ------------------------------------------------------------------------------------- document


def _main_variants(study: Study, pairing: str) -> list[str]:
    return [v for v in _variant_order(study, pairing) if " " not in v]


def _setup_lines(study: Study) -> list[str]:
    lines = []
    rows = []
    for p, ps in study.spec.pairings.items():
        r = next((r for r in study.runs if r.pairing == p and r.node is None), None)
        r = r or next((r for r in study.runs if r.pairing == p), None)
        if r is None:
            continue
        c = r.config
        nodes = []
        for n in c.nodes:
            m = model_label(n.model)
            if n.model.lora:
                m += f" + LoRA r={n.model.lora.r}"
            ws = f", warm start {n.warm_start.steps} steps" if n.warm_start else ""
            if n.warm_start and n.warm_start.mix:
                ws += f" on mix {json.dumps(n.warm_start.mix)}"
            nodes.append(f"`{n.name}`: {m}{ws}, lr {n.optim.lr:g}")
        rows.append(
            [
                ps.label or p,
                "; ".join(nodes),
                _task_line(c.task),
                f"{c.train.steps} x {c.train.prompts_per_step} prompts x G={c.train.group_size}",
                _eval_line(c),
            ]
        )
    lines += _table(["pairing", "nodes", "task", "RL steps", "greedy eval"], rows)
    return lines


# Task fields added after documents were generated (issue 36): shown only when set otherwise.
LATE_TASK_FIELDS = ("reward_max_error_share", "skip_bad_rows")


def _task_line(task: Any) -> str:
    """The task's kind and the fields a reader needs to know what it asks (no seeds, no sizes)."""
    data = task.model_dump(mode="json", exclude_none=True)
    for key in ("kind", "seed", "ood", "test_size", "size", "data_files"):
        data.pop(key, None)
    fields = type(task).model_fields
    for key in LATE_TASK_FIELDS:  # at their defaults they change nothing a reader needs
        if key in data and key in fields and data[key] == fields[key].default:
            del data[key]
    return f"`{task.kind}`: " + ", ".join(f"{k} {json.dumps(v)}" for k, v in data.items())


def _eval_line(c: Any) -> str:
    """Greedy eval splits and pass@k settings of a run config."""
    ood = getattr(c.task, "ood", None)
    names = ["test", *(ood.keys() if isinstance(ood, dict) else ["ood"])]
    line = f"{', '.join(names)} (at most {c.eval.size} each), every {c.eval.every} steps"
    if c.eval.pass_samples:
        ks = ", ".join(map(str, c.eval.pass_k))
        line += f"; pass@{{{ks}}} from {c.eval.pass_samples} samples of {c.eval.pass_problems}"
    return line


def render(
    study: Study,
    results: list[RunResult],
    missing: list[str],
    out_dir: Path,
    report_path: Path,
    reading: str,
) -> str:
    total = len(study.runs)
    has_alone = any(m.alone for m in study.spec.methods.values())
    seconds = [r.seconds for r in results if r.seconds is not None]
    seeds = sorted({r.run.seed for r in results})
    rel = _rel(study.path)
    L = [
        f"# Results: study `{study.spec.name}`",
        "",
        "<!-- Generated by `ftis sweep` from the run directories; edit only the hand-written "
        "section below. -->",
        "",
    ]
    L += partial_lines(len(results), total, missing, rel)
    if study.spec.description:
        L += [study.spec.description.strip(), ""]
    L += regenerate_lines(
        rel,
        out_dir,
        "Seeds: " + ", ".join(map(str, seeds)) + " (`train.seed`: prompt order and sampling; warm "
        "starts are shared across seeds).",
    )
    L += [
        "## Setup",
        "",
        *_setup_lines(study),
        "",
        f"{total} runs in the study ({len(results)} complete). Sum of the complete runs' wall "
        f"times, warm starts included: {sum(seconds) / 60:.1f} min"
        + (f" (mean {statistics.fmean(seconds):.0f} s per run)" if seconds else "")
        + ". "
        + _invocations_line(out_dir),
        "",
        _code_line(results),
        "",
        "Accuracy is greedy accuracy on the task's held-out `test` split (in distribution) and "
        "its `ood` split (out of distribution: harder than the problems RL trains on, see the "
        "pairing configs), at the last step, as "
        "**mean ± sample std over seeds** in percent."
        + (
            " `Alone` trains each node by itself with "
            "the plain clipped GRPO loss (`vis`) on its own samples, generating every group of a "
            "step; in a two-node run each node generates half of the step's groups and trains on "
            "all of them."
            if has_alone
            else ""
        ),
        "",
    ]
    L += [
        "## At step 0: the warm-started models",
        "",
        "Greedy accuracy per eval split and pass@k before any RL step (the same warm start for "
        "every method and seed; mean ± std over the seeds' step-0 evaluations), and the mean "
        "completion length at the first RL step.",
        "",
    ]
    L += _start_section(study, results)
    L += ["## Final accuracy per pairing, method and node", ""]
    for p, ps in study.spec.pairings.items():
        if not any(r.run.pairing == p for r in results):
            continue
        nodes = _node_order(study, p)
        header = ["method"] + [f"{n} {s}" for s in SPLITS for n in nodes] + ["seeds", "filtered"]
        rows = [
            ["start (step 0)"]
            + [fmt_pct(starts(results, p, n, s)) for s in SPLITS for n in nodes]
            + ["", ""]
        ]
        for v in _variant_order(study, p):
            vals = [finals(results, p, v, n, s) for s in SPLITS for n in nodes]
            if not any(vals):
                continue
            filt = [
                c.filtered
                for res in results
                if res.run.pairing == p and res.run.variant == v
                for c in res.nodes.values()
                if c.filtered is not None
            ]
            n_seeds = len(
                {res.run.seed for res in results if res.run.pairing == p and res.run.variant == v}
            )
            rows.append(
                [_label(study, v)]
                + [fmt_pct(x) for x in vals]
                + [
                    str(n_seeds),
                    f"{100 * statistics.fmean(filt):.1f}%" if filt and v.startswith("f-") else "-",
                ]
            )
        L += [f"### {ps.label or p}", ""]
        if ps.description:
            L += [ps.description, ""]
        L += _table(header, rows) + [""]
    L += [
        "'filtered' is the mean fraction of training sequences the F- filter zeroed per step "
        "(own and peers' samples together).",
        "",
        *section(
            "Accuracy per eval split",
            _skill_section(study, results),
            "Final greedy accuracy on the pairings' other eval splits (e.g. one skill each).",
            end=False,
        ),
        *section(
            "pass@k",
            _passk_section(study, results),
            "Unbiased pass@k on the first eval split at the last step, from `eval.pass_samples` "
            "samples per problem at the sampling temperature (distinct answers: distinct final "
            "answers among a problem's samples, when logged).",
            end=False,
        ),
        "## Off-policy statistics and completion lengths",
        "",
        "Per node, over its RL steps: the fraction of training sequences the F- filter zeroed "
        "(own and peers' samples), the mean and the largest token importance weight "
        "exp(logp_train - logp_gen) seen (1 for own on-policy samples), and the mean completion "
        "length in tokens over the last 5 steps.",
        "",
        *_offpolicy_section(study, results),
    ]
    if has_alone:
        L += [
            "## Gain over training alone",
            "",
            "Final test accuracy minus the same node's `Alone` accuracy, in percentage points "
            "(difference of the seed means; ± the std of the per-seed differences, seeds paired).",
            "",
            *_gain_table(study, results),
            "",
            "## Equal budget: accuracy per generated token",
            "",
            "With vertical sharing a node in a pair generates half of the groups it trains on. "
            "Here each two-node run's final test accuracy is set against its node's `Alone` run "
            "at the evaluation where Alone had generated about as many completion tokens itself "
            "(the nearest evaluation point; mean ± std over seeds; tokens are means over seeds).",
            "",
            *_budget_table(study, results),
            "",
        ]
    L += _difference_section(study, results)
    L += ["## Curves", ""]
    # one folder per document (docs/RESULTS.md -> docs/results/results/), so two studies'
    # reports in the same folder never overwrite each other's plots
    assets = report_path.parent / "results" / report_path.stem.lower()
    for name, x, title in [
        ("curves.png", "steps", "Test accuracy against RL step (mean over seeds)."),
        (
            "budget-tokens.png",
            "tokens",
            "Equal-budget view: test accuracy against the completion "
            "tokens each node generated itself. With vertical sharing a node in a pair generates "
            "half of what it trains on, so at a given token count it has taken twice as many steps "
            "as Alone.",
        ),
        (
            "budget-time.png",
            "seconds",
            "Equal-budget view: test accuracy against the run's RL "
            "wall time (after warm start). Both nodes of a pair share the same 2 CPU cores, one "
            "process each, while Alone has both cores to itself; on separate machines a pair's "
            "wall time would be about that of one node.",
        ),
    ]:
        if x != "steps" and not has_alone:
            continue
        variants = None if x == "steps" else _budget_variants(study)
        drawn = plot_grid(study, results, assets / name, x=x, variants=variants)
        L += figure_lines(drawn, assets / name, report_path, name, title)
    L += figure_lines(
        plot_passk(study, results, assets / "passk.png"),
        assets / "passk.png",
        report_path,
        "passk.png",
        "pass@k against k at the last step (solid) and at step 0 (dashed, the warm start), mean "
        "over seeds.",
    )
    L += reading_lines(reading)
    return "\n".join(L)


def _pairings_with_results(study: Study, results: list[RunResult]):
    for p, ps in study.spec.pairings.items():
        if any(r.run.pairing == p for r in results):
            yield p, ps


def _start_section(study: Study, results: list[RunResult]) -> list[str]:
    """Per pairing: each node's step-0 accuracy on every split and pass@k, and the gap between
    the nodes on each split (the expertise gap when the splits are per-skill)."""
    L: list[str] = []
    for p, ps in _pairings_with_results(study, results):
        nodes = _node_order(study, p)
        splits = splits_of(results, p)
        passk = eval_keys_of(results, p, lambda k: k.startswith("pass@"))
        distinct = eval_keys_of(results, p, lambda k: "distinct_answers" in k)
        rows = []
        means: dict[tuple[str, str], float] = {}
        for n in nodes:
            cells = []
            for sp in splits:
                vals = starts(results, p, n, sp)
                if vals:
                    means[(n, sp)] = statistics.fmean(vals)
                cells.append(fmt_pct(vals))
            for k in passk:
                cells.append(fmt_pct(_starts_eval(results, p, n, k)))
            for k in distinct:
                cells.append(spread(_starts_eval(results, p, n, k), 2))
            first = [
                c.lengths[0]
                for res in results
                if res.run.pairing == p
                for name, c in res.nodes.items()
                if name == n and c.lengths
            ]
            cells.append(f"{statistics.fmean(first):.1f}" if first else "-")
            rows.append([n, *cells])
        header = ["node", *splits, *passk, *distinct, "completion tokens (step 1)"]
        L += [f"### {ps.label or p}", "", *_table(header, rows), ""]
        if len(nodes) >= 2:
            gaps = []
            for sp in splits:
                have = [(means[(n, sp)], n) for n in nodes if (n, sp) in means]
                if len(have) >= 2:
                    (hi, top), (lo, _) = max(have), min(have)
                    gaps.append(f"{sp}: `{top}` +{100 * (hi - lo):.1f}")
            if gaps:
                L += ["Gap between the nodes at step 0 (points): " + "; ".join(gaps) + ".", ""]
    return L


def _starts_eval(results: list[RunResult], pairing: str, node: str, key: str) -> list[float]:
    """Step-0 value of an eval metric (pass@k, ...) of a node, one value per distinct seed."""
    return _per_seed_start(results, pairing, node, lambda c: c.start_eval(key))


def _method_table(
    study: Study, results: list[RunResult], p: str, columns: list[tuple[str, Any]]
) -> list[str]:
    """Rows = the pairing's variants; one column per (node, label, fn(curve) -> cell values)."""
    nodes = _node_order(study, p)
    header = ["method"] + [f"{n} {label}" for n in nodes for label, _ in columns]
    rows = []
    for v in _variant_order(study, p):
        cells = [fmt(node_values(results, p, v, n, fn)) for n in nodes for _, (fn, fmt) in columns]
        if any(c != "-" for c in cells):
            rows.append([_label(study, v), *cells])
    return _table(header, rows) if rows else []


def _skill_section(study: Study, results: list[RunResult]) -> list[str]:
    L: list[str] = []
    for p, ps in _pairings_with_results(study, results):
        extra = [sp for sp in splits_of(results, p) if sp not in SPLITS]
        if not extra:
            continue
        cols = [(sp, ((lambda c, sp=sp: c.final(sp)), fmt_pct)) for sp in extra]
        L += [f"### {ps.label or p}", "", *_method_table(study, results, p, cols), ""]
    return L


def _passk_section(study: Study, results: list[RunResult]) -> list[str]:
    L: list[str] = []
    for p, ps in _pairings_with_results(study, results):
        keys = eval_keys_of(results, p, lambda k: k.startswith("pass@"))
        keys += eval_keys_of(results, p, lambda k: "distinct_answers" in k)
        if not keys:
            continue
        cols = [
            (
                k,
                (
                    (lambda c, k=k: c.final_eval(k)),
                    fmt_pct if k.startswith("pass@") else (lambda v: spread(v, 2)),
                ),
            )
            for k in keys
        ]
        L += [f"### {ps.label or p}", "", *_method_table(study, results, p, cols), ""]
    return L


def _offpolicy_section(study: Study, results: list[RunResult]) -> list[str]:
    L: list[str] = []
    for p, ps in _pairings_with_results(study, results):
        cols = [
            ("filtered", ((lambda c: c.filtered), fmt_pct)),
            ("IS mean", ((lambda c: c.is_mean), lambda v: spread(v, 3))),
            ("IS max", ((lambda c: c.is_max), lambda v: spread(v, 1))),
            (
                "tokens (last 5 steps)",
                (
                    (lambda c: statistics.fmean(c.lengths[-5:]) if c.lengths else None),
                    lambda v: spread(v, 2),
                ),
            ),
        ]
        logged = {
            k
            for res in results
            if res.run.pairing == p
            for c in res.nodes.values()
            for k in c.loss_mean
        }
        if "variance_ratio_mean" in logged:  # ReCo's statistics
            cols += [
                (
                    "variance ratio mean",
                    ((lambda c: c.loss_mean.get("variance_ratio_mean")), lambda v: spread(v, 3)),
                ),
                (
                    "ReCo weight max",
                    ((lambda c: c.loss_max.get("reco_weight_max")), lambda v: spread(v, 2)),
                ),
                ("clipped", ((lambda c: c.loss_mean.get("clip_frac")), fmt_pct)),
            ]
        L += [f"### {ps.label or p}", "", *_method_table(study, results, p, cols), ""]
    return L


def _budget_variants(study: Study) -> list[str]:
    wanted = ["alone", "f-tis", "vis", "nois"]
    return [m for m in wanted if m in study.spec.methods]


def _against_alone(study: Study, variants_of):
    """(pairing, its spec, its Alone variant, a variant compared with it) for every pairing
    that has an Alone variant and every other variant of `variants_of(study, pairing)`."""
    for p, ps in study.spec.pairings.items():
        alone = [v for v in _variant_order(study, p) if study.spec.methods[v.split(" ")[0]].alone]
        if not alone:
            continue
        for v in variants_of(study, p):
            if v not in alone:
                yield p, ps, alone[0], v


def _budget_table(study: Study, results: list[RunResult]) -> list[str]:
    rows = []
    for p, ps, alone, v in _against_alone(study, _main_variants):
        for n in _node_order(study, p):
            mine = _curves_for(results, p, v, n)
            base = _curves_for(results, p, alone, n)
            if not mine or not base:
                continue
            tokens = statistics.fmean(c.tokens[-1] for c in mine)
            k = min(len(c.steps) for c in base)
            mean_tokens = [statistics.fmean(c.tokens[i] for c in base) for i in range(k)]
            i = min(range(k), key=lambda j: abs(mean_tokens[j] - tokens))
            rows.append(
                [
                    ps.label or p,
                    _label(study, v),
                    n,
                    f"{tokens:,.0f}",
                    fmt_pct([c.final("test") for c in mine]),
                    f"{mean_tokens[i]:,.0f} (step {base[0].steps[i]})",
                    fmt_pct([c.acc["test"][i] for c in base]),
                ]
            )
    header = (
        "pairing | method | node | tokens (pair, final) | test acc (pair) | "
        "tokens (Alone, nearest) | test acc (Alone, then)"
    )
    return _table(header, rows, empty="_No Alone baseline in the complete runs._")


def _gain_table(study: Study, results: list[RunResult]) -> list[str]:
    rows = []
    for p, ps, alone, v in _against_alone(study, _variant_order):
        nodes = _node_order(study, p)
        cells = []
        for n in nodes:
            base = {
                res.run.seed: res.nodes[n].final("test")
                for res in results
                if res.run.pairing == p
                and res.run.variant == alone
                and res.run.node == n
                and n in res.nodes
            }
            mine = {
                res.run.seed: res.nodes[n].final("test")
                for res in results
                if res.run.pairing == p and res.run.variant == v and n in res.nodes
            }
            common = sorted(set(base) & set(mine))
            gains = [100 * (mine[s] - base[s]) for s in common]
            cells.append(spread(gains, signed=True) if common else "-")
        if any(c != "-" for c in cells):
            rows.append(
                [ps.label or p, _label(study, v), *[f"{n}: {c}" for n, c in zip(nodes, cells)]]
            )
    if not rows:
        return ["_No Alone baseline in the complete runs._"]
    width = max(len(r) for r in rows)
    rows = [r + [""] * (width - len(r)) for r in rows]
    return _table(["pairing", "method"] + [f"node {i + 1}" for i in range(width - 2)], rows)


# --------------------------------------------------------------------------- paired differences


def _baseline(study: Study, pairing: str) -> str | None:
    """The variant a pairing's others are compared with: its Alone, else its first variant."""
    variants = _variant_order(study, pairing)
    alone = [v for v in variants if study.spec.methods[v.split(" ")[0]].alone]
    return alone[0] if alone else (variants[0] if variants else None)


def _by_seed(results: list[RunResult], pairing: str, variant: str, node: str) -> dict[int, Any]:
    """seed -> the node's curve in one pairing and variant (alone runs: the node's own run)."""
    out: dict[int, NodeCurve] = {}
    for res in results:
        r = res.run
        if r.pairing == pairing and r.variant == variant and r.node in (None, node):
            c = res.nodes.get(node)
            if c is not None and c.steps:
                out[r.seed] = c
    return out


def _final_map(curves: dict[int, NodeCurve], fn) -> dict[int, float]:
    return {s: float(v) for s, c in curves.items() for v in [fn(c)] if v is not None}


def _token_curve(c: NodeCurve, split: str) -> tuple[list[float], list[float]] | None:
    acc = c.acc.get(split, [])
    return (c.tokens, acc) if acc and len(acc) == len(c.tokens) else None


def _other_keys(results: list[RunResult], pairing: str) -> list[str]:
    """Columns of the second difference table: the extra eval splits, then pass@k at k = 1, 8
    and the largest k logged."""
    extra = [sp for sp in splits_of(results, pairing) if sp not in SPLITS]
    passk = eval_keys_of(results, pairing, lambda k: k.startswith("pass@"))
    ks = [int(k.split("@")[1]) for k in passk if k.split("@")[1].isdigit()]
    keep = {1, 8, max(ks)} if ks else set()
    return extra + [k for k in passk if k.split("@")[1].isdigit() and int(k.split("@")[1]) in keep]


def _difference_section(study: Study, results: list[RunResult]) -> list[str]:
    """Every method minus its pairing's baseline (Alone where the pairing has one, else its
    first method), per node, paired by seed with a Student-t interval: final test and ood
    accuracy at equal steps, and against Alone also at equal generated tokens (Alone's curve
    read at the method's final token count, ftis.study.stats.at_equal_tokens); then the other
    eval splits and pass@k at equal steps."""
    diffs = Differences()
    rows, other_tables = [], []
    for p, ps in _pairings_with_results(study, results):
        base = _baseline(study, p)
        if base is None:
            continue
        base_alone = study.spec.methods[base.split(" ")[0]].alone
        others = _other_keys(results, p)
        other_rows = []
        for v in _variant_order(study, p):
            if v == base:
                continue
            for n in _node_order(study, p):
                mine, ref = _by_seed(results, p, v, n), _by_seed(results, p, base, n)
                if not mine or not ref:
                    continue
                where = f"{ps.label or p}, {_label(study, v)}, {n}"
                cells = []
                for sp in SPLITS:
                    a = _final_map(mine, lambda c, sp=sp: c.final(sp))
                    b = _final_map(ref, lambda c, sp=sp: c.final(sp))
                    cells.append(diffs.cell(f"{where}, {sp} at equal steps", a, b))
                    if not base_alone:
                        continue
                    ca = {s: t for s, c in mine.items() for t in [_token_curve(c, sp)] if t}
                    cb = {s: t for s, c in ref.items() for t in [_token_curve(c, sp)] if t}
                    a, b = at_equal_tokens(ca, cb)
                    cells.append(diffs.cell(f"{where}, {sp} at equal tokens", a, b))
                seeds = len(set(mine) & set(ref))
                rows.append([ps.label or p, _label(study, v), n, *cells, str(seeds)])
                if others:
                    oc = []
                    for k in others:
                        if k.startswith("pass@"):
                            fn = lambda c, k=k: c.final_eval(k)  # noqa: E731
                        else:
                            fn = lambda c, k=k: c.final(k)  # noqa: E731
                        oc.append(
                            diffs.cell(f"{where}, {k}", _final_map(mine, fn), _final_map(ref, fn))
                        )
                    other_rows.append([_label(study, v), n, *oc])
        if other_rows:
            title = f"{ps.label or p}: other eval splits and pass@k, minus {_label(study, base)}"
            other_tables += [
                f"### {title}",
                "",
                *_table(["method", "node", *others], other_rows),
                "",
            ]
    if not rows:
        return []
    has_alone = any(m.alone for m in study.spec.methods.values())
    header = ["pairing", "method", "node"]
    for sp in SPLITS:
        header.append(f"{sp}, equal steps")
        if has_alone:
            header.append(f"{sp}, equal tokens")
    header.append("seeds")
    width = len(header)
    rows = [r[:-1] + ["-"] * (width - len(r)) + r[-1:] for r in rows]
    refs = ", ".join(
        f"{ps.label or p}: {_label(study, b)}"
        for p, ps in _pairings_with_results(study, results)
        for b in [_baseline(study, p)]
        if b
    )
    intro = (
        "Each method minus the same node's `Alone`, final greedy accuracy. Equal steps: "
        "both at their last step. Equal tokens: Alone's accuracy read at the completion "
        "tokens the method's node had generated itself by its last step (Alone's evaluations "
        "linearly interpolated, seed by seed; a seed whose budget lies outside Alone's curve "
        "is not paired). Where a pairing has no Alone, its first method is the reference. "
        if has_alone
        else f"Each method minus its pairing's first method ({refs}), final greedy accuracy "
        "at equal steps. "
    ) + DIFFERENCES_NOTE
    return [
        "## Paired differences with intervals",
        "",
        intro,
        "",
        *_table(header, rows),
        "",
        *other_tables,
        diffs.summary(),
        "",
    ]
