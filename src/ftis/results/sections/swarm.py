"""The swarm's section of report.md: who was there and what arrived.

From each peer's training rows (`swarm/*`): per peer, the rounds it trained, the live members it
waited for and the payloads that arrived (means over its rounds), the peer samples it trained on
against those its peers published (the simulator knows the latter; a real DHT does not, so that
column is absent there), and its rejected, stale and late records and timed-out rounds; per
round (the last rounds in the table, all in swarm.png), the peers present and the same figures
summed over them. A figure no row holds is left out, never shown as 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftis.report import nodes_in, pyplot, save_figure, table_lines

LAST_ROUNDS = 10  # rounds in the per-round table (the plot has all of them)
# (key, how a group of rows combines it): the figures of one peer's round
SUMMED = (
    "swarm/samples_received",
    "swarm/samples_published",
    "swarm/rejected",
    "swarm/stale",
    "swarm/late",
    "swarm/timed_out",
)
AVERAGED = ("swarm/members", "swarm/peers_seen", "swarm/peers_used")


def _round_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (peer, round) that trained in the swarm (a resumed repeat: the later row)."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        if r.get("swarm/samples_received") is not None or r.get("swarm/members") is not None:
            out[(r["node"], int(r["step"]))] = r
    return list(out.values())


def _sum(rs: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rs if r.get(key) is not None]
    return sum(vals) if vals else None


def _mean(rs: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r[key]) for r in rs if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def _count(v: float | None) -> str | None:
    return None if v is None else f"{v:.0f}"


def _avg(v: float | None) -> str | None:
    return None if v is None else f"{v:.1f}"


def _delivery(rs: list[dict[str, Any]]) -> float | None:
    """Peer samples trained on / published by the peers, over the rows holding both (None when
    none does or nothing was published)."""
    both = [r for r in rs if r.get("swarm/samples_published") is not None]
    received = _sum(both, "swarm/samples_received")
    published = _sum(both, "swarm/samples_published")
    if received is None or not published:
        return None
    return received / published


def _delivered(rs: list[dict[str, Any]]) -> str | None:
    ratio = _delivery(rs)
    return None if ratio is None else f"{100 * ratio:.1f}%"


def _figures(rs: list[dict[str, Any]]) -> list[str | None]:
    return [
        _avg(_mean(rs, "swarm/members")),
        _avg(_mean(rs, "swarm/peers_seen")),
        _avg(_mean(rs, "swarm/peers_used")),
        _count(_sum(rs, "swarm/samples_received")),
        _count(_sum(rs, "swarm/samples_published")),
        _delivered(rs),
        _count(_sum(rs, "swarm/rejected")),
        _count(_sum(rs, "swarm/stale")),
        _count(_sum(rs, "swarm/late")),
        _count(_sum(rs, "swarm/timed_out")),
    ]


FIGURES = [
    "members (mean)",
    "arrived (mean)",
    "peers used (mean)",
    "samples received",
    "samples published",
    "delivered",
    "rejected",
    "stale",
    "late",
    "timed out",
]


def report_section(rows: list[dict[str, Any]], run_dir: Path) -> list[str]:
    mine = _round_rows(rows)
    lines = ["## Swarm", ""]
    if not mine:
        return lines + ["No swarm round in the rows yet.", ""]
    peers = [n for n in nodes_in(rows) if any(r["node"] == n for r in mine)]
    rounds = sorted({int(r["step"]) for r in mine})
    body: list[list[str | None]] = []
    for p in peers:
        rs = [r for r in mine if r["node"] == p]
        steps = sorted(int(r["step"]) for r in rs)
        body.append([p, f"{len(steps)} ({steps[0]}-{steps[-1]})", *_figures(rs)])
    lines += [
        f"{len(peers)} peers over {len(rounds)} rounds. Per peer: members, the live peers it "
        "waited for; arrived, the peers whose payload came in time; peers used, those it "
        "trained on; samples received, peer samples trained on; samples published, what the "
        "other peers sent those rounds; delivered, their ratio; rejected (malformed or failed "
        "validation), stale (another round's or peer's record) and late (after the peer moved "
        "on) records; timed out, rounds that ended at the deadline.",
        "",
    ]
    lines += table_lines(["peer", "rounds (first-last)", *FIGURES], body)
    lines.append("")
    body = []
    for s in rounds[-LAST_ROUNDS:]:
        rs = [r for r in mine if int(r["step"]) == s]
        body.append([str(s), str(len(rs)), *_figures(rs)])
    lines += [f"The last {len(body)} rounds, summed (or averaged) over the peers present:", ""]
    lines += table_lines(["round", "peers present", *FIGURES], body)
    lines.append("")
    totals = [
        f"{_count(_sum(mine, k))} {what}"
        for k, what in (
            ("swarm/rejected", "rejected"),
            ("swarm/stale", "stale"),
            ("swarm/late", "late"),
        )
        if _sum(mine, k) is not None
    ]
    delivered = _delivered(mine)
    said = ([f"{delivered} of the published peer samples trained on"] if delivered else []) + (
        [", ".join(totals) + " records"] if totals else []
    )
    if said:
        lines += ["Over the run: " + "; ".join(said) + ".", ""]
    if _plot(mine, rounds, Path(run_dir) / "swarm.png"):
        lines += ["![swarm](swarm.png)", ""]
    return lines


def _plot(mine: list[dict[str, Any]], rounds: list[int], path: Path) -> bool:
    per = {s: [r for r in mine if int(r["step"]) == s] for s in rounds}
    panels = ["membership"]
    if any(r.get("swarm/samples_published") is not None for r in mine):
        panels.append("delivery")
    counts = [k for k in ("swarm/rejected", "swarm/stale", "swarm/late") if _sum(mine, k)]
    if counts:
        panels.append("counts")
    fig, axes = pyplot().subplots(1, len(panels), figsize=(4.8 * len(panels), 3.4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "membership":
            ax.plot(rounds, [len(per[s]) for s in rounds], marker="o", ms=3, label="peers present")
            for key, label in (
                ("swarm/members", "members (mean)"),
                ("swarm/peers_seen", "arrived (mean)"),
            ):
                pts = [(s, _mean(per[s], key)) for s in rounds]
                pts = [(s, v) for s, v in pts if v is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label)
            ax.set_title("membership")
        elif panel == "delivery":
            pts = [(s, _delivery(per[s])) for s in rounds]
            pts = [(s, 100 * v) for s, v in pts if v is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3)
            ax.set_title("peer samples trained on / published (%)")
        else:
            for key in counts:
                pts = [(s, _sum(per[s], key)) for s in rounds]
                pts = [(s, v) for s, v in pts if v is not None]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key[len("swarm/") :])
            ax.set_title("records per round")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    save_figure(fig, path)
    return True
