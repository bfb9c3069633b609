"""The DPO runs' section of report.md (kinds dpo, gossip-dpo, fed-dpo): per agent, the held-out
preference accuracy and DPO loss at step 0 and at the end and the reward accuracy at the end;
FedDPO's participation, staleness and rejected replies; the gossip graph's rho and spectral gap;
and a plot (dpo.png) of the training DPO loss, the held-out preference accuracy and DPO loss and
(gossip) the consensus error before and after mixing against the round. A figure no row holds
is left out (a '-' cell, a dropped column, a missing panel or clause), never shown as 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ftis.report import label_axes, nodes_in, pyplot, save_figure, series, table_lines


def _pct(v: float | None) -> str | None:
    return None if v is None else f"{100 * v:.1f}%"


def _span(vals: list[float], fmt) -> str | None:
    """'first -> last' of a series, or None when it is empty."""
    return f"{fmt(vals[0])} -> {fmt(vals[-1])}" if vals else None


def report_section(rows: list[dict[str, Any]], run_dir: Path) -> list[str]:
    nodes = nodes_in(rows)
    body: list[list[str | None]] = []
    for n in nodes:
        _, acc = series(rows, n, "eval/preference_accuracy")
        _, racc = series(rows, n, "eval/reward_accuracy")
        _, loss = series(rows, n, "eval/dpo_loss")
        if not (acc or racc or loss):
            continue
        label = "server (union of the clients' pairs)" if n == "server" else n
        body.append(
            [
                label,
                _span(acc, lambda v: f"{100 * v:.1f}%"),
                _pct(racc[-1] if racc else None),
                _span(loss, lambda v: f"{v:.3f}"),
            ]
        )
    lines = ["## DPO", ""]
    if body:
        lines += table_lines(
            [
                "agent",
                "preference accuracy (step 0 -> end)",
                "reward accuracy (end)",
                "held-out DPO loss (step 0 -> end)",
            ],
            body,
        )
        lines += [
            "",
            "Preference accuracy: share of the agent's held-out pairs whose chosen response the "
            "policy gives the higher summed log-prob. Reward accuracy: share with a positive DPO "
            "margin against the frozen reference (0 at step 0 by construction). Held-out DPO "
            "loss: the DPO loss on those pairs.",
            "",
        ]
    else:
        lines += ["No held-out preference evaluation in the rows.", ""]
    lines += _federated_lines(rows)
    lines += _gossip_lines(rows)
    if _plot(rows, nodes, Path(run_dir) / "dpo.png"):
        lines += ["![dpo](dpo.png)", ""]
    return lines


def _gossip_lines(rows: list[dict[str, Any]]) -> list[str]:
    rho = [r["gossip/rho_full"] for r in rows if r.get("gossip/rho_full") is not None]
    if not rho:
        return []
    live = [r for r in rows if r.get("gossip/rho") is not None]
    last = max(live, key=lambda r: r["step"]) if live else None
    tail = ""
    if last is not None:
        tail = f"; at the last round, over the agents still running: rho = {last['gossip/rho']:.4f}"
        if last.get("gossip/spectral_gap") is not None:
            tail += f", gap {last['gossip/spectral_gap']:.4f}"
    return [
        f"Gossip graph: rho = {rho[0]:.4f}, spectral gap 1 - rho^2 = {1 - rho[0] ** 2:.4f}"
        + tail
        + ".",
        "",
    ]


def _federated_lines(rows: list[dict[str, Any]]) -> list[str]:
    """FedDPO's server figures: participation, staleness, rejected and dropped replies; each
    clause only when the server's rows hold its figure."""
    server = sorted(
        (r for r in rows if r.get("node") == "server" and r.get("step", 0) > 0),
        key=lambda r: r["step"],
    )
    if any(r.get("fed/centralized") for r in server):
        return ["Centralized DPO on the union of the clients' pairs (no server rounds).", ""]
    fed = [r for r in server if r.get("fed/sampled") is not None]
    if not fed:
        return []

    def mean(key: str) -> float | None:
        vals = [float(r[key]) for r in fed if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    def last(key: str) -> float | None:
        vals = [r[key] for r in fed if r.get(key) is not None]
        return float(vals[-1]) if vals else None

    said = [f"{len(fed)} rounds", f"{mean('fed/sampled'):.1f} clients sampled"]
    if mean("fed/participants") is not None:
        said[-1] += f" and {mean('fed/participants'):.1f} averaged per round on average"
    if mean("fed/staleness_mean") is not None:
        said.append(f"mean staleness {mean('fed/staleness_mean'):.2f} rounds")
    counts = [
        f"{v:.0f} {what}"
        for what, v in (
            ("replies rejected", last("fed/rejected_total")),
            ("dropped", last("fed/dropped_total")),
            ("clients lost at the end", last("fed/lost_clients")),
        )
        if v is not None
    ]
    text = "FedDPO: " + ", ".join(said)
    if counts:
        text += "; " + ", ".join(counts)
    return [text + ".", ""]


def _plot(rows: list[dict[str, Any]], nodes: list[str], path: Path) -> bool:
    panels = [
        (key, title)
        for key, title in (
            ("loss/dpo", "DPO loss (training)"),
            ("eval/preference_accuracy", "held-out preference accuracy"),
            ("eval/dpo_loss", "held-out DPO loss"),
        )
        if any(r.get(key) is not None for r in rows)
    ]
    gossip = any(r.get("gossip/consensus_error_before") is not None for r in rows)
    if not panels and not gossip:
        return False
    n_ax = len(panels) + gossip
    fig, axes = pyplot().subplots(1, n_ax, figsize=(4.5 * n_ax, 3.4), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for n in nodes:
            x, y = series(rows, n, key)
            if x:
                ax.plot(x, y, marker="o" if "eval" in key else None, ms=3, label=n)
        label_axes(ax, title, "round")
    if gossip:
        ax = axes[0][-1]
        ref = next(n for n in nodes if series(rows, n, "gossip/consensus_error_before")[0])
        for key, style in (
            ("gossip/consensus_error_before", "-"),
            ("gossip/consensus_error_after", "--"),
        ):
            x, y = series(rows, ref, key)
            if x:
                ax.plot(x, [max(v, 1e-30) for v in y], style, label=key.split("_")[-1])
        ax.set_yscale("log")
        label_axes(ax, f"consensus error (as {ref} measured it)", "round")
    save_figure(fig, path)
    return True
