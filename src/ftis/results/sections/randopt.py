"""The population runs' section of report.md (kinds randopt, corp): per party, accuracy of
theta_0 and of the answer (CoRP's consolidated model, or RandOpt's top-K vote), the top-K vote
and the best member's accuracy, CoRP's choice, throughput and compute, rejected reward vectors,
and whether every party ended with the same weights (the sha256 each logged); then the vote and
the best member's accuracy against the members scored so far (a table of each party's last
evaluations and population.png). A figure no row holds is left out ('-' or no column), never
shown as 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftis.report import label_axes, nodes_in, pyplot, save_figure, table_lines

LAST_EVALS = 5  # evaluations per party in the vote table (the plot has all of them)


def _last(rows: list[dict[str, Any]], node: str, key: str) -> Any:
    vals = [(r["step"], r[key]) for r in rows if r.get("node") == node and r.get(key) is not None]
    return max(vals, key=lambda t: t[0])[1] if vals else None


def _first(rows: list[dict[str, Any]], node: str, key: str) -> Any:
    vals = [(r["step"], r[key]) for r in rows if r.get("node") == node and r.get(key) is not None]
    return min(vals, key=lambda t: t[0])[1] if vals else None


def _pct(v: Any) -> str | None:
    return None if v is None else f"{100 * float(v):.1f}%"


def _vote_points(rows: list[dict[str, Any]], node: str) -> list[tuple[int, float, Any, Any]]:
    """(step, members scored so far, vote accuracy, best member's accuracy) at each of the
    party's evaluations of the population after it scored members. RandOpt's answer is the
    vote itself (`eval/accuracy` with `eval/randopt/k`); CoRP logs `eval/randopt/*`."""
    out = []
    scored = 0.0
    for r in sorted((r for r in rows if r.get("node") == node), key=lambda r: r["step"]):
        if r.get("population/scored_total") is not None:
            scored = float(r["population/scored_total"])
        vote = r.get("eval/randopt/vote_accuracy")
        if vote is None and r.get("eval/randopt/k") is not None:
            vote = r.get("eval/accuracy")
        best = r.get("eval/randopt/best_accuracy")
        if scored and (vote is not None or best is not None):
            out.append((int(r["step"]), scored, vote, best))
    return out


def report_section(rows: list[dict[str, Any]], run_dir: Path) -> list[str]:
    nodes = nodes_in(rows)
    lines = ["## Population (RandOpt / CoRP)", ""]
    body: list[list[str | None]] = []
    for n in nodes:
        rate = [
            float(r["population/perturbations_per_second"])
            for r in rows
            if r.get("node") == n and r.get("population/perturbations_per_second") is not None
        ]
        q = _last(rows, n, "corp/q")
        points = _vote_points(rows, n)
        vote = points[-1][2] if points else None
        best = points[-1][3] if points else None
        tokens = _last(rows, n, "train/forward_tokens_total")
        rejected = _last(rows, n, "population/rejected_total")
        first, last = _first(rows, n, "eval/accuracy"), _last(rows, n, "eval/accuracy")
        body.append(
            [
                n,
                None if first is None else f"{_pct(first)} -> {_pct(last)}",
                None
                if vote is None and best is None
                else f"{_pct(vote) or '-'} / {_pct(best) or '-'}",
                None
                if q is None
                else f"({q:g}, {_last(rows, n, 'corp/beta'):g}, {_last(rows, n, 'corp/alpha'):g})",
                None
                if _last(rows, n, "corp/probe_base") is None
                else f"{_pct(_last(rows, n, 'corp/probe_base'))} -> "
                f"{_pct(_last(rows, n, 'corp/probe_reward'))}",
                f"{sum(rate) / len(rate):.1f}" if rate else None,
                None if tokens is None else f"{int(tokens):,}",
                None if rejected is None else f"{int(rejected)}",
            ]
        )
    lines += table_lines(
        [
            "party",
            "eval acc step 0 -> end",
            "RandOpt vote / best member (end)",
            "(q, beta, alpha)",
            "probe base -> chosen",
            "perturbations/s",
            "forward tokens",
            "rejected",
        ],
        body,
    )
    lines.append("")
    for key, what in (
        ("population/weights_sha256", "weights"),
        ("population/ensemble_sha256", "top-K ensemble"),
    ):
        digests = {n: _last(rows, n, key) for n in nodes if _last(rows, n, key) is not None}
        if not digests:
            continue
        if len(set(digests.values())) == 1:
            lines.append(
                f"Every party ({len(digests)}) ends with the same {what}: sha256 "
                f"`{next(iter(digests.values()))[:16]}...`."
            )
        else:
            lines.append(
                f"**The parties disagree on the {what}**: "
                + ", ".join(f"{n} `{d[:16]}...`" for n, d in digests.items())
                + " (a party saw other reward vectors: see its log for rejected or lost peers)."
            )
        lines.append("")
    lines += _vote_lines(rows, nodes, Path(run_dir))
    lines += [
        "Forward tokens: prompt plus completion tokens of every greedy scoring pass (support, "
        "probe), the compute figure of a matched-compute comparison (docs/randopt.md).",
        "",
    ]
    return lines


def _vote_lines(rows: list[dict[str, Any]], nodes: list[str], run_dir: Path) -> list[str]:
    """The vote and the best member's accuracy against the members scored so far."""
    points = {n: _vote_points(rows, n) for n in nodes}
    body: list[list[str | None]] = [
        [n, str(step), f"{scored:.0f}", _pct(vote), _pct(best)]
        for n in nodes
        for step, scored, vote, best in points[n][-LAST_EVALS:]
    ]
    if not body:
        return []
    lines = [
        "The top-K vote and the best member's accuracy (on the first eval split) as members "
        f"are scored (each party's last {LAST_EVALS} evaluations at most):",
        "",
        *table_lines(["party", "step", "members scored", "vote", "best member"], body),
        "",
    ]
    if _plot(points, run_dir / "population.png"):
        lines += ["![population](population.png)", ""]
    return lines


def _plot(points: dict[str, list[tuple[int, float, Any, Any]]], path: Path) -> bool:
    fig, ax = pyplot().subplots(figsize=(5.5, 3.6))
    for n, pts in points.items():
        for idx, style, what in ((2, "-", "vote"), (3, "--", "best member")):
            xy = [(p[1], 100 * float(p[idx])) for p in pts if p[idx] is not None]
            if xy:
                ax.plot(
                    [p[0] for p in xy],
                    [p[1] for p in xy],
                    style,
                    marker="o",
                    ms=3,
                    label=f"{n}: {what}",
                )
    label_axes(ax, "top-K vote and best member", "members scored", "greedy accuracy (%)")
    save_figure(fig, path)
    return True
