"""The collaboration study's tables and plots (studies/collab.yaml -> docs/results/collab.md):
does a node gain by training with a peer, against the same node training alone?

Every comparison is a paired difference by seed (same seed, same test problems) with a 95%
Student-t interval over the seeds (ftis.study.stats, docs/math.md §11), computed from
the runs' per-problem greedy outcomes (evals.jsonl):

- at equal steps: a method's last evaluation against an Alone baseline's at the same step;
- at equal generated tokens: against an Alone baseline's curve read at the tokens the method's
  node generated (linear interpolation between evaluations, never extrapolated);
- transfer: on a pairing of experts, each expert's accuracy on the *other* expert's skill.

HACPO's own figures (capability estimates, discrepancy coefficients, the fraction of peers'
samples its clipping discards) come from the runs' rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ftis.models.sources import model_label
from ftis.study.document import reading_lines
from ftis.study.pages import save
from ftis.study.runner import complete_runs
from ftis.study.stats import PairedDifference, at_equal_tokens, paired_difference, read_evals
from ftis.study.tables import code_line, interval_cell, invocations_line, rel, seconds_cell
from ftis.study.tables import fmt_pct as _pct
from ftis.study.tables import table as _table
from ftis.train.metrics import read_metrics

TOKENS = "train/generated_tokens_total"


@dataclass(frozen=True)
class NodeRun:
    """One node of one run: the study's pairing and method, its seed and its run directory."""

    pairing: str
    method: str
    node: str
    seed: int
    run_dir: Path


@dataclass
class _Cache:
    evals: dict[Path, Any] = field(default_factory=dict)
    rows: dict[Path, list[dict]] = field(default_factory=dict)

    def outcomes(self, run_dir: Path):
        if run_dir not in self.evals:
            self.evals[run_dir] = read_evals(run_dir)
        return self.evals[run_dir]

    def metrics(self, run_dir: Path) -> list[dict]:
        if run_dir not in self.rows:
            self.rows[run_dir] = read_metrics(run_dir / "metrics.jsonl")
        return self.rows[run_dir]


class CollabData:
    """The study's node runs, indexed by (pairing, method, node) -> seed -> NodeRun."""

    def __init__(self, node_runs: Sequence[NodeRun]) -> None:
        self.index: dict[tuple[str, str, str], dict[int, NodeRun]] = {}
        for r in node_runs:
            self.index.setdefault((r.pairing, r.method, r.node), {})[r.seed] = r
        self._cache = _Cache()

    def seeds(self, pairing: str, method: str, node: str) -> dict[int, NodeRun]:
        return self.index.get((pairing, method, node), {})

    def has(self, pairing: str, method: str, node: str) -> bool:
        return bool(self.seeds(pairing, method, node))

    # ---------------------------------------------------------------- per-problem outcomes

    def final(self, run: NodeRun, split: str) -> tuple[int, np.ndarray] | None:
        """(last evaluated step, (P,) outcomes there) of a node on a split, or None."""
        return self._evaluation(run, split, -1)

    def first(self, run: NodeRun, split: str) -> tuple[int, np.ndarray] | None:
        """(first evaluated step, (P,) outcomes there) of a node on a split, or None: step 0,
        or a swarm's late joiner's first evaluation."""
        return self._evaluation(run, split, 0)

    def _evaluation(self, run: NodeRun, split: str, i: int) -> tuple[int, np.ndarray] | None:
        o = self._cache.outcomes(run.run_dir).get(run.node, {}).get(split)
        if o is None or len(o.steps) == 0:
            return None
        return int(o.steps[i]), o.correct[i].astype(np.float64)

    def at_step(self, run: NodeRun, split: str, step: int) -> np.ndarray | None:
        o = self._cache.outcomes(run.run_dir).get(run.node, {}).get(split)
        if o is None or step not in o.steps.tolist():
            return None
        return o.at_step(step).astype(np.float64)

    def curve(self, run: NodeRun, split: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(generated tokens (E,), outcomes (E, P)) of a node on a split, or None."""
        o = self._cache.outcomes(run.run_dir).get(run.node, {}).get(split)
        if o is None:
            return None
        tokens = {
            int(r["step"]): float(r.get(TOKENS) or 0.0)
            for r in self._cache.metrics(run.run_dir)
            if r.get("node") == run.node and "step" in r
        }
        return np.array([tokens.get(int(s), 0.0) for s in o.steps]), o.correct.astype(np.float64)

    def accuracy(self, run: NodeRun, split: str) -> float | None:
        f = self.final(run, split)
        return None if f is None else float(f[1].mean())

    def start_accuracy(self, run: NodeRun, split: str) -> float | None:
        a = self.at_step(run, split, 0)
        return None if a is None else float(a.mean())

    def rows(self, run: NodeRun) -> list[dict]:
        return [r for r in self._cache.metrics(run.run_dir) if r.get("node") == run.node]

    # ---------------------------------------------------------------- comparisons

    def at_equal_steps(
        self, pairing: str, node: str, method: str, baseline: str, split: str
    ) -> PairedDifference:
        """method - baseline on `split`, each at the method's last evaluated step, by seed."""
        return self.final_against(
            self.seeds(pairing, method, node), self.seeds(pairing, baseline, node), split
        )

    def final_against(
        self, runs: dict[int, NodeRun], base: dict[int, NodeRun], split: str
    ) -> PairedDifference:
        """runs - base on `split` by seed, each at the last evaluated step of the seed's run."""
        a: dict[int, np.ndarray] = {}
        b: dict[int, np.ndarray] = {}
        for seed, run in runs.items():
            f = self.final(run, split)
            if f is None or seed not in base:
                continue
            other = self.at_step(base[seed], split, f[0])
            if other is None:
                continue
            a[seed], b[seed] = f[1], other
        return paired_difference(a, b)

    def at_equal_tokens(
        self, pairing: str, node: str, method: str, baseline: str, split: str
    ) -> PairedDifference:
        """method's last evaluation - baseline's curve read at the tokens the method's node
        generated, by seed (a seed whose budget lies outside the baseline's curve is dropped)."""
        a: dict[int, tuple] = {}
        b: dict[int, tuple] = {}
        base = self.seeds(pairing, baseline, node)
        for seed, run in self.seeds(pairing, method, node).items():
            ca = self.curve(run, split)
            cb = self.curve(base[seed], split) if seed in base else None
            if ca is None or cb is None:
                continue
            a[seed], b[seed] = ca, cb
        va, vb = at_equal_tokens(a, b)
        return paired_difference(va, vb)

    # ---------------------------------------------------------------- HACPO's figures

    def series(self, pairing: str, method: str, node: str, key: str) -> tuple[list, list]:
        """(steps, mean over seeds of `key` at each step), only at the steps where every seed
        logged it: a mean over a different set of seeds at some steps would move the curve by
        which seeds are in it, not by training."""
        per_step: dict[int, list[float]] = {}
        runs = list(self.seeds(pairing, method, node).values())
        for run in runs:
            for r in self.rows(run):
                if key in r and r[key] is not None:
                    per_step.setdefault(int(r["step"]), []).append(float(r[key]))
        steps = sorted(s for s, v in per_step.items() if len(v) == len(runs))
        return steps, [float(np.mean(per_step[s])) for s in steps]


Cell = Callable[[PairedDifference], str]


def difference_cell(d: PairedDifference) -> str:
    """'+1.2 [−0.3, +2.6]', with the verdict in bold where the interval excludes zero."""
    if d.seeds == 0:
        return "n/a"
    text = interval_cell(d, verdict=True)
    if d.dropped:
        text += f" ({d.dropped} seed(s) unpaired)"
    return text


# ------------------------------------------------------------------------------ the document


@dataclass(frozen=True)
class CollabOptions:
    """What the document compares (a study's `options:`).

    baselines: the Alone methods every sharing method is compared with at equal steps.
    tokens_baseline: the Alone method compared with at equal generated tokens.
    transfer: pairing -> node -> the split of the *other* node's skill.
    split: the main held-out split.
    """

    baselines: tuple[str, ...] = ("alone",)
    tokens_baseline: str | None = None
    transfer: dict[str, dict[str, str]] = field(default_factory=dict)
    split: str = "test"

    @staticmethod
    def from_spec(options: dict[str, Any] | None) -> CollabOptions:
        o = dict(options or {})
        return CollabOptions(
            baselines=tuple(o.get("baselines", ("alone",))),
            tokens_baseline=o.get("tokens_baseline"),
            transfer={p: dict(v) for p, v in (o.get("transfer") or {}).items()},
            split=o.get("split", "test"),
        )


def accuracy_table(
    data: CollabData,
    pairing: str,
    nodes: list[str],
    methods: list[str],
    labels: dict[str, str],
    split: str,
) -> list[str]:
    """Step-0 and final accuracy (mean ± sd over seeds) of every method and node on a split."""
    header = ["method", *(f"{n}: step 0 -> final (seeds)" for n in nodes)]
    rows = []
    for m in methods:
        cells = []
        for n in nodes:
            runs = list(data.seeds(pairing, m, n).values())
            start = [v for r in runs if (v := data.start_accuracy(r, split)) is not None]
            final = [v for r in runs if (v := data.accuracy(r, split)) is not None]
            cells.append(f"{_pct(start)} -> {_pct(final)} ({len(final)})" if final else "-")
        rows.append([labels.get(m, m), *cells])
    return _table(header, rows)


def difference_table(
    data: CollabData,
    pairing: str,
    nodes: list[str],
    methods: list[str],
    labels: dict[str, str],
    opts: CollabOptions,
    split: str,
) -> list[str]:
    """Every sharing method against every Alone baseline, per node: paired differences in
    accuracy points with their 95% intervals (bold where the interval excludes zero)."""
    columns: list[tuple[str, Callable[[str, str], PairedDifference]]] = []
    for b in opts.baselines:
        columns.append(
            (
                f"vs {labels.get(b, b)}, equal steps",
                lambda n, m, b=b: data.at_equal_steps(pairing, n, m, b, split),
            )
        )
    if opts.tokens_baseline:
        tb = opts.tokens_baseline
        columns.append(
            (
                f"vs {labels.get(tb, tb)}, equal generated tokens",
                lambda n, m, tb=tb: data.at_equal_tokens(pairing, n, m, tb, split),
            )
        )
    header = ["method", "node", *(c[0] for c in columns)]
    rows = []
    for m in methods:
        for n in nodes:
            if not data.has(pairing, m, n):
                continue
            rows.append([labels.get(m, m), n, *(difference_cell(fn(n, m)) for _, fn in columns)])
    return _table(header, rows)


def hacpo_table(data: CollabData, pairing: str, nodes: list[str], method: str) -> list[str]:
    """HACPO's capability estimates (first and last trained step), mean discrepancy coefficient
    of the peers' samples and mean fraction of the peers' samples its clipping discarded."""
    rows = []
    for n in nodes:
        steps, cap = data.series(pairing, method, n, "hacpo/capability")
        if not steps:
            continue
        _, peer = data.series(pairing, method, n, "hacpo/peer_capability")
        _, omega = data.series(pairing, method, n, "hacpo/discrepancy")
        _, clip = data.series(pairing, method, n, "hacpo/clipped_fraction")

        def span(v: list[float]) -> str:
            return f"{v[0]:.2f} -> {v[-1]:.2f}" if v else "-"

        rows.append(
            [
                n,
                span(cap),
                span(peer),
                f"{np.mean(omega):.2f}" if omega else "-",
                f"{np.mean(clip) * 100:.1f}%" if clip else "-",
            ]
        )
    if not rows:
        return []
    return _table(
        [
            "node",
            "capability P_k, first -> last step",
            "peer's capability P_j",
            "mean discrepancy omega(j, k)",
            "peers' samples clipped",
        ],
        rows,
    )


def plot_curves(
    data: CollabData,
    pairings: list[tuple[str, list[str]]],
    methods: list[str],
    labels: dict[str, str],
    split: str,
    path: Path,
    *,
    x: str = "step",
) -> bool:
    """Accuracy on `split` against steps (or generated tokens), one panel per pairing and node,
    one line per method (mean over seeds at each evaluation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(p, n) for p, nodes in pairings for n in nodes]
    if not panels:
        return False
    cols = 2
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(11, 3.2 * rows_n), squeeze=False)
    drew = False
    handles: dict[str, Any] = {}  # method -> a line, for one legend over every panel
    for ax, (p, n) in zip(axes.flat, panels, strict=False):
        for j, m in enumerate(methods):
            curves = [data.curve(r, split) for r in data.seeds(p, m, n).values()]
            curves = [c for c in curves if c is not None]
            if not curves:
                continue
            length = min(len(c[0]) for c in curves)
            acc = np.mean([c[1][:length].mean(axis=1) for c in curves], axis=0) * 100
            if x == "step":
                run = next(iter(data.seeds(p, m, n).values()))
                xs = data._cache.outcomes(run.run_dir)[n][split].steps[:length]
            else:
                xs = np.mean([c[0][:length] for c in curves], axis=0)
            # a method keeps its colour in every panel, whichever methods a pairing ran
            (line,) = ax.plot(xs, acc, marker="o", color=f"C{j % 10}", label=labels.get(m, m))
            handles.setdefault(m, line)
            drew = True
        ax.set_title(f"{p}: {n}")
        ax.set_xlabel("RL step" if x == "step" else "generated tokens")
        ax.set_ylabel(f"{split} accuracy (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if drew:
        order = [m for m in methods if m in handles]
        axes.flat[0].legend(
            [handles[m] for m in order], [labels.get(m, m) for m in order], fontsize=7
        )
    save(fig, path, dpi=90)
    return drew


def plot_hacpo(
    data: CollabData, pairings: list[tuple[str, list[str]]], method: str, path: Path
) -> bool:
    """HACPO's capability estimate of each node and the mean discrepancy coefficient of its
    peer's samples over the run (mean over seeds), one panel per pairing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(len(pairings), 1), figsize=(4.2 * max(len(pairings), 1), 3.2))
    axes = np.atleast_1d(axes)
    drew = False
    for ax, (p, nodes) in zip(axes, pairings, strict=False):
        right = ax.twinx()  # omega spans 0.1-10: a log axis of its own
        for i, n in enumerate(nodes):
            color = f"C{i}"
            s, cap = data.series(p, method, n, "hacpo/capability")
            s2, omega = data.series(p, method, n, "hacpo/discrepancy")
            if s:
                ax.plot(s, cap, color=color, label=f"{n}: capability P")
                drew = True
            if s2:
                right.plot(s2, omega, color=color, linestyle="--", label=f"{n}: omega of its peer")
        ax.set_title(p)
        ax.set_xlabel("RL step")
        ax.set_ylabel("capability (solid)")
        ax.set_ylim(0, 1)
        right.set_yscale("log")
        right.set_ylim(0.08, 12)
        right.set_ylabel("discrepancy omega (dashed)")
        ax.grid(alpha=0.3)
        handles = ax.get_legend_handles_labels()
        more = right.get_legend_handles_labels()
        ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=7)
    save(fig, path, dpi=90)
    return drew


# ------------------------------------------------------------------ collect and render (grid)


@dataclass(frozen=True)
class CollabResult:
    """A complete run of the study (for the runs table and the code line)."""

    id: str
    seconds: float | None
    code: str | None
    nodes: tuple[NodeRun, ...]


def _arm_of(r: CollabResult) -> str:
    """A run's arm: its id without the seed (`expertise-f-tis-j-s0` -> `expertise-f-tis-j`)."""
    suffix = f"-s{r.nodes[0].seed}" if r.nodes else ""
    return r.id[: -len(suffix)] if suffix and r.id.endswith(suffix) else r.id


def collect(study: Any, out_dir: Path) -> tuple[list[CollabResult], list[str]]:
    """The study's complete runs, each with its node runs, and the ids of the others."""
    results: list[CollabResult] = []
    done, missing = complete_runs(study, out_dir)
    for run, d, meta in done:
        names = [run.node] if run.node else [n.name for n in run.config.nodes]
        nodes = tuple(NodeRun(run.pairing, run.method, n, run.seed, d) for n in names)
        results.append(CollabResult(run.id, meta.get("seconds"), meta.get("code"), nodes))
    return results, missing


def _pairing_nodes(study: Any) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for run in study.runs:
        if run.node is None:
            out.setdefault(run.pairing, [n.name for n in run.config.nodes])
    for run in study.runs:  # pairings with Alone runs only
        if run.node is not None and run.node not in out.setdefault(run.pairing, []):
            out[run.pairing].append(run.node)
    return out


def _setup(study: Any, nodes: dict[str, list[str]], together: str) -> list[str]:
    spec = study.spec
    first: dict[str, Any] = {}
    for run in sorted(study.runs, key=lambda r: r.node is not None):  # a run of both nodes first
        first.setdefault(run.pairing, run.config)
    prow = []
    for key, p in spec.pairings.items():
        cfg = first.get(key)
        if cfg is None:
            continue
        desc = []
        for n in cfg.nodes:
            model = model_label(n.model)
            lora = f" + LoRA r={n.model.lora.r}" if n.model.lora else ""
            mix = (
                f", warm-start mix {n.warm_start.mix}" if n.warm_start and n.warm_start.mix else ""
            )
            desc.append(f"`{n.name}`: {model}{lora}, lr {n.optim.lr:g}{mix}")
        prow.append([p.label or key, "; ".join(desc), p.description or ""])
    mrow = []
    for key, m in spec.methods.items():
        over = ", ".join(f"`{x}`" for x in [*m.set, *m.run_set]) or "-"
        kind = "each node alone" if m.alone else together
        mrow.append([m.label or key, f"`{m.loss}`", kind, over])
    return [
        *_table(["pairing", "nodes", "what"], prow),
        "",
        *_table(["method", "loss", "runs", "overrides"], mrow),
    ]


def head_lines(
    study: Any,
    results: list[CollabResult],
    missing: list[str],
    out_dir: Path,
    *,
    together: str = "both nodes together",
) -> list[str]:
    """A collaboration document's head: title, partial-results banner, description, commands,
    run folder, seeds, code line, set-up (`together`: what a sharing method's run is) and how to
    read the tables."""
    spec = study.spec
    opts = CollabOptions.from_spec(spec.options)
    nodes = _pairing_nodes(study)
    study_rel = rel(study.path)
    L = [
        f"# Results: study `{spec.name}`",
        "",
        "<!-- Generated by `ftis sweep` from the run directories; edit only the hand-written "
        "section below. -->",
        "",
    ]
    if missing:
        L += [
            f"> **Partial results: {len(results)} of {len(study.runs)} runs complete.** "
            f"Missing: {len(missing)} runs (`ftis sweep {study_rel} --dry-run` lists them). "
            f"Resume with `ftis sweep {study_rel}`.",
            "",
        ]
    L += [
        spec.description.strip(),
        "",
        "```bash",
        f"ftis sweep {study_rel}                 # run every missing run, then rewrite this file",
        f"ftis sweep {study_rel} --report-only   # rewrite this file from the run directories",
        "```",
        "",
        f"Run directories: `{rel(out_dir)}/<run-id>/`. Seeds: "
        + ", ".join(map(str, sorted({n.seed for r in results for n in r.nodes}) or spec.seeds))
        + ". "
        + code_line(results, arm=_arm_of),
        "",
    ]
    inv = invocations_line(out_dir)
    if inv:
        L += [inv, ""]
    L += ["## Set-up", "", *_setup(study, nodes, together), ""]
    L += [
        "## How to read the tables",
        "",
        f"Accuracy is greedy accuracy on the `{opts.split}` split (held-out problems, the same "
        "for every seed and method). A difference is the method's accuracy minus the baseline's, "
        "in points, paired by seed (same seed, same problems): `mean [95% interval]`, the interval "
        "a Student-t interval over the seeds' differences, each a mean over the split's problems "
        "(docs/math.md §11). **Bold** marks a printed interval that excludes zero; the reading "
        "may call a method better or worse only on a bold primary comparison (the section "
        "'Primary comparisons', named in the study file before its runs): other bold cells are "
        "exploratory, and every other cell is *no difference detected at this resolution*. Equal steps: both at the method's "
        "last evaluation. Equal generated tokens: the baseline's curve read (linear "
        "interpolation, never extrapolated) at the tokens the method's node generated.",
        "",
    ]
    return L


@dataclass
class CollabDoc:
    """What a collaboration document reads: the study's options, methods (all, sharing, HACPO),
    labels, each pairing's nodes and the node runs."""

    spec: Any
    opts: CollabOptions
    labels: dict[str, str]
    methods: list[str]
    sharing: list[str]
    hacpo: list[str]
    nodes: dict[str, list[str]]
    data: CollabData

    @staticmethod
    def of(study: Any, node_runs: Sequence[NodeRun]) -> CollabDoc:
        spec = study.spec
        return CollabDoc(
            spec=spec,
            opts=CollabOptions.from_spec(spec.options),
            labels={k: m.label or k for k, m in spec.methods.items()},
            methods=list(spec.methods),
            sharing=[k for k, m in spec.methods.items() if not m.alone],
            hacpo=[k for k, m in spec.methods.items() if m.loss == "hacpo"],
            nodes=_pairing_nodes(study),
            data=CollabData(node_runs),
        )

    def with_results(self, methods: list[str]) -> list[str]:
        """The pairings where some node has runs of one of `methods`."""
        return [
            p
            for p in self.spec.pairings
            if any(self.data.has(p, m, n) for m in methods for n in self.nodes.get(p, []))
        ]

    def ran(self, p: str) -> list[str]:
        """The methods with runs on pairing p."""
        return [m for m in self.methods if any(self.data.has(p, m, n) for n in self.nodes[p])]

    def pairing_lines(self, p: str, *, ran_only: bool = False) -> list[str]:
        """A pairing's section head: its title and description, every method's accuracy (with
        `ran_only`, every method with runs on p) and every sharing method's paired differences
        to the Alone baselines."""
        pn, ps, opts = self.nodes.get(p, []), self.spec.pairings[p], self.opts
        methods = self.ran(p) if ran_only else self.methods
        L = [f"## {ps.label or p}", ""]
        if ps.description:
            L += [ps.description.strip(), ""]
        L += [f"### Accuracy (`{opts.split}`)", ""]
        L += [*accuracy_table(self.data, p, pn, methods, self.labels, opts.split), ""]
        L += ["### Paired differences to training alone", ""]
        L += [
            *difference_table(self.data, p, pn, self.sharing, self.labels, opts, opts.split),
            "",
        ]
        return L

    def hacpo_lines(self, p: str, h: str) -> list[str]:
        """HACPO method h's capability, discrepancy and clipping table on pairing p."""
        t = hacpo_table(self.data, p, self.nodes.get(p, []), h)
        if not t:
            return []
        return [
            f"### {self.labels[h]}: capability, discrepancy, clipping (mean over seeds)",
            "",
            *t,
            "",
        ]

    def tail_lines(
        self, pairings: list[str], results: list[CollabResult], reading: str, report_path: Path
    ) -> list[str]:
        """Plots of `pairings` (beside the document, in <study>-plots/), the runs, the reading."""
        panels = [(p, self.nodes.get(p, [])) for p in pairings]
        img_dir = report_path.parent / f"{self.spec.name}-plots"
        data, methods, labels, split = self.data, self.methods, self.labels, self.opts.split
        images = []
        if plot_curves(data, panels, methods, labels, split, img_dir / "accuracy.png"):
            images.append(("accuracy.png", f"{split} accuracy against RL steps"))
        tokens = img_dir / "accuracy-tokens.png"
        if plot_curves(data, panels, methods, labels, split, tokens, x="tokens"):
            images.append(("accuracy-tokens.png", f"{split} accuracy against generated tokens"))
        for h in self.hacpo:
            if plot_hacpo(data, panels, h, img_dir / f"{h}.png"):
                images.append((f"{h}.png", f"{labels[h]}: capability and discrepancy over the run"))
        L = ["## Plots", ""] if images else []
        for name, alt in images:
            L += [f"![{alt}]({(img_dir / name).relative_to(report_path.parent)})", ""]
        return L + runs_lines(results, reading)


# a document body: (the pairings it plots, its sections between the head and the plots)
Body = Callable[[CollabDoc], tuple[list[str], list[str]]]


def collab_renderer(
    body: Body,
    *,
    together: str = "both nodes together",
    node_runs: Callable[[Any, list[NodeRun]], list[NodeRun]] | None = None,
) -> Callable[..., str]:
    """A study renderer (ftis.study.registry) for a collaboration document: the head
    (`head_lines`), `body(doc)`'s sections, plots of the pairings it names, the runs and the
    reading. `node_runs(study, runs)`: what the document reads instead of the runs' own nodes
    (checked and extended: the groups study's shared Alone runs)."""

    def render(
        study: Any,
        results: list[CollabResult],
        missing: list[str],
        out_dir: Path,
        report_path: Path,
        reading: str,
    ) -> str:
        runs = [n for r in results for n in r.nodes]
        doc = CollabDoc.of(study, node_runs(study, runs) if node_runs else runs)
        pairings, lines = body(doc)
        return "\n".join(
            [
                *head_lines(study, results, missing, out_dir, together=together),
                *lines,
                *doc.tail_lines(pairings, results, reading, report_path),
            ]
        )

    return render


def _collab_body(doc: CollabDoc) -> tuple[list[str], list[str]]:
    """docs/results/collab.md: per pairing, every node's accuracy and its paired differences to
    the Alone baselines, the transfer on the expertise pairing, HACPO's figures."""
    opts = doc.opts
    with_results = doc.with_results(doc.methods)
    L: list[str] = []
    for p in with_results:
        L += doc.pairing_lines(p)
        if p in opts.transfer:
            L += [
                "### Transfer: each expert on the other's skill",
                "",
                *transfer_table(doc.data, p, opts.transfer[p], doc.sharing, doc.labels, opts),
                "",
            ]
        for h in doc.hacpo:
            L += doc.hacpo_lines(p, h)
    return with_results, L


render = collab_renderer(_collab_body)


def runs_lines(results: list[CollabResult], reading: str) -> list[str]:
    """The runs table (id, seconds, code) and the hand-written reading."""
    return [
        "## Runs",
        "",
        *_table(
            ["run", "s", "code"],
            [[r.id, seconds_cell(r.seconds), r.code or "-"] for r in results],
        ),
        "",
        *reading_lines(reading),
    ]


def transfer_table(
    data: CollabData,
    pairing: str,
    skill_of_other: dict[str, str],
    methods: list[str],
    labels: dict[str, str],
    opts: CollabOptions,
) -> list[str]:
    """Each expert's accuracy on the other's skill split, and its paired differences to the
    Alone baselines at equal steps."""
    header = [
        "method",
        "node",
        "split",
        "accuracy",
        *(f"vs {labels.get(b, b)}" for b in opts.baselines),
    ]
    rows = []
    for m in [*opts.baselines, *methods]:
        for node, split in skill_of_other.items():
            runs = list(data.seeds(pairing, m, node).values())
            if not runs:
                continue
            acc = [v for r in runs if (v := data.accuracy(r, split)) is not None]
            cells = [
                "-"
                if m in opts.baselines
                else difference_cell(data.at_equal_steps(pairing, node, m, b, split))
                for b in opts.baselines
            ]
            rows.append([labels.get(m, m), node, f"`{split}`", _pct(acc), *cells])
    return _table(header, rows)
