"""The population runs' section of report.md: per party, accuracy of theta_0 and of the answer
(CoRP's consolidated model, or RandOpt's top-K vote), the population's RandOpt figures, CoRP's
choice, throughput and compute, rejected reward vectors, and whether every party ended with the
same weights (the sha256 each logged)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _last(rows: list[dict[str, Any]], node: str, key: str) -> Any:
    vals = [(r["step"], r[key]) for r in rows if r.get("node") == node and r.get(key) is not None]
    return max(vals, key=lambda t: t[0])[1] if vals else None


def _first(rows: list[dict[str, Any]], node: str, key: str) -> Any:
    vals = [(r["step"], r[key]) for r in rows if r.get("node") == node and r.get(key) is not None]
    return min(vals, key=lambda t: t[0])[1] if vals else None


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * float(v):.1f}%"


def report_section(rows: list[dict[str, Any]], run_dir: Path) -> list[str]:
    nodes = list(dict.fromkeys(r["node"] for r in rows if "node" in r))
    lines = [
        "## Population (RandOpt / CoRP)",
        "",
        "| party | eval acc step 0 -> end | RandOpt vote / best member (end) | (q, beta, alpha) "
        "| probe base -> chosen | perturbations/s | forward tokens | rejected |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in nodes:
        rate = [
            float(r["population/perturbations_per_second"])
            for r in rows
            if r.get("node") == n and r.get("population/perturbations_per_second") is not None
        ]
        q = _last(rows, n, "corp/q")
        vote = _last(rows, n, "eval/randopt/vote_accuracy")
        if vote is None and _last(rows, n, "eval/randopt/k") is not None:
            vote = _last(rows, n, "eval/accuracy")  # randopt: the answer is the vote itself
        choice = (
            "-"
            if q is None
            else f"({q:g}, {_last(rows, n, 'corp/beta'):g}, {_last(rows, n, 'corp/alpha'):g})"
        )
        probe = (
            "-"
            if q is None
            else f"{_pct(_last(rows, n, 'corp/probe_base'))} -> "
            f"{_pct(_last(rows, n, 'corp/probe_reward'))}"
        )
        tokens = _last(rows, n, "train/forward_tokens_total")
        lines.append(
            f"| {n} | {_pct(_first(rows, n, 'eval/accuracy'))} -> "
            f"{_pct(_last(rows, n, 'eval/accuracy'))} | {_pct(vote)} / "
            f"{_pct(_last(rows, n, 'eval/randopt/best_accuracy'))} | {choice} | {probe} | "
            f"{sum(rate) / len(rate) if rate else 0:.1f} | "
            f"{'-' if tokens is None else f'{int(tokens):,}'} | "
            f"{int(_last(rows, n, 'population/rejected_total') or 0)} |"
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
    lines += [
        "Forward tokens: prompt plus completion tokens of every greedy scoring pass (support, "
        "probe), the compute figure of a matched-compute comparison (docs/randopt.md).",
        "",
    ]
    return lines
