"""FGRPO's section of report.md: how the server weighted the clients.

From the server's rows (`agg/weight/<client>`, `agg/gain/<client>`, `agg/baseline/<client>`,
`agg/performance/<client>`, `server/*`): per client over the run, the rounds its delta was
aggregated, its mean and largest weight, its mean gain and its last performance and baseline; the
weight and gain of every client in the last rounds; the server's rejected and dropped replies;
and a plot (fgrpo.png) of the weights and gains over the rounds. A client the server did not
aggregate in a round has no weight there ('-'), never 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftis.report import label_axes, nodes_in, pyplot, save_figure, table_lines

LAST_ROUNDS = 5  # rounds in the per-round table (the plot has all of them)


def _server_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that carry aggregation figures, one per round (a resumed run's repeat of a
    round: the later row), in round order."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in rows:
        if any(k.startswith("agg/weight/") for k in r):
            by_step[int(r["step"])] = r
    return [by_step[s] for s in sorted(by_step)]


def _per_client(row: dict[str, Any], what: str) -> dict[str, float]:
    prefix = f"agg/{what}/"
    return {
        k[len(prefix) :]: float(v) for k, v in row.items() if k.startswith(prefix) and v is not None
    }


def _clients(rows: list[dict[str, Any]], agg: list[dict[str, Any]]) -> list[str]:
    named = {c for r in agg for c in _per_client(r, "weight")}
    order = [n for n in nodes_in(rows) if n in named]
    return order + sorted(named - set(order))


def _mean(vals: list[float]) -> float | None:
    return sum(vals) / len(vals) if vals else None


def _num(v: float | None, fmt: str = ".3f") -> str | None:
    return None if v is None else format(v, fmt)


def _last_value(agg: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in agg if r.get(key) is not None]
    return vals[-1] if vals else None


def _rule(run_dir: Path) -> str | None:
    import yaml

    try:
        algo = (yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {})["algorithm"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None
    return algo.get("aggregation") if isinstance(algo, dict) else None


def report_section(rows: list[dict[str, Any]], run_dir: Path) -> list[str]:
    agg = _server_rows(rows)
    lines = ["## FGRPO aggregation", ""]
    if not agg:
        return lines + ["No aggregated round in the rows yet.", ""]
    clients = _clients(rows, agg)
    weights = [_per_client(r, "weight") for r in agg]
    gains = [_per_client(r, "gain") for r in agg]
    rule = _rule(run_dir)
    lines += [
        f"{len(agg)} aggregated rounds"
        + (f", weights by `{rule}`" if rule else "")
        + ". Weight: the client's share w_k of the round's update theta += eta_s * sum_k "
        "w_k delta_k; gain: its performance against its baseline (the figure relative-gain "
        "weights by; logged under every rule).",
        "",
    ]
    body: list[list[str | None]] = []
    for c in clients:
        w = [x[c] for x in weights if c in x]
        g = [x[c] for x in gains if c in x]
        body.append(
            [
                c,
                str(len(w)),
                _num(_mean(w)),
                _num(max(w) if w else None),
                _num(_mean(g), "+.3f"),
                _num(_last_value(agg, f"agg/performance/{c}")),
                _num(_last_value(agg, f"agg/baseline/{c}")),
            ]
        )
    lines += table_lines(
        [
            "client",
            "rounds aggregated",
            "mean weight",
            "largest weight",
            "mean gain",
            "last performance",
            "baseline (last round)",
        ],
        body,
    )
    lines.append("")
    tail = agg[-LAST_ROUNDS:]
    body = []
    for r, w, g in zip(tail, weights[-LAST_ROUNDS:], gains[-LAST_ROUNDS:]):
        line: list[str | None] = [str(int(r["step"]))]
        for c in clients:
            if c not in w:
                line.append(None)
            else:
                line.append(f"{w[c]:.3f}" + (f" ({g[c]:+.3f})" if c in g else ""))
        line.append(_num(r.get("server/update_norm"), ".4f"))
        body.append(line)
    lines += [f"Weight (gain) of each client in the last {len(tail)} rounds:", ""]
    lines += table_lines(["round", *clients, "update norm"], body)
    lines.append("")
    lines += _server_lines(agg)
    if _plot(agg, clients, weights, gains, Path(run_dir) / "fgrpo.png"):
        lines += ["![fgrpo](fgrpo.png)", ""]
    return lines


def _server_lines(agg: list[dict[str, Any]]) -> list[str]:
    said = []
    for key, what in (
        ("server/rejected_total", "replies rejected"),
        ("server/dropped_total", "dropped"),
    ):
        v = _last_value(agg, key)
        if v is not None:
            said.append(f"{v:.0f} {what}")
    for key, what in (
        ("server/skipped_update", "rounds without an update"),
        ("agg/no_positive_gain", "rounds in which no gain was positive"),
    ):
        vals = [float(r[key]) for r in agg if r.get(key) is not None]
        if vals:
            said.append(f"{sum(vals):.0f} {what}")
    return ["Server: " + ", ".join(said) + ".", ""] if said else []


def _plot(
    agg: list[dict[str, Any]],
    clients: list[str],
    weights: list[dict[str, float]],
    gains: list[dict[str, float]],
    path: Path,
) -> bool:
    steps = [int(r["step"]) for r in agg]
    panels = [("weight w_k", weights)] + ([("gain", gains)] if any(gains) else [])
    fig, axes = pyplot().subplots(1, len(panels), figsize=(5 * len(panels), 3.4), squeeze=False)
    for ax, (title, per_round) in zip(axes[0], panels):
        for c in clients:
            pts = [(s, x[c]) for s, x in zip(steps, per_round) if c in x]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=c)
        label_axes(ax, f"{title} per client", "round")
    save_figure(fig, path)
    return True
