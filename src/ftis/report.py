"""Reports: a summary table and PNG plots from a run directory's metrics.jsonl.

`write_report(run_dir)` writes report.md, accuracy.png and (when the rows hold F-TIS's training
figures) training.png, then the run's algorithm's own section (`register_algorithm(report=...)`,
found from config.yaml; this module never names an algorithm). `compare_runs` overlays several
runs. Everything is recomputed from metrics.jsonl, so `ftis report` can redraw any run.

No data is absent, never 0: a table cell a node has no value for is '-', and a column (or a
plot panel) no node has a value for is left out (`table_lines`).

Two readings of an evaluation: its mean greedy reward (`eval/<split>/accuracy` in the rows) and
the share of problems *solved*, whose greedy reward is above 0 (evals.jsonl, which the paired
change counts; `load_rows` adds it to the rows as `eval/<split>/solved`). With a 0/1 reward
they are the same number, shown once as "acc"; when they differ (a partial-credit or weighted
reward) the summary shows both, labelled "mean reward" and "solved (reward > 0)".
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from ftis.train.metrics import decode_outcomes, read_metrics

log = logging.getLogger(__name__)


class ReportError(ValueError):
    pass


def series(rows: list[dict[str, Any]], node: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one node's metric `key`, in step order, where it was logged."""
    pts = [(r["step"], r[key]) for r in rows if r.get("node") == node and r.get(key) is not None]
    pts.sort()
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def pyplot() -> Any:
    """matplotlib's pyplot, drawing off screen (the Agg backend): every report plot uses it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label_axes(ax: Any, title: str, xlabel: str, ylabel: str | None = None) -> None:
    """A report panel's title and axis labels, a light grid and a small legend."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def save_figure(fig: Any, path: Path, *, dpi: int = 110) -> bool:
    """Lay out, write (creating the folder) and close a matplotlib figure: every figure ftis
    writes, run reports' and results documents' alike. True: the figure was drawn."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return True


def load_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ReportError(
            f"{path} does not exist: is {run_dir} a run directory written by `ftis run`?"
        )
    rows = read_metrics(path)
    if not rows:
        raise ReportError(f"{path} has no rows yet")
    _add_solved(rows, Path(run_dir))
    return rows


SOLVED = "reward > 0"  # what makes a problem solved (ftis.train.evaluate's outcomes)


def _add_solved(rows: list[dict[str, Any]], run_dir: Path) -> None:
    """Put each evaluation's solved share (evals.jsonl: the share of the split's problems whose
    greedy reward is above 0) into its node's metrics row of that step, as
    `eval/<split>/solved` (in memory: metrics.jsonl is not changed). Nothing without
    evals.jsonl; a malformed line is skipped."""
    path = run_dir / "evals.jsonl"
    if not path.exists():
        return
    by_step: dict[tuple[Any, Any, str], dict[str, Any]] = {}
    for r in rows:
        for k in r:
            if k.startswith("eval/") and k.endswith("/accuracy") and k.count("/") == 2:
                by_step[(r.get("node"), r.get("step"), k.split("/")[1])] = r
    for e in read_metrics(path):
        try:
            n = int(e["n"])
            share = float(decode_outcomes(e["correct"], n).mean()) if n else None
            row = by_step.get((e["node"], e["step"], str(e["split"])))
        except (KeyError, TypeError, ValueError):
            continue
        if row is not None and share is not None:
            row[f"eval/{e['split']}/solved"] = share


def partial_credit_splits(rows: list[dict[str, Any]]) -> list[str]:
    """The eval splits whose mean reward and solved share differ at some evaluation (a reward
    that is not 0/1): their summary shows both."""
    out = []
    for split in eval_splits(rows):
        acc, solved = f"eval/{split}/accuracy", f"eval/{split}/solved"
        if any(
            r.get(acc) is not None
            and r.get(solved) is not None
            and abs(float(r[acc]) - float(r[solved])) > 1e-9
            for r in rows
        ):
            out.append(split)
    return out


def nodes_in(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["node"] for r in rows if "node" in r))


def eval_splits(rows: list[dict[str, Any]]) -> list[str]:
    keys = {k for r in rows for k in r if k.startswith("eval/") and k.endswith("/accuracy")}
    splits = {k.split("/")[1] for k in keys if k.count("/") == 2}
    return sorted(splits, key=lambda s: (s != "test", s))


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per node: accuracy before/after per split, mean filtered fraction, wire cost,
    wall time of the training steps and evaluations. A figure the node's rows do not hold is
    not a key of its dict."""
    out = []
    for node in nodes_in(rows):
        mine = [r for r in rows if r.get("node") == node]
        s: dict[str, Any] = {"node": node, "steps": max(r["step"] for r in mine)}
        for split in eval_splits(rows):
            steps, vals = series(rows, node, f"eval/{split}/accuracy")
            if vals:
                s[f"{split}_before"], s[f"{split}_after"] = vals[0], vals[-1]
                s.update(_same_clients(rows, node, f"eval/{split}/accuracy", split, steps))
            _, solved = series(rows, node, f"eval/{split}/solved")
            if solved:
                s[f"{split}_solved_before"], s[f"{split}_solved_after"] = solved[0], solved[-1]
        for k in pass_ks(rows):
            steps, vals = series(rows, node, f"eval/pass@{k}")
            if vals:
                s[f"pass@{k}_before"], s[f"pass@{k}_after"] = vals[0], vals[-1]
                s.update(_same_clients(rows, node, f"eval/pass@{k}", f"pass@{k}", steps))
        agg: dict[str, list[float]] = defaultdict(list)
        for r in mine:
            for k in (
                "loss/filtered_frac",
                "exchange/bytes_per_token",
                "reward/own",
                "reward/peers",
            ):
                if r.get(k) is not None:
                    agg[k].append(float(r[k]))
        for k, v in agg.items():
            s[k] = sum(v) / len(v)
        times = [
            float(v) for r in mine for k, v in r.items() if k.startswith("time/") and v is not None
        ]
        if times:  # a node that timed nothing (a federated server) has no node time, not 0 s
            s["seconds"] = sum(times)
        out.append(s)
    return out


def pass_ks(rows: list[dict[str, Any]]) -> list[int]:
    """The k of every `eval/pass@k` the rows hold, in increasing order."""
    keys = {k for r in rows for k, v in r.items() if k.startswith("eval/pass@") and v is not None}
    return sorted(int(k.removeprefix("eval/pass@")) for k in keys if k[10:].isdigit())


def _same_clients(
    rows: list[dict[str, Any]], node: str, key: str, name: str, steps: list[int]
) -> dict[str, Any]:
    """A node whose `key` (an accuracy, a pass@k) is a union over clients (its rows carry
    `eval/clients`: a federated server) compares before and after on the same clients: when
    the clients that evaluated at the first and the last of `steps` differ (a client lost, a
    failed evaluation), both become the union over the clients evaluated at both (weighted by
    `eval/size`), and `<name>_clients` says how many of how many. {} otherwise."""
    first, last = steps[0], steps[-1]
    mine = {r["step"]: r for r in rows if r.get("node") == node}
    if "eval/clients" not in mine.get(first, {}) and "eval/clients" not in mine.get(last, {}):
        return {}

    def at(step: int) -> dict[str, dict[str, Any]]:
        return {
            r["node"]: r
            for r in rows
            if r.get("step") == step and r.get("node") != node and r.get(key) is not None
        }

    before, after = at(first), at(last)
    if set(before) == set(after) or first == last:
        return {}
    common = [n for n in before if n in after]
    if not common:
        return {f"{name}_before": None, f"{name}_after": None, f"{name}_clients": (0, 0)}

    def union(evals: dict[str, dict[str, Any]]) -> float:
        weights = [float(evals[n].get("eval/size", 1.0)) for n in common]
        return sum(w * float(evals[n][key]) for w, n in zip(weights, common)) / sum(weights)

    return {
        f"{name}_before": union(before),
        f"{name}_after": union(after),
        f"{name}_clients": (len(common), len(set(before) | set(after))),
    }


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{100 * v:.1f}%"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def table_lines(header: list[str], body: list[list[str | None]]) -> list[str]:
    """A markdown table in which no data is absent: a cell that is None prints '-', and a
    column whose cells are all None is left out (with its header)."""
    from ftis.study.tables import table

    header, rows = drop_empty_columns(header, body)
    return table(header, rows)


def drop_empty_columns(
    header: list[str], body: list[list[str | None]]
) -> tuple[list[str], list[list[str]]]:
    """`header` and `body` without the columns no row has a value (not None) in; the other
    None cells become '-'."""
    keep = [j for j in range(len(header)) if any(r[j] is not None for r in body)]
    return [header[j] for j in keep], [["-" if r[j] is None else r[j] for j in keep] for r in body]


def summary_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-node summary, as strings (shared by report.md and the CLI).
    A node without a figure its peers have shows '-'; a figure no node has is no column. A
    split whose mean reward and solved share differ (`partial_credit_splits`) gets two
    columns, "<split> mean reward" and "<split> solved (reward > 0)"; the others one, "<split>
    acc", the number both readings agree on."""
    splits = eval_splits(rows)
    partial = set(partial_credit_splits(rows))
    passes = [f"pass@{k}" for k in pass_ks(rows)]
    header = ["node"]
    for s in splits:
        if s in partial:
            header += [f"{s} mean reward before -> after", f"{s} solved ({SOLVED}) before -> after"]
        else:
            header.append(f"{s} acc before -> after")
    header += [f"{p} before -> after" for p in passes]
    header += ["filtered", "bytes/token", "node time (s)"]
    body: list[list[str | None]] = []
    for s in summarize(rows):
        line: list[str | None] = [s["node"]]
        for sp in splits + passes:
            before, after = s.get(f"{sp}_before"), s.get(f"{sp}_after")
            if sp in partial:
                cell = None if before is None else f"{before:.3f} -> {after:.3f}"
            else:
                cell = None if before is None else f"{_fmt(before, True)} -> {_fmt(after, True)}"
            if cell is not None and f"{sp}_clients" in s:  # the same clients before and after
                cell += " (the {} of {} clients evaluated at both)".format(*s[f"{sp}_clients"])
            line.append(cell)
            if sp in partial:
                b, a = s.get(f"{sp}_solved_before"), s.get(f"{sp}_solved_after")
                line.append(None if b is None else f"{_fmt(b, True)} -> {_fmt(a, True)}")
        line += [
            _opt(s.get("loss/filtered_frac"), True),
            _opt(s.get("exchange/bytes_per_token")),
            None if s.get("seconds") is None else f"{s['seconds']:.0f}",
        ]
        body.append(line)
    return drop_empty_columns(header, body)


def _opt(v: Any, pct: bool = False) -> str | None:
    return None if v is None else _fmt(v, pct)


def _plot_accuracy(rows, path: Path, label_prefix: str = "", axes=None) -> None:
    plt = pyplot()
    splits = eval_splits(rows)
    own_fig = axes is None
    if own_fig:
        fig, axes = plt.subplots(
            1, max(len(splits), 1), figsize=(5 * max(len(splits), 1), 3.6), squeeze=False
        )
        axes = axes[0]
    for ax, split in zip(axes, splits):
        for node in nodes_in(rows):
            x, y = series(rows, node, f"eval/{split}/accuracy")
            if x:
                ax.plot(x, [100 * v for v in y], marker="o", ms=3, label=f"{label_prefix}{node}")
        partial = split in partial_credit_splits(rows)
        what = "mean reward (x100)" if partial else "accuracy"
        label_axes(ax, f"greedy {what}: {split}", "step", "%")
    if own_fig:
        save_figure(fig, path)


def _plot_training(rows, path: Path) -> None:
    panels = [
        ("reward/own", "reward on own samples"),
        ("reward/peers", "reward on peers' samples"),
        ("loss/filtered_frac", "filtered fraction"),
        ("loss/is_weight_mean", "mean IS weight"),
    ]
    panels = [p for p in panels if any(r.get(p[0]) is not None for r in rows)]
    if not panels:  # an algorithm that logs none of these (the rows still hold its own metrics)
        return
    fig, axes = pyplot().subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for node in nodes_in(rows):
            x, y = series(rows, node, key)
            if x:
                ax.plot(x, _smooth(y), label=node)
        label_axes(ax, title, "step")
    save_figure(fig, path)


def _smooth(y: list[float], k: int = 5) -> list[float]:
    out = []
    for i in range(len(y)):
        w = y[max(0, i - k + 1) : i + 1]
        out.append(sum(w) / len(w))
    return out


def write_report(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    rows = load_rows(run_dir)
    for stale in ("accuracy.png", "training.png"):  # a redraw must not link an old plot
        (run_dir / stale).unlink(missing_ok=True)
    if eval_splits(rows):
        _plot_accuracy(rows, run_dir / "accuracy.png")
    if any(r["step"] > 0 for r in rows):
        _plot_training(rows, run_dir / "training.png")
    header, body = summary_table(rows)
    lines = [f"# ftis run: {run_dir.name}", ""]
    lines += table_lines(header, body)  # type: ignore[arg-type]
    lines.append("")
    warnings = zero_reward_warnings(rows)
    if warnings:
        lines += [f"**Warning**: {w}" for w in warnings] + [""]
    if eval_splits(rows):
        lines.append(
            "Accuracy is greedy, on at most `eval.size` problems per split; 'before' is step 0."
        )
        if partial_credit_splits(rows):
            lines.append(
                "The reward is not 0/1, so each such split has two figures: 'mean reward', the "
                "mean greedy reward (`eval/<split>/accuracy` in metrics.jsonl), and 'solved', the "
                f"share of problems whose greedy reward is above 0 ({SOLVED}; evals.jsonl), which "
                "the paired change below counts. 'acc' is the one number both readings give."
            )
    if any(h.startswith("pass@") for h in header):
        lines.append(
            "pass@k is the unbiased estimate from `eval.pass_samples` samples per problem (at the "
            "training temperature) on the first `eval.pass_problems` problems of the first split."
        )
    if "filtered" in header:
        lines.append("'filtered' is the mean fraction of sequences the F- filter zeroed per step.")
    lines.append("")
    lines += change_section(run_dir)
    if (run_dir / "accuracy.png").exists():
        lines += ["![accuracy](accuracy.png)", ""]
    lines += federated_lines(rows)
    lines += _algorithm_section(rows, run_dir)
    if (run_dir / "training.png").exists():
        lines += ["![training](training.png)", ""]
    lines += samples_section(run_dir)
    lines += ["Config: [config.yaml](config.yaml). Metrics: [metrics.jsonl](metrics.jsonl).", ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _verdict_word(d, up: str, down: str, neither: str) -> str:
    """UP or DOWN only where the paired difference D's interval excludes zero (the one bold rule,
    ftis.study.tables.is_bold), else NEITHER."""
    from ftis.study.tables import is_bold

    return {"better": up, "worse": down}.get(d.verdict(), neither) if is_bold(d) else neither


def change_section(run_dir: Path) -> list[str]:
    """Did each node improve? Its last evaluation against its first, paired by problem (the same
    problems at every step, from evals.jsonl): the change in points with a 95% Student-t
    interval over the problems (docs/math.md §11, one seed), and 'improved' / 'worse' only where
    the interval excludes zero. One run says nothing of the spread over training seeds; a study
    (`ftis sweep`) pairs seeds. Empty for a run without two evaluations of a node."""
    from ftis.study.stats import paired_difference, read_evals
    from ftis.study.tables import is_bold

    try:
        evals = read_evals(run_dir)
    except (FileNotFoundError, ValueError):
        return []
    body = []
    for node, splits in evals.items():
        for split, outcomes in splits.items():
            if len(outcomes.steps) < 2:
                continue
            first, last = int(outcomes.steps[0]), int(outcomes.steps[-1])
            d = paired_difference({0: outcomes.correct[-1]}, {0: outcomes.correct[0]})
            word = _verdict_word(d, "improved", "worse", "no change detected")
            body.append(
                [
                    node,
                    split,
                    f"{first} -> {last}",
                    str(d.problems),
                    d.cells(),
                    f"**{word}**" if is_bold(d) else word,
                ]
            )
    if not body:
        return []
    header = [
        "node",
        "split",
        "steps",
        "problems",
        f"solved ({SOLVED}): change (points) [95% interval]",
        "reading",
    ]
    return [
        "### Change over the run, paired by problem",
        "",
        *table_lines(header, body),
        "",
        "The last evaluation's share of problems solved (greedy reward above 0) minus the "
        "first's, on the same problems: the summary's 'acc', or its 'solved' column where the "
        "reward is not 0/1 (its mean reward has no per-problem record to pair). The interval is "
        "a Student-t interval over those problems, so it covers which problems were drawn, not "
        "how another training seed would have gone (`ftis sweep` pairs seeds).",
        "",
    ]


ZERO_REWARD_STEPS = 5  # as ftis.train.loop's warning


def zero_reward_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """The reward warnings of a run's summary (report.md and the console): one line per node
    whose reward was 0 for every completion scored in its first steps (steps 0-5: rows'
    `reward/scored` and `reward/nonzero`, which ftis.train.loop writes), with the likely causes
    (none for nodes whose rows lack the counters); then `reward_failure_warnings`."""
    out = []
    for node in nodes_in(rows):
        first = [
            r
            for r in rows
            if r.get("node") == node
            and r.get("step", 0) <= ZERO_REWARD_STEPS
            and r.get("reward/scored") is not None
        ]
        scored = sum(float(r["reward/scored"]) for r in first)
        if not first or scored == 0 or any(float(r.get("reward/nonzero", 0)) for r in first):
            continue
        last = max(int(r["step"]) for r in first)
        errors = sorted(
            {
                k.removeprefix("reward/errors/")
                for r in first
                for k, v in r.items()
                if k.startswith("reward/errors/") and v
            }
        )
        raised = f" ({', '.join(errors)} failed: see reward/errors/*)" if errors else ""
        out.append(
            f"node {node}: all {int(scored)} completions scored in steps 0-{last} earned reward "
            f"0{raised}. Likely causes: completions that miss the reward's format (see "
            "samples.jsonl); reward markers (<think>, <answer>, ####) the model never emits or "
            "the prompt never asks for; a reward that raises; a model too weak for the task "
            "(docs/tasks.md)."
        )
    return out + reward_failure_warnings(rows) + skipped_rows_warnings(rows)


def skipped_rows_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """One line when the task skipped malformed rows of its data (`task.skip_bad_rows`; rows'
    `data/skipped_rows`, the same for every node, which loads the same data)."""
    counts = [
        float(r["data/skipped_rows"])
        for r in rows
        if isinstance(r.get("data/skipped_rows"), int | float)
    ]
    if not counts or not max(counts):
        return []
    return [
        f"the task's data: {int(max(counts))} malformed row(s) were skipped "
        "(task.skip_bad_rows; each node's log names the first ones)."
    ]


def reward_failure_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """One line per node and reward function that failed (raised, or returned something that is
    not a finite number) on some of the completions it scored: how many of how many, and its
    first failure with where it happened (rows' `reward/errors/<function>`, `reward/scored` and
    `reward/first_error/<function>`, which ftis.rewards.runtime writes). A run past
    `task.reward_max_error_share` has stopped with its own error instead."""
    out = []
    for node in nodes_in(rows):
        mine = [r for r in rows if r.get("node") == node]
        scored = sum(float(r.get("reward/scored") or 0) for r in mine)
        failed: dict[str, float] = defaultdict(float)
        first: dict[str, str] = {}
        for r in mine:
            for k, v in r.items():
                if k.startswith("reward/errors/") and isinstance(v, int | float) and v:
                    failed[k.removeprefix("reward/errors/")] += float(v)
                elif k.startswith("reward/first_error/") and isinstance(v, str):
                    first.setdefault(k.removeprefix("reward/first_error/"), v)
        for name, count in failed.items():
            what = f"; the first {first[name]}" if name in first else ""
            out.append(
                f"node {node}: reward {name} failed on {int(count)} of the {int(scored)} "
                f"completions scored (each scored 0 from it){what}."
            )
    return out


def _cell(text: str, limit: int = 60) -> str:
    """A markdown table cell: one line, pipes escaped, at most `limit` characters."""
    one = " ".join(str(text).split())
    if len(one) > limit:
        one = one[: limit - 1] + "\u2026"
    return "`" + one.replace("`", "'").replace("|", "\\|") + "`" if one else "(empty)"


def samples_section(run_dir: Path) -> list[str]:
    """Each node's sample completions at its last evaluation, from samples.jsonl (none for runs
    without one)."""
    path = Path(run_dir) / "samples.jsonl"
    if not path.exists():
        return []
    rows = [r for r in read_metrics(path) if {"step", "node", "split"} <= r.keys()]
    if not rows:
        return []
    from ftis.study.tables import table

    body = []
    for node in nodes_in(rows):
        mine = [r for r in rows if r["node"] == node]
        last = max(r["step"] for r in mine)
        for r in (r for r in mine if r["step"] == last):
            reward = r.get("reward")
            body.append(
                [
                    node,
                    str(last),
                    r["split"],
                    _cell(r.get("question", r.get("prompt", ""))),
                    _cell(r.get("completion", "")),
                    "-" if reward is None else f"{float(reward):g}",
                ]
            )
    header = ["node", "step", "split", "question", "completion", "reward"]
    lines = ["## Samples at the last evaluation", "", *table(header, body)]
    lines += [
        "",
        "Greedy completions of each split's first problems: [samples.jsonl](samples.jsonl) "
        "(its `prompt` is the text the model was given, chat template and special tokens "
        "included).",
        "",
    ]
    return lines


def federated_lines(rows: list[dict[str, Any]]) -> list[str]:
    """A federated run's server figures (its `server` rows): rounds, replies rejected and
    dropped, client workers lost (and restarted); [] for other runs."""
    server = sorted(
        (r for r in rows if r.get("node") == "server" and r.get("step", 0) > 0),
        key=lambda r: r["step"],
    )
    if not server or not any("server/workers_lost_total" in r for r in server):
        return []
    last = server[-1]

    # totals are running counts: the last row has them (FGRPO: server/*, FedDPO: fed/*)
    rejected = int(last.get("server/rejected_total", last.get("fed/rejected_total", 0)))
    dropped = int(last.get("server/dropped_total", last.get("fed/dropped_total", 0)))
    lost = int(last.get("server/workers_lost_total", 0))
    return [
        f"Federated server: {len(server)} rounds; {rejected} client replies rejected, "
        f"{dropped} dropped; {lost} client workers lost (each restarted for the next round).",
        "",
    ]


def _algorithm_section(rows: list[dict[str, Any]], run_dir: Path) -> list[str]:
    """The lines the run's algorithm adds to its report (`register_algorithm(report=...)`),
    found from config.yaml's algorithm kind; none when there is no config or no such hook."""
    import yaml

    from ftis.plugins import get_algorithm

    try:
        kind = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {})["algorithm"]["kind"]
        spec = get_algorithm(str(kind))
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return []
    return spec.report_section(rows, run_dir)


def _run_task(run_dir: Path) -> dict | None:
    """The task section of RUN_DIR/config.yaml (None when the run has no readable config)."""
    import yaml

    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    return cfg.get("task") if isinstance(cfg, dict) else None


def paired_final_rows(
    reference: Path, other: Path, *, pairs: dict[str, str] | None = None
) -> tuple[list[str], list[list[str]], str]:
    """REFERENCE's last evaluation minus OTHER's, per node present in both (by name) and split,
    or, with `pairs` {node of REFERENCE: node of OTHER}, per such pair (a node named in a pair
    that is not in its run is a ReportError), paired by problem: (header, rows, why-empty). Pairing needs the same problems, so the two
    runs' task sections must be equal (then a split of one name is the same problems in both);
    otherwise no row, and the third value says why. The interval is a Student-t interval over
    problems (one seed each), as in change_section."""
    from ftis.study.stats import paired_difference, read_evals

    header = ["node", "split", "steps", "problems", "difference (points) [95% interval]", "reading"]
    task_a, task_b = _run_task(reference), _run_task(other)
    if task_a is None or task_b is None or task_a != task_b:
        return header, [], "their tasks differ (config.yaml), so their problems cannot be paired"
    try:
        evals_a, evals_b = read_evals(reference), read_evals(other)
    except (FileNotFoundError, ValueError) as e:
        return header, [], f"no per-problem evaluations to pair ({e})"
    if pairs:
        for mine, run, have in (
            *((a, reference, evals_a) for a in pairs),
            *((b, other, evals_b) for b in pairs.values()),
        ):
            if mine not in have:
                raise ReportError(
                    f"--pair: {run} has no evaluated node {mine!r}; its nodes: "
                    + ", ".join(sorted(have))
                )
        matched = list(pairs.items())
    else:
        matched = [(n, n) for n in evals_a if n in evals_b]
    body = []
    for node, node_b in matched:
        for split in (s for s in evals_a[node] if s in evals_b[node_b]):
            a, b = evals_a[node][split], evals_b[node_b][split]
            if a.correct.shape[1] != b.correct.shape[1]:
                continue  # different eval.size: not the same problems
            d = paired_difference({0: a.correct[-1]}, {0: b.correct[-1]})
            word = _verdict_word(d, "higher", "lower", "no difference detected")
            body.append(
                [
                    node if node == node_b else f"{node} vs {node_b}",
                    split,
                    f"{int(a.steps[-1])} vs {int(b.steps[-1])}",
                    str(d.problems),
                    d.cells(),
                    word,
                ]
            )
    return header, body, "" if body else "no node and split evaluated on the same problems in both"


def compare_runs(run_dirs: list[Path], out: Path) -> Path:
    """Overlay several runs' accuracy curves in one PNG (one panel per eval split)."""
    all_rows = {Path(d).name: load_rows(Path(d)) for d in run_dirs}
    splits = sorted(
        {s for rows in all_rows.values() for s in eval_splits(rows)}, key=lambda s: (s != "test", s)
    )
    if not splits:
        raise ReportError(
            "no run logged an evaluation split (eval/<split>/accuracy), so there is no curve to plot"
        )
    fig, axes = pyplot().subplots(1, len(splits), figsize=(5.5 * len(splits), 3.8), squeeze=False)
    for name, rows in all_rows.items():
        _plot_accuracy(rows, out, label_prefix=f"{name}/", axes=axes[0])
    save_figure(fig, out)
    return out
